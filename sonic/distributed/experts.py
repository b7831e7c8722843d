"""Expert-parallel MoE experts: dispatch all-to-all → local sonic experts → combine all-to-all.

Expert ``e`` lives on EP rank ``e // (E/ep)`` (contiguous placement), or, given a
:class:`~sonic.distributed.Placement` (EPLB), in the slots the placement gives it: each rank
holds ``slots_per_rank`` expert weights and a pair of a replicated expert goes to one of its
replicas (:meth:`Placement.pair_slots`). A layer call:

1. **plan** (on the device): the destination slot and rank of every routed pair, the distinct
   (token, destination rank) rows to send — a token goes to a rank *once*, however many of its
   experts live there — and per destination the row and pair counts.
2. **count exchange**: one ``all_to_all_single`` of the counts (with a few integers that let
   every rank check that all ranks agree on shapes and indices), then **one host read** of the
   send and receive sizes: the only device→host synchronisation of the layer (MetaShuffling,
   PyTorch blog 2025: counts stay on the device, the host learns sizes once).
3. **dispatch**: all-to-all of the token rows (``S × d`` sent), of each pair's (row, local
   expert) and of the scores. The received rows play the role of X for the local experts.
4. **local experts**: :func:`sonic.moe_experts` on the received rows with local indices; its
   output is, per received row, the score-weighted sum over this rank's experts of the token.
5. **combine**: all-to-all of those partial outputs back to the token's rank, summed per token
   by sonic's aggregation (a gather-sum without atomics: deterministic).

Backward mirrors it: dO rows go to the ranks that hold the token's experts (combine's backward),
the local expert backward runs there, and the dX partials and score gradients come back
(dispatch's backward), dX summed per token. Expert weight gradients stay on their rank.

With ``num_chunks = C > 1`` steps 1–2 stay one per call (per (rank, chunk) counts in the one
exchange) and steps 3–5 run per chunk of consecutive tokens, pipelined so that one chunk's
all-to-alls overlap another's local experts (:mod:`sonic.distributed.overlap`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonic._validation import (check_choice, check_float, check_index, check_int,
                               check_same_device)
from sonic.autograd.moe_experts import autocast_experts, moe_experts
from sonic.backend import expert_ops
from sonic.distributed.comm import DTYPE_CODES, all_to_all, check_group
from sonic.distributed.eplb import Placement
from sonic.distributed.overlap import ChunkedExperts
from sonic.reference.ops import GATE_UP_LAYOUTS
from sonic.routing.metadata import routing_metadata
from sonic.routing.types import Routing

# What every rank sends every other rank beside its counts; all ranks compare all entries, so
# a disagreement raises on every rank at once instead of hanging in the next collective.
_AGREED = ("d (x.shape[1])", "n (w2_local.shape[2])", "num_experts", "dtype of x",
           "torch.is_grad_enabled()", "x.requires_grad", "scores.requires_grad",
           "w1_local.requires_grad", "w2_local.requires_grad",
           "placement (its fingerprint; 0 for the contiguous default)", "num_chunks",
           "recompute_dispatch")
# The most chunks a layer call may pipeline (the count message has room for this many).
MAX_CHUNKS = 16


@dataclass(frozen=True)
class DispatchChunk:
    """One chunk of a :class:`DispatchPlan`: the send rows ``rows`` (a slice of
    :attr:`DispatchPlan.send_tokens`) and pairs ``pairs`` (a slice of
    :attr:`DispatchPlan.pair_order`) of the chunk's tokens.

    Receive side: ``recv_tokens (P_recv,)`` int32 — the row of the chunk's received rows that
    each received pair reads; ``recv_experts (P_recv,)`` int32 — its local expert (slot), in
    ``[0, E/ep)`` or ``[0, slots_per_rank)`` with a placement. Host split sizes, one per group
    rank: ``send_rows``, ``recv_rows``, ``send_pairs``, ``recv_pairs``.
    """

    rows: slice
    pairs: slice
    recv_tokens: torch.Tensor
    recv_experts: torch.Tensor
    send_rows: list[int]
    recv_rows: list[int]
    send_pairs: list[int]
    recv_pairs: list[int]


@dataclass(frozen=True)
class DispatchPlan:
    """Where rows and pairs go in one expert-parallel layer call; all indices on the device.

    This rank's ``T`` tokens are split into ``C`` chunks of ``L = ceil(T / C)`` consecutive
    tokens (chunk ``c``: tokens ``[c·L, min((c+1)·L, T))``, possibly empty; ``C = 1``: one chunk
    of all of them), one dispatch and one combine all-to-all each.

    Send side (this rank's ``T`` tokens and ``P`` pairs):
        send_tokens: ``(S,)`` int64 — source token of each send row; rows grouped by chunk,
            then by destination rank, tokens ascending within a rank.
        token_rows: ``(S,)`` int32 — send rows grouped by token (the combine's gather-sum
            index, as :attr:`RoutingMetadata.token_rows`).
        token_offsets: ``(T+1,)`` int32 — exclusive prefix sum of send rows per token.
        pair_order: ``(P,)`` int64 — pairs grouped by chunk, then by destination rank (stable).
    chunks: the ``C`` :class:`DispatchChunk` s, with the receive side and the host sizes.
    """

    send_tokens: torch.Tensor
    token_rows: torch.Tensor
    token_offsets: torch.Tensor
    pair_order: torch.Tensor
    chunks: tuple[DispatchChunk, ...]
    num_tokens: int
    group: object


def plan_dispatch(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int,
                  num_experts: int, agreed: list[int], group,
                  placement: Placement | None = None, num_chunks: int = 1) -> DispatchPlan:
    """Build the :class:`DispatchPlan` with one count all-to-all and one host read, for
    ``num_chunks`` chunks of ``ceil(T / num_chunks)`` consecutive tokens (the last ones
    shorter or empty).

    ``agreed`` holds this rank's values of :data:`_AGREED`. ``placement``: where experts live
    (``None``: contiguous, expert ``e`` at local index ``e % (E/ep)`` of rank ``e // (E/ep)``).
    A pair's destination does not depend on the chunking (a replica is chosen from the token's
    index among all ``T``), so every chunk count sends every pair to the same expert.

    Raises:
        ValueError: on every rank, if any rank's indices are out of range or ranks disagree on
            an entry of :data:`_AGREED`.
    """
    ep_size, ep_rank = check_group(group)
    num_local = num_experts // ep_size if placement is None else placement.slots_per_rank
    device = token_idx.device
    tokens, experts = token_idx.long(), expert_idx.long()
    # Out-of-range indices are reported collectively after the exchange; clamping keeps the
    # scatters below in bounds until then.
    bad = ((tokens < 0) | (tokens >= num_tokens) | (experts < 0) | (experts >= num_experts)).any()
    chunk_len = max(1, -(-num_tokens // num_chunks))
    width = num_chunks * chunk_len                             # >= T, padded to whole chunks
    tokens = tokens.clamp(0, max(num_tokens, 1) - 1)
    experts = experts.clamp(0, num_experts - 1)
    # The slot of each pair: its expert (contiguous) or one of the expert's replicas.
    slots = experts if placement is None else placement.pair_slots(tokens, experts, ep_rank)
    dst = slots // num_local
    chunk = tokens // chunk_len
    cell = dst * width + tokens                                # (rank, token), rank-major
    mark = torch.zeros(ep_size * width, dtype=torch.int64, device=device).scatter_(0, cell, 1)
    # Send rows in (chunk, rank, token) order, so that each chunk's rows are one contiguous
    # block, grouped by destination rank as its all-to-all wants them.
    blocks = mark.view(ep_size, num_chunks, chunk_len)
    row_of_cell = (torch.cumsum(blocks.transpose(0, 1).flatten(), 0) - 1).view(
        num_chunks, ep_size, chunk_len).transpose(0, 1).flatten()
    rows = blocks.sum(2)                                       # (ep, C)
    bucket = dst * num_chunks + chunk                          # (rank, chunk), rank-major
    pairs = torch.zeros(ep_size * num_chunks, dtype=torch.int64, device=device).scatter_add_(
        0, bucket, torch.ones_like(bucket)).view(ep_size, num_chunks)
    send_row = row_of_cell[cell]
    by_chunk = rows.t().flatten()
    block_start = (torch.cumsum(by_chunk, 0) - by_chunk).view(num_chunks, ep_size).t()
    # One int per pair for the receiver: its row within the block of its chunk sent to that
    # rank, and its local expert.
    info = (send_row - block_start[dst, chunk]) * num_local + (slots - dst * num_local)

    # Padded to MAX_CHUNKS chunks, so the message has the same size on every rank even when
    # ranks disagree on num_chunks (which the agreement check then reports).
    pad = (0, MAX_CHUNKS - num_chunks)
    counts = torch.cat([torch.nn.functional.pad(rows, pad), torch.nn.functional.pad(pairs, pad),
                        bad.to(torch.int64).expand(ep_size, 1),
                        torch.tensor(agreed, dtype=torch.int64, device=device).expand(ep_size, -1)],
                       dim=1)
    recv = all_to_all(counts, [1] * ep_size, [1] * ep_size, group)
    host = torch.cat([counts[:, :2 * MAX_CHUNKS].flatten(), recv.flatten()]).tolist()  # one sync
    sent = [host[j * 2 * MAX_CHUNKS:(j + 1) * 2 * MAX_CHUNKS] for j in range(ep_size)]
    table = host[ep_size * 2 * MAX_CHUNKS:]
    table = [table[j * counts.shape[1]:(j + 1) * counts.shape[1]] for j in range(ep_size)]
    _check_agreement(table, agreed, ep_rank, num_tokens, num_experts)
    # [c][j]: chunk c, group rank j.
    send_rows = [[sent[j][c] for j in range(ep_size)] for c in range(num_chunks)]
    send_pairs = [[sent[j][MAX_CHUNKS + c] for j in range(ep_size)] for c in range(num_chunks)]
    recv_rows = [[table[j][c] for j in range(ep_size)] for c in range(num_chunks)]
    recv_pairs = [[table[j][MAX_CHUNKS + c] for j in range(ep_size)] for c in range(num_chunks)]

    # One exchange of the pair info for all chunks: it travels rank-major, (rank, chunk).
    info_order = torch.argsort(bucket, stable=True)
    recv_info = all_to_all(info.index_select(0, info_order), [sum(p) for p in zip(*recv_pairs)],
                           [sum(p) for p in zip(*send_pairs)], group)
    num_recv = recv_info.numel()
    recv_rows_dev = recv[:, :num_chunks]                       # (source rank, chunk)
    recv_row_start = torch.cumsum(recv_rows_dev, 0) - recv_rows_dev
    source_chunk = torch.repeat_interleave(
        torch.arange(ep_size * num_chunks, device=device),
        recv[:, MAX_CHUNKS:MAX_CHUNKS + num_chunks].flatten(), output_size=num_recv)
    source, recv_chunk = source_chunk // num_chunks, source_chunk % num_chunks
    recv_tokens = (recv_row_start[source, recv_chunk] + recv_info // num_local).to(torch.int32)
    recv_experts = (recv_info % num_local).to(torch.int32)
    if num_chunks > 1:
        # Chunk-major, source rank next: each chunk's pairs in the order of its row blocks.
        order = torch.argsort(recv_chunk, stable=True)
        recv_tokens, recv_experts = recv_tokens[order], recv_experts[order]

    num_send = sum(map(sum, send_rows))
    # Pairs of one (rank, token) cell share a row, so duplicate scatter indices write equal
    # values: the result is deterministic.
    send_tokens = torch.zeros(num_send, dtype=torch.int64, device=device).scatter_(
        0, send_row, tokens)
    token_major = mark.view(ep_size, width).t()
    token_major_row = (torch.cumsum(token_major.flatten(), 0) - 1).view(width, ep_size).t()
    token_rows = torch.zeros(num_send, dtype=torch.int32, device=device).scatter_(
        0, token_major_row.flatten()[cell], send_row.to(torch.int32))
    token_offsets = torch.zeros(num_tokens + 1, dtype=torch.int32, device=device)
    torch.cumsum(token_major.sum(1)[:num_tokens], 0, dtype=torch.int32, out=token_offsets[1:])

    chunks, row, pair, recv_pair = [], 0, 0, 0
    for c in range(num_chunks):
        num_rows, num_pairs, num_recv_pairs = sum(send_rows[c]), sum(send_pairs[c]), \
            sum(recv_pairs[c])
        received = slice(recv_pair, recv_pair + num_recv_pairs)
        chunks.append(DispatchChunk(
            rows=slice(row, row + num_rows), pairs=slice(pair, pair + num_pairs),
            recv_tokens=recv_tokens[received], recv_experts=recv_experts[received],
            send_rows=send_rows[c], recv_rows=recv_rows[c], send_pairs=send_pairs[c],
            recv_pairs=recv_pairs[c]))
        row, pair, recv_pair = row + num_rows, pair + num_pairs, recv_pair + num_recv_pairs
    return DispatchPlan(
        send_tokens=send_tokens, token_rows=token_rows, token_offsets=token_offsets,
        pair_order=torch.argsort(chunk * ep_size + dst, stable=True), chunks=tuple(chunks),
        num_tokens=num_tokens, group=group)


def check_placement(placement, num_experts: int, ep_size: int) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``placement`` is a :class:`Placement` for
    ``num_experts`` experts over ``ep_size`` ranks."""
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a sonic.distributed.Placement or None, got "
                        f"{type(placement).__name__}")
    if placement.num_ranks != ep_size:
        raise ValueError(f"placement is for num_ranks={placement.num_ranks}, the EP group has "
                         f"{ep_size} ranks")
    if placement.num_experts != num_experts:
        raise ValueError(f"placement is for num_experts={placement.num_experts}, got "
                         f"num_experts={num_experts}")


