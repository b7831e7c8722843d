"""Chunked expert parallelism: the all-to-alls of one chunk of tokens overlap the local expert
computation of another (the coarse form of Comet, arXiv 2502.19811: overlap at chunk, not
tile, granularity).

A :class:`~sonic.distributed.plan.DispatchPlan` of ``C`` chunks (contiguous token ranges,
one routing and one host read for the whole layer) is run as a two-stage pipeline::

    comm stream:     D0 D1 ·· C0 D2 ·· C1 D3 ·· C2 ·· ···
    compute stream:  ·· E0 ········ E1 ······ E2 ···· ··· aggregate

``D_c`` is chunk ``c``'s dispatch (its token rows and scores to the ranks holding their
experts), ``E_c`` the local experts on the rows it received (:func:`sonic.moe_experts`), ``C_c``
its combine (the partial outputs back). ``D_{c+1}`` is queued before ``E_c`` starts and
``C_c`` right after it, so while ``E_c`` runs the link carries ``C_{c-1}`` and ``D_{c+1}``:
only ``D_0``, ``C_{C-1}`` and the final per-token sum stay exposed. Backward runs the same
pipeline with dO rows in (combine's backward) and dX rows and score gradients out (dispatch's
backward), per chunk only the activation gradients (dH, dX, ds); the weight gradients dW1 and
dW2 are computed once, over the received rows of all chunks, after the last chunk — one
varlen-K GEMM per weight, as unchunked, while the last chunk's gradients are on the link::

    comm stream:     G0 G1 ·· X0 G2 ·· X1 ·· X2 ··········
    compute stream:  ·· B0 ········ B1 ····· B2 dW2 dW1 ··

For that the chunks' received rows (X, dO), H (then dH, written over it) and A' live in one
buffer each, chunk ``c`` at its own offset; the varlen-K GEMMs read them through two gather
indices over all received pairs sorted by expert: one into the rows, one into the chunks'
sorted pair positions (a chunk's pairs are sorted by expert within the chunk only).

SM margin: a persistent grouped GEMM holds every SM until it ends, so the all-to-all kernels
of the comm stream would wait for it; with ``sm_margin > 0`` the GEMMs launched here leave
that many SMs free (:func:`sonic.backend.sm_margin`; results unchanged).

Streams: on CUDA the all-to-alls and the row gathers that feed them run on a second stream,
ordered against the compute stream by events (the comm stream first waits for the compute
stream's queued work, so its inputs are ready; the compute stream waits for a chunk's event
before reading what arrived). Tensors crossing streams are marked with ``record_stream`` so the
caching allocator does not hand their memory to the other stream while it is still in use. On
the CPU (gloo) there is one thread: the same schedule runs sequentially.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import NamedTuple

import torch

from sonic._custom_op import graph_kept
from sonic.activation_cache import unpack as activation_cache_unpack
from sonic.backend import expert_ops, fp8_weight_grads_for, sm_margin
from sonic.distributed.plan import DispatchPlan
from sonic.ops import (_acc, _first_order_error, call, dh_step, dx_rows, experts_forward,
                       pair_score_grads, routing_metadata_op, unpack_metadata, weight_grad_fn)


_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}


class _Streams:
    """The compute stream (current when the layer runs) and the communication stream of its
    device; both ``None`` on the CPU, where every method is a no-op."""

    def __init__(self, device: torch.device):
        self.compute = self.comm = None
        if device.type == "cuda":
            self.compute = torch.cuda.current_stream(device)
            index = self.compute.device_index
            if index not in _COMM_STREAMS:
                _COMM_STREAMS[index] = torch.cuda.Stream(device)
            self.comm = _COMM_STREAMS[index]

    def on_comm(self, *made_on_compute: torch.Tensor):
        """Context in which the comm stream runs the block, after the compute stream's queued
        work; ``made_on_compute``: tensors of the compute stream the block reads or writes,
        which must outlive its use there."""
        comm, compute = self.comm, self.compute
        if comm is None or compute is None:
            return contextlib.nullcontext()
        comm.wait_stream(compute)
        for t in made_on_compute:
            t.record_stream(comm)
        return torch.cuda.stream(comm)

    def event(self):
        """An event at the comm stream's current end (``None`` on the CPU)."""
        if self.comm is None:
            return None
        event = torch.cuda.Event()
        event.record(self.comm)
        return event

    def wait(self, event, *made_on_comm: torch.Tensor) -> None:
        """The compute stream waits for ``event``; ``made_on_comm``: tensors allocated on the
        comm stream that the compute stream uses from now on."""
        compute = self.compute
        if event is None or compute is None:
            return
        compute.wait_event(event)
        for t in made_on_comm:
            t.record_stream(compute)


