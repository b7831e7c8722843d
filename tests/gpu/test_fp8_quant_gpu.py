"""GPU FP8 quantization kernels (sonic/kernels/fp8_quant.py) bitwise against the CPU reference.

The kernels and :mod:`sonic.reference.fp8` make the same fp32 operations (amax, ``amax / 448``,
IEEE ``x / scale``, round-to-nearest-even e4m3 with saturation), so ``q`` (compared as bytes)
and the scales must be equal, not close. Inputs: bf16 normals with 1 % outliers ×1000, a zero
row and a zero block, a row of large values (~1e30), a row of tiny ones (~1e-30, whose small
elements fall in e4m3's subnormal range) and bf16 subnormals (fp32-subnormal scales), 1 % negative
zeros.
Outputs are poisoned first (0xFF is NaN in e4m3 and fp32), and every launch is run twice.
"""

import pytest
import torch

from sonic.reference import fp8 as ref

from kernel_checks import poison_allocator, require_kernels


def _inputs(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    x = torch.where(torch.rand(*shape, generator=gen) < 0.01, x * 1000.0, x)
    # Negative zeros: the GPU's quotient keeps a zero's sign (fp8_quant.quotient).
    x = torch.where(torch.rand(*shape, generator=gen) < 0.01, torch.full_like(x, -0.0), x)
    rows = x.view(-1, shape[-1])
    specials = [0.0, None, 1e30, 1e-30, 1e-39]   # zero row, zero block, large, tiny, subnormal
    for i, factor in enumerate(specials[:rows.shape[0]]):
        if factor is None:
            rows[i, :128] = 0
        else:
            rows[i] *= factor
    return x.to(torch.bfloat16)


def _assert_bitwise(q, scales, q_ref, s_ref):
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert q.shape == q_ref.shape and scales.shape == s_ref.shape
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scales.cpu().view(torch.int32), s_ref.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [128, 384, 4096, 7168])
@pytest.mark.parametrize("m", [1, 7, 32, 33, 1000, 4097])
def test_quantize_rows_bitwise(m, k):
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_rows

    x = _inputs(m, k, seed=m * 7 + k)
    q_ref, s_ref = ref.quantize_rows(x)
    xd = x.cuda()
    poison_allocator()
    q, scales = quantize_rows(xd)
    _assert_bitwise(q, scales, q_ref, s_ref)
    poison_allocator()
    q2, s2 = quantize_rows(xd)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scales, s2)
    assert torch.equal(xd.cpu(), x)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 128, 128), (3, 256, 1024), (8, 300, 384), (2, 1, 128),
                                   (4, 7168, 256)])
def test_quantize_blocks_bitwise(shape):
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_blocks

    w = _inputs(*shape, seed=sum(shape))
    q_ref, s_ref = ref.quantize_blocks(w)
    poison_allocator()
    q, scales = quantize_blocks(w.cuda())
    _assert_bitwise(q, scales, q_ref, s_ref)
    poison_allocator()
    q2, s2 = quantize_blocks(w.cuda())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scales, s2)
    q2d, s2d = quantize_blocks(w[0].cuda())
    _assert_bitwise(q2d, s2d, q_ref[0], s_ref[0])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 128, 128), (3, 256, 384), (8, 2048, 1024)])
def test_quantize_blocks_transposed_bitwise(shape):
    """The one-pass transposed copy equals the reference quantization of ``wᵀ``, and the
    untransposed outputs are those of the plain kernel."""
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_blocks

    w = _inputs(*shape, seed=7 + sum(shape))
    w[0, :128, :128] = 0                      # an all-zero block: scale 1 in both copies
    q_ref, s_ref, qt_ref, st_ref = ref.quantize_blocks_and_transpose(w)
    poison_allocator()
    q, scales, q_t, scales_t = quantize_blocks(w.cuda(), transposed=True)
    _assert_bitwise(q, scales, q_ref, s_ref)
    _assert_bitwise(q_t, scales_t, qt_ref, st_ref)
    with pytest.raises(ValueError, match="transposed"):
        quantize_blocks(w[:, :64].contiguous().cuda(), transposed=True)


@pytest.mark.gpu
def test_quantize_rows_nonfinite_like_reference():
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_rows

    x = _inputs(4, 256, seed=3)
    x[1, 5] = float("nan")
    x[2, 200] = float("inf")
    q_ref, s_ref = ref.quantize_rows(x)
    q, scales = quantize_rows(x.cuda())
    # the NaN block's scale is 1.0 and the inf block's inf, in both
    assert torch.equal(scales.cpu(), s_ref) and s_ref[0, 1] == 1.0 and s_ref[1, 2].isinf()
    q = q.cpu()
    nan = q_ref.float().isnan()
    assert torch.equal(q.float().isnan(), nan)
    # NaN bytes may differ in the sign bit (0x7F against 0xFF); every other byte is equal
    assert torch.equal(q.view(torch.uint8)[~nan], q_ref.view(torch.uint8)[~nan])


@pytest.mark.gpu
def test_quantize_rows_past_2_31_elements():
    """M·K > 2**31: the last rows are addressed with 64-bit offsets (checked on a tail slice)."""
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_rows

    k = 4096
    m = (1 << 31) // k + 40
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    q, scales = quantize_rows(x)
    tail = slice(m - 40, m)
    q_ref, s_ref = ref.quantize_rows(x[tail].cpu())
    _assert_bitwise(q[tail], scales[:, tail].contiguous(), q_ref, s_ref)


@pytest.mark.gpu
def test_empty_and_validation_on_gpu():
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_blocks, quantize_rows

    q, s = quantize_rows(torch.empty(0, 256, device="cuda", dtype=torch.bfloat16))
    assert q.shape == (0, 256) and s.shape == (2, 0)
    q, s = quantize_blocks(torch.empty(0, 128, 256, device="cuda", dtype=torch.bfloat16))
    assert q.shape == (0, 128, 256) and s.shape == (0, 1, 2)
    x = torch.randn(8, 200, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x's last dimension K must be a multiple of 128"):
        quantize_rows(x)
    with pytest.raises(ValueError, match="w's last dimension K must be a multiple of 128"):
        quantize_blocks(x[None])
    with pytest.raises(ValueError, match="x must be contiguous"):
        quantize_rows(torch.randn(256, 8, device="cuda", dtype=torch.bfloat16).t())
    with pytest.raises(TypeError, match="w must have dtype bfloat16"):
        quantize_blocks(torch.randn(1, 128, 128, device="cuda"))
