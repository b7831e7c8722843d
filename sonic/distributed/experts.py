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

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from sonic._validation import (check_choice, check_float, check_index, check_int,
                               check_same_device)
from sonic.activation_cache import check_activation_cache
from sonic.experts.moe_experts import (PRECISIONS, Fp8ExpertWeights, autocast_experts,
                                        check_activation, check_fp8_call, moe_experts,
                                        quantize_expert_weights)
from sonic.backend import check_fp8_backend, expert_ops
from sonic.distributed.comm import check_group
from sonic.distributed.eplb import Placement
from sonic.distributed.overlap import ChunkedExperts
from sonic.distributed.peer import peer_transport, peer_transport_available
from sonic.distributed.plan import MAX_CHUNKS, DispatchPlan, agreed_values, plan_dispatch
from sonic.types import (GATED_ACTIVATIONS, TRANSPORTS, Activation, ActivationCache,
                         Backend, GateUp, Precision, Transport)
from sonic.reference.ops import GATE_UP_LAYOUTS
from sonic.routing.metadata import routing_metadata
from sonic.routing.types import Routing


# The largest EP group on which "auto" picks the copy engines: on four H200s they moved the
# all-to-alls at 180-192 GB/s bus bandwidth against NCCL's 295-328 and the step was slower
# (benchmarks/RESULTS.md, docs/expert-parallelism.md).
COPY_ENGINE_AUTO_MAX_RANKS = 2


def _resolve_transport(transport: Transport, group, device: torch.device):
    """The :class:`~sonic.distributed.peer.PeerTransport` that ``transport`` names for
    ``group`` on ``device``, or ``None`` for ``torch.distributed``. Collective (every rank
    agreed on ``transport``)."""
    if transport == "nccl":
        return None
    ep_size, _ = check_group(group)
    if transport == "auto" and (ep_size > COPY_ENGINE_AUTO_MAX_RANKS
                                or not peer_transport_available(group, device)):
        return None
    return peer_transport(group, device)


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


class Dispatch(torch.autograd.Function):
    """``(x (T, d), scores (P,))`` → ``(x_recv (R, d), scores_recv (P_recv,))`` for a plan of one
    chunk (the unchunked path; :mod:`sonic.distributed.overlap` pipelines several).

    Backward: the dX partials and score gradients go back to the token's rank; dX is summed
    per token by the aggregation (deterministic). Keeps only the plan's indices (saved
    tensors: autograd's saved-tensor hooks see them), no activations.
    """

    @staticmethod
    def forward(ctx, x, scores, plan: DispatchPlan, aggregate):
        (chunk,) = plan.chunks
        x_recv = plan.all_to_all(x, chunk.recv_rows, chunk.send_rows, index=plan.send_tokens)
        s_recv = plan.all_to_all(scores, chunk.recv_pairs, chunk.send_pairs,
                                 index=plan.pair_order)
        plan.save_for_backward(ctx)
        ctx.aggregate = aggregate
        return x_recv, s_recv

    @staticmethod
    def backward(ctx, grad_x_recv, grad_s_recv):
        _, plan = DispatchPlan.saved(ctx)
        (chunk,) = plan.chunks
        grad_x = grad_scores = None
        # Every rank takes the same branches: _AGREED includes the requires_grad flags.
        if ctx.needs_input_grad[0]:
            rows = plan.all_to_all(grad_x_recv, chunk.send_rows, chunk.recv_rows)
            grad_x = ctx.aggregate(rows, plan.token_rows, plan.token_offsets, None)
        if ctx.needs_input_grad[1]:
            g = plan.all_to_all(grad_s_recv, chunk.send_pairs, chunk.recv_pairs)
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
        rows = plan.all_to_all(y_recv, chunk.send_rows, chunk.recv_rows)
        plan.save_for_backward(ctx)
        return aggregate(rows, plan.token_rows, plan.token_offsets, None)

    @staticmethod
    def backward(ctx, grad_out):
        _, plan = DispatchPlan.saved(ctx)
        (chunk,) = plan.chunks
        return plan.all_to_all(grad_out, chunk.recv_rows, chunk.send_rows,
                               index=plan.send_tokens), None, None


