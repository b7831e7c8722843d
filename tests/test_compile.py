"""torch.compile / torch.export / torch.library custom ops on the CPU."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import sonic
from sonic import ops  # noqa: F401

OPS = ("topk_routing", "routing_metadata", "grouped_mm", "grouped_mm_varlen_k",
       "up_proj_swiglu", "dh_dswiglu", "aggregate", "moe_experts", "token_rounding_select")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_every_op_is_registered():
    for name in OPS:
        assert hasattr(torch.ops.sonic, name), name


def _layer(dtype, seed=0, **kw):
    torch.manual_seed(seed)
    return sonic.MoE(16, 8, 4, 2, dtype=dtype, aux_loss_coef=0.01, **kw)


def _step(layer, x):
    out, aux = layer(x, return_aux_loss=True)
    loss = out.float().square().mean() + aux
    grads = torch.autograd.grad(loss, [x, *layer.parameters()])
    return out.detach(), loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fullgraph_training_step_matches_eager_and_keeps_one_graph_for_any_T(dtype):
    layer = _layer(dtype)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    frames = None
    for T in (12, 17, 5):
        x = torch.randn(T, 16, dtype=dtype, requires_grad=True)
        got, expect = _step(compiled, x), _step(layer, x)
        torch.testing.assert_close(got[0], expect[0], **tol)
        torch.testing.assert_close(got[1], expect[1], **tol)
        for a, b in zip(got[2], expect[2]):
            torch.testing.assert_close(a, b, **tol)
        if frames is None:
            frames = counter.frame_count
        assert counter.frame_count == frames == 1, "a new T recompiled"


def test_compiled_graph_calls_sonic_ops_and_has_no_graph_break():
    layer = _layer(torch.float32)
    explanation = torch._dynamo.explain(layer)(torch.randn(9, 16))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    code = "\n".join(str(g.graph) for g in explanation.graphs)
    assert "sonic.topk_routing" in code and "sonic.moe_experts" in code
    assert "sonic.routing_metadata" in code


def test_model_with_sonic_layers_and_collector_compiles_fullgraph():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = sonic.MoE(16, 8, 4, 2, aux_loss_coef=0.1)
            self.b = sonic.MoE(16, 8, 4, 2, aux_loss_coef=0.1)

        def forward(self, x):
            with sonic.collect_aux_losses(self) as aux:
                y = self.b(torch.nn.functional.gelu(self.a(x)))
            return y, sum(aux)

    torch.manual_seed(1)
    net = Net()
    x = torch.randn(2, 7, 16)
    y, aux = torch.compile(net, fullgraph=True)(x)
    y_ref, aux_ref = net(x)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(aux, aux_ref)
    aux.backward()
    assert net.a.gate.weight.grad.abs().sum() > 0


def test_token_rounding_layer_compiles_without_a_graph_break():
    # The layer routes padded (no host read of P), so one graph holds the whole step.
    layer = _layer(torch.float32, router="token_rounding", tile=4)
    x = torch.randn(20, 16, requires_grad=True)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(got, layer(x))


def _selection_in_torch(probs, tc_scores, tc_experts, tile, rounding, capacity):
    """What the selection kernel returns (sonic.kernels.token_rounding.token_rounding_select),
    from the torch selection: a stand-in for the kernel on the CPU. It reads its inputs'
    addresses as the kernel's launch does, which nothing traced can."""
    from sonic.kernels import runtime
    from sonic.routing import token_rounding as tr
    from sonic.routing.topk import token_major_pairs

    for t in (probs, tc_scores, tc_experts):
        runtime.address(t.contiguous(), 4)

    T, E = probs.shape
    k = tc_experts.shape[1]
    keys, order, num_kept = tr._selection(tc_scores, token_major_pairs(T, k, "cpu").long(),
                                          tc_experts.flatten().long(), probs, tile, rounding)
    keys, order = keys[:capacity], order[:capacity]
    tokens, experts = keys % T, keys // T
    real, picks = experts < E, T * k
    source = torch.where(real, torch.where(order < picks, order, picks + tokens * E + experts),
                         picks + T * E)
    values = tr.scored_routing(tokens, experts, order, tc_scores, probs, num_kept).scores
    return (tokens.int(), experts.int(), source.int(), values.float(),
            num_kept.int().reshape(()))


@pytest.fixture
def selection_kernel_stand_in(monkeypatch):
    """Token rounding takes the selection kernel's path (the op sonic::token_rounding_select),
    with the kernel replaced by :func:`_selection_in_torch`."""
    from sonic.kernels import token_rounding as kernel
    from sonic.routing import token_rounding as tr

    monkeypatch.setattr(kernel, "token_rounding_select", _selection_in_torch)
    monkeypatch.setattr(tr, "_use_kernel", lambda backend, probs: True)


