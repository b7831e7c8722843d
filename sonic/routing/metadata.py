"""Routing metadata ("index shuffling"): counts, offsets and permutations of routed pairs.

DESIGN §2; MetaShuffling (PyTorch blog, 2025). Everything is built on the pairs' device without
a device→host synchronisation, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonic.routing.types import Routing


@dataclass(frozen=True)
class RoutingMetadata:
    """Where every routed pair lives once pairs are grouped by expert.

    "Rows" are positions in the expert-sorted order: the rows of expert ``e`` are
    ``expert_offsets[e]:expert_offsets[e+1]``, and within an expert rows keep the pairs' order
    (a stable sort), so the metadata is deterministic. All index tensors are int32 on the
    routing's device.

    Attributes:
        expert_counts: ``(E,)`` — pairs routed to each expert.
        expert_offsets: ``(E+1,)`` — exclusive prefix sum of ``expert_counts``; ``[E] == P``.
        sorted_pairs: ``(P,)`` — the pair index of each row.
        gather_idx: ``(P,)`` — the source token of each row (``token_idx[sorted_pairs]``);
            the gather index of the varlen-M GEMMs.
        pair_rows: ``(P,)`` — the row of each pair (inverse permutation of ``sorted_pairs``).
        token_offsets: ``(T+1,)`` — exclusive prefix sum of pairs per token.
        token_rows: ``(P,)`` — rows grouped by token: the rows of token ``t`` are
            ``token_rows[token_offsets[t]:token_offsets[t+1]]``, in pair order. The index of the
            per-token gather-sum (expert aggregation).
        num_tokens: ``T``.
        num_experts: ``E``.
    """

    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    sorted_pairs: torch.Tensor
    gather_idx: torch.Tensor
    pair_rows: torch.Tensor
    token_offsets: torch.Tensor
    token_rows: torch.Tensor
    num_tokens: int
    num_experts: int

    @property
    def num_pairs(self) -> int:
        """``P``, the number of routed pairs (rows)."""
        return self.sorted_pairs.numel()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The index tensors, in field order (for ``ctx.save_for_backward``)."""
        return (self.expert_counts, self.expert_offsets, self.sorted_pairs, self.gather_idx,
                self.pair_rows, self.token_offsets, self.token_rows)

    @classmethod
    def from_tensors(cls, tensors, num_tokens: int, num_experts: int) -> "RoutingMetadata":
        """Inverse of :meth:`tensors`."""
        return cls(*tensors, num_tokens=num_tokens, num_experts=num_experts)
