"""Routed experts with an activation other than SwiGLU, as the custom op
``torch.ops.sonic.moe_experts_act`` (PyTorch reference math of
:mod:`sonic.reference.activations`, on any device; the CuTe kernels' fused epilogues compute
SwiGLU only). Memory-minimal like :func:`sonic.moe_experts`: saved for backward are X (by
reference), H, the scores and the packed metadata; A is recomputed from H in backward.
"""

from __future__ import annotations

import torch

from sonic.ops import SonicOp, _first_order_error, _traced, pack_metadata, unpack_metadata
from sonic.reference import activations
from sonic.reference.ops import accumulate_dtype
from sonic.types import RoutingMetadata


def _rows(scores, meta, top_k, x, w1):
    """``(metadata, row_scores)`` of the packed metadata."""
    m = unpack_metadata(meta, x.shape[0], w1.shape[0], scores.shape[0], top_k)
    return m, scores.index_select(0, m.sorted_pairs).to(accumulate_dtype(x.dtype))


def _forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, scores: torch.Tensor,
             meta: torch.Tensor, top_k: int, activation: str, gate_up: str
             ) -> tuple[torch.Tensor, torch.Tensor]:
    m, row_scores = _rows(scores, meta, top_k, x, w1)
    return activations.experts_forward(x, w1, w2, row_scores, m.expert_offsets, m.gather_idx,
                                       m.token_rows, m.token_offsets, activation, gate_up)


_op = SonicOp("moe_experts_act", _forward)


@_op.register_fake
def _(x, w1, w2, scores, meta, top_k, activation, gate_up):
    return x.new_empty(x.shape), x.new_empty(scores.shape[0], w1.shape[1])


def _backward_impl(grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   h: torch.Tensor, scores: torch.Tensor, meta: torch.Tensor, top_k: int,
                   activation: str, gate_up: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m, row_scores = _rows(scores, meta, top_k, x, w1)
    dx, dw1, dw2, ds_rows = activations.experts_backward(
        grad_out, x, w1, w2, h, row_scores, m.expert_offsets, m.gather_idx, m.token_rows,
        m.token_offsets, activation, gate_up)
    # Rows past expert_offsets[E] are a padded routing's padding: no GEMM wrote them. (Top-K
    # metadata has none; the mask is then all true.)
    real = torch.arange(ds_rows.shape[0], device=ds_rows.device) < m.expert_offsets[-1]
    ds = torch.where(real, ds_rows, 0).index_select(0, m.pair_rows).to(scores.dtype)
    return dx, dw1, dw2, ds


_backward_op = SonicOp("moe_experts_act_backward", _backward_impl)


@_backward_op.register_fake
def _(grad_out, x, w1, w2, h, scores, meta, top_k, activation, gate_up):
    return (x.new_empty(x.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape),
            scores.new_empty(scores.shape))


def _setup(ctx, inputs, output):
    x, w1, w2, scores, meta, top_k, activation, gate_up = inputs
    ctx.save_for_backward(x, w1, w2, output[1], scores, meta)
    ctx.top_k, ctx.activation, ctx.gate_up = top_k, activation, gate_up
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, _grad_h):
    if torch.is_grad_enabled() and not _traced(grad_out):
        raise _first_order_error()
    x, w1, w2, h, scores, meta = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None, None, None
    grads = _backward_op(grad_out.contiguous().to(x.dtype), x, w1, w2, h, scores, meta,
                         ctx.top_k, ctx.activation, ctx.gate_up)
    return *grads, None, None, None, None


_op.register_autograd(_backward, setup_context=_setup)


def activation_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       scores: torch.Tensor, metadata: RoutingMetadata, activation: str,
                       gate_up: str = "concat") -> torch.Tensor:
    """Routed experts ``o_t = Σ s · W2[e]·act(W1[e]·x_t)`` for any activation of
    :data:`sonic.reference.activations.ACTIVATIONS`, on the PyTorch reference path.

    Args:
        x: ``(T, d)``; w1: ``(E, 2n, d)`` for gated activations, ``(E, n, d)`` otherwise;
            w2: ``(E, d, n)``; all in one dtype (the caller applies autocast).
        scores: ``(P,)`` float score of each pair.
        metadata: the :func:`sonic.routing_metadata` of the pairs (validated by it).
        activation, gate_up: the activation and ``w1``'s gate/up row layout.

    Returns:
        ``(T, d)`` in x's dtype, differentiable in x, w1, w2 and scores (first order;
        ``create_graph=True`` raises in backward). The caller checks shapes and names.
    """
    if metadata.packed is not None:
        packed, top_k = metadata.packed, metadata.top_k or 0
    else:       # built by hand or by a kernel function directly: pack it (a copy of O(P) ints)
        packed, top_k = pack_metadata(metadata, 0), 0
    return _op(x, w1, w2, scores, packed, top_k, activation, gate_up)[0]
