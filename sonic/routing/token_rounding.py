"""Tile-aware token rounding (SonicMoE paper §5.2, Algorithm 4; docs/design.md §2)."""

from __future__ import annotations

import dataclasses
from typing import get_args

import torch

from sonic._validation import check_bool, check_choice, check_int
from sonic.reference.ops import accumulate_dtype
from sonic.routing.topk import (affinity_scores, check_positive, check_router_args, scaled,
                                token_choice, token_major_pairs)
from sonic.routing.types import Routing
from sonic.types import Backend, Rounding, Score

ROUNDINGS: tuple[Rounding, ...] = get_args(Rounding)
# The most tokens rounding can add to one expert, per rounding mode, for a tile.
MAX_ADDED = {"nearest": lambda tile: tile - tile // 2, "up": lambda tile: tile - 1,
             "down": lambda tile: 0}


def rounded_counts(counts: torch.Tensor, tile: int, rounding: str, num_tokens: int) -> torch.Tensor:
    """Round per-expert token counts ``f_e`` to multiples of ``tile``, clamped to ``[0, T]``.

    ``"nearest"`` rounds a count exactly half-way between two multiples up.
    """
    if rounding == "up":
        r = (counts + tile - 1) // tile
    elif rounding == "down":
        r = counts // tile
    else:
        r = (counts + tile // 2) // tile
    return (r * tile).clamp(0, num_tokens)


def capacity(num_tokens: int, num_experts: int, k: int, tile: int, rounding: str) -> int:
    """The most pairs token rounding can route: ``min(T·K + E·MAX_ADDED(tile), T·E)`` (each
    expert gains fewer than ``tile`` tokens, and keeps at most ``T``). The length of a padded
    routing, known without looking at the logits."""
    return min(num_tokens * k + num_experts * MAX_ADDED[rounding](tile), num_tokens * num_experts)


def token_rounding_routing(logits: torch.Tensor, k: int, *, tile: int = 128,
                           rounding: Rounding = "nearest", backend: Backend = "auto",
                           padded: bool = False, score: Score = "softmax_topk",
                           renormalize: bool = False, expert_bias: torch.Tensor | None = None,
                           n_group: int = 1, topk_group: int | None = None,
                           scaling_factor: float = 1.0) -> Routing:
    """Token rounding: top-K token choice, then each expert's token count rounded to a tile.

    Training-time routing that removes the padding waste of partially filled GEMM tiles:
      1. ``S`` = the router's affinities (``softmax(logits)``, or ``sigmoid(logits)`` for
         ``score="sigmoid"``); top-K token choice (:func:`topk_routing` with this call's
         scoring options: bias, groups) gives ``f_e`` tokens per expert.
      2. Combined score ``C``: token-choice picks keep their token-choice score (``S/ΣS_picked``
         for the default ``"softmax_topk"``), every other entry is ``S − 1``, so every pick
         outranks every non-pick.
      3. Each expert sorts tokens by ``C[:, e]`` (descending; lower token index first on ties).
      4. ``r_e`` = ``f_e`` rounded to a multiple of ``tile`` (``rounding``), clamped to
         ``[0, T]``; the expert keeps its top ``r_e`` tokens: rounding down drops its weakest
         picks, rounding up adds its strongest non-picks. ``|r_e − f_e| < tile``.
      5. Kept picks are scored by their token-choice score, added pairs by ``S[t, e]``; all
         scores then times ``scaling_factor``.

    The rounding works on whatever scores the router made: an expert bias shifts a whole
    column of ``S`` and so leaves every expert's order of tokens unchanged, and an added pair
    may lie outside its token's ``topk_group`` groups (rounding adds by affinity alone).

    Args:
        logits: ``(T, E)`` float router logits.
        k: experts per token of the underlying token choice, ``1 <= k <= E``.
        tile: ``M_tile`` of the grouped GEMM (128 on Hopper), ``>= 1``.
        rounding: ``"nearest"`` (the paper's NR-f, default), ``"up"`` or ``"down"``.
        backend: backend of the token-choice step, as in :func:`topk_routing`, and of the
            selection: ``"cute"`` (or ``"auto"`` on a supported GPU) runs the selection kernel
            (:mod:`sonic.kernels.token_rounding`) for fp32/bf16/fp16 logits.
        padded: ``False``: the exact pairs, ``P = Σ r_e`` of them, which reads ``P`` back to
            the host once. ``True``: no host read (CUDA-graph capturable) — the pairs are padded
            to :func:`capacity` with ``Routing.num_valid`` the true ``P`` on the device;
            ``routing.trim()`` gives the exact routing.
        score, renormalize, expert_bias, n_group, topk_group, scaling_factor: the token
            choice's scoring, as in :func:`topk_routing`.

    Returns:
        A :class:`Routing` whose pairs are grouped by expert (ascending), each expert's tokens in
        ascending order (padding, if any, after them). Scores are fp32 (fp64 for fp64 logits),
        differentiable with respect to ``logits``.

    Raises:
        TypeError / ValueError: bad ``logits``, ``k`` outside ``[1, E]``, ``tile < 1``, unknown
            ``rounding``, ``padded`` not a bool, or a bad scoring option (see
            :func:`topk_routing`).

    Use it for training only; evaluate with :func:`topk_routing` (paper §5.2).
    """
    check_router_args(logits, k)
    check_int("tile", tile, low=1)
    check_choice("rounding", rounding, ROUNDINGS)
    check_bool("padded", padded)
    if not torch.compiler.is_compiling():     # a traced float may be symbolic
        check_positive("scaling_factor", scaling_factor)
    num_tokens, num_experts = logits.shape
    acc = accumulate_dtype(logits.dtype)
    if num_tokens == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=logits.device)
        num_valid = empty.new_zeros(()) if padded else None
        return Routing(empty, empty, logits.new_zeros(0, dtype=acc), 0, num_experts,
                       validated=True, num_valid=num_valid)
    # Token choice (the bitonic top-K kernel where it serves the scoring): the TC scores of
    # step 2, unscaled so that they stay within S's range; row t is token t's choices.
    tc_scores, tc_experts = token_choice(
        logits, k, score=score, renormalize=renormalize, backend=backend,
        expert_bias=expert_bias, n_group=n_group, topk_group=topk_group, scaling_factor=1.0)
    return _round(tc_scores, tc_experts, affinity_scores(logits, score), tile, rounding,
                  backend, padded, scaling_factor)