def _check_agreement(table: list[list[int]], agreed: list[int], ep_rank: int, num_tokens: int,
                     num_experts: int) -> None:
    """``table[j]``: what group rank ``j`` sent — ``2·MAX_CHUNKS`` counts, its out-of-range
    flag, then its values of :data:`_AGREED`."""
    num_counts = 2 * MAX_CHUNKS
    for source, row in enumerate(table):
        if row[num_counts]:
            where = "this rank" if source == ep_rank else f"EP rank {source}"
            raise ValueError(f"token_idx/expert_idx out of range on {where}: token_idx must be "
                             f"in [0, T) and expert_idx in [0, num_experts={num_experts}) on "
                             f"every rank (this rank has T={num_tokens})")
        for name, mine, theirs in zip(_AGREED, agreed, row[num_counts + 1:]):
            if mine != theirs:
                if name == "dtype of x":
                    mine, theirs = DTYPE_CODES[mine], DTYPE_CODES[theirs]
                raise ValueError(f"EP ranks disagree on {name}: EP rank {source} has {theirs}, "
                                 f"this rank ({ep_rank}) has {mine}")


class Dispatch(torch.autograd.Function):
    """``(x (T, d), scores (P,))`` → ``(x_recv (R, d), scores_recv (P_recv,))`` for a plan of one
    chunk (the unchunked path; :mod:`sonic.distributed.overlap` pipelines several).

    Backward: the dX partials and score gradients go back to the token's rank; dX is summed
    per token by the aggregation (deterministic). Keeps only the plan (indices, no activations).
    """

    @staticmethod
    def forward(ctx, x, scores, plan: DispatchPlan, aggregate):
        (chunk,) = plan.chunks
        x_send = x.index_select(0, plan.send_tokens)
        x_recv = all_to_all(x_send, chunk.recv_rows, chunk.send_rows, plan.group)
        del x_send
        s_send = scores.index_select(0, plan.pair_order)
        s_recv = all_to_all(s_send, chunk.recv_pairs, chunk.send_pairs, plan.group)
        ctx.plan, ctx.aggregate = plan, aggregate
        return x_recv, s_recv

    @staticmethod
    def backward(ctx, grad_x_recv, grad_s_recv):
        plan = ctx.plan
        (chunk,) = plan.chunks
        grad_x = grad_scores = None
        # Every rank takes the same branches: _AGREED includes the requires_grad flags.
        if ctx.needs_input_grad[0]:
            rows = all_to_all(grad_x_recv, chunk.send_rows, chunk.recv_rows, plan.group)
            grad_x = ctx.aggregate(rows, plan.token_rows, plan.token_offsets, None)
        if ctx.needs_input_grad[1]:
            g = all_to_all(grad_s_recv, chunk.send_pairs, chunk.recv_pairs, plan.group)
            grad_scores = torch.empty_like(g).index_copy_(0, plan.pair_order, g)
        return grad_x, grad_scores, None, None


