"""Routing metadata ("index shuffling"): counts, offsets and permutations of routed pairs.

docs/design.md §2; MetaShuffling (PyTorch blog, 2025). Everything is built on the pairs' device without
a device→host synchronisation (pairs from sonic's routers; hand-built ones are range-checked by
one host read first), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from sonic._validation import check_choice, check_range, read_min_max
# RoutingMetadata and the reference pairs_metadata live in the leaf sonic.types and in
# sonic.reference; re-exported here, their public path.
from sonic.reference.metadata import pairs_metadata
from sonic.routing.types import Routing
from sonic.types import Backend, RoutingMetadata

__all__ = ["RoutingMetadata", "pairs_metadata", "routing_metadata"]


def routing_metadata(routing: Routing, *, backend: Backend = "auto") -> RoutingMetadata:
    """Group a routing's pairs by expert and by token (docs/design.md §2, MetaShuffling).

    Args:
        routing: the pairs; ``token_idx``/``expert_idx`` int32 or int64. A padded routing's
            padding pairs (see :attr:`Routing.num_valid`) get the rows after
            ``expert_offsets[E]`` (the true ``P``) and no place in ``token_offsets`` /
            ``token_rows``, so the GEMMs and the aggregation never touch them.
        backend: ``"auto"`` uses the CuTe index-shuffling kernel on a supported GPU and the
            PyTorch reference (:func:`sonic.reference.metadata.pairs_metadata`) elsewhere; ``"torch"`` or ``"cute"``.

    Returns:
        A :class:`RoutingMetadata` on the routing's device (built by the custom op
        ``torch.ops.sonic.routing_metadata``; its fields are views of one int32 buffer),
        deterministic (stable order within
        each expert). Built without a device→host synchronisation when ``routing.validated``
        (sonic's routers); otherwise the index ranges, and with ``top_k`` the token-major
        order, are checked first, in one host read. A ``validated`` routing on a GPU is
        trusted: its values are not read, so that the fast path stays free of
        synchronisation (on the CPU they are checked, which costs no synchronisation).

    Raises:
        TypeError: ``routing`` is not a :class:`Routing` (e.g. a tuple of index tensors).
        ValueError: an index outside ``[0, T)`` / ``[0, E)``, or a ``top_k`` routing whose
            pairs are not token-major (pair ``t·K + j`` must belong to token ``t``); on the
            CPU, where reading values is free, also for a ``validated`` routing.
    """
    from sonic.backend import BACKENDS, resolve_backend
    from sonic.ops import routing_metadata_op

    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a sonic.Routing, got {type(routing).__name__}"
                        + ("; wrap the pairs: sonic.Routing(token_idx, expert_idx, scores, "
                           "num_tokens, num_experts)" if isinstance(routing, (tuple, list))
                           else ""))
    if not routing.validated:
        _check_hand_built(routing)
    elif routing.token_idx.device.type == "cpu" and not torch.compiler.is_compiling():
        # Reading CPU values costs no device synchronisation: a validated routing's promise is
        # checked where it is free, so a wrong one raises here instead of in an index op.
        _check_hand_built(routing, validated=True)
    check_choice("backend", backend, BACKENDS)
    if not torch.compiler.is_compiling():
        # backend="cute" where the kernels cannot run fails here, before the op.
        resolve_backend(backend, routing.token_idx.device)
    return routing_metadata_op(routing.token_idx, routing.expert_idx, routing.num_tokens,
                               routing.num_experts, routing.top_k, backend)


def _check_hand_built(routing: Routing, validated: bool = False) -> None:
    """Check the index values (one host read): in range (a padded routing's padding, expert
    ``E``, included) and, with ``top_k``, token-major."""
    tensors = [routing.token_idx, routing.expert_idx]
    if routing.top_k is not None:
        # Zero everywhere exactly when pair p belongs to token p // top_k.
        pair_token = torch.arange(routing.num_pairs, device=routing.token_idx.device) // routing.top_k
        tensors.append(routing.token_idx.long() - pair_token)
    token_bound, expert_bound, *layout = read_min_max(*tensors)
    padded = routing.num_valid is not None
    try:
        check_range("token_idx", token_bound, max(routing.num_tokens, 1) if padded
                    else routing.num_tokens)
        check_range("expert_idx", expert_bound, routing.num_experts + padded)
    except ValueError as err:
        if validated:
            raise ValueError(f"routing has validated=True, which promises indices a sonic "
                             f"router built, but {err}; leave validated=False for pairs built "
                             f"by hand") from err
        raise
    if layout and layout[0] is not None and layout[0] != (0, 0):
        raise ValueError(f"Routing with top_k={routing.top_k} needs token-major pairs (pair "
                         f"t·top_k + j belongs to token t), but token_idx does not follow "
                         f"that order; use top_k=None for pairs in any order")
