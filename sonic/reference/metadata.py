"""PyTorch reference of the routing metadata ("index shuffling", docs/design.md §2, MetaShuffling).

The test oracle of the CuTe routing-metadata kernels and the fallback of
:func:`sonic.routing_metadata`. Runs on any device PyTorch supports, without a device→host
synchronisation.
"""

from __future__ import annotations

import torch

from sonic.types import RoutingMetadata


def _counts_and_offsets(idx: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of ``idx`` values in ``[0, bins)`` and their exclusive prefix sum; a value
    ``bins`` (padding) is counted in neither."""
    # scatter_add_ rather than bincount: CUDA bincount reads the maximum back to the host.
    counts = torch.zeros(bins + 1, dtype=torch.int32, device=idx.device)
    counts.scatter_add_(0, idx.long(), torch.ones_like(idx, dtype=torch.int32))
    counts = counts[:bins]
    offsets = torch.zeros(bins + 1, dtype=torch.int32, device=idx.device)
    torch.cumsum(counts, 0, dtype=torch.int32, out=offsets[1:])
    return counts, offsets


def pairs_metadata(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int,
                   num_experts: int, *, top_k: int | None = None) -> RoutingMetadata:
    """:func:`sonic.routing_metadata` on raw pair tensors (PyTorch reference implementation).

    Args:
        token_idx: ``(P,)`` int32/int64 in ``[0, num_tokens)``.
        expert_idx: ``(P,)`` int32/int64 in ``[0, num_experts]``: ``num_experts`` marks a
            padding pair (:attr:`sonic.Routing.num_valid`), which gets a row after
            ``expert_offsets[E]`` and belongs to no token (``token_offsets[T]`` counts only
            routed pairs).
        top_k: ``K`` if the pairs are token-major top-K choices (see :attr:`sonic.Routing.top_k`):
            the per-token grouping is then the pair order itself and needs no sort.
    """
    num_pairs = token_idx.numel()
    device = token_idx.device
    expert_counts, expert_offsets = _counts_and_offsets(expert_idx, num_experts)
    sorted_pairs = torch.argsort(expert_idx, stable=True)
    rows = torch.arange(num_pairs, dtype=torch.int32, device=device)
    pair_rows = torch.empty_like(rows).scatter_(0, sorted_pairs, rows)
    if top_k is None:
        # Padding pairs count as token T: they sort after every token's rows.
        owner = torch.where(expert_idx < num_experts, token_idx, num_tokens)
        _, token_offsets = _counts_and_offsets(owner, num_tokens)
        token_rows = pair_rows[torch.argsort(owner, stable=True)]
    else:
        token_offsets = torch.arange(0, num_tokens * top_k + 1, top_k, dtype=torch.int32,
                                     device=device)
        token_rows = pair_rows
    return RoutingMetadata(
        expert_counts=expert_counts,
        expert_offsets=expert_offsets,
        sorted_pairs=sorted_pairs.to(torch.int32),
        gather_idx=token_idx[sorted_pairs].to(torch.int32),
        pair_rows=pair_rows,
        token_offsets=token_offsets,
        token_rows=token_rows,
        num_tokens=num_tokens,
        num_experts=num_experts,
    )
