"""Token rounding across expert-parallel ranks (docs/design.md §2).

Every rank routes its own tokens, yet each expert's rounded count must be a tile multiple of
the tokens it receives from *all* ranks, with exactly the selection that single-process
:func:`sonic.token_rounding_routing` makes on the concatenated batch (rank order =
concatenation order, so rank ``r``'s token ``t`` is global token ``offset_r + t``).

Rounding moves each expert's boundary by fewer than ``tile`` pairs: an expert that rounds down
drops its ``-change_e`` globally weakest picks, one that rounds up adds its ``change_e``
globally strongest non-picks. Those are among the union of every rank's ``|change_e|`` locally
weakest picks (strongest non-picks), so a rank only ships those candidates:

1. token choice locally; **all-gather #1** of the per-expert pick counts and ``T_r``
   (``E + 1`` int64 per rank) → global ``f_e``, ``T`` and this rank's token offset, then
   ``r_e = rounded_counts(f_e)`` and ``change_e = r_e − f_e`` on every rank alike;
2. **all-gather #2** of each rank's candidates, a fixed ``(E, W)`` block of (score or
   probability bits, global token) — ``W`` depends only on ``tile`` and ``rounding``
   (``W = 0``, e.g. ``tile = 1``, skips it) — ranked per expert with the single-process tie
   rules (weakest pick: lower score first, the higher global token first among equals;
   strongest non-pick: higher probability first, the lower global token first among equals);
   each rank keeps, drops and adds its own pairs accordingly;
3. **one host read**: this rank's number of kept pairs, to size its :class:`Routing` (the
   single-process router reads ``P`` once too). Everything else stays on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist

from sonic._validation import check_choice, check_int
from sonic.distributed.comm import check_group, comm_device
from sonic.distributed.plan import check_settings
from sonic.reference.ops import accumulate_dtype, affinity_scores
from sonic.routing.token_rounding import (ROUNDINGS, expert_counts, kept_keys,
                                          kept_routing, rounded_counts,
                                          strongest_non_pick_tokens, weakest_pick_ranks)
from sonic.routing.topk import check_scoring, topk_routing
from sonic.routing.types import Routing
from sonic.types import Backend, Rounding, Score

# The most pairs rounding can move one expert's boundary by, per rounding mode, for a tile:
# "nearest" drops at most ceil(tile/2) - 1 picks or adds at most floor(tile/2) non-picks.
MAX_CHANGE = {"nearest": lambda tile: tile // 2, "up": lambda tile: tile - 1,
              "down": lambda tile: tile - 1}


def candidate_width(tile: int, rounding: str) -> int:
    """``W``: candidates one rank sends per expert (an expert drops or adds, never both)."""
    return MAX_CHANGE[rounding](tile)


def ep_token_rounding_routing(logits: torch.Tensor, k: int, *, group=None, tile: int = 128,
                              rounding: Rounding = "nearest", backend: Backend = "auto",
                              settings: Mapping[str, object] | None = None,
                              score: Score = "softmax_topk", renormalize: bool = False,
                              expert_bias: torch.Tensor | None = None, n_group: int = 1,
                              topk_group: int | None = None,
                              scaling_factor: float = 1.0) -> Routing:
    """Token rounding of the whole expert-parallel batch, run by every rank on its own tokens.

    Collective: every rank of ``group`` must call it, with the same ``E``, ``k``, ``tile``,
    ``rounding`` and logits dtype. The union over ranks of the returned pairs (token ``t`` of
    rank ``r`` read as global token ``offset_r + t``) equals the pairs of
    :func:`sonic.token_rounding_routing` on the logits concatenated in rank order, tie rules
    included, with equal scores and equal gradients to the logits.

    Args:
        logits: ``(T_r, E)`` float router logits of this rank's tokens (``T_r`` may differ
            between ranks, and may be 0).
        k, tile, rounding, backend: as in :func:`sonic.token_rounding_routing`.
        score, renormalize, expert_bias, n_group, topk_group, scaling_factor: the scoring
            options of :func:`sonic.token_rounding_routing`, the same on every rank (they act
            per token, so each rank's token choice and affinities are those of the whole
            batch); ``expert_bias`` ``(E,)`` must hold the same values on every rank.
        group: the EP process group (``None``: the default group).
        settings: further settings every rank must share, as in
            :func:`sonic.distributed.ep_moe_experts` (:class:`ExpertParallelMoE` passes its
            own).

    Returns:
        This rank's :class:`Routing`: token indices local to the rank, global expert indices,
        pairs grouped by expert (ascending) and tokens ascending within an expert; scores fp32
        (fp64 for fp64 logits), differentiable with respect to ``logits``.

    Agreement: the first collective is the count exchange of :func:`ep_moe_experts` without
    counts, carrying ``E``, ``k``, ``tile``, ``rounding``, the scoring options (whether there
    is an ``expert_bias``, not its values), the scores' dtype and ``settings``:
    ranks that disagree on any of them, or where another rank dispatches top-K pairs instead,
    raise on every rank naming the setting, before the gathers (whose sizes depend on them).

    Cost: one count exchange, two all-gathers (``E + 1`` int64, then ``E × W × 2`` int64 per rank,
    ``W = candidate_width(tile, rounding)``: ``tile // 2`` for ``"nearest"``, ``tile − 1``
    otherwise; ``W = 0``, as for ``tile = 1``, skips the second) and one device→host read.

    Raises:
        TypeError / ValueError: as :func:`sonic.token_rounding_routing`; ValueError on every
            rank when ranks disagree (see above).
        RuntimeError: ``torch.distributed`` not initialised; ValueError: this process is not
            in ``group``.
    """
    # Before the first collective: a bad option raises on this rank, not in a gather's size.
    topk_group = check_scoring(logits, k, score, renormalize, expert_bias, n_group, topk_group,
                               scaling_factor)
    check_int("tile", tile, low=1)
    check_choice("rounding", rounding, ROUNDINGS)
    ep_size, ep_rank = check_group(group)
    num_tokens, num_experts = logits.shape
    device = logits.device
    comm = comm_device(group, device)
    acc = accumulate_dtype(logits.dtype)
    check_settings({**(settings or {}), "router": "token_rounding", "top_k": k, "tile": tile,
                    "rounding": rounding, "num_experts": num_experts, "dtype of scores": acc,
                    "score": score, "renormalize": renormalize, "n_group": n_group,
                    "topk_group": topk_group,
                    "expert_bias": expert_bias is not None,
                    "routed_scaling_factor": scaling_factor},
                   group, device)
    key_dtype = torch.int32 if num_experts * num_tokens < 2**31 else torch.int64
    # Token choice on this rank's tokens: per token, so its picks and scores are those of the
    # whole batch.
    tc = topk_routing(logits, k, backend=backend, score=score, renormalize=renormalize,
                      expert_bias=expert_bias, n_group=n_group, topk_group=topk_group)
    tc_scores = tc.scores.to(acc)
    probs = affinity_scores(logits, score)
    scores_d, probs_d = tc_scores.detach(), probs.detach()
    tc_tokens, tc_experts = tc.token_idx.to(key_dtype), tc.expert_idx.to(key_dtype)

    # 1. Global counts, T and this rank's offset (all-gather #1).
    local_counts = expert_counts(tc_experts, num_experts)
    message = torch.cat([local_counts, local_counts.new_full((1,), num_tokens)])
    gathered = _all_gather(message.to(comm), ep_size, group).to(device)
    counts = gathered[:, :num_experts].sum(0)
    total = gathered[:, num_experts].sum()
    offset = gathered[:ep_rank, num_experts].sum()
    # |change| < tile. total stays a 0-d device tensor (no host read); clamp takes it as the
    # bound.
    change = rounded_counts(counts, tile, rounding, total) - counts  # type: ignore[arg-type]
    drop, add = (-change).clamp(min=0), change.clamp(min=0)

    num_picks = tc_experts.numel()
    dropped = torch.zeros(num_picks, dtype=torch.bool, device=device)
    added = None
    width = candidate_width(tile, rounding)
    if width > 0:
        dropped, added = _boundary(scores_d, probs_d, tc_tokens, tc_experts, local_counts,
                                   drop, add, offset, width, ep_size, ep_rank, group, comm)
    keys, order = kept_keys(tc_tokens, tc_experts, dropped, added, num_tokens, num_experts)
    kept = num_picks - dropped.sum()
    if added is not None:
        kept = kept + (added < num_experts * num_tokens).sum()
    num_kept = int(kept)                                       # the one host read: P_r
    if num_tokens == 0:
        # No pairs; the empty scores stay attached to the logits, as on the other ranks (the
        # expert dispatch checks that all ranks agree on scores.requires_grad).
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return Routing(empty, empty, probs.reshape(-1)[:0], 0, num_experts, validated=True)
    routing = kept_routing(keys, order, num_kept, tc_scores, probs)
    # Unconditionally, as the single-process router scales (a traced float stays symbolic).
    return dataclasses.replace(routing, scores=routing.scores * scaling_factor)


def _all_gather(x: torch.Tensor, ep_size: int, group) -> torch.Tensor:
    """``(ep, *x.shape)``: every rank's ``x``, by group rank."""
    out = [torch.empty_like(x) for _ in range(ep_size)]
    dist.all_gather(out, x.contiguous(), group=group)
    return torch.stack(out)


