"""The plain-eager path of sonic's custom ops (sonic._custom_op): it skips the dispatcher only
where nothing needs it, and computes exactly what the dispatcher path computes."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import sonic
from sonic import ops
from sonic._custom_op import plain_eager


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it every op goes through the dispatcher."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _FunctionPassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_eager_only_for_real_tensors_with_no_mode_or_transform():
    x = torch.randn(3)
    assert plain_eager((x, 2, "torch", [x, x], None))
    assert not plain_eager((torch.empty(3, device="meta"),))
    assert not plain_eager(([x, torch.empty(3, device="meta")],))
    with _PassThrough():
        assert not plain_eager((x,))
    with _FunctionPassThrough():
        assert not plain_eager((x,))
    seen = []
    torch.func.vmap(lambda t: seen.append(plain_eager((t,))) or t)(torch.randn(2, 3))
    assert seen == [False]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not plain_eager((fake,))


def _sonic_ops_called(fn) -> set:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("sonic::")}


def _layer_step(layer, x):
    out, aux = layer(x, return_aux_loss=True)
    loss = out.square().mean() + aux
    return (out, *torch.autograd.grad(loss, [x, *layer.parameters()]))


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_eager_step_skips_the_dispatcher_and_equals_the_dispatched_step(router):
    torch.manual_seed(0)
    layer = sonic.MoE(16, 8, 4, 2, router=router, tile=2, aux_loss_coef=0.01,
                      dtype=torch.float64, backend="torch")
    x = torch.randn(13, 16, dtype=torch.float64, requires_grad=True)
    results = {}
    eager = _sonic_ops_called(lambda: results.setdefault("eager", _layer_step(layer, x)))
    with _PassThrough():
        dispatched = _sonic_ops_called(
            lambda: results.setdefault("dispatched", _layer_step(layer, x)))
    assert eager == set()
    assert {"sonic::moe_experts", "sonic::routing_metadata", "sonic::grouped_mm_varlen_k",
            "sonic::aggregate"} <= dispatched
    for a, b in zip(results["eager"], results["dispatched"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("score,renormalize", [("softmax_topk", False),
                                                ("topk_softmax", False), ("topk_softmax", True)])
def test_topk_scores_stay_twice_differentiable_on_the_eager_path(score, renormalize):
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradgradcheck(
        lambda t: sonic.topk_routing(t, 3, score=score, renormalize=renormalize,
                                     backend="torch").scores, (logits,))


def test_op_without_a_backward_still_refuses_to_differentiate():
    # Eagerly the reference implementation would record a graph of its own; the call goes
    # through the dispatcher instead, which says that no formula is registered.
    a = torch.randn(6, 8, requires_grad=True)
    b = torch.randn(2, 8, 4)
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    y = ops.call.grouped_mm(a, b, offsets, None, "torch")
    with pytest.raises(RuntimeError, match="no autograd formula"):
        y.sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(ops.call.grouped_mm(a, b, offsets, None, "torch"),
                                   torch.ops.sonic.grouped_mm(a, b, offsets, None, "torch"))