class ChunkedExperts(torch.autograd.Function):
    """``(x (T, d), scores (P,), w1_local, w2_local)`` → ``(T, d)``: dispatch, local experts
    and combine of a plan of ``C ≥ 2`` chunks, pipelined (module docstring).

    ``x``, ``w1_local`` and ``w2_local`` share one dtype (the caller applies autocast). Forward
    runs the expert forward of each chunk (:func:`sonic.ops.experts_forward`, what
    :func:`sonic.moe_experts` runs) on the rows it received; backward runs, per chunk, the dH
    kernel and dX, then the two weight-gradient GEMMs once over all chunks.

    Kept for backward: the received rows ``x_recv (R, d)`` and scores ``(P_recv,)``, ``H
    (P_recv, 2n)`` (one buffer each, chunks at their offsets), the per-chunk routing metadata
    and the plan — what the unchunked path keeps. With ``recompute_dispatch``, ``x`` (by
    reference) instead of ``x_recv``: backward sends its rows again, on the comm stream while
    dW2 runs, for dW1 (the same bytes, so the gradients are bitwise those without it). All of
    it, the plan's indices and the chunks' packed metadata included, is kept with
    ``save_for_backward``, so autograd's saved-tensor hooks see it
    (:func:`sonic.profile_activation_memory`, ``torch.autograd.graph.save_on_cpu``). With the
    fp8 activation cache, each chunk's e4m3 H and scales instead of the bf16 H buffer; with
    FP8 weight copies, those by reference. Backward adds, beside the unchunked path's buffers,
    A' ``(P_recv, n)`` of all chunks until dW2 (unchunked: of the one chunk) and the dO rows
    ``(R, d)`` of all chunks (unchunked: the same), and writes dH over H (when the graph is not
    kept, and with the bf16 cache; otherwise a second ``(P_recv, 2n)`` buffer, and with the
    fp8 cache each chunk's dequantized H is a transient the dH step overwrites).
    """

    @staticmethod
    def forward(ctx, x, scores, w1, w2, plan: DispatchPlan, num_local: int, gate_up: str,
                backend: str, aggregate, margin: int, recompute_dispatch: bool,
                fp8_weights: tuple | None, activation_cache: str, activation: str):
        streams = _Streams(x.device)
        rows_at, pairs_at = _received_slices(plan)
        # The local routing of every chunk, while the first dispatch is on the link. Its pairs
        # were built from range-checked indices: no second check (a host read).
        metadata = [routing_metadata_op(chunk.recv_tokens, chunk.recv_experts,
                                        sum(chunk.recv_rows), num_local, None, backend)
                    for chunk in plan.chunks]
        x_recv = x.new_empty((rows_at[-1].stop, x.shape[1]))
        s_recv = scores.new_empty(pairs_at[-1].stop)
        # H of all chunks in one buffer (dH goes over it for the one dW1 GEMM); with the fp8
        # cache, each chunk's e4m3 H and scales instead.
        h = x.new_empty((pairs_at[-1].stop, w1.shape[1])) if activation_cache == "bf16" else None
        caches = []

        def dispatch(c):
            chunk = plan.chunks[c]
            with streams.on_comm(scores, s_recv):
                plan.all_to_all(scores, chunk.recv_pairs, chunk.send_pairs,
                                out=s_recv[pairs_at[c]], index=plan.pair_order[chunk.pairs])
            return _send_token_rows(streams, x, plan, c, x_recv, rows_at)

        rows = x.new_empty((plan.send_tokens.numel(), x.shape[1]))  # partial outputs, send order
        arrived = dispatch(0)
        with sm_margin(margin):
            for c, chunk in enumerate(plan.chunks):
                streams.wait(arrived)
                if c + 1 < len(plan.chunks):
                    arrived = dispatch(c + 1)
                y_recv, *cache = experts_forward(
                    x_recv[rows_at[c]], w1, w2, s_recv[pairs_at[c]], metadata[c], gate_up,
                    backend, h_out=None if h is None else h[pairs_at[c]],
                    activation_cache=activation_cache, fp8_weights=fp8_weights,
                    activation=activation)
                if h is None:
                    caches += cache
                with streams.on_comm(y_recv, rows):
                    plan.all_to_all(y_recv, chunk.send_rows, chunk.recv_rows,
                                    out=rows[chunk.rows])
                del y_recv
        # The comm stream runs in issue order: its end is the end of the last combine.
        streams.wait(streams.event())
        # Everything kept goes through save_for_backward (the hooks of
        # torch.autograd.graph.saved_tensors_hooks see it). With recompute_dispatch, x (an
        # in-place change of it then fails backward loudly) instead of the rows it sent:
        # backward sends them again for dW1.
        # The FP8 weight copies are the caller's: saved by reference, like w1 and w2.
        kept_h = [h] if h is not None else caches
        plan.save_for_backward(ctx, w1, w2, x if recompute_dispatch else x_recv, s_recv,
                               *(m.packed for m in metadata), *kept_h, *(fp8_weights or ()))
        ctx.recompute_dispatch = recompute_dispatch
        ctx.activation_cache, ctx.fp8 = activation_cache, fp8_weights is not None
        # The weight gradients' precision as set when the forward ran (as the layer's op).
        ctx.fp8_weight_grads = ctx.fp8 and fp8_weight_grads_for(w2.shape[1],
                                                                w2.shape[2]) == "fp8"
        ctx.num_local, ctx.gate_up, ctx.backend = num_local, gate_up, backend
        ctx.activation = activation
        ctx.aggregate, ctx.margin = aggregate, margin
        return aggregate(rows, plan.token_rows, plan.token_offsets, None)

    @staticmethod
    def backward(ctx, grad_out):
        # Grad mode is on here exactly under create_graph=True: the hand-written expert
        # backward is not twice differentiable, so it refuses, as it does outside EP.
        if torch.is_grad_enabled():
            raise _first_order_error()
        (w1, w2, x_or_rows, s_recv, *rest), plan = DispatchPlan.saved(ctx)
        num_chunks = len(plan.chunks)
        packed, rest = rest[:num_chunks], rest[num_chunks:]
        fp8_weights = rest[-8:] if ctx.fp8 else None
        # H: one bf16 buffer, or per chunk the fp8 cache's (e4m3 H, scales).
        kept_h = rest[:-8] if ctx.fp8 else rest
        h = kept_h[0] if ctx.activation_cache == "bf16" else None
        backend = ctx.backend
        x, x_recv = (x_or_rows, None) if ctx.recompute_dispatch else (None, x_or_rows)
        # When the graph is not kept, dH is written over H: autograd frees the saved tensors
        # after this backward, so nothing reads H again.
        keep = graph_kept()
        streams = _Streams(grad_out.device)
        need_x, need_s, need_w1, need_w2 = ctx.needs_input_grad[:4]
        rows_at, pairs_at = _received_slices(plan)
        dequantize_kernel = expert_ops(backend, grad_out.device).name == "cute"
        metadata = [unpack_metadata(p, rows.stop - rows.start, ctx.num_local,
                                    pairs.stop - pairs.start, 0)
                    for p, rows, pairs in zip(packed, rows_at, pairs_at)]
        grad_out = grad_out.contiguous().to(w1.dtype)
        # dO rows of all chunks, kept for dW2
        grad_y = grad_out.new_empty((rows_at[-1].stop, grad_out.shape[1]))
        num_pairs = pairs_at[-1].stop
        a_scaled = grad_out.new_empty((num_pairs, w2.shape[2])) if need_w2 else None
        dh_all = None
        if need_w1:
            dh_all = h if h is not None and not keep else grad_out.new_empty(
                (num_pairs, w1.shape[1]))
        grad_rows = grad_out.new_empty((plan.send_tokens.numel(), grad_out.shape[1])) \
            if need_x else None
        grad_s_sent = s_recv.new_empty(plan.pair_order.numel()) if need_s else None

        def send_grad_out(c):
            return _send_token_rows(streams, grad_out, plan, c, grad_y, rows_at)

        arrived = send_grad_out(0)
        with sm_margin(ctx.margin):
            # All received pairs sorted by expert, for the weight gradients (off the link's
            # critical path: the first dO rows are in flight).
            weights = _weight_grad_index(plan, metadata, rows_at, pairs_at, ctx.num_local,
                                         backend) if need_w1 or need_w2 else None
            for c, chunk in enumerate(plan.chunks):
                streams.wait(arrived)
                if c + 1 < len(plan.chunks):
                    arrived = send_grad_out(c + 1)
                pairs = pairs_at[c]
                if h is not None:
                    h_c, owned = h[pairs], False
                else:   # the fp8 cache: dequantized into a buffer this backward owns
                    h_c, owned = activation_cache_unpack(
                        kept_h[2 * c], kept_h[2 * c + 1], w1.dtype, dequantize_kernel), True
                grad_x_recv, grad_s_recv = _activation_grads(
                    grad_y[rows_at[c]], w1, w2, fp8_weights, h_c, s_recv[pairs], metadata[c],
                    ctx.gate_up, ctx.activation, backend, need_x, need_s,
                    overwrite_h=owned or not keep,
                    a_out=a_scaled[pairs] if need_w2 else None,
                    dh_out=dh_all[pairs] if need_w1 else None)
                del h_c
                # Every rank takes the same branches: the requires_grad flags are agreed.
                touched = [t for t in (grad_x_recv, grad_s_recv, grad_rows, grad_s_sent)
                           if t is not None]
                with streams.on_comm(*touched):
                    if need_x:
                        plan.all_to_all(grad_x_recv, chunk.send_rows, chunk.recv_rows,
                                        out=grad_rows[chunk.rows])
                    if need_s:
                        plan.all_to_all(grad_s_recv, chunk.send_pairs, chunk.recv_pairs,
                                        out=grad_s_sent[chunk.pairs])
                del grad_x_recv, grad_s_recv, touched
            resent = None
            if need_w1 and x_recv is None:
                # Recompute: x's rows go out again, after the chunks' gradients on the link
                # and while dW2 runs; dW1 waits for them.
                x_recv = grad_out.new_empty(grad_y.shape)
                for c in range(len(plan.chunks)):
                    resent = _send_token_rows(streams, x, plan, c, x_recv, rows_at)
            grad_w1, grad_w2 = _weight_grads(grad_y, a_scaled, dh_all, x_recv, weights,
                                             backend, lambda: streams.wait(resent),
                                             ctx.fp8_weight_grads)
            del a_scaled, grad_y, dh_all, x_recv
        streams.wait(streams.event())
        grad_x = grad_scores = None
        if need_x:
            grad_x = ctx.aggregate(grad_rows, plan.token_rows, plan.token_offsets, None)
        if need_s:
            grad_scores = torch.empty_like(grad_s_sent).index_copy_(0, plan.pair_order,
                                                                    grad_s_sent)
        return (grad_x, grad_scores, grad_w1, grad_w2) + (None,) * 10


