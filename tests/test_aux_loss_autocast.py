"""The load-balancing loss (HF's scale, returned or collected, no graph on the module) and
torch.autocast in the experts."""

import copy
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sonic


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("aux_loss_coef", 0.1)
    return sonic.MoE(16, 8, 6, 2, **kw)


# ----------------------------------------------------------------------------- scale


@pytest.mark.parametrize("K", [1, 2, 4])
def test_load_balancing_loss_equals_transformers(K):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(K))
    routing = sonic.topk_routing(logits, K, backend="torch")
    ours = sonic.load_balancing_loss(logits, routing)
    theirs = mixtral.load_balancing_loss_func((logits,), num_experts=8, top_k=K)
    torch.testing.assert_close(ours, theirs)


def test_uniform_routing_gives_k():
    # Every expert gets T·K/E pairs and mean probability 1/E: HF's loss is K.
    E, K, T = 4, 2, 8
    logits = torch.zeros(T, E)
    expert_idx = torch.arange(T * K) % E
    routing = sonic.Routing(torch.arange(T).repeat_interleave(K), expert_idx,
                            torch.full((T * K,), 0.5), T, E, top_k=K)
    torch.testing.assert_close(sonic.load_balancing_loss(logits, routing), torch.tensor(2.0))


# ----------------------------------------------------------------------------- returned / collected


def test_return_aux_loss_matches_the_formula_and_keeps_no_graph_on_the_module():
    layer = _layer()
    x = torch.randn(20, 16)
    out, aux = layer(x, return_aux_loss=True)
    routing = layer.route(layer.gate(x))
    torch.testing.assert_close(aux, 0.1 * sonic.load_balancing_loss(layer.gate(x), routing))
    assert aux.grad_fn is not None
    assert layer._aux_loss is None and layer.last_routing.scores.grad_fn is None
    for value in vars(layer).values():
        assert not (isinstance(value, torch.Tensor) and value.grad_fn is not None)
    aux.backward()
    assert layer.gate.weight.grad.abs().sum() > 0


def test_collector_gathers_each_forward_and_filters_by_model():
    a, b, other = _layer(0), _layer(1), _layer(2)
    model = torch.nn.Sequential(a, b)
    x = torch.randn(10, 16)
    with sonic.collect_aux_losses(model) as aux:
        y = model(x)
        other(x)                                   # not in model: not collected
    assert len(aux) == 2 and all(t.grad_fn is not None for t in aux)
    expect = [a(x, return_aux_loss=True)[1], b(a(x), return_aux_loss=True)[1]]
    for got, ref in zip(aux, expect):
        torch.testing.assert_close(got, ref)
    (y.sum() + sum(aux)).backward()
    assert a.gate.weight.grad is not None and other.gate.weight.grad is None
    with sonic.collect_aux_losses() as everything:
        model.eval()(x)
    assert everything == []                         # eval mode: no aux loss


