"""GPU block-scaled FP8 grouped GEMM (``grouped_gemm_fp8``) against the fp32
block-scaled reference (:func:`sonic.reference.fp8.grouped_mm_fp8_reference`) and against the bf16 kernel on the unquantized data.

Tolerances, and why:

* Against the block-scaled reference (the same quantized operands, the same per-k-block
  promotion in fp32): the only differences are fp32 summation order and the WGMMA's internal
  accumulation of a 128-wide k-block (DeepSeek-V3 §3.3.2: about 14 significant bits), both
  ~1e-5 relative, far below the output's bf16 rounding (2^-9 relative). So the kernel's bf16
  output is the reference rounded to bf16 except where the tiny difference flips a rounding:
  relative error (Frobenius) against ``ref.bfloat16()`` < 2^-8 (each side is within half an
  ulp of nearly the same fp32 value; 1e-3 was too tight: 1.05e-3 measured when one expert
  takes every row), and every element within one
  bf16 ulp (2^-7 relative) of the fp32 reference plus 1e-4 of its largest magnitude (for
  values cancelled to near zero).
* Against the bf16 kernel on the unquantized data: e4m3 keeps 3 mantissa bits, a rounding of
  ≈2.6% rms relative per operand element (measured on this data), ≈3.7–3.9% for a product of
  two; summed over K random terms the output's relative error stays about that. Bound: 6%.

Operands are quantized by :mod:`sonic.reference.fp8` (scale = amax / 448 per block, 1.0 for an
all-zero block; A scales ``(K/128, M)``, B scales ``(E, N/128, K/128)``).
"""

import functools

import pytest
import torch

from kernel_checks import (fp8_kernels,  # noqa: F401 (fixture)
                           expert_counts as _counts, expert_offsets as _offsets,
                           force_n_band, fp8_rand as _rand, poison_allocator,
                           rel_err as _rel_err)

from sonic.reference.fp8 import grouped_mm_fp8_reference, quantize_blocks, quantize_rows

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp8_kernels")]

BLOCK = 128



def _problem(num_pairs, num_experts, dim_n, dim_k, mode, gathered):
    gen = torch.Generator().manual_seed(num_pairs + 7 * dim_n + dim_k + gathered)
    offsets = _offsets(_counts(mode, num_experts, num_pairs, gen))
    w = _rand(num_experts, dim_n, dim_k, gen=gen)
    num_rows = max(num_pairs // 3, 1) if gathered else num_pairs
    x = _rand(num_rows, dim_k, gen=gen)
    idx = (torch.randint(0, num_rows, (num_pairs,), generator=gen, dtype=torch.int32).cuda()
           if gathered else None)
    return x, w, offsets, idx


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("num_pairs,num_experts,dim_n,dim_k,mode", [
    (1, 1, 128, 128, "ragged"),           # P = 1
    (1000, 8, 1536, 256, "ragged"),
    (3001, 16, 512, 1536, "empty"),       # half the experts empty
    (777, 4, 256, 384, "one"),            # one expert takes every row
    (20000, 512, 256, 128, "ragged"),     # many small experts
    (2500, 32, 2048, 768, "ragged"),      # 30B down-proj widths
    (1500, 8, 384, 2048, "ragged"),       # OLMoE d, odd n-block count
])
def test_fp8_varlen_m(num_pairs, num_experts, dim_n, dim_k, mode, gathered):
    from sonic.kernels.grouped_gemm import grouped_gemm, grouped_gemm_fp8

    x, w, offsets, idx = _problem(num_pairs, num_experts, dim_n, dim_k, mode, gathered)
    a_q, a_s = quantize_rows(x)
    b_q, b_s = quantize_blocks(w)
    args = (a_q, a_s, b_q, b_s, offsets)
    inputs = [t.clone() for t in args]
    ref = grouped_mm_fp8_reference(*args, gather_idx=idx, out_dtype=torch.float32)
    poison_allocator(512 << 20)
    out = grouped_gemm_fp8(*args, gather_idx=idx)
    assert out.shape == (num_pairs, dim_n) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    # Same math as the reference up to fp32 summation order (and the WGMMA's narrower
    # accumulation inside a k-block): out and bf16(ref) are each within half a bf16 ulp
    # (2^-9 relative) of nearly the same fp32 value, so they differ by at most 2^-8 relative.
    assert _rel_err(out, ref.bfloat16()) < 2 ** -8
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7,
                               atol=1e-4 * ref.abs().max().item())
    # Within the e4m3 bound of the bf16 GEMM on the unquantized operands.
    exact = grouped_gemm(x, w, offsets, gather_idx=idx)
    assert _rel_err(out, exact) < 0.06
    # Bitwise repeatable, writes into a given out, leaves the inputs alone.
    preset = torch.full_like(out, float("nan"))
    poison_allocator(512 << 20)
    again = grouped_gemm_fp8(*args, gather_idx=idx, out=preset)
    assert again is preset and torch.equal(out, again)
    for before, after in zip(inputs, args):
        assert torch.equal(before.view(torch.uint8) if before.dtype == torch.float8_e4m3fn
                           else before,
                           after.view(torch.uint8) if after.dtype == torch.float8_e4m3fn
                           else after)


