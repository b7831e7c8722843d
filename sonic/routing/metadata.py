"""Routing metadata ("index shuffling"): counts, offsets and permutations of routed pairs.

DESIGN §2; MetaShuffling (PyTorch blog, 2025). Everything is built on the pairs' device without
a device→host synchronisation (pairs from sonic's routers; hand-built ones are range-checked by
one host read first), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonic._validation import check_choice, check_range, read_min_max
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
        expert_offsets: ``(E+1,)`` — exclusive prefix sum of ``expert_counts``; ``[E] == P``,
            the routed pairs (for a padded routing less than the rows: the padding rows follow).
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
    packed: torch.Tensor | None = None
    top_k: int | None = None

    @property
    def num_pairs(self) -> int:
        """``P``, the number of routed pairs (rows)."""
        return self.sorted_pairs.numel()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The index tensors, in field order (for ``ctx.save_for_backward``)."""
        return (self.expert_counts, self.expert_offsets, self.sorted_pairs, self.gather_idx,
                self.pair_rows, self.token_offsets, self.token_rows)

    @classmethod
    def from_tensors(cls, tensors, num_tokens: int, num_experts: int, *,
                     packed: torch.Tensor | None = None,
                     top_k: int | None = None) -> "RoutingMetadata":
        """Inverse of :meth:`tensors`. ``packed``: the one int32 buffer the fields are views of,
        when they are (``torch.ops.sonic.routing_metadata`` returns it; ``top_k`` says whether
        it leaves out ``token_rows``, see :func:`sonic.ops.pack_metadata`)."""
        return cls(*tensors, num_tokens=num_tokens, num_experts=num_experts, packed=packed,
                   top_k=top_k)


def routing_metadata(routing: Routing, *, backend: str = "auto") -> RoutingMetadata:
    """Group a routing's pairs by expert and by token (DESIGN §2, MetaShuffling).

    Args:
        routing: the pairs; ``token_idx``/``expert_idx`` int32 or int64. A padded routing's
            padding pairs (see :attr:`Routing.num_valid`) get the rows after
            ``expert_offsets[E]`` (the true ``P``) and no place in ``token_offsets`` /
            ``token_rows``, so the GEMMs and the aggregation never touch them.
        backend: ``"auto"`` uses the CuTe index-shuffling kernel on a supported GPU and the
            PyTorch reference (:func:`pairs_metadata`) elsewhere; ``"torch"`` or ``"cute"``.

    Returns:
        A :class:`RoutingMetadata` on the routing's device (built by the custom op
        ``torch.ops.sonic.routing_metadata``; its fields are views of one int32 buffer),
        deterministic (stable order within
        each expert). Built without a device→host synchronisation when ``routing.validated``
        (sonic's routers); otherwise the index ranges, and with ``top_k`` the token-major
        order, are checked first, in one host read. A ``validated`` routing is trusted: its
        values are not read, so that the GPU fast path stays free of synchronisation.

    Raises:
        ValueError: an index outside ``[0, T)`` / ``[0, E)``, or a ``top_k`` routing whose
            pairs are not token-major (pair ``t·K + j`` must belong to token ``t``).
    """
    from sonic.backend import BACKENDS, resolve_backend
    from sonic.ops import routing_metadata_op

    if not routing.validated:
        _check_hand_built(routing)
    check_choice("backend", backend, BACKENDS)
    if not torch.compiler.is_compiling():
        # backend="cute" where the kernels cannot run fails here, before the op.
        resolve_backend(backend, routing.token_idx.device)
    return routing_metadata_op(routing.token_idx, routing.expert_idx, routing.num_tokens,
                               routing.num_experts, routing.top_k, backend)


def _check_hand_built(routing: Routing) -> None:
    tensors = [routing.token_idx, routing.expert_idx]
    if routing.top_k is not None:
        # Zero everywhere exactly when pair p belongs to token p // top_k.
        pair_token = torch.arange(routing.num_pairs, device=routing.token_idx.device) // routing.top_k
        tensors.append(routing.token_idx.long() - pair_token)
    token_bound, expert_bound, *layout = read_min_max(*tensors)
    check_range("token_idx", token_bound, routing.num_tokens)
    check_range("expert_idx", expert_bound, routing.num_experts)
    if layout and layout[0] is not None and layout[0] != (0, 0):
        raise ValueError(f"Routing with top_k={routing.top_k} needs token-major pairs (pair "
                         f"t·top_k + j belongs to token t), but token_idx does not follow "
                         f"that order; use top_k=None for pairs in any order")


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
    """:func:`routing_metadata` on raw pair tensors (PyTorch reference implementation).

    Args:
        token_idx: ``(P,)`` int32/int64 in ``[0, num_tokens)``.
        expert_idx: ``(P,)`` int32/int64 in ``[0, num_experts]``: ``num_experts`` marks a
            padding pair (:attr:`Routing.num_valid`), which gets a row after
            ``expert_offsets[E]`` and belongs to no token (``token_offsets[T]`` counts only
            routed pairs).
        top_k: ``K`` if the pairs are token-major top-K choices (see :attr:`Routing.top_k`):
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
