"""The `Routing` container: routed (token, expert) pairs with their scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonic._validation import (check_bool, check_float, check_index, check_int,
                               check_same_device)


@dataclass(frozen=True)
class Routing:
    """Routed (token, expert) pairs produced by a router (docs/design.md §2).

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
        num_valid: ``None`` when every pair is routed. Otherwise a 0-d integer tensor on the
            pairs' device: the routing is *padded* to a capacity known without looking at the
            values (token rounding built with ``padded=True``), its first ``num_valid`` pairs
            are the routed ones and the rest are inert padding — expert ``num_experts`` (a
            sentinel that sorts after every expert), token 0, score 0 — which
            :func:`sonic.routing_metadata` gives rows after ``expert_offsets[E]``, so no GEMM,
            aggregation or count sees them. :meth:`trim` drops the padding (one host read).

    Pairs may come in any order; a token may have 0..E pairs and an expert 0..T.
    ``P = T·K`` for top-K token choice and data-dependent for token rounding.

    Construction checks what needs no look at the values (no device→host synchronisation):
    types, dtypes, shapes, devices, and ``P == num_tokens·top_k`` when ``top_k`` is set. Index
    values (ranges, and the token-major order that ``top_k`` promises) are checked by
    :func:`sonic.routing_metadata` for ``validated=False`` routings, in one host read.

    Raises:
        TypeError: a field of the wrong type or dtype (indices must be int32/int64, scores
            floating point, sizes ints, ``validated`` a bool).
        ValueError: tensors that are not 1-D of one length ``P`` on one device, negative sizes,
            ``top_k`` with ``P != num_tokens·top_k``, or ``num_valid`` that is not a 0-d
            integer tensor on the pairs' device, or is given with ``top_k`` or without
            ``validated`` (only sonic's routers build padded routings).
    """

    token_idx: torch.Tensor
    expert_idx: torch.Tensor
    scores: torch.Tensor
    num_tokens: int
    num_experts: int
    top_k: int | None = None
    validated: bool = False
    num_valid: torch.Tensor | None = None

    def __post_init__(self):
        check_index("token_idx", self.token_idx)
        check_index("expert_idx", self.expert_idx)
        check_float("scores", self.scores, ndim=1)
        check_same_device(token_idx=self.token_idx, expert_idx=self.expert_idx,
                          scores=self.scores)
        num_pairs = self.token_idx.shape[0]
        for name in ("expert_idx", "scores"):
            if getattr(self, name).shape[0] != num_pairs:
                raise ValueError(f"{name} must have shape (P={num_pairs},) like token_idx, got "
                                 f"{tuple(getattr(self, name).shape)}")
        check_int("num_tokens", self.num_tokens, low=0)
        check_int("num_experts", self.num_experts, low=0)
        check_bool("validated", self.validated)
        if self.top_k is not None:
            check_int("top_k", self.top_k, low=1)
            if num_pairs != self.num_tokens * self.top_k:
                raise ValueError(
                    f"top_k={self.top_k} promises P = num_tokens·top_k = "
                    f"{self.num_tokens * self.top_k} token-major pairs, got P={num_pairs}; "
                    "use top_k=None for pairs in any other layout")
        if self.num_valid is not None:
            check_index("num_valid", self.num_valid, ndim=0)
            check_same_device(token_idx=self.token_idx, num_valid=self.num_valid)
            if self.top_k is not None or not self.validated:
                raise ValueError("num_valid (a padded routing) needs top_k=None and "
                                 "validated=True: only sonic's routers build padded routings")

    @property
    def num_pairs(self) -> int:
        """``P``, the length of the pair tensors: the number of routed pairs, or for a padded
        routing (``num_valid`` set) the capacity, an upper bound on it (see :meth:`trim`)."""
        return self.token_idx.numel()

    def trim(self) -> "Routing":
        """This routing without its padding: ``self`` when ``num_valid`` is ``None``, else the
        first ``num_valid`` pairs (views; the scores keep their graph to the logits). Reads
        ``num_valid`` back to the host: a device→host synchronisation."""
        if self.num_valid is None:
            return self
        count = int(self.num_valid)
        return Routing(self.token_idx[:count], self.expert_idx[:count], self.scores[:count],
                       self.num_tokens, self.num_experts, validated=True)
