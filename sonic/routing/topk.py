"""Top-K token-choice routing (docs/design.md §2; SonicMoE paper §2, kernel §4.3)."""

from __future__ import annotations

import math
from numbers import Real
from typing import get_args

import torch

from sonic._validation import check_bool, check_choice, check_float, check_int, check_same_device
# The torch selection lives in sonic.reference.ops (sonic.ops may import it, not this module);
# the losses and token rounding import affinity_scores and group_limited_choice from here.
from sonic.reference.ops import affinity_scores, group_limited_choice, scored_topk  # noqa: F401
from sonic.routing.types import Routing
from sonic.types import Backend, Score

SCORES: tuple[Score, ...] = get_args(Score)
# Scores the fused top-K op computes without a bias or groups; it computes sigmoid with both.
_KERNEL_SCORES = ("softmax_topk", "topk_softmax")


def check_router_args(logits, k) -> None:
    check_float("logits", logits, ndim=2)
    check_int("k", k, low=1, high=max(logits.shape[1], 1))


def check_positive(name: str, value) -> None:
    """Raise unless ``value`` is a finite real number ``> 0`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and float(value) > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")


def token_major_pairs(num_tokens: int, k: int, device) -> torch.Tensor:
    """``(T·k,)`` int32 token index of each pair when pair ``t·k + j`` is token t's j-th choice."""
    return torch.arange(num_tokens, dtype=torch.int32, device=device).repeat_interleave(k)