@pytest.fixture
def fp8_banded(monkeypatch):
    """Make the FP8 varlen-M plans walk N in bands of ``width`` n-groups."""
    return functools.partial(force_n_band, monkeypatch, "e4m3")


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("gathered", [False, True])
def test_fp8_banded_tile_order_is_bitwise_the_plain_one(fp8_banded, width, gathered):
    """Banded (``n_band``, the last band narrower) the FP8 store GEMM and the SwiGLU up-proj
    compute every tile once with the same math: bitwise the unbanded outputs. N = 1280:
    five 256-wide n-tiles; half the experts empty."""
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8, grouped_gemm_fp8_swiglu

    x, w, offsets, idx = _problem(3001, 16, 1280, 512, "empty", gathered)
    a_q, a_s = quantize_rows(x)
    b_q, b_s = quantize_blocks(w)
    args = (a_q, a_s, b_q, b_s, offsets)
    plain = grouped_gemm_fp8(*args, gather_idx=idx)
    up = grouped_gemm_fp8_swiglu(*args, idx, gate_up="concat") if gathered else None
    fp8_banded(width)
    assert torch.equal(grouped_gemm_fp8(*args, gather_idx=idx), plain)
    if gathered:
        h, a = grouped_gemm_fp8_swiglu(*args, idx, gate_up="concat")
        assert torch.equal(h, up[0]) and torch.equal(a, up[1])


def test_fp8_zero_blocks_and_empty_input():
    """All-zero blocks (scale 1.0) give exact zeros; P = 0 returns an empty output."""
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8

    gen = torch.Generator().manual_seed(0)
    x = _rand(300, 256, gen=gen)
    x[:, :BLOCK] = 0
    x[17] = 0
    w = _rand(2, 256, 256, gen=gen)
    w[1] = 0
    offsets = _offsets(torch.tensor([150, 150]))
    a_q, a_s = quantize_rows(x)
    b_q, b_s = quantize_blocks(w)
    out = grouped_gemm_fp8(a_q, a_s, b_q, b_s, offsets)
    ref = grouped_mm_fp8_reference(a_q, a_s, b_q, b_s, offsets, out_dtype=torch.float32)
    assert _rel_err(out, ref.bfloat16()) < 2 ** -8
    assert torch.equal(out[150:], torch.zeros_like(out[150:]))
    assert torch.equal(out[17], torch.zeros_like(out[17]))
    empty = grouped_gemm_fp8(a_q[:0], a_s[:, :0].contiguous(), b_q, b_s,
                             _offsets(torch.tensor([0, 0])))
    assert empty.shape == (0, 256)


def test_fp8_validation_on_device():
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8

    gen = torch.Generator().manual_seed(1)
    a_q, a_s = quantize_rows(_rand(16, 256, gen=gen))
    b_q, b_s = quantize_blocks(_rand(2, 128, 256, gen=gen))
    off = _offsets(torch.tensor([8, 8]))
    with pytest.raises(ValueError, match="b_q must have E = 1 experts"):
        grouped_gemm_fp8(a_q, a_s, b_q, b_s, off[:2].contiguous())
    with pytest.raises(ValueError, match="a_scales must be contiguous"):
        grouped_gemm_fp8(a_q, a_s.t().contiguous().t(), b_q, b_s, off)
    with pytest.raises(ValueError, match="out must have shape"):
        grouped_gemm_fp8(a_q, a_s, b_q, b_s, off,
                         out=torch.empty(16, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="gather_idx must have dtype int32"):
        grouped_gemm_fp8(a_q, a_s, b_q, b_s, off, gather_idx=off.long())