def _check_arguments(x, w1_local, w2_local, scores, token_idx, expert_idx, *, group,
                     num_experts, gate_up, placement, num_chunks, comm_sm_margin,
                     recompute_dispatch, precision, transport, activation,
                     activation_cache) -> tuple[int, int]:
    """The checks of :func:`ep_moe_experts` that need no other rank (raised on this rank,
    before any collective); returns ``(ep_size, local experts or slots per rank)``."""
    check_float("x", x, ndim=2)
    check_float("w1_local", w1_local, ndim=3)
    check_float("w2_local", w2_local, ndim=3)
    check_float("scores", scores, ndim=1)
    check_index("token_idx", token_idx)
    check_index("expert_idx", expert_idx)
    check_int("num_experts", num_experts, low=1)
    check_int("num_chunks", num_chunks, low=1, high=MAX_CHUNKS)
    check_int("comm_sm_margin", comm_sm_margin, low=0)
    check_choice("precision", precision, PRECISIONS)
    check_choice("transport", transport, TRANSPORTS)
    if not isinstance(recompute_dispatch, bool):
        raise TypeError(f"recompute_dispatch must be a bool, got "
                        f"{type(recompute_dispatch).__name__}")
    check_choice("gate_up", gate_up, GATE_UP_LAYOUTS)
    check_activation(activation, precision, activation_cache)
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
    d = x.shape[1]
    n = w2_local.shape[-1]
    rows, rows_name = (2 * n, "2n") if activation in GATED_ACTIVATIONS else (n, "n")
    if tuple(w1_local.shape) != (num_local, rows, d):
        raise ValueError(f"w1_local must have shape ({label}={num_local}, {rows_name}={rows}, "
                         f"d={d}) for activation={activation!r}, got {tuple(w1_local.shape)}")
    if tuple(w2_local.shape) != (num_local, d, n):
        raise ValueError(f"w2_local must have shape ({label}={num_local}, d={d}, n), "
                         f"got {tuple(w2_local.shape)}")
    for name, t in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if t.shape != scores.shape:
            raise ValueError(f"{name} must have shape (P={scores.shape[0]},) like scores, "
                             f"got {tuple(t.shape)}")
    return ep_size, num_local


