"""torch.compile(fullgraph=True) of sonic.MoE with the routing, activation and shared-expert
options (CPU, fp32): one graph, eager's results, buffers updated as eagerly."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import sonic

OPTIONS = {
    "deepseek_v3_routing": dict(score="sigmoid", renormalize=True, routed_scaling_factor=2.5,
                                n_group=4, topk_group=2, bias_update_rate=1e-3,
                                seq_aux_loss_coef=1e-3, z_loss_coef=1e-3, aux_loss_coef=0.01),
    "softmax_groups": dict(score="topk_softmax", n_group=2, topk_group=1, expert_bias=True),
    "geglu": dict(activation="geglu"),
    "relu2": dict(activation="relu2", score="sigmoid"),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer(**kw):
    torch.manual_seed(0)
    return sonic.MoE(16, 8, 8, 2, dtype=torch.float32, **kw)


def _step(layer, x):
    out, aux = layer(x, return_aux_loss=True)
    loss = out.square().mean() + aux
    grads = torch.autograd.grad(loss, [x, *layer.parameters()])
    return out.detach(), loss.detach(), grads


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_fullgraph_with_options_matches_eager(name):
    eager, layer = _layer(**OPTIONS[name]), _layer(**OPTIONS[name])
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for T in (12, 12):
        x = torch.randn(3, T // 3, 16, requires_grad=True)
        got, expect = _step(compiled, x), _step(eager, x)
        torch.testing.assert_close(got[0], expect[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], expect[1], rtol=1e-4, atol=1e-5)
        for a, b in zip(got[2], expect[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(layer.state_dict()[key], value)
    if eager.bias_update_rate:
        torch.testing.assert_close(layer.tokens_per_expert, eager.tokens_per_expert)
        assert layer.tokens_per_expert.sum() == 2 * 12 * 2