def _boundary(scores, probs, tc_tokens, tc_experts, local_counts, drop, add, offset, width,
              ep_size, ep_rank, group, comm):
    """``(dropped, added)``: the mask of this rank's picks that the global boundary drops and
    the ``(E·width,)`` keys ``e·T_r + t`` of this rank's non-picks it adds (``E·T_r`` unused),
    from every rank's candidates (all-gather #2)."""
    num_tokens, num_experts = probs.shape
    device = probs.device
    num_picks = tc_experts.numel()
    slots = num_experts * width
    # This rank's candidates in an (E, width) block, plus one spare slot that absorbs writes
    # of non-candidates: value, global token (-1: empty slot), local source (pick or token).
    value = probs.new_zeros(slots + 1)
    token = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)
    source = torch.zeros(slots + 1, dtype=torch.int64, device=device)
    # Dropping experts: their drop[e] weakest local picks (fewer where the rank has fewer).
    ranked, rank = weakest_pick_ranks(scores, tc_experts, local_counts)
    ranked_experts = tc_experts[ranked].long()
    where = torch.where(rank < drop[ranked_experts], ranked_experts * width + rank, slots)
    value.scatter_(0, where, scores[ranked])
    token.scatter_(0, where, offset + tc_tokens[ranked].long())
    source.scatter_(0, where, ranked)
    # Adding experts: their add[e] strongest local non-picks (fewer where the rank has fewer).
    local_width = min(width, num_tokens)
    if local_width > 0:
        # Slots past an expert's non-picks are not used (fp32 ones hold no valid token).
        best = strongest_non_pick_tokens(probs, tc_tokens, tc_experts, local_width).clamp(min=0)
        slot = torch.arange(local_width, device=device)
        usable = torch.minimum(add, num_tokens - local_counts)[:, None]
        experts = torch.arange(num_experts, device=device)[:, None]
        where = torch.where(slot < usable, experts * width + slot, slots).flatten()
        value.scatter_(0, where, probs.t().gather(1, best).flatten())
        token.scatter_(0, where, offset + best.flatten())
        source.scatter_(0, where, best.flatten())
    value, token, source = value[:slots], token[:slots], source[:slots]

    # All-gather #2: (value bits, global token) of every rank's candidates, exact.
    bits = value.view(torch.int64) if value.dtype == torch.float64 else \
        value.view(torch.int32).to(torch.int64)
    theirs = _all_gather(torch.stack([bits, token], dim=1).to(comm), ep_size, group).to(device)
    # (E, ep·width) per expert: every rank's block of candidates, rank-major.
    theirs = theirs.view(ep_size, num_experts, width, 2).transpose(0, 1).reshape(
        num_experts, ep_size * width, 2)
    all_bits, all_tokens = theirs[..., 0], theirs[..., 1]
    all_values = (all_bits.view(torch.float64) if value.dtype == torch.float64 else
                  all_bits.to(torch.int32).view(torch.float32))
    empty = all_tokens < 0
    # Rank each expert's candidates as single-process token rounding ranks them, by two
    # stable sorts (token, then value). Empty slots go last.
    dropping = drop[:, None] > 0
    by_token = torch.sort(all_tokens, dim=1, descending=True, stable=True).indices
    key = torch.where(empty, torch.inf, all_values).gather(1, by_token)
    weakest = by_token.gather(1, torch.sort(key, dim=1, stable=True).indices)
    by_token = torch.sort(all_tokens, dim=1, stable=True).indices
    key = torch.where(empty, -torch.inf, all_values).gather(1, by_token)
    strongest = by_token.gather(1, torch.sort(key, dim=1, descending=True, stable=True).indices)
    ranking = torch.where(dropping, weakest, strongest)
    position = torch.empty_like(ranking).scatter_(
        1, ranking, torch.arange(ep_size * width, device=device).expand_as(ranking))
    chosen = position < (drop + add)[:, None]                 # |change_e| of each expert
    mine = chosen[:, ep_rank * width:(ep_rank + 1) * width].flatten()
    dropping = dropping.expand(num_experts, width).flatten()

    dropped = torch.zeros(num_picks + 1, dtype=torch.bool, device=device)
    dropped.scatter_(0, torch.where(mine & dropping, source, num_picks), True)
    experts = torch.arange(num_experts, device=device).repeat_interleave(width)
    added = torch.where(mine & ~dropping, experts * num_tokens + source, num_experts * num_tokens)
    return dropped[:num_picks], added.to(tc_tokens.dtype)