def test_deepcopy_and_ema_after_a_collected_forward():
    layer = _layer()
    with sonic.collect_aux_losses(layer) as aux:
        out = layer(torch.randn(8, 16))
    clone = copy.deepcopy(layer)
    ema = torch.optim.swa_utils.AveragedModel(
        layer, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    (out.sum() + sum(aux)).backward()
    ema.update_parameters(layer)
    assert torch.equal(clone.w1, layer.w1) and clone.w1 is not layer.w1
    torch.testing.assert_close(ema.module.w1, layer.w1)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_aux_loss_trains_the_router(use_reentrant):
    layer = _layer()
    x = torch.randn(12, 16, requires_grad=True)

    def fn(inp):
        return layer(inp, return_aux_loss=True)

    out, aux = checkpoint(fn, x, use_reentrant=use_reentrant)
    (out.sum() + aux).backward()
    got = layer.gate.weight.grad.clone()
    layer.zero_grad()
    out, aux = fn(x)
    (out.sum() + aux).backward()
    torch.testing.assert_close(got, layer.gate.weight.grad)


def test_deprecated_attribute_still_trains_and_warns():
    layer = _layer()
    out = layer(torch.randn(8, 16))
    with pytest.warns(DeprecationWarning, match="return_aux_loss"):
        aux = layer.aux_loss
    (out.sum() + aux).backward()
    assert layer.gate.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- autocast


def test_autocast_bf16_keeps_h_in_bf16_and_matches_a_bf16_layer():
    layer = _layer(aux_loss_coef=0.0)
    ref = copy.deepcopy(layer).to(torch.bfloat16)
    x = torch.randn(24, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = sonic.profile_activation_memory(layer, x.clone().requires_grad_())
    out = report.output
    assert out.dtype == torch.bfloat16
    h = [s for s in report.saved if s.kind == "activation" and s.shape == (24 * 2, 16)]
    assert h and all(s.dtype == torch.bfloat16 for s in h), report.format()
    assert not any(s.dtype == torch.float32 and s.shape == (48, 16) for s in report.saved)
    out.float().square().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())   # fp32 master grads
    ref_out = ref(x.to(torch.bfloat16))
    ref_out.float().square().sum().backward()
    torch.testing.assert_close(out, ref_out)
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_functional_moe_experts_follows_autocast():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    w1 = torch.randn(3, 8, 8, generator=g, requires_grad=True)
    w2 = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    r = sonic.topk_routing(torch.randn(6, 3, generator=g), 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sonic.moe_experts(x, w1, w2, r.scores, r.token_idx, r.expert_idx)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert w1.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_bf16_weights_with_fp32_input_raise_outside_autocast_and_work_inside():
    layer = _layer(aux_loss_coef=0.0).to(torch.bfloat16)
    x = torch.randn(5, 16)
    with pytest.raises(TypeError, match="autocast"):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16


def test_fp64_layer_is_left_alone_by_autocast():
    layer = _layer(aux_loss_coef=0.0).to(torch.float64)
    x = torch.randn(5, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = layer(x)
    assert out.dtype == torch.float64


def test_load_balancing_loss_refuses_logits_of_another_batch_or_layer():
    # Counts of one routing against logits of another would give a plausible, wrong number.
    routing = sonic.topk_routing(torch.randn(5, 4), 2, backend="torch")
    for logits, kind, match in ((torch.randn(6, 4), ValueError, r"\(T, E\) = \(6, 4\)"),
                                (torch.randn(5, 3), ValueError, "E=4 experts"),
                                (torch.randn(5), ValueError, "2-D"),
                                (torch.zeros(5, 4, dtype=torch.int64), TypeError, "dtype")):
        with pytest.raises(kind, match=match):
            sonic.load_balancing_loss(logits, routing)
    with pytest.raises(TypeError, match="sonic.Routing"):
        sonic.load_balancing_loss(torch.randn(5, 4), (routing.token_idx, routing.expert_idx))


def test_collected_aux_loss_under_reentrant_checkpointing_raises():
    """A reentrant checkpoint runs the forward without grad: a collected aux loss could not
    train the router, so the layer raises instead of collecting a detached one."""
    layer = _layer()
    x = torch.randn(12, 16, requires_grad=True)
    with sonic.collect_aux_losses(layer) as aux:
        with pytest.raises(RuntimeError, match="use_reentrant=False.*return_aux_loss=True"):
            checkpoint(layer, x, use_reentrant=True)
        out = checkpoint(layer, x, use_reentrant=False)        # non-reentrant: collected
    assert len(aux) == 1 and aux[0].requires_grad
    (out.sum() + aux[0]).backward()
    assert layer.gate.weight.grad.abs().sum() > 0
    # Without gradients in eval mode, or with frozen parameters, nothing is wrong.
    with sonic.collect_aux_losses(layer) as aux, torch.no_grad():
        layer.eval()
        layer(x)
        layer.train()
        layer.requires_grad_(False)
        layer(x)
    assert len(aux) == 1 and not aux[0].requires_grad
