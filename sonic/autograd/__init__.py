"""Former path of :mod:`sonic.experts` and :mod:`sonic.activation_cache`.

``sonic.autograd.moe_experts`` and ``sonic.autograd.activation_cache`` name the same module
objects as their new paths, so existing imports keep working.
"""

import sys

from sonic import activation_cache
from sonic.experts import (Fp8ExpertWeights, moe_experts, quantize_expert_weights,
                           reuse_fp8_weights)

sys.modules[f"{__name__}.moe_experts"] = sys.modules["sonic.experts.moe_experts"]
sys.modules[f"{__name__}.activation_cache"] = activation_cache

__all__ = ["Fp8ExpertWeights", "moe_experts", "quantize_expert_weights", "reuse_fp8_weights"]
