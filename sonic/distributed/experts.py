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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonic._validation import (check_choice, check_float, check_index, check_int,
                               check_same_device)
from sonic.autograd.moe_experts import moe_experts
from sonic.backend import expert_ops
from sonic.distributed.comm import DTYPE_CODES, all_to_all, check_group
from sonic.distributed.eplb import Placement
from sonic.reference.ops import GATE_UP_LAYOUTS
from sonic.routing.metadata import routing_metadata
from sonic.routing.types import Routing

# What every rank sends every other rank beside its counts; all ranks compare all entries, so
# a disagreement raises on every rank at once instead of hanging in the next collective.
_AGREED = ("d (x.shape[1])", "n (w2_local.shape[2])", "num_experts", "dtype of x",
           "torch.is_grad_enabled()", "x.requires_grad", "scores.requires_grad",
           "w1_local.requires_grad", "w2_local.requires_grad",
           "placement (its fingerprint; 0 for the contiguous default)")


@dataclass(frozen=True)
class DispatchPlan:
    """Where rows and pairs go in one expert-parallel layer call; all indices on the device.

    Send side (this rank's ``T`` tokens and ``P`` pairs):
        send_tokens: ``(S,)`` int64 — source token of each send row; rows grouped by
            destination rank, tokens ascending within a rank.
        token_rows: ``(S,)`` int32 — send rows grouped by token (the combine's gather-sum
            index, as :attr:`RoutingMetadata.token_rows`).
        token_offsets: ``(T+1,)`` int32 — exclusive prefix sum of send rows per token.
        pair_order: ``(P,)`` int64 — pairs grouped by destination rank (stable).
    Receive side:
        recv_tokens: ``(P_recv,)`` int32 — received row of each received pair.
        recv_experts: ``(P_recv,)`` int32 — its local expert (slot), in ``[0, E/ep)`` or
            ``[0, slots_per_rank)`` with a placement.
    Host split sizes (one per group rank): ``send_rows``, ``recv_rows``, ``send_pairs``,
    ``recv_pairs``.
    """

    send_tokens: torch.Tensor
    token_rows: torch.Tensor
    token_offsets: torch.Tensor
    pair_order: torch.Tensor
    recv_tokens: torch.Tensor
    recv_experts: torch.Tensor
    send_rows: list[int]
    recv_rows: list[int]
    send_pairs: list[int]
    recv_pairs: list[int]
    num_tokens: int
    group: object


