"""Expert activations beyond SwiGLU (torch backend) against a naive fp64 per-token MoE.

GLU variants (Shazeer 2020): A = φ(x W_gate) ⊙ (x W_up), φ = SiLU / GELU / GELU(tanh) / ReLU;
non-gated: ReLU² (So et al. 2021, Primer) and GELU (Hendrycks & Gimpel 2016).
"""

import pytest
import torch
import torch.nn.functional as F

import sonic

F64 = torch.float64
PHI = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": lambda g: F.gelu(g, approximate="tanh"),
       "reglu": F.relu}
PLAIN = {"relu2": lambda h: F.relu(h) ** 2, "gelu": F.gelu}


def naive_layer(layer, x):
    tokens = x.reshape(-1, layer.d_model)
    r = layer.last_routing
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(layer.d_model, dtype=x.dtype)
        for p in (r.token_idx == t).nonzero().flatten().tolist():
            e = int(r.expert_idx[p])
            h = layer.w1[e] @ tokens[t]
            if layer.activation in PHI:
                g, u = h.chunk(2) if layer.gate_up == "concat" else (h[0::2], h[1::2])
                a = PHI[layer.activation](g) * u
            else:
                a = PLAIN[layer.activation](h)
            acc = acc + _score(layer, tokens, t, e) * (layer.w2[e] @ a)
        rows.append(acc)
    return torch.stack(rows).reshape(x.shape)


def _score(layer, tokens, t, e):
    """Top-K softmax_topk score of (t, e), recomputed with autograd from the gate."""
    logits = tokens[t] @ layer.gate.weight.T
    chosen = torch.sort(logits.detach(), descending=True, stable=True).indices[:layer.top_k]
    return torch.softmax(logits[chosen], -1)[chosen.tolist().index(e)]


