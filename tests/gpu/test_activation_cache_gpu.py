"""The FP8 activation cache (issue 18) on a CUDA device: the CuTe path keeping H as e4m3 +
1x128 scales against the reference path with the same cache, its saved bytes and forward peak,
and a training step without a host synchronisation."""

import pytest
import torch

import sonic
from sonic.ops import routing_metadata_op
from sonic.reference import fp8

from _reference import random_problem

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _leaves(T, d, n, E, K, seed):
    x, w1, w2, s, tok, exp = random_problem(T, d, n, E, K=K, seed=seed)
    leaves = [t.cuda().bfloat16().requires_grad_() for t in (x, w1, w2)]
    return leaves + [s.cuda().requires_grad_()], tok.cuda(), exp.cuda()


def _step(leaves, tok, exp, grad, **kw):
    for t in leaves:
        t.grad = None
    out = sonic.moe_experts(*leaves, tok, exp, **kw)
    out.backward(grad)
    return out.detach(), [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_cute_fp8_cache_matches_reference_fp8_cache(gate_up):
    T, d, n, E, K = 2048, 256, 256, 16, 4
    leaves, tok, exp = _leaves(T, d, n, E, K, seed=31)
    grad = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    out_bf16, _ = _step(leaves, tok, exp, grad, gate_up=gate_up, backend="auto")
    out_cute, grads_cute = _step(leaves, tok, exp, grad, gate_up=gate_up, backend="auto",
                                 activation_cache="fp8")
    out_ref, grads_ref = _step(leaves, tok, exp, grad, gate_up=gate_up, backend="torch",
                               activation_cache="fp8")
    assert torch.equal(out_cute, out_bf16)       # the forward does not read the cache
    assert _rel(out_cute, out_ref) < 1e-2
    for name, mine, theirs in zip(("dx", "dw1", "dw2", "ds"), grads_cute, grads_ref):
        assert _rel(mine, theirs) < 2e-2, name


def test_cute_cache_is_the_reference_quantization_of_the_kernels_h():
    """The e4m3 H and scales the CuTe path saves are sonic.reference.fp8.quantize_rows of the H
    its up-proj kernel writes, bit for bit."""
    T, d, n, E, K = 1024, 256, 192, 8, 2
    leaves, tok, exp = _leaves(T, d, n, E, K, seed=32)
    x, w1, w2, s = (t.detach() for t in leaves)
    meta = routing_metadata_op(tok, exp, T, E, None, "auto").packed
    _, h, _ = torch.ops.sonic.moe_experts(x, w1, w2, s, meta, 0, "concat", "auto", "bf16")
    _, q, scales = torch.ops.sonic.moe_experts(x, w1, w2, s, meta, 0, "concat", "auto", "fp8")
    q_ref, scales_ref = fp8.quantize_rows(h)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (2 * n // 128, T * K)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scales, scales_ref)


def test_fp8_cache_saved_bytes_and_forward_peak():
    """Saved MiB at most 55% of the bf16 cache's; the forward peak is not above bf16's (H is
    quantized and freed before the down-proj allocates Y; here d >= 2n, so H + A + Y of the
    bf16 path exceeds both H + A + q and A + q + Y)."""
    torch.manual_seed(0)
    layer = sonic.MoE(512, 256, 8, 4, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bf16 = sonic.profile_activation_memory(layer, x)
    layer.activation_cache = "fp8"
    fp8_cache = sonic.profile_activation_memory(layer, x)
    assert fp8_cache.activation_bytes <= 0.55 * bf16.activation_bytes
    assert fp8_cache.peak_bytes <= bf16.peak_bytes, (fp8_cache.peak_bytes, bf16.peak_bytes)


def test_fp8_cache_training_step_makes_no_host_sync():
    torch.manual_seed(0)
    layer = sonic.MoE(256, 128, 16, 4, device="cuda", dtype=torch.bfloat16,
                      activation_cache="fp8")
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    layer(x).backward(grad)                      # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
