"""PyTorch modules built on sonic's MoE computation."""

from sonic.nn.config import MoEConfig
from sonic.nn.moe import MoE, collect_aux_losses, load_balancing_loss, update_expert_biases

__all__ = ["MoE", "MoEConfig", "collect_aux_losses", "load_balancing_loss",
           "update_expert_biases"]
