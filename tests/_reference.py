"""A naive per-expert MoE written with plain autograd: the oracle the tests compare against."""

import torch
import torch.nn.functional as F


def naive_moe(x, w1, w2, scores, token_idx, expert_idx, gate_up="concat"):
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        sel = (expert_idx == e).nonzero().flatten()
        if sel.numel() == 0:
            continue
        tok = token_idx[sel].long()
        h = x[tok] @ w1[e].T
        gate, up = h.chunk(2, dim=-1) if gate_up == "concat" else (h[:, 0::2], h[:, 1::2])
        y = (F.silu(gate) * up) @ w2[e].T
        out = out.index_add(0, tok, scores[sel, None] * y)
    return out


def random_problem(T, d, n, E, P=None, K=2, *, dtype=torch.float32, seed=0, generator_pairs=None):
    """Random weights and input; pairs are top-K of random logits unless ``generator_pairs``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g, dtype=dtype)
    w1 = torch.randn(E, 2 * n, d, generator=g, dtype=dtype) / d ** 0.5
    w2 = torch.randn(E, d, n, generator=g, dtype=dtype) / n ** 0.5
    if generator_pairs is None:
        logits = torch.randn(T, E, generator=g)
        expert_idx = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :K]
        token_idx = torch.arange(T).repeat_interleave(K)
        expert_idx = expert_idx.flatten()
    else:
        token_idx, expert_idx = generator_pairs(g)
    scores = torch.rand(token_idx.numel(), generator=g, dtype=dtype) + 0.1
    return x, w1, w2, scores, token_idx.to(torch.int32), expert_idx.to(torch.int32)
