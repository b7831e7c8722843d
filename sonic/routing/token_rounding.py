"""Tile-aware token rounding (SonicMoE paper §5.2, Algorithm 4; DESIGN §2)."""

from __future__ import annotations

import torch

from sonic._validation import check_choice, check_int
from sonic.reference.ops import accumulate_dtype
from sonic.routing.topk import check_router_args, topk_indices
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
                           rounding: str = "nearest") -> Routing:
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

    Returns:
        A :class:`Routing` whose pairs are grouped by expert (ascending), each expert's tokens in
        descending ``C`` order; ``P = Σ r_e`` is data-dependent, so building it reads ``P`` back to
        the host once. Scores are fp32 (fp64 for fp64 logits), differentiable with respect to ``logits``.

    Raises:
        TypeError / ValueError: bad ``logits``, ``k`` outside ``[1, E]``, ``tile < 1``, unknown
            ``rounding``.

    Use it for training only; evaluate with :func:`topk_routing` (paper §5.2).
    """
    check_router_args(logits, k)
    check_int("tile", tile, low=1)
    check_choice("rounding", rounding, ROUNDINGS)
    num_tokens, num_experts = logits.shape
    device = logits.device
    logits32 = logits.to(accumulate_dtype(logits.dtype))
    probs = torch.softmax(logits32, dim=-1)
    picks = topk_indices(logits32, k)
    picked = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, picks, True)
    picked_probs = torch.where(picked, probs, torch.zeros_like(probs))
    tc_scores = picked_probs / picked_probs.sum(dim=-1, keepdim=True)
    combined = torch.where(picked, tc_scores, probs - 1.0).detach()

    counts = picked.sum(dim=0)
    kept = rounded_counts(counts, tile, rounding, num_tokens)
    order = torch.argsort(combined, dim=0, descending=True, stable=True)       # (T, E)
    rank = torch.arange(num_tokens, device=device)
    expert_idx, ranks = (rank[None, :] < kept[:, None]).nonzero(as_tuple=True)  # expert-major
    token_idx = order[ranks, expert_idx]
    scores = torch.where(picked[token_idx, expert_idx], tc_scores[token_idx, expert_idx],
                         probs[token_idx, expert_idx])
    return Routing(
        token_idx=token_idx.to(torch.int32),
        expert_idx=expert_idx.to(torch.int32),
        scores=scores,
        num_tokens=num_tokens,
        num_experts=num_experts,
    )
