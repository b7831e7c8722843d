"""Baselines sonic is measured against (docs/design.md §5)."""

from sonic.baselines.torch_gmm import torch_gmm_experts, torch_gmm_moe

__all__ = ["torch_gmm_experts", "torch_gmm_moe"]
