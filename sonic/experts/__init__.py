"""The routed-experts API: :func:`moe_experts` (the memory-minimal SwiGLU experts as one custom
op with a registered backward, docs/design.md "Backward") and the FP8 weight copies it takes."""

from sonic.experts.moe_experts import (Fp8ExpertWeights, moe_experts, quantize_expert_weights,
                                        reuse_fp8_weights)

__all__ = ["Fp8ExpertWeights", "moe_experts", "quantize_expert_weights", "reuse_fp8_weights"]