def _round(tc_scores: torch.Tensor, tc_experts: torch.Tensor, probs: torch.Tensor, tile: int,
           rounding: str, backend: str, padded: bool, scaling_factor: float) -> Routing:
    """Steps 2–5 of :func:`token_rounding_routing` on the token choice (``(T, K)`` scores and
    experts) and the affinities ``probs (T, E)``."""
    num_tokens, num_experts = probs.shape
    k = tc_experts.shape[1]
    tc_scores = tc_scores.flatten().to(probs.dtype)
    size = capacity(num_tokens, num_experts, k, tile, rounding)
    if _use_kernel(backend, probs):
        import sonic.ops
        tokens, experts, source, values, num_kept = sonic.ops.call.token_rounding_select(
            probs.detach(), tc_scores.detach(), tc_experts, tile, rounding, size)
        if not padded:
            count = int(num_kept)                              # the one host read: P
            tokens, experts, source, values = (tokens[:count], experts[:count],
                                               source[:count], values[:count])
        return Routing(token_idx=tokens, expert_idx=experts,
                       scores=scaled(kept_scores(values, source, tc_scores, probs),
                                     scaling_factor),
                       num_tokens=num_tokens, num_experts=num_experts, validated=True,
                       num_valid=num_kept if padded else None)
    # Keys e·T + t, and the sorts over them, in int32 where they fit: half the radix passes.
    key_dtype = torch.int32 if num_experts * num_tokens < 2**31 else torch.int64
    inputs = (tc_scores.detach(), token_major_pairs(num_tokens, k, probs.device).to(key_dtype),
              tc_experts.flatten().to(key_dtype), probs.detach())
    keys, order, num_kept = _selection(*inputs, tile, rounding)
    if padded:
        routing = kept_routing(keys, order, num_kept, tc_scores, probs, capacity=size)
    else:
        routing = kept_routing(keys, order, int(num_kept), tc_scores, probs)  # the host read: P
    scores = scaled(routing.scores, scaling_factor)
    return routing if scores is routing.scores else dataclasses.replace(routing, scores=scores)


def _use_kernel(backend: str, probs: torch.Tensor) -> bool:
    """Whether the selection runs as the CuTe kernel: fp32 combined scores (their bits are the
    kernel's sort keys) on a device where the kernels run."""
    from sonic.backend import resolve_backend
    if probs.dtype != torch.float32 or resolve_backend(backend, probs.device) != "cute":
        return False
    from sonic.kernels.token_rounding import kernel_fits
    return kernel_fits(*probs.shape)


def kept_routing(keys: torch.Tensor, order: torch.Tensor, num_kept, tc_scores: torch.Tensor,
                 probs: torch.Tensor, *, capacity: int | None = None) -> Routing:
    """The :class:`Routing` of the kept sorted keys ``e·T + t`` (``order``: their sources, as
    :func:`kept_keys` returns them), scored as :func:`scored_routing` says.

    ``capacity=None``: the first ``num_kept`` (an int) keys. Otherwise the first ``capacity``
    keys, ``num_kept`` (a 0-d tensor) of them kept and the rest the sentinel key ``E·T``: a
    padded routing, built with no host read."""
    num_tokens, num_experts = probs.shape
    length = num_kept if capacity is None else capacity
    keys, order = keys[:length], order[:length]
    return scored_routing(keys % num_tokens, keys // num_tokens, order, tc_scores, probs,
                          None if capacity is None else num_kept)


