"""Token rounding on a CUDA device against the CPU path."""

import pytest
import torch

import sonic
from sonic.nn.moe import collect_aux_losses

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_token_rounding_cuda_matches_cpu(rounding):
    g = torch.Generator().manual_seed(5)
    for quantum in (None, 0.5, None):
        logits = torch.randn(700, 48, generator=g)
        if quantum:
            logits = (logits / quantum).round() * quantum
        cpu_logits = logits.double().requires_grad_()
        cuda_logits = logits.double().cuda().requires_grad_()
        # backend="torch": the same token choice as the CPU (the top-K kernel treats logits
        # within 2**-17 relative as tied).
        mine = sonic.token_rounding_routing(cuda_logits.float(), 4, tile=32, rounding=rounding,
                                            backend="torch")
        ref = sonic.token_rounding_routing(cpu_logits.float(), 4, tile=32, rounding=rounding)
        assert torch.equal(mine.token_idx.cpu(), ref.token_idx)
        assert torch.equal(mine.expert_idx.cpu(), ref.expert_idx)
        torch.testing.assert_close(mine.scores.cpu(), ref.scores)
        weights = torch.randn(ref.num_pairs, generator=g)
        (mine.scores * weights.cuda()).sum().backward()
        (ref.scores * weights).sum().backward()
        # fp32 scores: the gradients agree to fp32 rounding, summed in another order.
        torch.testing.assert_close(cuda_logits.grad.cpu(), cpu_logits.grad, rtol=1e-5, atol=1e-6)


def _require_kernels():
    from kernel_checks import require_kernels
    require_kernels()


def _tie_logits(T, E, ties, seed):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed))
    if ties == "rounded":
        logits = (logits * 2).round() / 2
    elif ties == "repeated_rows":
        logits = logits[torch.arange(T) % 5]
    return logits


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
@pytest.mark.parametrize("ties", [None, "rounded", "repeated_rows"])
@pytest.mark.parametrize("T,E,k,tile", [(3000, 64, 8, 128), (700, 48, 4, 32), (1, 8, 2, 128),
                                        (257, 1, 1, 16), (96, 6, 6, 16), (33000, 256, 8, 128)])
def test_selection_kernel_matches_torch_selection(rounding, ties, T, E, k, tile):
    """On one token choice, the CuTe selection routes exactly the pairs of the PyTorch
    selection (the literal-sort oracle's, tests/test_routing.py), padded alike, with equal
    scores and equal gradients to the logits."""
    _require_kernels()
    from kernel_checks import poison_allocator
    from sonic.kernels.token_rounding import token_rounding_select
    from sonic.routing import token_rounding as tr

    logits = _tie_logits(T, E, ties, seed=T + E).cuda()
    size = tr.capacity(T, E, k, tile, rounding)
    routings, grads = [], []
    for use_kernel in (True, False):
        poison_allocator()
        leaf = logits.clone().requires_grad_()
        tc = sonic.topk_routing(leaf, k)
        probs = torch.softmax(leaf, dim=-1)
        if use_kernel:
            tokens, experts, source, values, num_kept = token_rounding_select(
                probs.detach(), tc.scores.detach(), tc.expert_idx.view(T, k), tile, rounding,
                size)
            # The kernel's scores are the gathers' bit for bit, padding 0.
            gathered = tr.scored_routing(tokens, experts, source, tc.scores, probs, num_kept)
            assert torch.equal(values, gathered.scores.detach())
            # Each score's gradient slot: a pick's top-K pair (its token's choice of this
            # expert), an added pair's T·k + t·E + e, padding's T·k + T·E.
            pick, real = source < T * k, experts < E
            src = source.long().clamp(max=T * k - 1)
            assert torch.equal(tc.expert_idx[src][pick], experts[pick])
            assert torch.equal((src // k)[pick], tokens.long()[pick])
            assert torch.equal(source[~pick & real].long(),
                               (T * k + tokens.long() * E + experts.long())[~pick & real])
            assert (source[~real] == T * k + T * E).all()
            r = sonic.Routing(tokens, experts, tr.kept_scores(values, source, tc.scores, probs),
                              T, E, validated=True, num_valid=num_kept)
        else:
            keys, order, num_kept = tr._selection(tc.scores.detach(), tc.token_idx,
                                                  tc.expert_idx, probs.detach(), tile, rounding)
            r = tr.kept_routing(keys, order, num_kept, tc.scores, probs, capacity=size)
        weights = torch.randn(r.num_pairs, generator=torch.Generator().manual_seed(1)).cuda()
        (r.scores * weights).sum().backward()
        routings.append(r)
        grads.append(leaf.grad)
    mine, ref = routings
    assert int(mine.num_valid) == int(ref.num_valid)
    assert torch.equal(mine.token_idx, ref.token_idx)
    assert torch.equal(mine.expert_idx, ref.expert_idx)
    assert torch.equal(mine.scores, ref.scores)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-7)


def _tr_layer(seed=0, **kw):
    torch.manual_seed(seed)
    return sonic.MoE(256, 128, 32, 4, router="token_rounding", tile=64, device="cuda",
                     dtype=torch.bfloat16, **kw)


def _step(layer, x, grad):
    out = layer(x)
    out.backward(grad)
    return out


def test_token_rounding_layer_step_makes_no_host_sync():
    _require_kernels()
    layer = _tr_layer(aux_loss_coef=0.01)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    _step(layer, x, grad)                        # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with collect_aux_losses(layer) as aux:
            out = layer(x)
        (out.float().mul(grad.float()).sum() + sum(aux)).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert layer.last_routing.num_valid is not None


def test_token_rounding_layer_step_in_a_cuda_graph_equals_eager():
    _require_kernels()
    layer = _tr_layer(seed=3)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def grads():
        return [t.grad.clone() for t in (x, *layer.parameters())]

    eager_out = _step(layer, x, grad).detach().clone()
    eager = grads()
    # Warm up on a side stream (kernels compiled, allocator warmed), as CUDA graphs require.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            _step(layer, x, grad)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    layer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(layer, x, grad)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager_out)
    for a, b in zip(grads(), eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_padded_layer_gradients_equal_exact_routing(rounding):
    """The padded, kernel-selected layer step gives the output of the exact routing (host read
    of P) run through the same experts, and the same gradients, the router's included."""
    _require_kernels()
    layer = _tr_layer(seed=5, rounding=rounding)
    x = torch.randn(1500, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    out = _step(layer, x, grad)
    mine = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    r = sonic.token_rounding_routing(layer.gate(x), 4, tile=64, rounding=rounding)
    ref = sonic.moe_experts(x, layer.w1, layer.w2, r.scores, r.token_idx, r.expert_idx,
                            metadata=sonic.routing_metadata(r))
    ref.backward(grad)
    theirs = [x.grad] + [p.grad for p in layer.parameters()]
    assert torch.equal(out, ref)
    for a, b in zip(mine, theirs):
        # Same rows and kernels: equal up to the order of atomics in index_add (router grad).
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