def check_group_args(num_experts: int, k: int, n_group: int, topk_group: int | None) -> int:
    """Check group-limited routing's arguments; returns ``topk_group`` (``n_group`` for None).

    Raises:
        TypeError / ValueError: ``n_group`` not an int dividing ``E``, ``topk_group`` outside
            ``[1, n_group]``, or ``k`` larger than the ``topk_group·E/n_group`` experts a token
            may choose among.
    """
    check_int("n_group", n_group, low=1, high=num_experts)
    if num_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide num_experts={num_experts}")
    topk_group = n_group if topk_group is None else topk_group
    check_int("topk_group", topk_group, low=1, high=n_group)
    allowed = topk_group * (num_experts // n_group)
    if k > allowed:
        raise ValueError(f"top_k={k} is more than the topk_group·E/n_group = {topk_group}·"
                         f"{num_experts // n_group} = {allowed} experts a token may choose among")
    return topk_group


def check_scoring(logits, k, score, renormalize, expert_bias, n_group, topk_group,
                  scaling_factor) -> int:
    """Raise what :func:`topk_routing` raises for its logits, ``k`` and scoring options (see
    there); returns the resolved ``topk_group``."""
    check_router_args(logits, k)
    check_choice("score", score, SCORES)
    check_bool("renormalize", renormalize)
    num_experts = logits.shape[1]
    topk_group = check_group_args(num_experts, k, n_group, topk_group)
    if not torch.compiler.is_compiling():     # a traced float may be symbolic
        check_positive("scaling_factor", scaling_factor)
    if expert_bias is not None:
        check_float("expert_bias", expert_bias, ndim=1)
        check_same_device(logits=logits, expert_bias=expert_bias)
        if expert_bias.shape[0] != num_experts:
            raise ValueError(f"expert_bias must have shape (E={num_experts},), got "
                             f"{tuple(expert_bias.shape)}")
    return topk_group


def topk_routing(logits: torch.Tensor, k: int, *, score: Score = "softmax_topk",
                 renormalize: bool = False, backend: Backend = "auto",
                 expert_bias: torch.Tensor | None = None, n_group: int = 1,
                 topk_group: int | None = None, scaling_factor: float = 1.0) -> Routing:
    """Top-K token choice: every token picks the K experts with the largest logits.

    Args:
        logits: ``(T, E)`` float router logits.
        k: experts per token, ``1 <= k <= E``.
        score: ``"softmax_topk"`` — softmax over the K selected logits (sums to 1),
            ``"topk_softmax"`` — the K largest entries of the softmax over all E experts, or
            ``"sigmoid"`` — the K largest of ``sigmoid(logits)`` (DeepSeek-V3 §2.1.2).
        renormalize: with ``"topk_softmax"`` or ``"sigmoid"``, divide the K scores by their
            sum (a ``bool``; DeepSeek-V3 renormalises its sigmoid scores).
        backend: ``"auto"`` runs the bitonic top-K kernel (paper §4.3) on a supported GPU for
            bf16/fp32 logits with ``E <= 512`` and ``k <= 16``, a stable sort otherwise;
            ``"torch"`` always the stable sort; ``"cute"`` requires a supported GPU. The
            kernel serves the softmax scores without ``expert_bias`` and groups, and sigmoid
            scores with or without both (groups whose size is a multiple of the lanes sharing
            a row, see :func:`sonic.kernels.topk.kernel_fits`; others and softmax with a bias
            or groups run in torch on the logits' device, with no host read). Either way the
            pairs feed the same metadata path.
        expert_bias: optional ``(E,)`` float per-expert bias added to the affinities ``s``
            (softmax or sigmoid of the logits) for the selection only; the scores stay the
            unbiased ones (aux-loss-free balancing, DeepSeek-V3 §2.1.2). Not differentiated.
        n_group: experts form ``n_group`` groups of ``E/n_group`` consecutive experts
            (group-limited routing); ``1`` (default) disables it.
        topk_group: each token chooses its ``k`` experts within its ``topk_group`` best groups
            (see :func:`group_limited_choice`); ``None`` means ``n_group``.
        scaling_factor: a finite float ``> 0`` multiplying every score after renormalisation
            (DeepSeek-V3's ``routed_scaling_factor``).

    Returns:
        A :class:`Routing` with ``P = T·k`` pairs in token-major order (pair ``t·k + j`` is token
        ``t``'s ``j``-th choice, experts by descending logit, the lower index first on ties);
        scores are fp32 (fp64 for fp64 logits) and differentiable with respect to ``logits``.
        The kernel orders fp32 logits by value with the lowest ``log2(E)`` mantissa bits
        cleared (ties within that go to the lower index); bf16 logits are ordered exactly.

    Raises:
        TypeError / ValueError: ``logits`` not a 2-D float tensor, ``k`` outside ``[1, E]``,
            ``renormalize`` not a bool, unknown ``score`` or ``backend``, an ``expert_bias``
            that is not an ``(E,)`` float tensor on the logits' device, bad group arguments
            (:func:`check_group_args`), ``scaling_factor`` not finite and positive.
    """
    scores, idx = token_choice(logits, k, score=score, renormalize=renormalize,
                               backend=backend, expert_bias=expert_bias, n_group=n_group,
                               topk_group=topk_group, scaling_factor=scaling_factor)
    num_tokens, num_experts = logits.shape
    return Routing(
        token_idx=token_major_pairs(num_tokens, k, logits.device),
        expert_idx=idx.flatten(),
        scores=scores.flatten(),
        num_tokens=num_tokens,
        num_experts=num_experts,
        top_k=k,
        validated=True,
    )


def token_choice(logits: torch.Tensor, k: int, *, score: Score, renormalize: bool,
                 backend: Backend, expert_bias: torch.Tensor | None, n_group: int,
                 topk_group: int | None, scaling_factor: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_routing`'s selection without the :class:`Routing` around it: ``(scores,
    experts)``, both ``(T, k)`` (row ``t`` is token ``t``'s choices, experts by descending
    logit), scores fp32 (fp64 for fp64 logits) and differentiable, experts int32. Checks and
    raises as :func:`topk_routing` does; token rounding starts from it."""
    import sonic.ops
    from sonic.backend import BACKENDS, resolve_backend

    topk_group = check_scoring(logits, k, score, renormalize, expert_bias, n_group, topk_group,
                               scaling_factor)
    check_choice("backend", backend, BACKENDS)
    if not torch.compiler.is_compiling():
        resolve_backend(backend, logits.device)   # backend="cute" that cannot run fails here
    if score in _KERNEL_SCORES and expert_bias is None and n_group == 1:
        # The op topk_routing: the bitonic kernel where it serves the call, a stable sort
        # otherwise; backward (twice differentiable) registered with the op.
        scores, idx = sonic.ops.call.topk_routing(logits, k, score, renormalize, backend)
    elif score == "sigmoid" and backend != "torch" and logits.device.type == "cuda":
        # The same op with the kernel's sigmoid options; off CUDA (or with backend="torch")
        # the torch selection keeps plain autograd (and torch.func transforms).
        scores, idx = sonic.ops.call.topk_routing(logits, k, score, renormalize, backend,
                                                  expert_bias, n_group, topk_group)
    else:
        scores, idx = scored_topk(logits, k, score, renormalize, expert_bias, n_group,
                                  topk_group)
    return scaled(scores, scaling_factor), idx


def scaled(scores: torch.Tensor, scaling_factor: float) -> torch.Tensor:
    """``scores · scaling_factor``; eagerly ``scores`` itself for a factor of 1 (no kernel,
    no autograd node: host time in a host-bound step). Traced, always the product: a layer's
    factor may be a symbolic float under torch.compile, which a comparison would specialise
    at the cost of a second trace."""
    if torch.compiler.is_compiling() or scaling_factor != 1.0:
        return scores * scaling_factor
    return scores