class Combine(torch.autograd.Function):
    """Partial outputs ``(R, d)`` of the received rows → ``(T, d)`` summed per token, for a
    plan of one chunk.

    Backward: dO rows of each send row's token go to the rank that computed the row. Keeps only
    the plan.
    """

    @staticmethod
    def forward(ctx, y_recv, plan: DispatchPlan, aggregate):
        (chunk,) = plan.chunks
        rows = all_to_all(y_recv, chunk.send_rows, chunk.recv_rows, plan.group)
        ctx.plan = plan
        return aggregate(rows, plan.token_rows, plan.token_offsets, None)

    @staticmethod
    def backward(ctx, grad_out):
        plan = ctx.plan
        (chunk,) = plan.chunks
        rows = grad_out.index_select(0, plan.send_tokens)
        return all_to_all(rows, chunk.recv_rows, chunk.send_rows, plan.group), None, None


def ep_moe_experts(x: torch.Tensor, w1_local: torch.Tensor, w2_local: torch.Tensor,
                   scores: torch.Tensor, token_idx: torch.Tensor, expert_idx: torch.Tensor, *,
                   group, num_experts: int, gate_up: str = "concat",
                   backend: str = "auto", placement: Placement | None = None,
                   num_chunks: int = 1, comm_sm_margin: int = 0,
                   recompute_dispatch: bool = False) -> torch.Tensor:
    """Expert-parallel :func:`sonic.moe_experts`: this rank's tokens, experts spread over ``group``.

    Every rank of ``group`` calls it with its own tokens and routed pairs; expert ``e`` lives on
    group rank ``e // (E/ep)``, which holds it at local index ``e % (E/ep)``. The result on each
    rank equals :func:`sonic.moe_experts` on the concatenated batch with all ``E`` experts,
    restricted to this rank's tokens. A group of size 1 runs :func:`sonic.moe_experts` directly.

    With a ``placement`` (EPLB), this rank holds the experts of its ``slots_per_rank`` slots
    (``w1_local[i]`` is expert ``placement.rank_experts(ep_rank)[i]``), and a pair of an expert
    with ``R`` replicas goes to replica ``(token + ep_rank) % R``. The output is the same; each
    replica's weight gradient covers the pairs it received, so the gradient of the expert as a
    whole is the sum over its replicas: :func:`sonic.distributed.reduce_replica_grads` (or
    :meth:`ExpertParallelMoE.reduce_replica_grads`) sums them after backward.

    Args:
        x: ``(T, d)`` this rank's tokens (bf16, fp16, fp32 or fp64); ``T`` may differ per rank
            and may be 0.
        w1_local: ``(E/ep, 2n, d)`` up-projection weights of this rank's experts, ``x``'s dtype.
        w2_local: ``(E/ep, d, n)`` down-projection weights of this rank's experts.
        scores: ``(P,)`` float gate weight of each routed pair.
        token_idx: ``(P,)`` int32/int64 local token of each pair, in ``[0, T)``.
        expert_idx: ``(P,)`` int32/int64 *global* expert of each pair, in ``[0, E)``.
        group: the EP process group (``None``: the default group).
        num_experts: ``E``, all experts over all ranks; divisible by the group size ``ep``
            unless a ``placement`` is given.
        gate_up, backend: as in :func:`sonic.moe_experts`, for the local expert computation.
        placement: a :class:`~sonic.distributed.Placement` for ``ep`` ranks and ``E`` experts
            (the same on every rank), or ``None`` for the contiguous placement; with it
            ``w1_local``/``w2_local`` hold ``slots_per_rank`` experts.
        num_chunks: ``C`` in ``[1, MAX_CHUNKS = 16]``, the same on every rank. ``C > 1`` splits
            this rank's tokens into ``C`` chunks of ``ceil(T/C)`` consecutive tokens and
            pipelines them (:mod:`sonic.distributed.overlap`): the all-to-alls of one chunk
            run on a communication stream while the local experts of another run, forward
            and backward. Routing, the plan, its count exchange and its host read stay one per
            call; a pair goes to the same expert (replica) for every ``C``, so the result
            equals ``C = 1`` up to the order in which the weight gradients accumulate rows. ``C = 1`` (default): the unchunked path. With ``C > 1`` each chunk's
            backward computes only activation gradients; dW1 and dW2 are computed once over
            all chunks' rows.
        comm_sm_margin: SMs that the grouped GEMMs of the chunked pipeline (``C > 1``) leave
            free for the all-to-all kernels running beside them (:func:`sonic.backend.sm_margin`;
            results unchanged); ``0`` (default): every SM. Ignored on the unchunked path
            (``C = 1`` without ``recompute_dispatch``), where no communication overlaps the
            experts. May differ between ranks.
        recompute_dispatch: keep ``x`` instead of the received rows ``x_recv (R, d)`` and send
            its rows again in backward for dW1 (:mod:`sonic.distributed.overlap`, which then
            runs also for ``C = 1``): ``R·d`` fewer bytes kept per layer (``x`` is usually kept
            anyway, by whatever produced it or by the router) for one more ``R × d``
            all-to-all in backward, overlapped with dW2. All-to-all moves bytes unchanged, so
            the gradients are exactly those without it (for the same ``C``; ``C = 1`` then
            differs from the unchunked path by the order of dW sums only). The same on every
            rank. An in-place change of ``x`` before backward raises there, as for any tensor
            autograd saved.

    Returns:
        ``(T, d)`` in ``x``'s dtype; differentiable in x, w1_local, w2_local and scores. Every
        rank of ``group`` must call backward through it (its backward runs collectives).

    Kept for backward on each rank:
        * the received rows ``x_recv (R, d)``, ``R`` = (token, rank) pairs sent here — the
          local experts' X, needed for dW1. Unlike single-process sonic, where X is the
          caller's tensor kept by reference, this is a new tensor; ``recompute_dispatch``
          keeps ``x`` by reference instead and re-sends its rows in backward.
        * ``H (P_recv, 2n)``, the received scores and the local routing metadata — what
          :func:`sonic.moe_experts` keeps;
        * the :class:`DispatchPlan`: ``O(S + P + P_recv + T)`` int indices and the host split
          sizes, so backward needs no count exchange and no host synchronisation.
        Not kept: x, the sent rows, the partial outputs, Y.
        With ``C > 1`` the same totals, in one buffer each (chunk ``c``'s ``R_c`` rows and
        its pairs at their offsets), with per-chunk metadata; backward adds A' ``(P_recv, n)``
        of all chunks until the weight gradients.

    Synchronisation: one device→host read per call (the split sizes, of all chunks); every
    collective waits at most the process group's timeout.

    Raises:
        TypeError: a wrong type or dtype (as :func:`sonic.moe_experts`).
        ValueError: mismatched shapes on this rank, ``num_experts`` not divisible by the group
            size, ``w1_local`` not holding ``E/ep`` experts, unknown ``gate_up``/``backend``;
            raised on this rank before any collective, so other ranks wait until the process
            group's timeout. Out-of-range indices on any rank, or ranks disagreeing on ``d``,
            ``n``, ``E``, ``num_chunks``, the dtype or grad mode and which inputs require grad
            (backward's collectives depend on them): raised on *every* rank after the count
            exchange. With a ``placement``: one for other than ``ep`` ranks
            or ``E`` experts, or ``w1_local`` not holding ``slots_per_rank`` experts (this
            rank); ranks holding different placements (every rank).
        TypeError: ``placement`` not a :class:`~sonic.distributed.Placement` or ``None``.
        RuntimeError: ``torch.distributed`` not initialised, or a collective timed out.

    Sources: MetaShuffling (PyTorch blog, 2025) for the on-device counts with one host sync;
    SonicMoE (arXiv 2512.14080) for the local expert computation; Comet (arXiv 2502.19811)
    for overlapping the all-to-alls with it, here at chunk granularity.
    """
    check_float("x", x, ndim=2)
    check_float("w1_local", w1_local, ndim=3)
    check_float("w2_local", w2_local, ndim=3)
    check_float("scores", scores, ndim=1)
    check_index("token_idx", token_idx)
    check_index("expert_idx", expert_idx)
    check_int("num_experts", num_experts, low=1)
    check_int("num_chunks", num_chunks, low=1, high=MAX_CHUNKS)
    check_int("comm_sm_margin", comm_sm_margin, low=0)
    if not isinstance(recompute_dispatch, bool):
        raise TypeError(f"recompute_dispatch must be a bool, got "
                        f"{type(recompute_dispatch).__name__}")
    check_choice("gate_up", gate_up, GATE_UP_LAYOUTS)
    check_same_device(x=x, w1_local=w1_local, w2_local=w2_local, scores=scores,
                      token_idx=token_idx, expert_idx=expert_idx)
    ep_size, _ = check_group(group)
    if placement is None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP size "
                             f"{ep_size} (the size of group)")
        num_local, label = num_experts // ep_size, "E/ep"
    else:
        check_placement(placement, num_experts, ep_size)
        num_local, label = placement.slots_per_rank, "slots_per_rank"
    num_tokens, d = x.shape
    n = w2_local.shape[-1]
    if tuple(w1_local.shape) != (num_local, 2 * n, d):
        raise ValueError(f"w1_local must have shape ({label}={num_local}, 2n={2 * n}, d={d}), "
                         f"got {tuple(w1_local.shape)}")
    if tuple(w2_local.shape) != (num_local, d, n):
        raise ValueError(f"w2_local must have shape ({label}={num_local}, d={d}, n), "
                         f"got {tuple(w2_local.shape)}")
    for name, t in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if t.shape != scores.shape:
            raise ValueError(f"{name} must have shape (P={scores.shape[0]},) like scores, "
                             f"got {tuple(t.shape)}")
    if ep_size == 1 and placement is None:
        return moe_experts(x, w1_local, w2_local, scores, token_idx, expert_idx,
                           gate_up=gate_up, backend=backend)
    # Autocast before the dispatch, as moe_experts does on one process: the rows travel in
    # the autocast dtype, and a dtype error is raised here, before any collective.
    x, w1_local, w2_local = autocast_experts(x, w1_local, w2_local)
    for name, w in (("w1_local", w1_local), ("w2_local", w2_local)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype} (outside "
                            "torch.autocast the experts do not cast)")
    ops = expert_ops(backend, x.device)
    agreed = [d, n, num_experts, DTYPE_CODES.index(x.dtype), int(torch.is_grad_enabled()),
              *(int(t.requires_grad) for t in (x, scores, w1_local, w2_local)),
              0 if placement is None else placement.fingerprint(), num_chunks,
              int(recompute_dispatch)]
    plan = plan_dispatch(token_idx, expert_idx, num_tokens, num_experts, agreed, group,
                         placement, num_chunks)
    if num_chunks > 1 or recompute_dispatch:
        return ChunkedExperts.apply(x, scores, w1_local, w2_local, plan, num_local, gate_up,
                                    backend, ops.aggregate, comm_sm_margin, recompute_dispatch)
    (chunk,) = plan.chunks
    x_recv, scores_recv = Dispatch.apply(x, scores, plan, ops.aggregate)
    # The pairs were built here from range-checked indices: no second check (a host read).
    local = Routing(chunk.recv_tokens, chunk.recv_experts, scores_recv, sum(chunk.recv_rows),
                    num_local, validated=True)
    y_recv = moe_experts(x_recv, w1_local, w2_local, scores_recv, chunk.recv_tokens,
                         chunk.recv_experts, gate_up=gate_up, backend=backend,
                         metadata=routing_metadata(local, backend=backend))
    return Combine.apply(y_recv, plan, ops.aggregate)
