"""The FP8 activation cache on a CUDA device: the CuTe path keeping H as e4m3 +
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


@pytest.mark.parametrize("m,k", [(1, 128), (1000, 256), (4096, 2048), (33, 1536)])
def test_dequantize_rows_kernel_is_bitwise_the_reference(m, k):
    from sonic.kernels.fp8_quant import dequantize_rows
    g = torch.Generator(device="cuda").manual_seed(m + k)
    # Magnitudes over many binades, an all-zero slice and a slice of tiny values (e4m3
    # subnormals after scaling).
    x = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-4, 4, k, device="cuda")
    x[0, :128] = 0
    x[-1, -128:] *= 1e-30
    q, scales = fp8.quantize_rows(x.bfloat16())
    got = dequantize_rows(q, scales)
    want = fp8.dequantize_rows(q, scales).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (m, k)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_dequantize_rows_kernel_errors_and_empty():
    from sonic.kernels.fp8_quant import dequantize_rows
    q = torch.zeros(4, 256, device="cuda", dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize_rows(q, torch.ones(4, 2, device="cuda"))
    with pytest.raises(ValueError, match="multiple of 128"):
        dequantize_rows(q[:, :192].contiguous(), torch.ones(2, 4, device="cuda"))
    with pytest.raises(TypeError):
        dequantize_rows(q.float(), torch.ones(2, 4, device="cuda"))
    empty = dequantize_rows(q[:0], torch.ones(2, 0, device="cuda"))
    assert empty.shape == (0, 256) and empty.dtype == torch.bfloat16