def ep_moe_experts(x: torch.Tensor, w1_local: torch.Tensor, w2_local: torch.Tensor,
                   scores: torch.Tensor, token_idx: torch.Tensor, expert_idx: torch.Tensor, *,
                   group, num_experts: int, gate_up: GateUp = "concat",
                   backend: Backend = "auto", placement: Placement | None = None,
                   num_chunks: int = 1, comm_sm_margin: int = 0,
                   recompute_dispatch: bool = False, precision: Precision = "bf16",
                   fp8_weights: Fp8ExpertWeights | None = None,
                   activation_cache: ActivationCache = "bf16",
                   settings: Mapping[str, object] | None = None,
                   transport: Transport = "nccl",
                   activation: Activation = "swiglu") -> torch.Tensor:
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
        w1_local: ``(E/ep, 2n, d)`` up-projection weights of this rank's experts (``(E/ep,
            n, d)`` for a non-gated ``activation``), ``x``'s dtype.
        w2_local: ``(E/ep, d, n)`` down-projection weights of this rank's experts.
        scores: ``(P,)`` float gate weight of each routed pair.
        token_idx: ``(P,)`` int32/int64 local token of each pair, in ``[0, T)``.
        expert_idx: ``(P,)`` int32/int64 *global* expert of each pair, in ``[0, E)``.
        group: the EP process group (``None``: the default group).
        num_experts: ``E``, all experts over all ranks; divisible by the group size ``ep``
            unless a ``placement`` is given.
        gate_up, backend, activation: as in :func:`sonic.moe_experts`, for the local expert
            computation (``activation``: the same on every rank).
        placement: a :class:`~sonic.distributed.Placement` for ``ep`` ranks and ``E`` experts
            (the same on every rank), or ``None`` for the contiguous placement; with it
            ``w1_local``/``w2_local`` hold ``slots_per_rank`` experts.
        num_chunks: ``C`` in ``[1, MAX_CHUNKS = 16]``, the same on every rank. ``C > 1``
            pipelines ``C`` chunks of ``ceil(T/C)`` consecutive tokens
            (:mod:`sonic.distributed.overlap`): one chunk's all-to-alls run on a communication
            stream while another's local experts run, forward and backward; routing, the plan
            and its host read stay one per call, and dW1, dW2 are computed once over all
            chunks' rows. The result equals ``C = 1`` (default, unchunked) up to the order of
            the weight-gradient sums.
        comm_sm_margin: SMs the grouped GEMMs of the chunked pipeline leave free
            (:func:`sonic.backend.sm_margin`; results unchanged); ``0`` (default): every SM.
            Ignored without chunks or ``recompute_dispatch``. May differ between ranks.
        recompute_dispatch: keep ``x`` (by reference) instead of the received rows
            ``x_recv (R, d)`` and send its rows again in backward for dW1, overlapped with dW2
            (:mod:`sonic.distributed.overlap`, then also for ``C = 1``): ``R·d`` fewer bytes
            kept for one more ``R × d`` all-to-all; the gradients are exactly those without
            it. The same on every rank. An in-place change of ``x`` before backward raises.
        precision, fp8_weights, activation_cache: as in :func:`sonic.moe_experts`, for the
            local experts (``fp8_weights``: the copies of ``w1_local``/``w2_local``), on every
            path; the rows travel in bf16 either way (each rank quantizes what it received).
        transport: what moves the data all-to-alls, the same on every rank: ``"nccl"``
            (default, ``torch.distributed``: NCCL on GPU, gloo on CPU), ``"copy_engine"``
            (NVLink peer memory and copy engines, :mod:`sonic.distributed.peer`; CUDA ranks of
            one host) or ``"auto"`` (``"copy_engine"`` where available). The same bytes move,
            so every result is the same; the plan's count exchange always uses
            ``torch.distributed``.
        settings: further settings of the caller that every rank must share, by name:
            ``router``, ``training``, ``top_k``, ``tile``, ``rounding``, ``score``,
            ``renormalize`` (what :class:`ExpertParallelMoE` passes); they travel in the count
            exchange with this call's own (``d``, ``n``, ``E``, dtypes of x and scores, grad
            mode, ...), so a disagreement raises on every rank.

    Returns:
        ``(T, d)`` in ``x``'s dtype; differentiable in x, w1_local, w2_local and scores. Every
        rank of ``group`` must call backward through it (its backward runs collectives).

    Kept for backward on each rank: the received rows ``x_recv (R, d)`` (``R`` = (token,
    rank) pairs sent here; a new tensor, where single-process sonic keeps the caller's X by
    reference — ``recompute_dispatch`` keeps ``x`` instead), ``H (P_recv, 2n)``, the received
    scores and local routing metadata (what :func:`sonic.moe_experts` keeps), and the
    :class:`DispatchPlan`'s ``O(S + P + P_recv + T)`` int indices and host split sizes, so
    backward needs no count exchange and no host read. Not kept: x, the sent rows, the partial
    outputs. With ``C > 1`` the same totals, one buffer each; backward adds A'
    ``(P_recv, n)`` of all chunks until the weight gradients.

    Synchronisation: one device→host read per call; every collective waits at most the
    process group's timeout.

    Raises:
        TypeError: a wrong type or dtype (as :func:`sonic.moe_experts`).
        ValueError: on this rank before any collective (the others then wait until the
            process group's timeout): mismatched shapes, ``num_experts`` not divisible by the
            group size, ``w1_local`` not holding ``E/ep`` experts (``slots_per_rank`` with a
            ``placement``), a ``placement`` for other than ``ep`` ranks or ``E`` experts,
            unknown ``gate_up``/``backend``/``transport``. On *every* rank after the count
            exchange: out-of-range indices on any rank, or ranks disagreeing on ``d``, ``n``,
            ``E``, the placement, ``num_chunks``, the dtypes, the grad mode, which inputs
            require grad or an entry of ``settings`` (naming the setting and each rank's
            value); ``transport="copy_engine"`` on a group that is not NCCL on one host.
        TypeError: ``placement`` not a :class:`~sonic.distributed.Placement` or ``None``.
        RuntimeError: ``torch.distributed`` not initialised, or a collective timed out.

    Sources: MetaShuffling (PyTorch blog, 2025) for the on-device counts with one host sync;
    SonicMoE (arXiv 2512.14080) for the local expert computation; Comet (arXiv 2502.19811)
    for overlapping the all-to-alls with it, here at chunk granularity.
    """
    ep_size, num_local = _check_arguments(
        x, w1_local, w2_local, scores, token_idx, expert_idx, group=group,
        num_experts=num_experts, gate_up=gate_up, placement=placement, num_chunks=num_chunks,
        comm_sm_margin=comm_sm_margin, recompute_dispatch=recompute_dispatch,
        precision=precision, transport=transport, activation=activation,
        activation_cache=activation_cache)
    num_tokens, d = x.shape
    local_options: dict[str, Any] = {
        "gate_up": gate_up, "backend": backend, "precision": precision,
        "fp8_weights": fp8_weights, "activation_cache": activation_cache,
        "activation": activation}
    if ep_size == 1 and placement is None:
        return moe_experts(x, w1_local, w2_local, scores, token_idx, expert_idx,
                           **local_options)
    x, w1_local, w2_local = _autocast_checked(x, w1_local, w2_local, num_local,
                                              local_options)
    ops = expert_ops(backend, x.device)
    agreed = agreed_values({
        **(settings or {}), **_call_settings(x, scores, w1_local, w2_local),
        "num_experts": num_experts,
        "placement (its fingerprint; 0 for the contiguous default)":
            0 if placement is None else placement.fingerprint(),
        "num_chunks": num_chunks, "recompute_dispatch": recompute_dispatch,
        "precision": precision, "activation_cache": activation_cache, "transport": transport,
        "activation": activation})
    plan = plan_dispatch(token_idx, expert_idx, num_tokens, num_experts, agreed, group,
                         placement, num_chunks)
    # After the exchange: every rank agrees on the transport and takes the same (collective)
    # steps to set it up.
    mover = _resolve_transport(transport, group, x.device)
    if mover is not None:
        mover.reserve(max(plan.largest_rows * d * x.element_size(),
                          plan.largest_pairs * scores.element_size()))
        plan = dataclasses.replace(plan, transport=mover)
    if num_chunks > 1 or recompute_dispatch:
        if precision == "fp8" and fp8_weights is None:
            fp8_weights = quantize_expert_weights(w1_local, w2_local, backend)
        return ChunkedExperts.apply(x, scores, w1_local, w2_local, plan, num_local, gate_up,
                                    backend, ops.aggregate, comm_sm_margin, recompute_dispatch,
                                    None if precision == "bf16" or fp8_weights is None
                                    else tuple(fp8_weights),
                                    activation_cache, activation)
    return _unchunked(x, scores, w1_local, w2_local, plan, num_local, ops.aggregate,
                      local_options)


def _autocast_checked(x, w1_local, w2_local, num_local: int, local_options: dict):
    """``(x, w1_local, w2_local)`` cast as :func:`sonic.moe_experts` casts them on one process
    (so the rows travel in the autocast dtype), after raising, before any collective, what the
    local experts would refuse."""
    x, w1_local, w2_local = autocast_experts(x, w1_local, w2_local)
    for name, w in (("w1_local", w1_local), ("w2_local", w2_local)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype} (outside "
                            "torch.autocast the experts do not cast)")
    n = w2_local.shape[-1]
    check_activation_cache(local_options["activation_cache"], x.dtype, w1_local.shape[1])
    if local_options["precision"] == "fp8":
        check_fp8_call(x, num_local, n, local_options["fp8_weights"])
        check_fp8_backend(local_options["backend"], x.device)
    return x, w1_local, w2_local


def _call_settings(x, scores, w1_local, w2_local) -> dict:
    """The settings of one call that every rank must share, by their :data:`_AGREED` names:
    sizes, dtypes and which tensors need gradients (backward's collectives depend on them)."""
    return {"dtype of scores": scores.dtype, "d (x.shape[1])": x.shape[1],
            "n (w2_local.shape[2])": w2_local.shape[2], "dtype of x": x.dtype,
            "torch.is_grad_enabled()": torch.is_grad_enabled(),
            "x.requires_grad": x.requires_grad, "scores.requires_grad": scores.requires_grad,
            "w1_local.requires_grad": w1_local.requires_grad,
            "w2_local.requires_grad": w2_local.requires_grad}


def _unchunked(x, scores, w1_local, w2_local, plan: DispatchPlan, num_local: int, aggregate,
               local_options: dict) -> torch.Tensor:
    """Dispatch, local experts and combine of a plan of one chunk (module docstring)."""
    (chunk,) = plan.chunks
    x_recv, scores_recv = Dispatch.apply(x, scores, plan, aggregate)
    # The pairs were built here from range-checked indices: no second check (a host read).
    local = Routing(chunk.recv_tokens, chunk.recv_experts, scores_recv, sum(chunk.recv_rows),
                    num_local, validated=True)
    y_recv = moe_experts(x_recv, w1_local, w2_local, scores_recv, chunk.recv_tokens,
                         chunk.recv_experts,
                         metadata=routing_metadata(local, backend=local_options["backend"]),
                         **local_options)
    return Combine.apply(y_recv, plan, aggregate)