def _activation_grads(grad_y, w1, w2, fp8_weights, h, scores, m, gate_up, activation, backend,
                      need_x, need_s, *, overwrite_h, a_out, dh_out):
    """One chunk's expert backward without the weight gradients: the dH step (dH into
    ``dh_out`` when given, A' into ``a_out``; FP8 with ``fp8_weights``), then ``(dX of the
    received rows or None, score gradients or None)``. The steps of sonic's expert backward
    (:mod:`sonic.ops`: :func:`~sonic.ops.dh_step`, :func:`~sonic.ops.dx_rows`)."""
    row_scores = scores.index_select(0, m.sorted_pairs).to(_acc(grad_y.dtype))
    dh, _, ds_rows, *dx_operand = dh_step(grad_y, w2, fp8_weights, m, h, row_scores, gate_up,
                                          backend, overwrite_h=overwrite_h, a_out=a_out,
                                          for_dx=need_x, activation=activation)
    if dh_out is not None and dh.data_ptr() != dh_out.data_ptr():
        dh_out.copy_(dh)            # the reference, or a kept graph: dH not written over H
    grad_s = pair_score_grads(ds_rows, m, scores.dtype) if need_s else None
    grad_x = None
    if need_x:
        rows = dx_rows(dh, w1, fp8_weights, m.expert_offsets, backend, *dx_operand)
        dx_operand.clear()
        grad_x = call.aggregate(rows, m.token_rows, m.token_offsets, None, backend)
    return grad_x, grad_s


