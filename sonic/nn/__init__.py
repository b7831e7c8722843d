"""PyTorch modules built on sonic's MoE computation."""

from sonic.nn.moe import MoE, load_balancing_loss

__all__ = ["MoE", "load_balancing_loss"]
