"""Shared experts (DeepSeekMoE §3.2; Qwen2-MoE's gated shared expert) against a naive fp64
dense MLP added to the routed output, and what they keep for backward."""

import pytest
import torch
import torch.nn.functional as F

import sonic

F64 = torch.float64


def naive_shared(layer, tokens):
    h = tokens @ layer.shared_w1[0].T
    if layer.activation == "swiglu":
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
    else:
        a = F.relu(h) ** 2
    y = a @ layer.shared_w2[0].T
    if layer.shared_gate is not None:
        y = torch.sigmoid(tokens @ layer.shared_gate.weight.T) * y
    return y


def _pair(**kw):
    """A layer with shared experts and the same layer without them (same routed weights)."""
    torch.manual_seed(0)
    layer = sonic.MoE(12, 6, 4, 2, dtype=F64, **kw)
    routed = sonic.MoE(12, 6, 4, 2, dtype=F64, activation=layer.activation)
    routed.load_state_dict({k: v for k, v in layer.state_dict().items()
                            if not k.startswith("shared")})
    return layer, routed


@pytest.mark.parametrize("kw", [dict(num_shared_experts=1), dict(num_shared_experts=2),
                                dict(shared_expert_d=10, shared_expert_gate=True),
                                dict(num_shared_experts=1, activation="relu2",
                                     shared_expert_gate=True)])
def test_shared_experts_match_naive(kw):
    layer, routed = _pair(**kw)
    size = kw.get("shared_expert_d", kw.get("num_shared_experts", 0) * 6)
    assert layer.shared_w2.shape == (1, 12, size)
    x = torch.randn(3, 5, 12, dtype=F64, requires_grad=True)
    out = layer(x)
    expect = routed(x) + naive_shared(layer, x.reshape(-1, 12)).reshape(x.shape)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    shared = [p for n, p in layer.named_parameters() if n.startswith("shared")]
    got = torch.autograd.grad((out * dout).sum(), [x, layer.gate.weight, layer.w1, *shared])
    ref_x = x.detach().requires_grad_()
    ref = routed(ref_x) + naive_shared(layer, ref_x.reshape(-1, 12)).reshape(x.shape)
    want = torch.autograd.grad((ref * dout).sum(), [ref_x, routed.gate.weight, routed.w1,
                                                   *shared])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_shared_experts_keep_only_h_scores_and_metadata():
    torch.manual_seed(0)
    T, d, n_s = 64, 32, 48
    plain = sonic.MoE(d, 16, 4, 2)
    shared = sonic.MoE(d, 16, 4, 2, shared_expert_d=n_s, shared_expert_gate=True)
    x = torch.randn(T, d, requires_grad=True)
    extra = (sonic.profile_activation_memory(shared, x).activation_bytes
             - sonic.profile_activation_memory(plain, x).activation_bytes)
    h_bytes = T * 2 * n_s * 4
    # H, the fp32 scores, the int32 metadata (a few T-long vectors) and the gate's logits.
    assert h_bytes <= extra <= h_bytes + 16 * T * 4


def test_shared_experts_under_autocast_and_errors():
    torch.manual_seed(0)
    layer = sonic.MoE(16, 8, 4, 2, num_shared_experts=1, shared_expert_gate=True)
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), layer(x), rtol=0.05, atol=0.02)
    with pytest.raises(ValueError, match="shared_expert_gate=True needs shared experts"):
        sonic.MoE(16, 8, 4, 2, shared_expert_gate=True)
    with pytest.raises(ValueError, match="num_shared_experts"):
        sonic.MoE(16, 8, 4, 2, num_shared_experts=-1)
    with pytest.raises(ValueError, match="shared_expert_d"):
        sonic.MoE(16, 8, 4, 2, shared_expert_d=0)