@pytest.mark.parametrize("activation", sorted(PHI) + sorted(PLAIN))
@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_layer_activation_matches_naive(activation, gate_up):
    torch.manual_seed(0)
    layer = sonic.MoE(10, 6, 5, 2, activation=activation, gate_up=gate_up, dtype=F64)
    assert layer.w1.shape == (5, 12 if activation in PHI else 6, 10)
    x = torch.randn(2, 7, 10, dtype=F64, requires_grad=True)
    out = layer(x)
    expect = naive_layer(layer, x)
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-12)
    dout = torch.randn_like(out)
    params = [x, layer.gate.weight, layer.w1, layer.w2]
    got = torch.autograd.grad((out * dout).sum(), params)
    want = torch.autograd.grad((expect * dout).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("activation", ["geglu_tanh", "relu2", "gelu"])
def test_activation_op_gradcheck(activation):
    torch.manual_seed(1)
    layer = sonic.MoE(6, 3, 4, 2, activation=activation, dtype=F64)
    x = torch.randn(5, 6, dtype=F64, requires_grad=True)
    r = layer.route(x.detach() @ layer.gate.weight.T)
    scores = r.scores.detach().requires_grad_()

    def experts(x, w1, w2, scores):
        return layer.experts(x, w1, w2, sonic.Routing(r.token_idx, r.expert_idx, scores, 5, 4,
                                                      top_k=2, validated=True))

    assert torch.autograd.gradcheck(experts, (x, layer.w1, layer.w2, scores))


def test_activation_with_padded_token_rounding_matches_trimmed():
    torch.manual_seed(2)
    layer = sonic.MoE(8, 4, 6, 2, activation="relu2", router="token_rounding", tile=4,
                      dtype=F64)
    x = torch.randn(19, 8, dtype=F64, requires_grad=True)
    out = layer(x)
    r = layer.last_routing
    assert r.num_valid is not None and r.num_pairs > int(r.num_valid)
    trimmed = r.trim()
    logits = x @ layer.gate.weight.T
    s = sonic.token_rounding_routing(logits, 2, tile=4).scores
    meta = sonic.routing_metadata(trimmed)
    expect = sonic.moe_experts(x, layer.w1, layer.w2, s, trimmed.token_idx, trimmed.expert_idx,
                               metadata=meta, activation="relu2")
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    g1 = torch.autograd.grad(out.sum(), [x, layer.w1, layer.gate.weight])
    g2 = torch.autograd.grad(expect.sum(), [x, layer.w1, layer.gate.weight])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert torch.isfinite(a).all()


def test_activation_keeps_h_and_not_a():
    torch.manual_seed(3)
    layer = sonic.MoE(32, 16, 4, 2, activation="geglu")
    x = torch.randn(64, 32, requires_grad=True)
    report = sonic.profile_activation_memory(layer, x)
    P = 64 * 2
    # Kept: H (P, 2n) fp32, the scores and int metadata — no (P, n) A nor (P, d) rows.
    assert report.activation_bytes < P * 32 * 4 + P * 16 * 4
    assert report.activation_bytes >= P * 32 * 4


@pytest.mark.parametrize("kw,match", [
    (dict(precision="fp8"), "precision='fp8'"),
    (dict(activation_cache="fp8"), "activation_cache='fp8'"),
])
def test_swiglu_only_options_raise_at_construction(kw, match):
    with pytest.raises(ValueError, match=f"activation='gelu'.*{match}"):
        sonic.MoE(128, 128, 4, 2, activation="gelu", **kw)
    layer = sonic.MoE(128, 128, 4, 2, activation="gelu")
    name, value = next(iter(kw.items()))
    with pytest.raises(ValueError, match=match):
        setattr(layer, name, value)
    with pytest.raises(ValueError, match="activation must be one of"):
        sonic.MoE(8, 4, 4, 2, activation="swish")


@pytest.mark.parametrize("activation", ["geglu", "relu2"])
def test_experts_op_with_an_activation_passes_opcheck_and_compiles(activation):
    g = torch.Generator().manual_seed(4)
    rows = 8 if activation == "geglu" else 4
    x = torch.randn(9, 8, generator=g, requires_grad=True)
    w1 = (torch.randn(4, rows, 8, generator=g) / 8 ** 0.5).requires_grad_()
    w2 = torch.randn(4, 8, 4, generator=g) / 2
    r = sonic.topk_routing(torch.randn(9, 4, generator=g), 2, backend="torch")
    meta = sonic.routing_metadata(r, backend="torch")
    torch.library.opcheck(torch.ops.sonic.moe_experts.default,
                          (x, w1, w2, r.scores.detach(), meta.packed, 2, "concat", "torch",
                           "bf16", activation))
    fn = torch.compile(sonic.moe_experts, fullgraph=True)
    args = (x, w1, w2, r.scores.detach(), r.token_idx, r.expert_idx)
    torch.testing.assert_close(fn(*args, activation=activation),
                               sonic.moe_experts(*args, activation=activation))


def test_moe_experts_checks_the_activation_against_the_weights():
    x = torch.randn(5, 8)
    tok, exp, s = torch.tensor([0, 1, 4]), torch.tensor([0, 1, 1]), torch.rand(3)
    w1, w2 = torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match=r"w2 must have shape \(E=2, d=8, n=8\)"):
        sonic.moe_experts(x, w1, w2, s, tok, exp, activation="relu2")
    with pytest.raises(ValueError, match=r"w1 must have shape \(E, 2n, d=8\).*'geglu'"):
        sonic.moe_experts(x, torch.randn(2, 7, 8), w2, s, tok, exp, activation="geglu")
    with pytest.raises(ValueError, match="activation must be one of"):
        sonic.moe_experts(x, w1, w2, s, tok, exp, activation="silu")
    with pytest.raises(ValueError, match="precision='fp8' runs SwiGLU experts only.*'gelu'"):
        sonic.moe_experts(x, w1, torch.randn(2, 8, 8), s, tok, exp, activation="gelu",
                          precision="fp8")
