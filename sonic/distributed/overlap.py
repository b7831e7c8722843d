"""Chunked expert parallelism: the all-to-alls of one chunk of tokens overlap the local expert
computation of another (the coarse form of Comet, arXiv 2502.19811: overlap at chunk, not
tile, granularity).

A :class:`~sonic.distributed.experts.DispatchPlan` of ``C`` chunks (contiguous token ranges,
one routing and one host read for the whole layer) is run as a two-stage pipeline::

    comm stream:     D0 D1 ·· C0 D2 ·· C1 D3 ·· C2 ·· ···
    compute stream:  ·· E0 ········ E1 ······ E2 ···· ··· aggregate

``D_c`` is chunk ``c``'s dispatch (its token rows and scores to the ranks holding their
experts), ``E_c`` the local experts on the rows it received (:func:`sonic.moe_experts`), ``C_c``
its combine (the partial outputs back). ``D_{c+1}`` is queued before ``E_c`` starts and
``C_c`` right after it, so while ``E_c`` runs the link carries ``C_{c-1}`` and ``D_{c+1}``:
only ``D_0``, ``C_{C-1}`` and the final per-token sum stay exposed. Backward runs the same
pipeline with dO rows in (combine's backward) and dX rows and score gradients out (dispatch's
backward).

Streams: on CUDA the all-to-alls and the row gathers that feed them run on a second stream,
ordered against the compute stream by events (the comm stream first waits for the compute
stream's queued work, so its inputs are ready; the compute stream waits for a chunk's event
before reading what arrived). Tensors crossing streams are marked with ``record_stream`` so the
caching allocator does not hand their memory to the other stream while it is still in use. On
the CPU (gloo) there is one thread: the same schedule runs sequentially.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import get_gradient_edge

from sonic.autograd.moe_experts import _graph_kept, moe_experts
from sonic.distributed.comm import all_to_all
from sonic.ops import routing_metadata_op

if TYPE_CHECKING:
    from sonic.distributed.experts import DispatchPlan

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
        if self.comm is None:
            return contextlib.nullcontext()
        self.comm.wait_stream(self.compute)
        for t in made_on_compute:
            t.record_stream(self.comm)
        return torch.cuda.stream(self.comm)

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
        if event is None:
            return
        self.compute.wait_event(event)
        for t in made_on_comm:
            t.record_stream(self.compute)


class ChunkedExperts(torch.autograd.Function):
    """``(x (T, d), scores (P,), w1_local, w2_local)`` → ``(T, d)``: dispatch, local experts
    and combine of a plan of ``C ≥ 2`` chunks, pipelined (module docstring).

    Forward builds, per chunk, a small autograd graph of the local experts
    (:func:`sonic.moe_experts` on the received rows and scores, with ``w1_local``/``w2_local``
    as leaves); backward differentiates each chunk's graph in turn between its dO all-to-all
    and its dX / score-gradient all-to-alls, and sums the chunks' weight gradients.

    Kept for backward, per chunk ``c``: the received rows ``x_recv_c (R_c, d)`` and scores, and
    what :func:`sonic.moe_experts` keeps (``H (P_recv_c, 2n)``, the routing metadata) — in total
    what the unchunked path keeps — plus the plan. Not kept: x, the sent rows, the partial
    outputs (only their graph edge), Y.
    """

    @staticmethod
    def forward(ctx, x, scores, w1_local, w2_local, plan: DispatchPlan, num_local: int,
                gate_up: str, backend: str, aggregate):
        streams = _Streams(x.device)
        need_x, need_s, need_w1, need_w2 = ctx.needs_input_grad[:4]
        w1_leaf = w1_local.detach().requires_grad_(need_w1)
        w2_leaf = w2_local.detach().requires_grad_(need_w2)
        # The local routing of every chunk, while the first dispatch is on the link. Its pairs
        # were built from range-checked indices: no second check (a host read).
        metadata = [routing_metadata_op(chunk.recv_tokens, chunk.recv_experts,
                                        sum(chunk.recv_rows), num_local, None, backend)
                    for chunk in plan.chunks]

        def dispatch(chunk):
            with streams.on_comm(x, scores):
                x_recv = all_to_all(x.index_select(0, plan.send_tokens[chunk.rows]),
                                    chunk.recv_rows, chunk.send_rows, plan.group)
                s_recv = all_to_all(scores.index_select(0, plan.pair_order[chunk.pairs]),
                                    chunk.recv_pairs, chunk.send_pairs, plan.group)
            return x_recv, s_recv, streams.event()

        rows = None           # the partial outputs of all chunks, in send-row order
        edges, leaves = [], []
        pending = dispatch(plan.chunks[0])
        for c, chunk in enumerate(plan.chunks):
            x_recv, s_recv, arrived = pending
            if c + 1 < len(plan.chunks):
                pending = dispatch(plan.chunks[c + 1])
            streams.wait(arrived, x_recv, s_recv)
            with torch.enable_grad():
                x_recv.requires_grad_(need_x)
                s_recv.requires_grad_(need_s)
                y_recv = moe_experts(x_recv, w1_leaf, w2_leaf, s_recv, chunk.recv_tokens,
                                     chunk.recv_experts, gate_up=gate_up, backend=backend,
                                     metadata=metadata[c])
            if y_recv.requires_grad:
                edges.append(get_gradient_edge(y_recv))
            leaves.append((x_recv, s_recv))
            if rows is None:
                rows = y_recv.new_empty((plan.send_tokens.numel(), y_recv.shape[1]))
            with streams.on_comm(y_recv, rows):
                all_to_all(y_recv, chunk.send_rows, chunk.recv_rows, plan.group,
                           out=rows[chunk.rows])
            del y_recv
        # The comm stream runs in issue order: its end is the end of the last combine.
        streams.wait(streams.event())
        ctx.plan, ctx.edges, ctx.leaves = plan, edges, leaves
        ctx.weight_leaves, ctx.aggregate = (w1_leaf, w2_leaf), aggregate
        return aggregate(rows, plan.token_rows, plan.token_offsets, None)

    @staticmethod
    def backward(ctx, grad_out):
        plan = ctx.plan
        streams = _Streams(grad_out.device)
        need_x, need_s, need_w1, need_w2 = ctx.needs_input_grad[:4]
        w1_leaf, w2_leaf = ctx.weight_leaves
        grad_out = grad_out.contiguous()
        # Backward of the inner graphs keeps them when this one is kept (retain_graph), and
        # records a graph exactly when the caller asked for one (create_graph): sonic's expert
        # backward then refuses, as it does outside EP.
        keep, create = _graph_kept(), torch.is_grad_enabled()

        def send_grad_out(chunk):
            with streams.on_comm(grad_out):
                grad_y = all_to_all(grad_out.index_select(0, plan.send_tokens[chunk.rows]),
                                    chunk.recv_rows, chunk.send_rows, plan.group)
            return grad_y, streams.event()

        x_recv0, s_recv0 = ctx.leaves[0]
        num_rows = plan.send_tokens.numel()
        grad_rows = x_recv0.new_empty((num_rows, x_recv0.shape[1])) if need_x else None
        grad_s_sent = s_recv0.new_empty(plan.pair_order.numel()) if need_s else None
        grad_w1 = grad_w2 = None
        pending = send_grad_out(plan.chunks[0])
        for c, chunk in enumerate(plan.chunks):
            grad_y, arrived = pending
            if c + 1 < len(plan.chunks):
                pending = send_grad_out(plan.chunks[c + 1])
            streams.wait(arrived, grad_y)
            x_recv, s_recv = ctx.leaves[c]
            inputs = [t for t, need in ((x_recv, need_x), (s_recv, need_s), (w1_leaf, need_w1),
                                        (w2_leaf, need_w2)) if need]
            grads = torch.autograd.grad([ctx.edges[c]], inputs, [grad_y], retain_graph=keep,
                                        create_graph=create, allow_unused=True)
            if not keep:    # the chunk's received rows need not outlive its backward
                ctx.leaves[c] = ctx.edges[c] = None
            # A gradient the chunk's graph does not produce (nothing of it reached the input)
            # is zero; the all-to-alls below still need its rows.
            grads = iter([torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)])
            del grad_y
            grad_x_recv = next(grads) if need_x else None
            grad_s_recv = next(grads) if need_s else None
            if need_w1:
                g = next(grads)
                grad_w1 = g if grad_w1 is None else grad_w1.add_(g)
            if need_w2:
                g = next(grads)
                grad_w2 = g if grad_w2 is None else grad_w2.add_(g)
            # Every rank takes the same branches: the requires_grad flags are agreed.
            touched = [t for t in (grad_x_recv, grad_s_recv, grad_rows, grad_s_sent)
                       if t is not None]
            with streams.on_comm(*touched):
                if need_x:
                    all_to_all(grad_x_recv, chunk.send_rows, chunk.recv_rows, plan.group,
                               out=grad_rows[chunk.rows])
                if need_s:
                    all_to_all(grad_s_recv, chunk.send_pairs, chunk.recv_pairs, plan.group,
                               out=grad_s_sent[chunk.pairs])
            del grad_x_recv, grad_s_recv, touched
        streams.wait(streams.event())
        grad_x = grad_scores = None
        if need_x:
            grad_x = ctx.aggregate(grad_rows, plan.token_rows, plan.token_offsets, None)
        if need_s:
            grad_scores = torch.empty_like(grad_s_sent).index_copy_(0, plan.pair_order,
                                                                    grad_s_sent)
        return grad_x, grad_scores, grad_w1, grad_w2, None, None, None, None, None
