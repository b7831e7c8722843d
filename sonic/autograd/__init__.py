"""Memory-minimal autograd functions of the MoE layer (DESIGN §3)."""

from sonic.autograd.moe_experts import moe_experts

__all__ = ["moe_experts"]
