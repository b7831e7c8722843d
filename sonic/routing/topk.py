"""Top-K token-choice routing (docs/design.md §2; SonicMoE paper §2, kernel §4.3)."""

from __future__ import annotations

from typing import get_args

import torch

from sonic._validation import check_bool, check_choice, check_float, check_int
from sonic.reference.ops import accumulate_dtype
from sonic.routing.types import Routing
from sonic.types import Backend, Score

SCORES: tuple[Score, ...] = get_args(Score)


def check_router_args(logits, k) -> None:
    check_float("logits", logits, ndim=2)
    check_int("k", k, low=1, high=max(logits.shape[1], 1))


def token_major_pairs(num_tokens: int, k: int, device) -> torch.Tensor:
    """``(T·k,)`` int32 token index of each pair when pair ``t·k + j`` is token t's j-th choice."""
    return torch.arange(num_tokens, dtype=torch.int32, device=device).repeat_interleave(k)


def topk_routing(logits: torch.Tensor, k: int, *, score: Score = "softmax_topk",
                 renormalize: bool = False, backend: Backend = "auto") -> Routing:
    """Top-K token choice: every token picks the K experts with the largest logits.

    Args:
        logits: ``(T, E)`` float router logits.
        k: experts per token, ``1 <= k <= E``.
        score: ``"softmax_topk"`` — softmax over the K selected logits (sums to 1), or
            ``"topk_softmax"`` — the K largest entries of the softmax over all E experts.
        renormalize: with ``"topk_softmax"``, divide the K scores by their sum (a ``bool``).
        backend: ``"auto"`` runs the bitonic top-K kernel (paper §4.3) on a supported GPU for
            bf16/fp32 logits with ``E <= 512`` and ``k <= 16``, a stable sort otherwise;
            ``"torch"`` always the stable sort; ``"cute"`` requires a supported GPU.

    Returns:
        A :class:`Routing` with ``P = T·k`` pairs in token-major order (pair ``t·k + j`` is token
        ``t``'s ``j``-th choice, experts by descending logit, the lower index first on ties);
        scores are fp32 (fp64 for fp64 logits) and differentiable with respect to ``logits``.
        The kernel orders fp32 logits by value with the lowest ``log2(E)`` mantissa bits
        cleared (ties within that go to the lower index); bf16 logits are ordered exactly.

    Raises:
        TypeError / ValueError: ``logits`` not a 2-D float tensor, ``k`` outside ``[1, E]``,
            ``renormalize`` not a bool, unknown ``score`` or ``backend``.
    """
    import sonic.ops
    from sonic.backend import BACKENDS, resolve_backend

    check_router_args(logits, k)
    check_choice("score", score, SCORES)
    check_bool("renormalize", renormalize)
    check_choice("backend", backend, BACKENDS)
    if not torch.compiler.is_compiling():
        resolve_backend(backend, logits.device)   # backend="cute" that cannot run fails here
    num_tokens, num_experts = logits.shape
    # The op topk_routing: the bitonic kernel where it serves the call, a stable sort
    # otherwise; backward (twice differentiable) registered with the op.
    scores, idx = sonic.ops.call.topk_routing(logits, k, score, renormalize, backend)
    return Routing(
        token_idx=token_major_pairs(num_tokens, k, logits.device),
        expert_idx=idx.flatten(),
        scores=scores.flatten(),
        num_tokens=num_tokens,
        num_experts=num_experts,
        top_k=k,
        validated=True,
    )