def scored_routing(tokens: torch.Tensor, experts: torch.Tensor, source: torch.Tensor,
                   tc_scores: torch.Tensor, probs: torch.Tensor,
                   num_valid: torch.Tensor | None) -> Routing:
    """The :class:`Routing` of kept pairs (``tokens``, ``experts``; padding: expert ``E``)
    scored differentiably: a kept pick by its token-choice score ``tc_scores[source]``
    (``source < T·K``), an added pair by ``probs[t, e]``, padding by 0."""
    num_tokens, num_experts = probs.shape
    experts = experts.to(torch.int32)
    real = experts < num_experts
    # Gathers by index_select, whose backward (index_add) is fast where indexing's is not;
    # indices clamped into range for padding, whose scores are then masked (the masked
    # branch gets no gradient, whatever the backward computes for padding rows).
    num_picks = tc_scores.numel()
    pick_scores = tc_scores.index_select(0, source.clamp(0, num_picks - 1))
    add_scores = probs.reshape(-1).index_select(
        0, tokens.long() * num_experts + experts.clamp(max=num_experts - 1))
    scores = torch.where(source < num_picks, pick_scores, add_scores)
    if num_valid is not None:
        scores = torch.where(real, scores, 0)
    return Routing(
        token_idx=tokens.to(torch.int32),
        expert_idx=experts,
        scores=scores,
        num_tokens=num_tokens,
        num_experts=num_experts,
        validated=True,
        num_valid=num_valid,
    )


class _KeptScores(torch.autograd.Function):
    """The kept pairs' scores as the selection kernel wrote them, with the gradient of the
    gathers :func:`scored_routing` runs: each pair's goes to its slot ``source`` in
    ``[tc_scores | probs.flatten() | one unused slot]`` (a pick's to ``tc_scores[source]``, an
    added pair's to ``probs[t, e]``, padding's to the unused slot). The backward is one
    ``index_add`` (a differentiable op), so higher-order gradients pass through."""

    @staticmethod
    def forward(ctx, values, source, tc_scores, probs):
        ctx.save_for_backward(source)
        ctx.sizes = tc_scores.numel(), probs.shape
        return values

    @staticmethod
    def backward(ctx, grad):
        (source,) = ctx.saved_tensors
        num_picks, (num_tokens, num_experts) = ctx.sizes
        # Kept pairs have distinct slots; padding shares the last one, which is dropped.
        slots = grad.new_zeros(num_picks + num_tokens * num_experts + 1).index_add(
            0, source, grad)
        grad_picks = slots[:num_picks] if ctx.needs_input_grad[2] else None
        grad_probs = (slots[num_picks:-1].view(num_tokens, num_experts)
                      if ctx.needs_input_grad[3] else None)
        return None, None, grad_picks, grad_probs


def kept_scores(values: torch.Tensor, source: torch.Tensor, tc_scores: torch.Tensor,
                probs: torch.Tensor) -> torch.Tensor:
    """``(P,)`` scores of kept pairs whose values are known (``values``, as
    :func:`sonic.kernels.token_rounding.token_rounding_select` writes them: the pick's
    ``tc_scores[source]``, the added pair's ``probs[t, e]``, 0 for padding), differentiable
    with respect to ``tc_scores (T·K,)`` and ``probs (T, E)`` as :func:`scored_routing`'s
    gathers are. ``source`` (int32 or int64): each pair's slot in ``[tc_scores |
    probs.flatten() | one unused slot]``, ``T·K + T·E`` for padding."""
    if not (tc_scores.requires_grad or probs.requires_grad) or not torch.is_grad_enabled():
        return values
    return _KeptScores.apply(values, source, tc_scores, probs)


def _selection(tc_scores: torch.Tensor, tc_tokens: torch.Tensor, tc_experts: torch.Tensor,
               probs: torch.Tensor, tile: int, rounding: str):
    """Steps 3–4 on detached tensors with data-independent shapes: ``(keys, order, P)``, the
    sorted keys ``e·T + t`` of the kept pairs first (``P`` of them, a 0-d tensor), and for each
    key its source: ``order < T·K`` is a kept pick, larger an added pair."""
    num_tokens, num_experts = probs.shape
    counts = expert_counts(tc_experts, num_experts)
    change = rounded_counts(counts, tile, rounding, num_tokens) - counts     # |change| < tile
    # Every pick outranks every non-pick, so rounding only moves an expert's boundary: it drops
    # its -change weakest picks or adds its change strongest non-picks.
    dropped = _weakest_picks(tc_scores, tc_experts, counts, (-change).clamp(min=0))
    width = min(MAX_ADDED[rounding](tile), num_tokens)
    added = None
    if width > 0:
        added = _strongest_non_picks(probs, tc_tokens, tc_experts, change.clamp(min=0), width)
    keys, order = kept_keys(tc_tokens, tc_experts, dropped, added, num_tokens, num_experts)
    return keys, order, tc_tokens.numel() + change.sum()


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(E,)`` int64 number of pairs of each expert."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, experts.long(), counts.new_ones(1).expand(experts.numel()))


