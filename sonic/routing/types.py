"""The `Routing` container: routed (token, expert) pairs with their scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Routed (token, expert) pairs produced by a router (DESIGN §2).

    Attributes:
        token_idx: ``(P,)`` int32 — source token of each pair, in ``[0, num_tokens)``.
        expert_idx: ``(P,)`` int32 — expert of each pair, in ``[0, num_experts)``.
        scores: ``(P,)`` float32 (float64 for float64 logits) — gate weight ``s_{t,e}`` of each pair; differentiable with
            respect to the router logits it came from.
        num_tokens: ``T``, the number of tokens routed.
        num_experts: ``E``, the number of experts.
        top_k: ``K`` when the pairs are top-K token choices in token-major order (pair
            ``t·K + j`` is token t's j-th expert), which lets :func:`sonic.routing_metadata` take
            its faster top-K path; ``None`` for arbitrary pairs (token rounding).
        validated: ``True`` when the indices are known to be in range because a sonic router
            built them; :func:`sonic.routing_metadata` then skips its range check, a
            device→host read. Leave it ``False`` for pairs built by hand.

    Pairs may come in any order; a token may have 0..E pairs and an expert 0..T.
    ``P = T·K`` for top-K token choice and data-dependent for token rounding.
    """

    token_idx: torch.Tensor
    expert_idx: torch.Tensor
    scores: torch.Tensor
    num_tokens: int
    num_experts: int
    top_k: int | None = None
    validated: bool = False

    @property
    def num_pairs(self) -> int:
        """``P``, the number of routed pairs."""
        return self.token_idx.numel()
