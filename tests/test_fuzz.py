"""Differential fuzzing: sonic against a naive fp64 MoE written here, pair by pair.

Each iteration draws sizes, a dtype, a routing (top-K with and without ties, empty experts,
one-hot, every token to one expert, arbitrary pairs, padded and exact token rounding), a
gradient mode and a ``gate_up`` layout, runs :func:`sonic.moe_experts` and compares output
and gradients with :func:`_pairwise_moe` in fp64. A second fuzzer drives a ``sonic.MoE``
through module operations (deepcopy, pickle, ``state_dict`` round trips, in-place weight
edits through ``.data`` and ``copy_``, router and mode switches) and compares every forward
and the expert weight gradients with the same oracle on the layer's current weights.

Fixed seeds; ``SONIC_FUZZ_ITERS`` sets the iterations (a few seconds by default on the CPU).
``tests/gpu/test_fuzz_gpu.py`` runs the CuTe kernels in bf16 against the same oracle.
"""

import copy
import io
import os
import pickle

import pytest
import torch
import torch.nn.functional as F

import sonic

ITERS = int(os.environ.get("SONIC_FUZZ_ITERS", "0"))
# Relative error allowed against fp64, per compute dtype: bf16 rounds H and A to 8 bits.
TOL = {torch.float64: 1e-11, torch.float32: 2e-5, torch.bfloat16: 3e-2}
ROUTINGS = ("topk", "ties", "empty_experts", "one_hot", "all_to_one", "arbitrary",
            "token_rounding", "token_rounding_padded")
GRAD_MODES = ("none", "x", "all", "no_grad", "inference_mode")


def _pairwise_moe(x, w1, w2, scores, token_idx, expert_idx, gate_up):
    """``o_t = Σ_pairs s · W2[e] · (silu(gate) ⊙ up)``, ``[gate; up] = W1[e] · x_t``, one pair
    at a time (a batched einsum over pairs, no grouping by expert), in x's dtype."""
    tok, exp = token_idx.long(), expert_idx.long()
    h = torch.einsum("pd,pmd->pm", x[tok], w1[exp])
    gate, up = h.chunk(2, dim=-1) if gate_up == "concat" else (h[:, 0::2], h[:, 1::2])
    y = torch.einsum("pn,pdn->pd", F.silu(gate) * up, w2[exp])
    return torch.zeros_like(x).index_add(0, tok, scores[:, None] * y)


def _rel(got, want):
    got, want = got.double(), want.double()
    scale = want.norm()
    return ((got - want).norm() / (scale if scale > 0 else 1)).item()


