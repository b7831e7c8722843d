"""Memory-minimal MoE expert computation with a hand-written backward (SonicMoE §3.2, App. C).

Forward: up-proj (gathered X · W1ᵀ) → SwiGLU → down-proj (A · W2ᵀ) → aggregation.
Saved for backward: the layer input X (by reference), H ``(P, 2n)``, the scores and the routing
metadata — nothing of size ``P·d`` and not A. Backward recomputes A from H and never forms Y or
dY: the score gradient is ``ds = ⟨dO_t·W2[e], a⟩ = ⟨dA', A⟩`` (DESIGN §3).
"""

from __future__ import annotations

import functools

import torch

from sonic._validation import (check_choice, check_float, check_index, check_index_ranges,
                               check_same_device)
from sonic.backend import ExpertOps, expert_ops
from sonic.reference.ops import GATE_UP_LAYOUTS, accumulate_dtype
from sonic.routing.metadata import RoutingMetadata


def first_order_only(backward):
    """Make a hand-written ``backward`` refuse ``create_graph=True``.

    Such a backward works on saved tensors that carry no graph (H, the metadata), so a graph
    recorded through it would miss terms: the second derivative would be wrong without any
    error. Grad mode is on inside ``backward`` exactly when the caller asked for
    ``create_graph=True``, so refusing then is cheap and never refuses plain training.
    """
    @functools.wraps(backward)
    def guarded(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "sonic's MoE expert backward is not twice differentiable, so it cannot run "
                "with create_graph=True (gradient penalties, Hessian-vector products, "
                "double backward). Take first-order gradients with create_graph=False, or, where "
                "second derivatives are needed, write the experts with plain PyTorch ops "
                "(a per-expert loop) whose backward autograd records.")
        return backward(ctx, *grads)
    return guarded