def test_token_rounding_through_the_selection_op_compiles_fullgraph(selection_kernel_stand_in):
    """On a GPU token rounding selects in a CuTe kernel; as the op sonic::token_rounding_select
    it traces (its fake gives the shapes), so a token-rounding layer still compiles into one
    graph, forward and backward, and computes what it computes eagerly."""
    layer = _layer(torch.float32, router="token_rounding", tile=4)
    x = torch.randn(20, 16, requires_grad=True)
    expect = _step(layer, x)
    counter = CompileCounterWithBackend("aot_eager")
    got = _step(torch.compile(layer, fullgraph=True, backend=counter), x)
    assert counter.frame_count == 1
    for a, b in zip(_flat(got), _flat(expect)):
        torch.testing.assert_close(a, b)
    probs = torch.randn(20, 4).softmax(-1)
    tc = sonic.topk_routing(probs.log(), 2, backend="torch")
    torch.library.opcheck(torch.ops.sonic.token_rounding_select.default,
                          (probs, tc.scores, tc.expert_idx.view(20, 2), 4, "nearest", 32))


def _flat(step):
    out, loss, grads = step
    return [out, loss, *grads]


def test_exact_token_rounding_compiles_with_a_graph_break_at_its_host_read():
    def route(logits):
        return sonic.token_rounding_routing(logits, 2, tile=4).scores

    logits = torch.randn(20, 6)
    explanation = torch._dynamo.explain(route)(logits)
    assert explanation.graph_break_count >= 1
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(route)(logits), route(logits))


def test_export_forward_with_dynamic_tokens():
    layer = _layer(torch.float32).eval()
    x = torch.randn(2, 5, 16)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    exported = torch.export.export(layer, (x,), dynamic_shapes=({0: batch, 1: seq},))
    targets = {str(n.target) for n in exported.graph.nodes}
    assert {"sonic.topk_routing.default", "sonic.moe_experts.default"} <= targets
    for shape in ((2, 5, 16), (3, 9, 16)):
        x = torch.randn(*shape)
        torch.testing.assert_close(exported.module()(x), layer(x))


def test_export_training_forward():
    layer = _layer(torch.float32)
    x = torch.randn(10, 16)
    exported = torch.export.export(layer, (x,), kwargs={"return_aux_loss": True})
    out, aux = exported.module()(x, return_aux_loss=True)
    ref, aux_ref = layer(x, return_aux_loss=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(aux, aux_ref)


def _problem(T=9, d=8, n=4, E=4, K=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g, dtype=dtype)
    w1 = torch.randn(E, 2 * n, d, generator=g, dtype=dtype) / d ** 0.5
    w2 = torch.randn(E, d, n, generator=g, dtype=dtype) / n ** 0.5
    logits = torch.randn(T, E, generator=g)
    return x, w1, w2, logits


def test_opcheck_expert_and_routing_ops():
    x, w1, w2, logits = _problem()
    r = sonic.topk_routing(logits, 2, backend="torch")
    meta = sonic.routing_metadata(r, backend="torch")
    scores = r.scores.detach()
    for args in [(x.requires_grad_(), w1.requires_grad_(), w2, scores, meta.packed, 2,
                  "concat", "torch")]:
        torch.library.opcheck(torch.ops.sonic.moe_experts.default, args)
    torch.library.opcheck(torch.ops.sonic.topk_routing.default,
                          (logits.requires_grad_(), 2, "softmax_topk", False, "torch"))
    torch.library.opcheck(torch.ops.sonic.routing_metadata.default,
                          (r.token_idx, r.expert_idx, 9, 4, 0, "torch"))
    torch.library.opcheck(torch.ops.sonic.aggregate.default,
                          (torch.randn(18, 8), meta.token_rows, meta.token_offsets,
                           torch.rand(18), "torch"))


def test_moe_experts_functional_compiles_with_hand_built_pairs():
    x, w1, w2, _ = _problem()
    tok = torch.tensor([0, 1, 1, 3, 8, 8, 2])
    exp = torch.tensor([1, 0, 3, 3, 2, 0, 1])
    s = torch.rand(7)
    fn = torch.compile(sonic.moe_experts, fullgraph=True)
    torch.testing.assert_close(fn(x, w1, w2, s, tok, exp), sonic.moe_experts(x, w1, w2, s, tok, exp))


def test_backward_with_retain_graph_twice_gives_the_same_gradients():
    # retain_graph keeps the saved H: the dH step must not overwrite it then.
    layer = _layer(torch.float32)
    x = torch.randn(11, 16, requires_grad=True)
    out = layer(x)
    first = torch.autograd.grad(out.square().sum(), [x, layer.w1], retain_graph=True)
    second = torch.autograd.grad(out.square().sum(), [x, layer.w1])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)


