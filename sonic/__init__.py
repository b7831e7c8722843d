"""sonic: CuTe-DSL kernels and memory-minimal autograd for Mixture-of-Experts training.

Implements SonicMoE (Guo et al., arXiv 2512.14080): the expert computation keeps only the layer
input, the up-projection output H and routing metadata for backward; top-K token choice and
tile-aware token rounding routers; a PyTorch reference backend that runs everywhere.
"""

from sonic import distributed
from sonic import ops  # noqa: F401  (registers torch.ops.sonic.*)
from sonic.experts import (Fp8ExpertWeights, moe_experts, quantize_expert_weights,
                           reuse_fp8_weights)
from sonic.backend import explain_backend
from sonic.memory import ActivationMemoryReport, profile_activation_memory
from sonic.nn import MoE, MoEConfig, collect_aux_losses, load_balancing_loss
from sonic.routing import (Routing, RoutingMetadata, routing_metadata, token_rounding_routing,
                           topk_routing)

__version__ = "0.1.0"

__all__ = [
    "ActivationMemoryReport",
    "Fp8ExpertWeights",
    "MoE",
    "MoEConfig",
    "Routing",
    "RoutingMetadata",
    "collect_aux_losses",
    "distributed",
    "explain_backend",
    "load_balancing_loss",
    "moe_experts",
    "profile_activation_memory",
    "quantize_expert_weights",
    "reuse_fp8_weights",
    "routing_metadata",
    "token_rounding_routing",
    "topk_routing",
]
