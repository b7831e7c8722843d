"""Tile-aware token rounding (SonicMoE paper §5.2, Algorithm 4; DESIGN §2)."""

from __future__ import annotations

import torch

from sonic._validation import check_choice, check_int
from sonic.reference.ops import accumulate_dtype
from sonic.routing.topk import check_router_args, topk_routing
from sonic.routing.types import Routing

ROUNDINGS = ("nearest", "up", "down")


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


def token_rounding_routing(logits: torch.Tensor, k: int, *, tile: int = 128,
                           rounding: str = "nearest", backend: str = "auto") -> Routing:
    """Token rounding: top-K token choice, then each expert's token count rounded to a tile.

    Training-time routing that removes the padding waste of partially filled GEMM tiles:
      1. ``S = softmax(logits)``; top-K token choice gives ``f_e`` tokens per expert.
      2. Combined score ``C``: token-choice picks keep their score ``S/ΣS_picked``, every other
         entry is ``S − 1``, so every pick outranks every non-pick.
      3. Each expert sorts tokens by ``C[:, e]`` (descending; lower token index first on ties).
      4. ``r_e`` = ``f_e`` rounded to a multiple of ``tile`` (``rounding``), clamped to
         ``[0, T]``; the expert keeps its top ``r_e`` tokens: rounding down drops its weakest
         picks, rounding up adds its strongest non-picks. ``|r_e − f_e| < tile``.
      5. Kept picks are scored by their token-choice score, added pairs by ``S[t, e]``.

    Args:
        logits: ``(T, E)`` float router logits.
        k: experts per token of the underlying token choice, ``1 <= k <= E``.
        tile: ``M_tile`` of the grouped GEMM (128 on Hopper), ``>= 1``.
        rounding: ``"nearest"`` (the paper's NR-f, default), ``"up"`` or ``"down"``.
        backend: backend of the token-choice step, as in :func:`topk_routing`.

    Returns:
        A :class:`Routing` whose pairs are grouped by expert (ascending), each expert's tokens in
        ascending order; ``P = Σ r_e`` is data-dependent, so building it reads ``P`` back to the
        host once. Scores are fp32 (fp64 for fp64 logits), differentiable with respect to ``logits``.

    Raises:
        TypeError / ValueError: bad ``logits``, ``k`` outside ``[1, E]``, ``tile < 1``, unknown
            ``rounding``.

    Use it for training only; evaluate with :func:`topk_routing` (paper §5.2).
    """
    check_router_args(logits, k)
    check_int("tile", tile, low=1)
    check_choice("rounding", rounding, ROUNDINGS)
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=logits.device)
        return Routing(empty, empty, logits.new_zeros(0, dtype=accumulate_dtype(logits.dtype)),
                       0, num_experts)
    # Work in (E, T) layout: every step below is per expert, along tokens.
    probs = torch.softmax(logits.to(accumulate_dtype(logits.dtype)), dim=-1).t().contiguous()
    # Token choice (the bitonic top-K kernel where it runs): its scores S/ΣS_picked are the
    # renormalised TC scores of step 2.
    tc = topk_routing(logits, k, backend=backend)
    picks = tc.expert_idx.view(num_tokens, k).long().t()
    picked = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, picks, True)
    tc_scores = torch.zeros_like(probs).scatter(0, picks, tc.scores.view(num_tokens, k).t().to(probs.dtype))

    counts = picked.sum(dim=1)
    change = rounded_counts(counts, tile, rounding, num_tokens) - counts     # |change| < tile
    # Every pick outranks every non-pick, so rounding only moves an expert's boundary: it drops
    # its -change weakest picks or adds its change strongest non-picks — fewer than `tile`
    # entries either way, found by a top-`tile` selection instead of sorting whole columns.
    width = min(tile, num_tokens)
    dropped = _smallest(torch.where(picked, tc_scores.detach(), torch.inf),
                        (-change).clamp(min=0), width, ties_to_higher_tokens=True)
    added = _smallest(torch.where(picked, torch.inf, -probs.detach()), change.clamp(min=0), width,
                      ties_to_higher_tokens=False)
    kept = (picked & ~dropped) | added
    expert_idx, token_idx = kept.nonzero(as_tuple=True)                    # expert-major
    scores = torch.where(picked[expert_idx, token_idx], tc_scores[expert_idx, token_idx],
                         probs[expert_idx, token_idx])
    return Routing(
        token_idx=token_idx.to(torch.int32),
        expert_idx=expert_idx.to(torch.int32),
        scores=scores,
        num_tokens=num_tokens,
        num_experts=num_experts,
    )


def _smallest(values: torch.Tensor, counts: torch.Tensor, width: int, *,
              ties_to_higher_tokens: bool) -> torch.Tensor:
    """``(E, T)`` mask of the ``counts[e]`` smallest entries of each row (``counts[e] <= width``).

    Among equal values the higher (or lower) tokens are taken first, as a stable sort of the
    pairs' order would rank them, so the choice is exact and deterministic: a top-``width``
    selection only finds each row's threshold value; comparisons and a running count over the
    tied entries decide.
    """
    smallest = torch.topk(values, width, dim=1, largest=False, sorted=True).values
    threshold = smallest.gather(1, (counts - 1).clamp(min=0)[:, None])
    threshold = torch.where(counts[:, None] > 0, threshold, -torch.inf)
    below = values < threshold
    tied = values == threshold
    missing = counts[:, None] - below.sum(dim=1, keepdim=True)
    if ties_to_higher_tokens:
        order = tied.flip(1).cumsum(dim=1).flip(1)
    else:
        order = tied.cumsum(dim=1)
    return below | (tied & (order <= missing))
