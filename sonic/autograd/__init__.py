"""Memory-minimal autograd functions of the MoE layer (DESIGN §3)."""

from sonic.autograd.moe_experts import (Fp8ExpertWeights, moe_experts, quantize_expert_weights,
                                        reuse_fp8_weights)

__all__ = ["Fp8ExpertWeights", "moe_experts", "quantize_expert_weights", "reuse_fp8_weights"]