def _routing(kind, T, E, K, g):
    """``(token_idx, expert_idx, metadata or None)`` of one routing kind."""
    if kind in ("topk", "ties"):
        logits = torch.randn(T, E, generator=g)
        if kind == "ties":      # few distinct values: most top-K choices are ties
            logits = torch.randint(0, 3, (T, E), generator=g).float()
        r = sonic.topk_routing(logits, K, backend="torch")
        # Whatever the tie rule, a token's picks are K distinct experts none of whose logits
        # is below an unpicked one's.
        picked = r.expert_idx.view(T, K).long()
        assert all(len(set(row)) == K for row in picked.tolist())
        if T:
            mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, picked, True)
            lowest = logits.masked_fill(~mask, float("inf")).amin(1)
            highest = logits.masked_fill(mask, -float("inf")).amax(1)
            assert (lowest >= highest).all()
        return r.token_idx, r.expert_idx, None
    if kind in ("token_rounding", "token_rounding_padded"):
        padded = kind.endswith("padded")
        r = sonic.token_rounding_routing(torch.randn(T, E, generator=g), K,
                                         tile=int(torch.randint(1, 9, (), generator=g)),
                                         backend="torch", padded=padded)
        meta = sonic.routing_metadata(r, backend="torch")
        return r.token_idx, r.expert_idx, (meta, r.trim())
    if kind == "one_hot":
        exp = torch.randint(0, E, (T,), generator=g)
        return torch.arange(T), exp, None
    if kind == "all_to_one":
        return torch.arange(T), torch.full((T,), int(torch.randint(0, E, (), generator=g))), None
    if kind == "empty_experts":
        used = torch.randperm(E, generator=g)[:max(1, E // 2)]
        k = min(K, used.numel())
        pick = torch.stack([used[torch.randperm(used.numel(), generator=g)[:k]]
                            for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
        return torch.arange(T).repeat_interleave(k), pick.flatten(), None
    # arbitrary: each (token, expert) pair present with probability 1/2, any order
    mask = torch.rand(T, E, generator=g) < 0.5
    tok, exp = mask.nonzero(as_tuple=True)
    order = torch.randperm(tok.numel(), generator=g)
    return tok[order], exp[order], None


def _fuzz_moe_experts(seed, *, backend="torch", dtypes=(torch.float64, torch.float32,
                                                         torch.bfloat16),
                      sizes=((0, 40), (8, 16, 24), (4, 8, 12)), device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (), generator=g))]

    T = int(torch.randint(sizes[0][0], sizes[0][1] + 1, (), generator=g))
    d, n = pick(sizes[1]), pick(sizes[2])
    E = int(torch.randint(1, 9, (), generator=g))
    K = int(torch.randint(1, E + 1, (), generator=g))
    dtype, kind, mode = pick(dtypes), pick(ROUTINGS), pick(GRAD_MODES)
    gate_up = pick(("concat", "interleaved"))
    case = dict(seed=seed, T=T, d=d, n=n, E=E, K=K, dtype=dtype, routing=kind, mode=mode,
                gate_up=gate_up)
    tok, exp, extra = _routing(kind, T, E, K, g)
    x = torch.randn(T, d, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, 2 * n, d, generator=g, dtype=torch.float64) / d ** 0.5
    w2 = torch.randn(E, d, n, generator=g, dtype=torch.float64) / n ** 0.5
    scores = torch.rand(tok.numel(), generator=g, dtype=torch.float64) + 0.1
    leaves = [t.to(device, dtype) for t in (x, w1, w2)] + [scores.to(device)]
    score_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves[3] = leaves[3].to(score_dtype)
    wants_grad = {"x": [0], "all": [0, 1, 2, 3]}.get(mode, [0, 1, 2, 3])
    for i in wants_grad:
        leaves[i].requires_grad_(mode != "none")
    kw = dict(gate_up=gate_up, backend=backend)
    tok_d, exp_d = tok.to(device), exp.to(device)
    if extra is not None:
        meta, trimmed = extra
        kw["metadata"] = meta if device == "cpu" else sonic.routing_metadata(
            sonic.Routing(tok_d.int(), exp_d.int(), leaves[3], T, E, validated=True,
                          num_valid=None if trimmed.num_pairs == tok.numel()
                          else torch.tensor(trimmed.num_pairs, device=device)),
            backend=backend)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        mode, torch.enable_grad)
    with context():
        out = sonic.moe_experts(*leaves, tok_d, exp_d, **kw)
    # The oracle: fp64, only the routed pairs (a padded routing's padding has score 0 and
    # expert E, so it is left out by its count).
    valid = tok.numel() if extra is None else extra[1].num_pairs
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    ref = _pairwise_moe(*ref_leaves[:3], ref_leaves[3][:valid], tok[:valid], exp[:valid],
                        gate_up)
    assert out.shape == (T, d) and out.dtype == dtype, case
    assert _rel(out.cpu(), ref) <= TOL[dtype], (case, _rel(out.cpu(), ref))
    if mode in ("x", "all") and T:
        grad = torch.randn(T, d, generator=g, dtype=torch.float64)
        got = torch.autograd.grad(out, [leaves[i] for i in wants_grad], grad.to(device, dtype))
        want = torch.autograd.grad(ref, [ref_leaves[i] for i in wants_grad], grad,
                                   allow_unused=True)
        for i, a, b in zip(wants_grad, got, want):
            b = torch.zeros_like(ref_leaves[i]) if b is None else b
            if i == 3:      # padding scores get no gradient
                assert not a.cpu()[valid:].any(), case
                a, b = a[:valid], b[:valid]
            assert _rel(a.cpu(), b) <= 3 * TOL[dtype], (case, i, _rel(a.cpu(), b))
    elif mode in ("no_grad", "inference_mode"):
        assert not out.requires_grad, case


@pytest.mark.parametrize("seed", range(ITERS or 40))
def test_moe_experts_against_the_fp64_oracle(seed):
    _fuzz_moe_experts(seed)


def _layer_forward_matches(layer, x):
    """The layer's output equals the oracle on its current weights and last routing; its
    expert weight gradients too."""
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    r = layer.last_routing.trim()
    w1, w2 = (w.detach().double().requires_grad_() for w in (layer.w1, layer.w2))
    ref = _pairwise_moe(x.double(), w1, w2, r.scores.double(), r.token_idx, r.expert_idx,
                        layer.gate_up)
    tol = TOL[layer.w1.dtype]
    assert _rel(out, ref) <= tol, _rel(out, ref)
    if layer.training and x.shape[0]:
        grad = torch.randn_like(ref)
        out.backward(grad.to(out.dtype))
        want = torch.autograd.grad(ref, [w1, w2], grad)
        for p, b in zip((layer.w1, layer.w2), want):
            assert _rel(p.grad, b) <= 3 * tol, _rel(p.grad, b)
    return out.detach()


def _module_op(layer, op, g):
    """``layer`` after module operation ``op`` (a new object for copies)."""
    if op == "deepcopy":
        return copy.deepcopy(layer)
    if op == "pickle":
        return pickle.loads(pickle.dumps(layer))
    if op == "torch_save":
        buf = io.BytesIO()
        torch.save(layer, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    if op == "state_dict":
        fresh = sonic.MoE(layer.d_model, layer.d_expert, layer.num_experts, layer.top_k,
                          gate_up=layer.gate_up, backend=layer.backend, dtype=layer.w1.dtype,
                          router=layer.router, tile=layer.tile)
        fresh.load_state_dict(copy.deepcopy(layer.state_dict()))
        return fresh
    with torch.no_grad():
        if op == "data_mul":
            layer.w2.data.mul_(1.5)
        elif op == "data_copy":
            layer.w1.data.copy_(torch.randn(layer.w1.shape, generator=g).to(layer.w1.dtype)
                                * layer.d_model ** -0.5)
        elif op == "copy_":
            layer.w2.copy_(torch.randn(layer.w2.shape, generator=g).to(layer.w2.dtype)
                           * layer.d_expert ** -0.5)
        elif op == "router":
            layer.router = "token_rounding" if layer.router == "topk" else "topk"
        elif op == "mode":
            layer.train(not layer.training)
        elif op == "top_k":
            layer.top_k = int(torch.randint(1, layer.num_experts + 1, (), generator=g))
    return layer


MODULE_OPS = ("deepcopy", "pickle", "torch_save", "state_dict", "data_mul", "data_copy",
              "copy_", "router", "mode", "top_k")


@pytest.mark.parametrize("seed", range(ITERS // 4 or 8))
def test_layer_under_module_operations_against_the_fp64_oracle(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    dtype = (torch.float64, torch.float32, torch.bfloat16)[seed % 3]
    E = int(torch.randint(2, 7, (), generator=g))
    torch.manual_seed(seed)
    layer = sonic.MoE(16, 8, E, int(torch.randint(1, E + 1, (), generator=g)), tile=4,
                      gate_up=("concat", "interleaved")[seed % 2], backend="torch",
                      dtype=dtype)
    x = torch.randn(int(torch.randint(0, 30, (), generator=g)), 16, generator=g).to(dtype)
    _layer_forward_matches(layer, x)
    for _ in range(6):
        op = MODULE_OPS[int(torch.randint(0, len(MODULE_OPS), (), generator=g))]
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        new = _module_op(layer, op, g)
        if new is not layer:      # a copy is independent of its source
            for k, v in new.state_dict().items():
                assert torch.equal(v, before[k]) and v.data_ptr() != before[k].data_ptr()
        layer = new
        _layer_forward_matches(layer, x)