def _send_token_rows(streams: _Streams, t: torch.Tensor, plan: DispatchPlan, c: int,
                     out: torch.Tensor, rows_at: list[slice]):
    """On the comm stream, chunk ``c``'s send rows of ``t (T, d)`` (x, dO) to the ranks that
    hold their tokens' experts, received into ``out[rows_at[c]]``; the event at its end."""
    chunk = plan.chunks[c]
    with streams.on_comm(t, out):
        plan.all_to_all(t, chunk.recv_rows, chunk.send_rows, out=out[rows_at[c]],
                        index=plan.send_tokens[chunk.rows])
    return streams.event()


def _weight_grads(grad_y, a_scaled, dh, x_recv, weights, backend, before_w1, fp8: bool):
    """``(dW1 or None, dW2 or None)`` over the received pairs of all chunks: one varlen-K GEMM
    per weight (FP8 ones with ``fp8``, as the single-process layer's,
    :func:`sonic.ops.weight_grad_fn`), its operands gathered by ``weights``
    (:class:`_WeightGradIndex`); ``a_scaled`` / ``dh`` None when that gradient is not needed.
    ``before_w1()`` runs between the two (the compute stream waits there for re-sent rows)."""
    weight_grad = weight_grad_fn(weights.expert_offsets, backend, fp8)
    grad_w1 = grad_w2 = None
    if a_scaled is not None:
        grad_w2 = weight_grad(grad_y, a_scaled, weights.row_idx, weights.chunk_pos)
    if dh is not None:
        before_w1()
        grad_w1 = weight_grad(dh, x_recv, weights.chunk_pos, weights.row_idx)
    return grad_w1, grad_w2


