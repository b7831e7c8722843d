"""The router gate that sums the layer input's two gradients in one GEMM (sonic.routing.gate)."""

import pytest
import torch
from torch import nn

import sonic
from sonic.routing.gate import _GateAndInput, gate_logits, router_logits


def _fused(logits):
    return isinstance(logits.grad_fn, _GateAndInput._backward_cls)


def _graph_has_fused_gate(out):
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, _GateAndInput._backward_cls):
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


@pytest.mark.parametrize("bias", [False, True])
def test_gate_gradcheck_and_gradgradcheck(bias):
    torch.manual_seed(0)
    gate = nn.Linear(6, 4, bias=bias, dtype=torch.float64)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    mix = torch.randn(6, 6, dtype=torch.float64)

    def fn(x, weight, *b):
        logits, tokens = _GateAndInput.apply(x, weight, b[0] if b else None)
        # Both outputs reach the loss nonlinearly, as the router and the experts do.
        return logits.tanh().sum() + (tokens @ mix).sin().sum()

    args = (x, gate.weight) + ((gate.bias,) if bias else ())
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_layer_gradients_equal_the_unfused_gate(dtype, router):
    torch.manual_seed(1)
    layer = sonic.MoE(16, 8, 6, 2, router=router, tile=8, backend="torch", dtype=dtype)
    x = torch.randn(3, 11, 16, dtype=dtype, requires_grad=True)
    d_out = torch.randn(3, 11, 16, dtype=dtype)

    def grads(fused):
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        out = layer(x)
        assert _graph_has_fused_gate(out) == fused
        out.backward(d_out)
        return [x.grad] + [p.grad for p in layer.parameters()]

    d_out_before = d_out.clone()
    fused = grads(True)
    assert torch.equal(d_out, d_out_before)
    calls = []
    # A forward hook on the gate must see its call: the layer then runs the gate itself.
    handle = layer.gate.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    plain = grads(False)
    handle.remove()
    assert calls == [(33, 6)]
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-3}
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, **tol)
    assert x.grad.abs().sum() > 0 and layer.gate.weight.grad.abs().sum() > 0


def test_gate_falls_back_where_fusing_would_change_what_users_see():
    torch.manual_seed(2)
    gate = nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8, requires_grad=True)
    logits, tokens = gate_logits(gate, x)
    assert _fused(logits) and torch.equal(tokens, x)
    torch.testing.assert_close(logits, gate(x), rtol=0, atol=0)

    # No input gradient needed: nothing to sum, and the experts must not be asked for dX.
    x_frozen = x.detach()
    logits, tokens = gate_logits(gate, x_frozen)
    assert tokens is x_frozen and not tokens.requires_grad

    class Scaled(nn.Linear):
        def forward(self, inp):
            return 2 * super().forward(inp)

    sub = Scaled(8, 4, bias=False)
    logits, tokens = gate_logits(sub, x)
    assert tokens is x and torch.allclose(logits, 2 * nn.functional.linear(x, sub.weight))

    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        logits, tokens = gate_logits(gate, x)
        assert tokens is x
    finally:
        handle.remove()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, tokens = gate_logits(gate, x)
    assert tokens is x and logits.dtype == torch.bfloat16

    handle = gate.register_full_backward_hook(lambda m, gi, go: None)
    logits, tokens = gate_logits(gate, x)
    handle.remove()
    assert tokens is x


def test_layer_input_is_not_modified_and_backward_twice_accumulates():
    torch.manual_seed(3)
    layer = sonic.MoE(16, 8, 6, 2, tile=8, backend="torch", dtype=torch.float64)
    x = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    x_before = x.detach().clone()
    out = layer(x)
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first)
    assert torch.equal(x.detach(), x_before)


def test_router_logits_with_moe_experts_equals_the_plain_gate():
    torch.manual_seed(4)
    T, d, n, E, K = 17, 16, 8, 5, 2
    kw = {"dtype": torch.float64}
    x = torch.randn(T, d, **kw, requires_grad=True)
    leaves = [x, torch.randn(E, d, **kw, requires_grad=True),
              torch.randn(E, 2 * n, d, **kw, requires_grad=True),
              torch.randn(E, d, n, **kw, requires_grad=True)]
    d_out = torch.randn(T, d, **kw)

    def grads(gate):
        x, router_weight, w1, w2 = leaves
        logits, tokens = gate(x, router_weight)
        r = sonic.topk_routing(logits, K, backend="torch")
        out = sonic.moe_experts(tokens, w1, w2, r.scores, r.token_idx, r.expert_idx,
                                backend="torch")
        return torch.autograd.grad(out, leaves, d_out)

    fused = grads(router_logits)
    plain = grads(lambda x, w: (x @ w.t(), x))
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        logits, tokens = router_logits(x, leaves[1])
    assert tokens is x


def test_experts_of_a_subclass_get_the_plain_gate():
    """A subclass's experts may hand their output gradient back unchanged (here: an
    identity); the gate then must not add into it in place: the user's gradient stays."""

    class Passthrough(sonic.MoE):
        def experts(self, tokens, w1, w2, routing):
            return tokens * routing.scores.new_ones(()).to(tokens.dtype)

    class Identity(sonic.MoE):
        def experts(self, tokens, w1, w2, routing):
            return tokens

    torch.manual_seed(5)
    for cls in (Passthrough, Identity):
        layer = cls(16, 8, 6, 2, tile=8, backend="torch", dtype=torch.float64)
        x = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
        g = torch.randn(10, 16, dtype=torch.float64)
        g_before = g.clone()
        out = layer(x)
        assert not _graph_has_fused_gate(out)
        out.backward(g)
        assert torch.equal(g, g_before)


def test_gate_under_torch_func_grad():
    torch.manual_seed(6)
    x = torch.randn(5, 6, dtype=torch.float64)
    weight = torch.randn(4, 6, dtype=torch.float64)
    mix = torch.randn(6, 6, dtype=torch.float64)

    def loss(x, weight):
        logits, tokens = _GateAndInput.apply(x, weight, None)
        return logits.tanh().sum() + (tokens @ mix).sin().sum()

    got = torch.func.grad(loss, argnums=(0, 1))(x, weight)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_router_logits_names_a_wrong_argument():
    weight = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="tokens"):
        router_logits(torch.randn(2, 3, 8, requires_grad=True), weight)
    with pytest.raises(TypeError, match="tokens"):
        router_logits(torch.ones(3, 8, dtype=torch.int64), weight)
    with pytest.raises(ValueError, match="weight"):
        router_logits(torch.randn(3, 8), weight[None])
