"""Router auxiliary losses beside the load-balancing loss: DeepSeek-V3's sequence-wise balance
loss and ST-MoE's router z-loss, and the per-expert load that aux-loss-free balancing reads."""

from __future__ import annotations

import torch

from sonic._validation import check_float, check_int
from sonic.reference.ops import accumulate_dtype
from sonic.routing.topk import SCORES, affinity_scores
from sonic.routing.types import Routing


def expert_load(routing: Routing) -> torch.Tensor:
    """``(E,)`` fp32 number of pairs routed to each expert (a padded routing's padding left
    out), counted on the device with one ``scatter_add`` and no host read."""
    counts = torch.zeros(routing.num_experts + 1, dtype=torch.float32,
                         device=routing.expert_idx.device)
    counts.scatter_add_(0, routing.expert_idx.long(),
                        counts.new_ones(1).expand(routing.expert_idx.shape[0]))
    return counts[:routing.num_experts]


def sequence_balance_loss(logits: torch.Tensor, routing: Routing, seq_len: int, *,
                          score: str = "sigmoid", top_k: int | None = None) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (§2.1.2, eqs. 17–20), without α.

    The tokens form sequences of ``seq_len`` consecutive tokens; per sequence of ``S`` tokens,
    ``f_i = E / (K·S) · #{t : (t, i) routed}``, ``P_i = 1/S · Σ_t s'_{i,t}`` with
    ``s'_{i,t} = s_{i,t} / Σ_j s_{j,t}`` the normalised affinities, and the loss is
    ``Σ_i f_i·P_i``; this returns its mean over the sequences (1 for perfectly uniform
    routing). ``f`` is a count (not differentiated), ``P`` carries the gradient.

    Args:
        logits: ``(T, E)`` float router logits; ``T`` a multiple of ``seq_len``.
        routing: the :class:`Routing` of those tokens (padding of a padded routing ignored).
        seq_len: ``S >= 1``, tokens per sequence.
        score: how the affinities ``s`` are made from the logits, as in
            :func:`sonic.topk_routing` (``"sigmoid"``: ``sigmoid(logits)``; otherwise softmax).
        top_k: ``K``; ``None`` takes ``routing.top_k`` (required for other routings).

    Returns:
        A 0-d tensor in fp32 (fp64 for fp64 logits), differentiable w.r.t. ``logits``; 0 for
        an empty batch.

    Raises:
        TypeError / ValueError: ``logits`` not 2-D float, ``(T, E)`` unlike the routing's,
            ``seq_len`` not a positive int dividing ``T``, unknown ``score``, no ``top_k``.
    """
    check_float("logits", logits, ndim=2)
    check_int("seq_len", seq_len, low=1)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    num_tokens, num_experts = logits.shape
    _check_routing(logits, routing)
    if num_tokens % seq_len:
        raise ValueError(f"seq_len={seq_len} must divide the number of tokens T={num_tokens}")
    top_k = routing.top_k if top_k is None else top_k
    if top_k is None:
        raise ValueError("top_k is needed for a routing that is not top-K (routing.top_k None)")
    check_int("top_k", top_k, low=1, high=num_experts)
    acc = accumulate_dtype(logits.dtype)
    if num_tokens == 0:
        return logits.sum().to(acc) * 0
    num_seqs = num_tokens // seq_len
    affinity = affinity_scores(logits, score)
    normalised = affinity / affinity.sum(dim=-1, keepdim=True)
    mean_prob = normalised.view(num_seqs, seq_len, num_experts).mean(dim=1)
    # Bin (sequence, expert); a padding pair's expert E falls in its sequence's spare bin.
    bins = (routing.token_idx.long() // seq_len) * (num_experts + 1) + routing.expert_idx.long()
    counts = torch.zeros(num_seqs * (num_experts + 1), dtype=acc, device=logits.device)
    counts.scatter_add_(0, bins, counts.new_ones(1).expand(bins.shape[0]))
    counts = counts.view(num_seqs, num_experts + 1)[:, :num_experts]
    fraction = counts * (num_experts / (top_k * seq_len))
    return (fraction * mean_prob).sum(dim=-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): ``1/T · Σ_t (log Σ_j e^{x_{t,j}})²``.

    Args:
        logits: ``(T, E)`` float router logits.

    Returns:
        A 0-d tensor in fp32 (fp64 for fp64 logits), differentiable; 0 for ``T = 0``.

    Raises:
        TypeError / ValueError: ``logits`` not a 2-D float tensor.
    """
    check_float("logits", logits, ndim=2)
    acc = accumulate_dtype(logits.dtype)
    z = torch.logsumexp(logits.to(acc), dim=-1)
    return z.square().sum() / max(logits.shape[0], 1)


def _check_routing(logits: torch.Tensor, routing: Routing) -> None:
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a sonic.Routing, got {type(routing).__name__}")
    if tuple(logits.shape) != (routing.num_tokens, routing.num_experts):
        raise ValueError(f"logits has (T, E) = {tuple(logits.shape)} but the routing is of "
                         f"T={routing.num_tokens} tokens over E={routing.num_experts} experts")
