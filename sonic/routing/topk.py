"""Top-K token-choice routing (DESIGN §2; SonicMoE paper §2)."""

from __future__ import annotations

import torch

from sonic._validation import check_choice, check_float, check_int
from sonic.reference.ops import accumulate_dtype
from sonic.routing.types import Routing

SCORES = ("softmax_topk", "topk_softmax")


def check_router_args(logits, k) -> None:
    check_float("logits", logits, ndim=2)
    check_int("k", k, low=1, high=max(logits.shape[1], 1))


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``(T, k)`` int64 indices of each row's ``k`` largest logits, in descending order.

    A stable descending sort, so among equal logits the lower expert index comes first — the
    order the bitonic top-K kernel produces (DESIGN §4) — and results are deterministic.
    """
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]


def token_major_pairs(num_tokens: int, k: int, device) -> torch.Tensor:
    """``(T·k,)`` int32 token index of each pair when pair ``t·k + j`` is token t's j-th choice."""
    return torch.arange(num_tokens, dtype=torch.int32, device=device).repeat_interleave(k)


def topk_routing(logits: torch.Tensor, k: int, *, score: str = "softmax_topk",
                 renormalize: bool = False) -> Routing:
    """Top-K token choice: every token picks the K experts with the largest logits.

    Args:
        logits: ``(T, E)`` float router logits (any float dtype; scores are computed in fp32).
        k: experts per token, ``1 <= k <= E``.
        score: ``"softmax_topk"`` — softmax over the K selected logits (sums to 1), or
            ``"topk_softmax"`` — the K largest entries of the softmax over all E experts.
        renormalize: with ``"topk_softmax"``, divide the K scores by their sum.

    Returns:
        A :class:`Routing` with ``P = T·k`` pairs in token-major order (pair ``t·k + j`` is token
        ``t``'s ``j``-th choice, experts by descending logit, the lower index first on ties);
        scores are fp32 (fp64 for fp64 logits) and differentiable with respect to ``logits``.

    Raises:
        TypeError / ValueError: ``logits`` not a 2-D float tensor, ``k`` outside ``[1, E]``,
            unknown ``score``.
    """
    check_router_args(logits, k)
    check_choice("score", score, SCORES)
    num_tokens, num_experts = logits.shape
    logits32 = logits.to(accumulate_dtype(logits.dtype))
    idx = topk_indices(logits32, k)
    if score == "softmax_topk":
        scores = torch.softmax(logits32.gather(1, idx), dim=-1)
    else:
        scores = torch.softmax(logits32, dim=-1).gather(1, idx)
        if renormalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
    return Routing(
        token_idx=token_major_pairs(num_tokens, k, logits.device),
        expert_idx=idx.flatten().to(torch.int32),
        scores=scores.flatten(),
        num_tokens=num_tokens,
        num_experts=num_experts,
    )