def _received_slices(plan: DispatchPlan) -> tuple[list[slice], list[slice]]:
    """Per chunk, its received rows' and received pairs' ranges in the buffers holding those
    of all chunks (chunk-major)."""
    def ranges(sizes):
        ends = list(itertools.accumulate(sizes))
        return [slice(end - size, end) for size, end in zip(sizes, ends)]

    return (ranges([sum(chunk.recv_rows) for chunk in plan.chunks]),
            ranges([sum(chunk.recv_pairs) for chunk in plan.chunks]))


class _WeightGradIndex(NamedTuple):
    """All received pairs sorted by local expert: ``expert_offsets (E_local+1,)`` int32;
    ``row_idx (P_recv,)`` int32, the received row of each (into the rows of all chunks);
    ``chunk_pos (P_recv,)`` int32, its row in the buffers of per-chunk expert-sorted pairs
    (dH, A')."""

    expert_offsets: torch.Tensor
    row_idx: torch.Tensor
    chunk_pos: torch.Tensor


def _weight_grad_index(plan, metadata, rows_at, pairs_at, num_local, backend):
    tokens = torch.cat([chunk.recv_tokens + rows.start
                        for chunk, rows in zip(plan.chunks, rows_at)])
    experts = torch.cat([chunk.recv_experts for chunk in plan.chunks])
    everything = routing_metadata_op(tokens, experts, rows_at[-1].stop, num_local, None,
                                     backend)
    # A pair's row in its chunk's expert-sorted order, offset by the chunk's first pair.
    sorted_in_chunk = torch.cat([m.pair_rows + pairs.start
                                 for m, pairs in zip(metadata, pairs_at)])
    chunk_pos = sorted_in_chunk.index_select(0, everything.sorted_pairs.long())
    return _WeightGradIndex(everything.expert_offsets, everything.gather_idx,
                            chunk_pos.to(torch.int32))
