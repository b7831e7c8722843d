"""Baselines sonic is measured against (ANCHORS.md)."""

from sonic.baselines.torch_gmm import torch_gmm_moe

__all__ = ["torch_gmm_moe"]
