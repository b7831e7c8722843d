"""torch.compile(fullgraph=True) of sonic.MoE with the routing, activation and shared-expert
options (CPU, fp32): one graph, eager's results, buffers updated as eagerly."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import sonic

DEEPSEEK_V3 = dict(score="sigmoid", renormalize=True, routed_scaling_factor=2.5, n_group=4,
                   topk_group=2, bias_update_rate=1e-3, seq_aux_loss_coef=1e-3,
                   z_loss_coef=1e-3, aux_loss_coef=0.01)
OPTIONS = {
    # Sigmoid scoring with all three aux losses at once: see the xfail test below.
    "deepseek_v3_routing": dict(DEEPSEEK_V3, z_loss_coef=0.0),
    "three_losses": dict(score="topk_softmax", seq_aux_loss_coef=1e-3, z_loss_coef=1e-3,
                         aux_loss_coef=0.01),
    "softmax_groups": dict(score="topk_softmax", n_group=2, topk_group=1, expert_bias=True),
    "geglu": dict(activation="geglu"),
    "relu2": dict(activation="relu2", score="sigmoid"),
    "shared_gated": dict(num_shared_experts=1, shared_expert_gate=True),
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


def _check_matches_eager(options, backend="inductor"):
    eager, layer = _layer(**options), _layer(**options)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    # 3·T tokens above 16: for fewer, inductor decomposes the (3T, d=16) x (16, 1) GEMM of
    # the shared expert's gate into a reduction and guards on 3T + 16 <= 32 (its small-mm
    # heuristic), so crossing that size compiles a second graph.
    for T in (7, 9):
        x = torch.randn(3, T, 16, requires_grad=True)
        got, expect = _step(compiled, x), _step(eager, x)
        frames.append(counter.frame_count)
        torch.testing.assert_close(got[0], expect[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], expect[1], rtol=1e-4, atol=1e-5)
        for a, b in zip(got[2], expect[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert frames[0] == frames[1], "a new T recompiled"
    if backend == "inductor":
        assert frames[0] == 1
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(layer.state_dict()[key], value)
    if eager.bias_update_rate:
        torch.testing.assert_close(layer.tokens_per_expert, eager.tokens_per_expert)
        assert layer.tokens_per_expert.sum() == 3 * (7 + 9) * 2


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_fullgraph_with_options_matches_eager(name):
    _check_matches_eager(OPTIONS[name])


def test_fullgraph_deepseek_v3_layer_graph_matches_eager():
    # The traced graph itself (AOTAutograd, no inductor codegen) with every option at once.
    _check_matches_eager(DEEPSEEK_V3, backend="aot_eager")


@pytest.mark.xfail(strict=True, reason="inductor's code for sigmoid scoring together with all "
                   "three aux losses gives the output's x/gate gradients ~1e-3 off eager "
                   "(fp32 and fp64; aot_eager matches; any two of the losses match); not "
                   "understood yet")
def test_fullgraph_deepseek_v3_layer_inductor_matches_eager():
    _check_matches_eager(DEEPSEEK_V3)