def kept_keys(tc_tokens: torch.Tensor, tc_experts: torch.Tensor, dropped: torch.Tensor,
              added: torch.Tensor | None, num_tokens: int, num_experts: int):
    """``(keys, order)``: the keys ``e·T + t`` of the token-choice pairs not ``dropped``
    followed by the ``added`` keys, sorted (the kept pairs first, grouped by expert, tokens
    ascending); ``order`` the source of each key (``< T·K``: a pick). A dropped pick and an
    unused slot carry the key ``E·T``, which sorts past the kept pairs."""
    keys = torch.where(dropped, num_experts * num_tokens, tc_experts * num_tokens + tc_tokens)
    if added is not None:
        keys = torch.cat([keys, added])
    return torch.sort(keys)


def _weakest_picks(scores: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                   drop: torch.Tensor) -> torch.Tensor:
    """``(P,)`` mask of each expert ``e``'s ``drop[e]`` lowest-scored token-major pairs
    (``counts[e]`` pairs per expert)."""
    ranked, rank = weakest_pick_ranks(scores, experts, counts)
    return torch.zeros_like(experts, dtype=torch.bool).scatter_(
        0, ranked, rank < drop[experts[ranked]])


def weakest_pick_ranks(scores: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor):
    """``(ranked, rank)``: the token-major pairs grouped by expert (ascending), weakest first
    within an expert (``counts[e]`` pairs per expert), and each one's position in its expert.

    Among equal scores the higher token goes first, so the choice is exact and deterministic:
    pairs are ranked within their expert by two stable sorts (score, then expert) of the pairs
    taken in reverse, descending-token, order.
    """
    num_pairs = scores.numel()
    reverse = torch.arange(num_pairs - 1, -1, -1, device=scores.device)
    by_score = reverse[torch.argsort(scores[reverse], stable=True)]
    ranked = by_score[torch.argsort(experts[by_score], stable=True)]
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=scores.device) - starts[experts[ranked]]
    return ranked, rank


def _strongest_non_picks(probs: torch.Tensor, tc_tokens: torch.Tensor, tc_experts: torch.Tensor,
                         add: torch.Tensor, width: int) -> torch.Tensor:
    """``(E·width,)`` keys ``e·T + t`` of each expert ``e``'s ``add[e] <= width`` non-picked
    tokens of largest ``probs[t, e]``; ``E·T`` in the unused slots."""
    num_tokens, num_experts = probs.shape
    device = probs.device
    tokens = strongest_non_pick_tokens(probs, tc_tokens, tc_experts, width)
    slot = torch.arange(width, device=device)
    experts = torch.arange(num_experts, device=device)[:, None]
    keys = torch.where(slot < add[:, None], experts * num_tokens + tokens, num_experts * num_tokens)
    return keys.flatten().to(tc_tokens.dtype)


def strongest_non_pick_tokens(probs: torch.Tensor, tc_tokens: torch.Tensor,
                              tc_experts: torch.Tensor, width: int) -> torch.Tensor:
    """``(E, width)`` int64: per expert, tokens by descending ``probs[t, e]``, non-picks first
    (``width <= T``; past an expert's non-picks come picks, which callers must not use).

    Among equal probabilities the lower token goes first, so the choice is exact and
    deterministic: fp32 probabilities (non-negative, so their bits order like integers) are
    ranked by one top-``width`` selection over int64 keys ``bits·2³² + (T−1−t)``, unique per
    column; fp64 ones by a stable sort.
    """
    num_tokens, num_experts = probs.shape
    device = probs.device
    token_order = torch.arange(num_tokens - 1, -1, -1, device=device)
    picks = tc_experts.long() * num_tokens + tc_tokens
    if probs.dtype == torch.float32:
        ranks = (probs.t().contiguous().view(torch.int32).to(torch.int64) << 32) | token_order
        ranks.view(-1).index_fill_(0, picks, -1)          # a pick is never added
        top = torch.topk(ranks, width, dim=1).values
        return num_tokens - 1 - (top & 0xFFFFFFFF)
    values = probs.t().clone(memory_format=torch.contiguous_format)
    values.view(-1).index_fill_(0, picks, -1.0)
    return torch.sort(values, dim=1, descending=True, stable=True).indices[:, :width]