class MoEExpertsFunction(torch.autograd.Function):
    """Autograd function behind :func:`moe_experts`; ``ops`` selects the kernels."""

    @staticmethod
    def forward(ctx, x, w1, w2, scores, token_idx, expert_idx, gate_up: str, ops: ExpertOps,
                meta: RoutingMetadata | None):
        if meta is None:
            meta = ops.metadata(token_idx, expert_idx, x.shape[0], w1.shape[0])
        offsets = meta.expert_offsets
        # The CuTe up-proj gathers X's rows while loading them (the reference: a transient copy)
        # and its epilogue stores both H (kept) and A (transient).
        h, act = ops.up_proj_swiglu(x, w1, offsets, meta.gather_idx, gate_up)
        y = ops.grouped_mm(act, w2.transpose(1, 2), offsets)
        del act
        row_scores = scores.index_select(0, meta.sorted_pairs).to(accumulate_dtype(x.dtype))
        out = ops.aggregate(y, meta.token_rows, meta.token_offsets, row_scores)
        ctx.save_for_backward(x, w1, w2, h, scores, *meta.tensors())
        ctx.meta_sizes = (meta.num_tokens, meta.num_experts)
        ctx.gate_up, ctx.ops = gate_up, ops
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        x, w1, w2, h, scores, *meta_tensors = ctx.saved_tensors
        meta = RoutingMetadata.from_tensors(meta_tensors, *ctx.meta_sizes)
        ops, gate_up = ctx.ops, ctx.gate_up
        need_x, need_w1, need_w2, need_s = ctx.needs_input_grad[:4]
        offsets = meta.expert_offsets
        grad_out = grad_out.contiguous().to(x.dtype)
        row_scores = scores.index_select(0, meta.sorted_pairs).to(accumulate_dtype(x.dtype))

        # dH kernel: dA' = gather(dO)·W2; its epilogue recomputes A from H and gives dH, A', ds.
        # H is dead after it unless the graph is kept for another backward, so the kernel may
        # write dH over it: the backward's peak then holds one P x 2n buffer instead of two.
        overwrite_h = not _graph_kept()
        dh, a_scaled, ds_rows = ops.dh_dswiglu(grad_out, w2, offsets, meta.gather_idx, h,
                                               row_scores, gate_up, overwrite_h=overwrite_h)
        if dh.data_ptr() == h.data_ptr():
            # Anything that still unpacks the saved H must fail loudly, not read dH.
            torch.autograd.graph.increment_version(h)
        del h
        grad_scores = ds_rows.index_select(0, meta.pair_rows).to(scores.dtype) if need_s else None

        grad_w2 = grad_w1 = grad_x = None
        if need_w2:
            grad_w2 = ops.grouped_mm_varlen_k(grad_out, a_scaled, offsets,
                                              gather_idx_a=meta.gather_idx)
        del a_scaled
        if need_x:
            dx_rows = ops.grouped_mm(dh, w1, offsets)
            grad_x = ops.aggregate(dx_rows, meta.token_rows, meta.token_offsets, None)
            del dx_rows
        if need_w1:
            grad_w1 = ops.grouped_mm_varlen_k(dh, x, offsets, gather_idx_b=meta.gather_idx)
        return grad_x, grad_w1, grad_w2, grad_scores, None, None, None, None, None


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``/``create_graph``), so
    saved tensors must survive it. Unknown (no such query in this PyTorch) counts as kept."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def moe_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, scores: torch.Tensor,
                token_idx: torch.Tensor, expert_idx: torch.Tensor, *, gate_up: str = "concat",
                backend: str = "auto", metadata: RoutingMetadata | None = None) -> torch.Tensor:
    """Routed SwiGLU experts: ``o_t = Σ_{(t,e) routed} s · W2[e]·SwiGLU(W1[e]·x_t)``.

    Args:
        x: ``(T, d)`` layer input (bf16, fp16, fp32 or fp64).
        w1: ``(E, 2n, d)`` up-projection weights, ``x``'s dtype. Rows ``[gate; up]`` with
            ``gate_up="concat"`` (Hugging Face layout), alternating gate/up rows with
            ``"interleaved"``.
        w2: ``(E, d, n)`` down-projection weights, ``x``'s dtype.
        scores: ``(P,)`` float gate weight of each routed pair.
        token_idx: ``(P,)`` int32/int64 token of each pair, in ``[0, T)``.
        expert_idx: ``(P,)`` int32/int64 expert of each pair, in ``[0, E)``. Pairs may come in
            any order; a token may have 0..E pairs, an expert 0..T.
        gate_up: ``"concat"`` or ``"interleaved"``.
        backend: ``"auto"`` (CuTe kernels where they can run, see
            :func:`sonic.explain_backend`), ``"torch"`` (PyTorch reference) or ``"cute"``.
        metadata: the :func:`sonic.routing_metadata` of exactly these pairs, if the caller has
            it already (e.g. from the faster top-K path); built here otherwise. The kernels
            then read only the metadata, whose indices :func:`sonic.routing_metadata` has
            range-checked, so ``token_idx``/``expert_idx`` values are not read again: a call
            with metadata makes no device→host synchronisation.

    Returns:
        ``(T, d)`` in ``x``'s dtype; fp32 accumulation. Differentiable in x, w1, w2 and scores.
        Saved for backward: x (by reference), H ``(P, 2n)``, scores and the routing metadata.

    Raises:
        TypeError: a non-tensor argument or a wrong dtype (index tensors must be integer,
            weights in ``x``'s dtype).
        ValueError: mismatched shapes or devices, indices out of range (without ``metadata``;
            checked where values can be read without breaking graph capture), unknown
            ``gate_up``/``backend``.
        RuntimeError: ``backend="cute"`` where the kernels cannot run; in backward, a
            ``create_graph=True`` differentiation (the backward is hand-written and not twice
            differentiable, so it refuses rather than return a wrong second derivative).

    Source: SonicMoE (arXiv 2512.14080) §3.2 and Appendix C.
    """
    check_float("x", x, ndim=2)
    check_float("w1", w1, ndim=3)
    check_float("w2", w2, ndim=3)
    check_float("scores", scores, ndim=1)
    check_index("token_idx", token_idx)
    check_index("expert_idx", expert_idx)
    check_choice("gate_up", gate_up, GATE_UP_LAYOUTS)
    check_same_device(x=x, w1=w1, w2=w2, scores=scores, token_idx=token_idx,
                      expert_idx=expert_idx)
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
    num_tokens, d = x.shape
    num_experts, two_n, d_w1 = w1.shape
    if two_n % 2 or d_w1 != d:
        raise ValueError(f"w1 must have shape (E, 2n, d={d}), got {tuple(w1.shape)}")
    if tuple(w2.shape) != (num_experts, d, two_n // 2):
        raise ValueError(f"w2 must have shape (E={num_experts}, d={d}, n={two_n // 2}), "
                         f"got {tuple(w2.shape)}")
    num_pairs = scores.shape[0]
    for name, t in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if t.shape[0] != num_pairs:
            raise ValueError(f"{name} must have shape (P={num_pairs},) like scores, got {tuple(t.shape)}")
    if metadata is None:
        check_index_ranges(token_idx=(token_idx, num_tokens), expert_idx=(expert_idx, num_experts))
    elif (metadata.num_pairs, metadata.num_tokens, metadata.num_experts) != (
            num_pairs, num_tokens, num_experts):
        raise ValueError(f"metadata must describe P={num_pairs} pairs of T={num_tokens} tokens and "
                         f"E={num_experts} experts, got P={metadata.num_pairs}, "
                         f"T={metadata.num_tokens}, E={metadata.num_experts}")
    ops = expert_ops(backend, x.device)
    return MoEExpertsFunction.apply(x, w1, w2, scores, token_idx, expert_idx, gate_up, ops,
                                    metadata)
