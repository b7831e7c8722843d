"""The router's linear gate, with the layer input's two gradients summed inside one GEMM.

The layer input X feeds both the gate (``logits = X W_rᵀ``) and the experts, so autograd sums
the two gradients of X, ``dX = dX_experts + dLogits W_r``, in a separate elementwise kernel
that reads two ``(T, d)`` tensors and writes a third after the GEMM wrote one.
:func:`router_logits` instead hands the experts X through the gate's own autograd node, whose
backward receives both gradients and adds ``dLogits W_r`` into ``dX_experts`` in place
(``addmm_``: one GEMM that reads its addend and writes the sum; one rounding of the sum instead
of two), faster than the separate add at every layer size measured. In place, because an
out-of-place ``addmm`` copies the addend into its output first, which makes it slower than the
separate add.
In place is safe only where ``dX_experts`` belongs to nobody else, i.e. where the experts are
sonic's (:func:`sonic.moe_experts` returns a fresh dX); hence the contract of
:func:`router_logits`.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from sonic._custom_op import autocast_dtype
from sonic._validation import check_float


class _GateAndInput(torch.autograd.Function):
    """``(x, weight, bias) → (x Wᵀ + b, x)``; backward sums x's two gradients in the GEMM."""

    @staticmethod
    def forward(x, weight, bias):
        return nn.functional.linear(x, weight, bias), x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, d_logits, d_x):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if need_x:
            # With create_graph the sum must stay out of place: d_x may be in the graph.
            add = torch.addmm if torch.is_grad_enabled() else torch.Tensor.addmm_
            grad_x = add(d_x, d_logits, weight)
        if need_w:
            grad_w = d_logits.t().mm(x)
        if need_b and ctx.has_bias:
            grad_b = d_logits.sum(0)
        return grad_x, grad_w, grad_b


# With setup_context declared (which torch.func transforms need), Function.apply binds the
# arguments through inspect.signature(forward) on every call; a stored signature is read back
# instead of rebuilt.
setattr(_GateAndInput.forward, "__signature__", inspect.signature(_GateAndInput.forward))


# torch.nn.modules.module's registries of hooks on every module (nn.modules.module.register_*).
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_forward_hooks_always_called", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def _fusable(tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether summing X's gradients inside the gate's GEMM changes nothing observable and
    saves the add: X needs a gradient, and the GEMM is ``F.linear`` on plain tensors of one
    dtype. Unlike :func:`sonic._custom_op.plain_eager`, dispatch modes and functorch
    transforms may see it: the node runs aten ops, so what they see is still the step."""
    if not (torch.is_grad_enabled() and tokens.requires_grad):
        return False      # no dX: the experts must not be asked for one
    tensors = (tokens, weight) + (() if bias is None else (bias,))
    if any(type(t) not in (torch.Tensor, nn.Parameter) for t in tensors):
        return False      # DTensor, tensor subclasses: their own dispatch
    # Under autocast the GEMM runs in another dtype than its inputs'; under torch.compile /
    # export the compiler owns the backward graph.
    return (tokens.dtype == weight.dtype and autocast_dtype(tokens.device.type) is None
            and not torch.compiler.is_compiling())


def router_logits(tokens: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``tokens · weightᵀ (+ bias)`` and the tokens the experts should read.

    Args:
        tokens: ``(T, d)`` float layer input.
        weight: ``(E, d)`` router weight, in ``tokens``' dtype (or under autocast).
        bias: optional ``(E,)``.

    Returns:
        ``(logits (T, E), tokens_for_experts (T, d))``, equal to
        ``(F.linear(tokens, weight, bias), tokens)``. When ``tokens`` requires grad (plain
        tensors of one dtype, no autocast, not compiling), both come from one autograd node
        whose backward adds ``dLogits · weight`` into the gradient of ``tokens_for_experts``
        in place; otherwise ``tokens_for_experts`` is ``tokens`` itself.

    ``tokens_for_experts`` must be used once, as the tokens of :func:`sonic.moe_experts`
    (whose backward makes a fresh dX) and nothing else: a consumer that hands its own output
    gradient back unchanged (an identity, a view) would have that tensor modified in place.

    Raises:
        TypeError / ValueError: ``tokens`` or ``weight`` not a 2-D float tensor.
    """
    check_float("tokens", tokens, ndim=2)
    check_float("weight", weight, ndim=2)
    if _fusable(tokens, weight, bias):
        return _GateAndInput.apply(tokens, weight, bias)
    return nn.functional.linear(tokens, weight, bias), tokens


def gate_logits(gate: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_logits` for a gate module (``sonic.MoE.gate``), under its contract:
    ``(gate(tokens), tokens)``, fused when ``gate`` is exactly an ``nn.Linear`` without hooks
    (subclasses, parametrized or LoRA-wrapped gates and hooked ones run themselves, so users
    see them run)."""
    plain = type(gate) is nn.Linear and not (
        gate._forward_hooks or gate._forward_pre_hooks or gate._backward_hooks
        or gate._backward_pre_hooks
        or any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS))
    if plain and isinstance(gate, nn.Linear):      # isinstance: the type for the checker
        return router_logits(tokens, gate.weight, gate.bias)
    return gate(tokens), tokens