def test_create_graph_still_raises_through_the_op():
    layer = _layer(torch.float64)
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)


def test_token_rounding_compiles_fullgraph_with_captured_scalar_outputs(monkeypatch):
    # The host read of P becomes a data-dependent size inside the graph (still a device->host
    # read when it runs, so not CUDA-graph capturable).
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)
    layer = _layer(torch.float32, router="token_rounding", tile=4)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    for T in (20, 27):
        x = torch.randn(T, 16, requires_grad=True)
        got, expect = _step(compiled, x), _step(layer, x)
        torch.testing.assert_close(got[0], expect[0])
        for a, b in zip(got[2], expect[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1


def _recording_dh(calls):
    """A dh_dswiglu that, like the CuTe dH kernel, writes dH over H when offered."""
    from sonic.reference import ops as reference

    def dh_dswiglu(dout, w2, offsets, gather_idx, h, row_scores, gate_up, *, overwrite_h=False,
                   a_out=None, activation="swiglu"):
        assert activation == "swiglu"
        calls.append(overwrite_h)
        dh, a_scaled, ds = reference.dh_dswiglu(dout, w2, offsets, gather_idx, h, row_scores,
                                                gate_up, a_out=a_out)
        if overwrite_h:
            h.copy_(dh)
            dh = h
        return dh, a_scaled, ds
    return dh_dswiglu


def test_dh_overwrites_h_only_eagerly_and_when_the_graph_is_not_kept(monkeypatch):
    import dataclasses

    import sonic.backend

    calls = []
    monkeypatch.setattr(sonic.backend, "TORCH_OPS",
                        dataclasses.replace(sonic.backend.TORCH_OPS,
                                            dh_dswiglu=_recording_dh(calls)))
    layer = _layer(torch.float32, backend="torch")
    x = torch.randn(13, 16, requires_grad=True)

    def grads(fn, **kw):
        out = fn(x)
        return torch.autograd.grad(out.square().sum(), [x, layer.w1, layer.w2], **kw)

    kept = grads(layer, retain_graph=True)                  # graph kept: H must survive
    assert calls == [False]
    eager = grads(layer)                                    # graph freed: H is dead
    assert calls == [False, True]
    compiled = grads(torch.compile(layer, fullgraph=True))  # traced: the functional op
    assert calls[2:] and not any(calls[2:])
    for a, b, c in zip(kept, eager, compiled):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_fullgraph_block_under_non_reentrant_checkpointing(router):
    """A block that checkpoints its MoE (non-reentrant) compiles into one graph, with the aux
    loss returned through the checkpoint, and matches eager; the traced forward leaves the
    module untouched."""
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.moe = _layer(torch.float32, router=router, tile=4)

        def forward(self, x):
            out, aux = checkpoint(self.moe, self.norm(x), return_aux_loss=True,
                                  use_reentrant=False)
            return x + out, aux

    def run(block, x):
        out, aux = block(x)
        loss = out.square().mean() + aux
        return out.detach(), torch.autograd.grad(loss, [x, *block.parameters()])

    block = Block()
    x = torch.randn(20, 16, requires_grad=True)
    want, want_grads = run(block, x)
    eager_routing = block.moe.last_routing
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got, grads = run(torch.compile(block, fullgraph=True, backend=counter), x)
    assert counter.frame_count == 1
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
    assert block.moe.last_routing is eager_routing


def test_opcheck_on_padded_token_rounding_routing():
    """H's padding rows (past expert_offsets[E]) are zeros on the reference, so the op's
    outputs are a function of its inputs."""
    x, w1, w2, logits = _problem(T=13)
    r = sonic.token_rounding_routing(logits, 2, tile=4, backend="torch", padded=True)
    assert int(r.num_valid) < r.num_pairs
    meta = sonic.routing_metadata(r, backend="torch")
    args = (x.requires_grad_(), w1.requires_grad_(), w2.requires_grad_(),
            r.scores.detach().requires_grad_(), meta.packed, 0, "concat", "torch")
    torch.library.opcheck(torch.ops.sonic.moe_experts.default, args)
    _, h, _ = torch.ops.sonic.moe_experts(*args)
    assert h[int(r.num_valid):].eq(0).all() and h[:int(r.num_valid)].ne(0).any()
