"""The whole MoE path on a CUDA device (auto backend: CuTe kernels where they exist)."""

import pytest
import torch

import sonic

from _reference import naive_moe, random_problem

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
@pytest.mark.parametrize("router", ["topk", "token_rounding"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_moe_experts_cuda_bf16_matches_fp32_reference(gate_up, router, backend):
    T, d, n, E, K = 1000, 256, 128, 16, 4
    x, w1, w2, _, _, _ = random_problem(T, d, n, E, K=K, seed=11)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(12))
    if router == "topk":
        r = sonic.topk_routing(logits.cuda(), K, backend=backend)
    else:
        r = sonic.token_rounding_routing(logits.cuda(), K, tile=64)
    s = r.scores.detach()
    leaves = [t.cuda().bfloat16().requires_grad_() for t in (x, w1, w2)] + [s.clone().requires_grad_()]
    out = sonic.moe_experts(*leaves, r.token_idx, r.expert_idx, gate_up=gate_up, backend=backend)
    ref_leaves = [t.detach().float().cpu().requires_grad_() for t in leaves]
    ref = naive_moe(*ref_leaves, r.token_idx.cpu(), r.expert_idx.cpu(), gate_up=gate_up)
    assert _rel(out.cpu(), ref) < 1e-2
    grad = torch.randn(T, d)
    out.backward(grad.cuda().bfloat16())
    ref.backward(grad)
    for mine, theirs in zip(leaves, ref_leaves):
        assert _rel(mine.grad.cpu(), theirs.grad) < 2e-2


def test_backward_writes_dh_over_h_only_when_the_graph_is_freed():
    """The dH kernel overwrites the saved H with dH only when no later backward can read H:
    with retain_graph a second backward gives the same gradients as the first, and a backward
    that frees the graph needs one P x 2n buffer less at its peak."""
    T, d, n, E, K = 4096, 256, 512, 8, 4
    x, w1, w2, s, tok, exp = [t.cuda() for t in random_problem(T, d, n, E, K=K, seed=21)]
    leaves = [t.bfloat16().requires_grad_() for t in (x, w1, w2)] + [s.requires_grad_()]
    grad = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)

    def backward_peak(retain):
        out = sonic.moe_experts(*leaves, tok, exp)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(out, leaves, grad, retain_graph=retain)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return out, grads, peak

    out, first, kept_peak = backward_peak(True)
    second = torch.autograd.grad(out, leaves, grad)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    del out
    _, freed, freed_peak = backward_peak(False)
    assert all(torch.equal(a, b) for a, b in zip(first, freed))
    h_bytes = T * K * 2 * n * 2
    assert kept_peak - freed_peak >= 0.9 * h_bytes, (kept_peak, freed_peak, h_bytes)
    # Nothing H-sized besides: the backward's new buffers are at most A', dX̃'s rows and the
    # gradients (a materialised zero gradient of the H output once added a P x 2n buffer).
    P = T * K
    grads = sum(t.numel() * t.element_size() for t in leaves)
    bound = P * n * 2 + P * d * 2 + grads + (2 << 20)
    assert freed_peak <= bound, (freed_peak, bound)


def test_moe_layer_cuda_training_step_is_deterministic():
    def step():
        torch.manual_seed(0)
        layer = sonic.MoE(128, 64, 8, 2, aux_loss_coef=0.01, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16, generator=None)
        out, aux_loss = layer(x, return_aux_loss=True)
        (out.float().square().mean() + aux_loss).backward()
        return [p.grad.clone() for p in layer.parameters()]

    for a, b in zip(step(), step()):
        assert torch.equal(a, b)


def test_saved_tensors_on_cuda_are_x_h_and_metadata():
    T, d, n, E, K = 512, 128, 64, 8, 2
    x, w1, w2, s, tok, exp = [t.cuda() for t in random_problem(T, d, n, E, K=K, seed=13)]
    leaves = [t.bfloat16().requires_grad_() for t in (x, w1, w2)] + [s.requires_grad_()]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sonic.moe_experts(*leaves, tok, exp)
    P = T * K
    new = [t for t in saved if all(t is not leaf for leaf in leaves)]
    big = [tuple(t.shape) for t in new if t.numel() >= P * 2 * n]
    assert big == [(P, 2 * n)]


@pytest.mark.parametrize("dtype,d,n,E", [(torch.float16, 64, 32, 8), (torch.bfloat16, 20, 12, 8),
                                         (torch.bfloat16, 64, 32, 600), (torch.float32, 64, 32, 8)])
def test_auto_backend_serves_shapes_the_kernels_do_not(dtype, d, n, E):
    """fp16/fp32, d or n not a multiple of 8, E above the metadata kernel's limit: the auto
    backend falls back step by step and still matches the reference."""
    T, K = 300, 2
    x, w1, w2, _, _, _ = random_problem(T, d, n, E, K=K, seed=14)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(15))
    r = sonic.topk_routing(logits.cuda().to(dtype), K)
    leaves = [t.cuda().to(dtype).requires_grad_() for t in (x, w1, w2)]
    s = r.scores.detach().clone().requires_grad_()
    out = sonic.moe_experts(*leaves, s, r.token_idx, r.expert_idx,
                            metadata=sonic.routing_metadata(r))
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in (*leaves, s)]
    ref = naive_moe(*ref_leaves, r.token_idx.cpu().long(), r.expert_idx.cpu().long())
    assert _rel(out.cpu(), ref) < 1e-2
    out.backward(torch.ones_like(out))
    ref.backward(torch.ones_like(ref))
    for mine, theirs in zip((*leaves, s), ref_leaves):
        assert _rel(mine.grad.cpu(), theirs.grad) < 2e-2


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_layer_input_gradient_summed_in_the_gate_gemm(precision):
    """The gate's backward adds dLogits·W_r into the experts' dX in place (one GEMM): same
    gradients as the unfused gate (a hook on the gate turns the fusion off), the caller's
    output gradient untouched, no host synchronisation."""
    torch.manual_seed(7)
    layer = sonic.MoE(256, 128, 8, 2, device="cuda", dtype=torch.bfloat16, precision=precision)
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d_out = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    d_out_before = d_out.clone()

    def grads():
        for t in [x, *layer.parameters()]:
            t.grad = None
        layer(x).backward(d_out)
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    grads()     # compile and make the FP8 weight copies outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused = grads()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    handle = layer.gate.register_forward_hook(lambda m, i, o: None)
    plain = grads()
    handle.remove()
    assert torch.equal(d_out, d_out_before)
    # x.grad: one rounding of the sum instead of two; everything else bitwise.
    assert _rel(fused[0], plain[0]) < 4e-3
    for a, b in zip(fused[1:], plain[1:]):
        assert torch.equal(a, b)