def plan_dispatch(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int,
                  num_experts: int, agreed: list[int], group,
                  placement: Placement | None = None) -> DispatchPlan:
    """Build the :class:`DispatchPlan` with one count all-to-all and one host read.

    ``agreed`` holds this rank's values of :data:`_AGREED`. ``placement``: where experts live
    (``None``: contiguous, expert ``e`` at local index ``e % (E/ep)`` of rank ``e // (E/ep)``).

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
    width = max(num_tokens, 1)
    tokens, experts = tokens.clamp(0, width - 1), experts.clamp(0, num_experts - 1)
    # The slot of each pair: its expert (contiguous) or one of the expert's replicas.
    slots = experts if placement is None else placement.pair_slots(tokens, experts, ep_rank)
    dst = slots // num_local
    cell = dst * width + tokens                                # (rank, token), rank-major
    mark = torch.zeros(ep_size * width, dtype=torch.int64, device=device).scatter_(0, cell, 1)
    row_of_cell = torch.cumsum(mark, 0) - 1
    rows_per_rank = mark.view(ep_size, width).sum(1)
    pairs_per_rank = torch.zeros(ep_size, dtype=torch.int64, device=device).scatter_add_(
        0, dst, torch.ones_like(dst))
    send_row = row_of_cell[cell]
    rank_start = torch.cumsum(rows_per_rank, 0) - rows_per_rank
    # One int per pair for the receiver: its row within the block sent to that rank, and its
    # local expert.
    info = (send_row - rank_start[dst]) * num_local + (slots - dst * num_local)

    counts = torch.cat([rows_per_rank[:, None], pairs_per_rank[:, None],
                        bad.to(torch.int64).expand(ep_size, 1),
                        torch.tensor(agreed, dtype=torch.int64, device=device).expand(ep_size, -1)],
                       dim=1)
    recv = all_to_all(counts, [1] * ep_size, [1] * ep_size, group)
    host = torch.cat([counts[:, :2].flatten(), recv.flatten()]).tolist()     # the one sync
    sent, table = host[:2 * ep_size], host[2 * ep_size:]
    table = [table[i * counts.shape[1]:(i + 1) * counts.shape[1]] for i in range(ep_size)]
    _check_agreement(table, agreed, ep_rank, num_tokens, num_experts)
    send_rows, send_pairs = sent[0::2], sent[1::2]
    recv_rows, recv_pairs = [row[0] for row in table], [row[1] for row in table]

    pair_order = torch.argsort(dst, stable=True)
    recv_info = all_to_all(info.index_select(0, pair_order), recv_pairs, send_pairs, group)
    recv_row_start = torch.cumsum(recv[:, 0], 0) - recv[:, 0]
    source = torch.repeat_interleave(torch.arange(ep_size, device=device), recv[:, 1],
                                     output_size=sum(recv_pairs))
    recv_tokens = recv_row_start[source] + recv_info // num_local

    num_send = sum(send_rows)
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
    return DispatchPlan(
        send_tokens=send_tokens, token_rows=token_rows, token_offsets=token_offsets,
        pair_order=pair_order, recv_tokens=recv_tokens.to(torch.int32),
        recv_experts=(recv_info % num_local).to(torch.int32),
        send_rows=send_rows, recv_rows=recv_rows, send_pairs=send_pairs, recv_pairs=recv_pairs,
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
    for source, row in enumerate(table):
        if row[2]:
            where = "this rank" if source == ep_rank else f"EP rank {source}"
            raise ValueError(f"token_idx/expert_idx out of range on {where}: token_idx must be "
                             f"in [0, T) and expert_idx in [0, num_experts={num_experts}) on "
                             f"every rank (this rank has T={num_tokens})")
        for name, mine, theirs in zip(_AGREED, agreed, row[3:]):
            if mine != theirs:
                if name == "dtype of x":
                    mine, theirs = DTYPE_CODES[mine], DTYPE_CODES[theirs]
                raise ValueError(f"EP ranks disagree on {name}: EP rank {source} has {theirs}, "
                                 f"this rank ({ep_rank}) has {mine}")


class Dispatch(torch.autograd.Function):
    """``(x (T, d), scores (P,))`` → ``(x_recv (R, d), scores_recv (P_recv,))``.

    Backward: the dX partials and score gradients go back to the token's rank; dX is summed
    per token by the aggregation (deterministic). Keeps only the plan (indices, no activations).
    """

    @staticmethod
    def forward(ctx, x, scores, plan: DispatchPlan, aggregate):
        x_send = x.index_select(0, plan.send_tokens)
        x_recv = all_to_all(x_send, plan.recv_rows, plan.send_rows, plan.group)
        del x_send
        s_send = scores.index_select(0, plan.pair_order)
        s_recv = all_to_all(s_send, plan.recv_pairs, plan.send_pairs, plan.group)
        ctx.plan, ctx.aggregate = plan, aggregate
        return x_recv, s_recv

    @staticmethod
    def backward(ctx, grad_x_recv, grad_s_recv):
        plan = ctx.plan
        grad_x = grad_scores = None
        # Every rank takes the same branches: _AGREED includes the requires_grad flags.
        if ctx.needs_input_grad[0]:
            rows = all_to_all(grad_x_recv, plan.send_rows, plan.recv_rows, plan.group)
            grad_x = ctx.aggregate(rows, plan.token_rows, plan.token_offsets, None)
        if ctx.needs_input_grad[1]:
            g = all_to_all(grad_s_recv, plan.send_pairs, plan.recv_pairs, plan.group)
            grad_scores = torch.empty_like(g).index_copy_(0, plan.pair_order, g)
        return grad_x, grad_scores, None, None


class Combine(torch.autograd.Function):
    """Partial outputs ``(R, d)`` of the received rows → ``(T, d)`` summed per token.

    Backward: dO rows of each send row's token go to the rank that computed the row. Keeps only
    the plan.
    """

    @staticmethod
    def forward(ctx, y_recv, plan: DispatchPlan, aggregate):
        rows = all_to_all(y_recv, plan.send_rows, plan.recv_rows, plan.group)
        ctx.plan = plan
        return aggregate(rows, plan.token_rows, plan.token_offsets, None)

    @staticmethod
    def backward(ctx, grad_out):
        plan = ctx.plan
        rows = grad_out.index_select(0, plan.send_tokens)
        return all_to_all(rows, plan.recv_rows, plan.send_rows, plan.group), None, None


def ep_moe_experts(x: torch.Tensor, w1_local: torch.Tensor, w2_local: torch.Tensor,
                   scores: torch.Tensor, token_idx: torch.Tensor, expert_idx: torch.Tensor, *,
                   group, num_experts: int, gate_up: str = "concat",
                   backend: str = "auto", placement: Placement | None = None) -> torch.Tensor:
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

    Returns:
        ``(T, d)`` in ``x``'s dtype; differentiable in x, w1_local, w2_local and scores. Every
        rank of ``group`` must call backward through it (its backward runs collectives).

    Kept for backward on each rank:
        * the received rows ``x_recv (R, d)``, ``R`` = (token, rank) pairs sent here — the
          local experts' X, needed for dW1. Unlike single-process sonic, where X is the
          caller's tensor kept by reference, this is a new tensor; re-sending X in backward
          would trade it for a second ``R × d`` all-to-all.
        * ``H (P_recv, 2n)``, the received scores and the local routing metadata — what
          :func:`sonic.moe_experts` keeps;
        * the :class:`DispatchPlan`: ``O(S + P + P_recv + T)`` int indices and the host split
          sizes, so backward needs no count exchange and no host synchronisation.
        Not kept: x, the sent rows, the partial outputs, Y.

    Synchronisation: one device→host read per call (the split sizes); every collective waits at
    most the process group's timeout.

    Raises:
        TypeError: a wrong type or dtype (as :func:`sonic.moe_experts`).
        ValueError: mismatched shapes on this rank, ``num_experts`` not divisible by the group
            size, ``w1_local`` not holding ``E/ep`` experts, unknown ``gate_up``/``backend``;
            raised on this rank before any collective, so other ranks wait until the process
            group's timeout. Out-of-range indices on any rank, or ranks disagreeing on ``d``,
            ``n``, ``E``, the dtype or grad mode and which inputs require grad (backward's
            collectives depend on them): raised on *every*
            rank after the count exchange. With a ``placement``: one for other than ``ep`` ranks
            or ``E`` experts, or ``w1_local`` not holding ``slots_per_rank`` experts (this
            rank); ranks holding different placements (every rank).
        TypeError: ``placement`` not a :class:`~sonic.distributed.Placement` or ``None``.
        RuntimeError: ``torch.distributed`` not initialised, or a collective timed out.

    Sources: MetaShuffling (PyTorch blog, 2025) for the on-device counts with one host sync;
    SonicMoE (arXiv 2512.14080) for the local expert computation.
    """
    check_float("x", x, ndim=2)
    check_float("w1_local", w1_local, ndim=3)
    check_float("w2_local", w2_local, ndim=3)
    check_float("scores", scores, ndim=1)
    check_index("token_idx", token_idx)
    check_index("expert_idx", expert_idx)
    check_int("num_experts", num_experts, low=1)
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
    ops = expert_ops(backend, x.device)
    agreed = [d, n, num_experts, DTYPE_CODES.index(x.dtype), int(torch.is_grad_enabled()),
              *(int(t.requires_grad) for t in (x, scores, w1_local, w2_local)),
              0 if placement is None else placement.fingerprint()]
    plan = plan_dispatch(token_idx, expert_idx, num_tokens, num_experts, agreed, group,
                         placement)
    x_recv, scores_recv = Dispatch.apply(x, scores, plan, ops.aggregate)
    # The pairs were built here from range-checked indices: no second check (a host read).
    local = Routing(plan.recv_tokens, plan.recv_experts, scores_recv, sum(plan.recv_rows),
                    num_local, validated=True)
    y_recv = moe_experts(x_recv, w1_local, w2_local, scores_recv, plan.recv_tokens,
                         plan.recv_experts, gate_up=gate_up, backend=backend,
                         metadata=routing_metadata(local, backend=backend))
    return Combine.apply(y_recv, plan, ops.aggregate)
