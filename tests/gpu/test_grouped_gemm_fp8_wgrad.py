"""GPU FP8 weight gradients: ``quantize_cols_grouped`` bitwise against its reference,
and ``grouped_gemm_varlen_k_fp8`` against the promoted fp32 reference
(:func:`sonic.reference.fp8.grouped_mm_varlen_k_fp8_reference`) and the bf16 varlen-K kernel.

Tolerances, and why (as in ``test_grouped_gemm_fp8.py``):

* Quantization: the same amax, IEEE division and e4m3 rounding as the reference, so bitwise
  (every column of the K-major copy, padding and the unused tail included).
* GEMM against the reference on the same quantized operands: fp32 summation order and the
  WGMMA's narrower accumulation inside a 128-row block (DeepSeek-V3 §3.3.2: about 14
  significant bits) differ. In the Frobenius norm that is far below the bf16 output rounding:
  error against ``ref.bfloat16()`` < 2^-8. Per element the accumulation error scales with the
  block's sum of |products|, not with the result: rows here differ in magnitude by up to
  ~50x, so a k-block's terms do too, and an element that cancels to near zero can err by
  several percent of itself (7% seen on 2 of 262144 elements). So every element within one
  bf16 ulp (2^-7 relative) plus 2^-10 of ``Σ |a|·|b|`` over its expert's rows (measured on
  the H200: at most 2^-11.2 on this data, 2^-13.3 on randn; 32 products per WGMMA each
  truncated by up to 2^-14 of the largest would be 2^-9).
* Against the bf16 varlen-K kernel on the unquantized rows: two e4m3 roundings per product,
  ≈3.7–3.9% rms relative on this data; bound 6%.
"""

import pytest
import torch

from kernel_checks import (fp8_kernels,  # noqa: F401 (fixture)
                           expert_counts as _counts, expert_offsets as _offsets,
                           fp8_rand as _rand, poison_allocator, rel_err as _rel_err)

from sonic.reference import fp8 as R

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp8_kernels")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _abs(q: torch.Tensor) -> torch.Tensor:
    """|q| of an e4m3 tensor (its sign bit cleared)."""
    return (q.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def _rows(num_pairs, num_experts, cols, mode, gathered, seed):
    gen = torch.Generator().manual_seed(seed)
    offsets = _offsets(_counts(mode, num_experts, num_pairs, gen))
    num_src = max(num_pairs // 3, 1) if gathered else num_pairs
    x = _rand(num_src, cols, gen=gen)
    idx = (torch.randint(0, num_src, (num_pairs,), generator=gen, dtype=torch.int32).cuda()
           if gathered else None)
    return x, offsets, idx


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("num_pairs,num_experts,cols,mode", [
    (1, 1, 128, "ragged"),            # T = 1: one row, 127 rows of padding
    (1000, 8, 768, "ragged"),
    (3001, 16, 256, "empty"),         # half the experts empty
    (777, 4, 384, "one"),             # one expert takes every row
    (4096, 32, 128, "ragged"),
    (20000, 256, 2048, "ragged"),     # many experts, 30B's d
    (2500, 8, 640, "ragged"),         # an odd number of chunks per strip (5)
])
def test_quantize_cols_grouped_bitwise(num_pairs, num_experts, cols, mode, gathered):
    from sonic.kernels.fp8_quant import quantize_cols_grouped

    x, offsets, idx = _rows(num_pairs, num_experts, cols, mode, gathered, num_pairs + cols)
    x[0, :5] *= 300.0                                 # an outlier column block
    x[:, 8:16] *= 1e-30         # tiny columns: their threads take the division instruction
    x[1::7] = -0.0              # negative zeros keep their sign
    k_offsets = R.padded_offsets(offsets)
    want = R.quantize_cols_grouped(x, offsets, k_offsets, idx)
    before = x.clone()
    poison_allocator(256 << 20)
    got = quantize_cols_grouped(x, offsets, k_offsets, idx)
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert torch.equal(_bits(got[0]), _bits(want[0]))
    assert torch.equal(got[1], want[1])
    assert torch.equal(x, before)


def test_quantize_cols_grouped_exact_multiples_and_padded_routing():
    """Counts that are multiples of 128 (no padding), and rows past ``offsets[E]`` (a padded
    routing's padding, NaN here) that must not be read."""
    from sonic.kernels.fp8_quant import quantize_cols_grouped

    gen = torch.Generator().manual_seed(3)
    x = _rand(1024, 256, gen=gen)
    x[900:] = float("nan")
    offsets = _offsets(torch.tensor([256, 0, 512, 128]))
    k_offsets = R.padded_offsets(offsets)
    assert k_offsets.tolist() == offsets.tolist()
    got = quantize_cols_grouped(x, offsets, k_offsets)
    want = R.quantize_cols_grouped(x, offsets, k_offsets)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(got[1], want[1])
    assert torch.isfinite(got[1]).all()


@pytest.mark.parametrize("gathered", [False, True])
def test_quantize_cols_grouped_nonfinite_like_reference(gathered):
    """A NaN inside an expert's rows gives its column block the reference's scale 1.0, an inf
    the scale inf; every other block of the column and every other column is unaffected."""
    from sonic.kernels.fp8_quant import quantize_cols_grouped

    x, offsets, idx = _rows(1000, 8, 256, "ragged", gathered, 11)
    rows = idx.long() if gathered else torch.arange(x.shape[0], device=x.device)
    x[rows[5], 3] = float("nan")
    x[rows[700], 130] = float("-inf")
    k_offsets = R.padded_offsets(offsets)
    got = quantize_cols_grouped(x, offsets, k_offsets, idx)
    want = R.quantize_cols_grouped(x, offsets, k_offsets, idx)
    assert torch.equal(got[1], want[1])
    assert (want[1] == 1.0).any() and want[1].isinf().any()
    nan = want[0].float().isnan()
    assert torch.equal(got[0].float().isnan(), nan) and nan.any()
    # NaN bytes may differ in the sign bit (0x7F against 0xFF); every other byte is equal
    assert torch.equal(_bits(got[0])[~nan], _bits(want[0])[~nan])


def test_quantize_cols_grouped_without_rows():
    """No rows at all: the copy is all padding, zeros with scale 1, as the reference's."""
    from sonic.kernels.fp8_quant import quantize_cols_grouped

    x = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    offsets = _offsets(torch.zeros(3, dtype=torch.long))
    k_offsets = R.padded_offsets(offsets)
    got, want = (f(x, offsets, k_offsets) for f in (quantize_cols_grouped,
                                                      R.quantize_cols_grouped))
    assert got[0].shape == want[0].shape == (256, 256)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(got[1], want[1])


def _wgrad_problem(num_pairs, num_experts, dim_m, dim_n, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    offsets = _offsets(_counts(mode, num_experts, num_pairs, gen))
    a, b = _rand(num_pairs, dim_m, gen=gen), _rand(num_pairs, dim_n, gen=gen)
    return a, b, offsets


@pytest.mark.parametrize("num_pairs,num_experts,dim_m,dim_n,mode", [
    (1, 1, 128, 128, "ragged"),           # T = 1
    (1000, 8, 256, 128, "ragged"),        # even m-tiles: 2-CTA cluster
    (1000, 8, 384, 256, "ragged"),        # odd m-tiles: one CTA
    (3001, 16, 1536, 512, "empty"),       # half the experts get zeros
    (777, 4, 256, 384, "one"),            # one expert takes every row
    (20000, 128, 256, 256, "ragged"),     # 128 experts
    (8192, 16, 1536, 2048, "ragged"),     # 30B dW1 widths (2n, d)
])
def test_varlen_k_fp8(num_pairs, num_experts, dim_m, dim_n, mode):
    from sonic.kernels.fp8_quant import quantize_cols_grouped
    from sonic.kernels.grouped_gemm import grouped_gemm_varlen_k, grouped_gemm_varlen_k_fp8

    a, b, offsets = _wgrad_problem(num_pairs, num_experts, dim_m, dim_n, mode,
                                   num_pairs + dim_m + dim_n)
    k_offsets = R.padded_offsets(offsets)
    a_t = quantize_cols_grouped(a, offsets, k_offsets)
    b_t = quantize_cols_grouped(b, offsets, k_offsets)
    inputs = [t.clone() for t in (*a_t, *b_t)]
    ref = R.grouped_mm_varlen_k_fp8_reference(*a_t, *b_t, k_offsets, out_dtype=torch.float32)
    poison_allocator(512 << 20)
    out = grouped_gemm_varlen_k_fp8(*a_t, *b_t, k_offsets)
    assert out.shape == (num_experts, dim_m, dim_n) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    assert _rel_err(out, ref.bfloat16()) < 2 ** -8
    magnitude = R.grouped_mm_varlen_k_fp8_reference(_abs(a_t[0]), a_t[1], _abs(b_t[0]), b_t[1],
                                                    k_offsets, out_dtype=torch.float32)
    assert ((out.float() - ref).abs() <= 2 ** -7 * ref.abs() + 2 ** -10 * magnitude).all()
    counts = (offsets[1:] - offsets[:-1]).tolist()
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(out[e], torch.zeros_like(out[e]))
    # Within the e4m3 bound of the bf16 varlen-K kernel on the unquantized rows.
    assert _rel_err(out, grouped_gemm_varlen_k(a, b, offsets)) < 0.06
    poison_allocator(512 << 20)
    assert torch.equal(out, grouped_gemm_varlen_k_fp8(*a_t, *b_t, k_offsets))
    for before, after in zip(inputs, (*a_t, *b_t)):
        assert torch.equal(_bits(before), _bits(after))


def test_varlen_k_fp8_gathered_operand_matches_its_copy():
    """Gathering while quantizing equals quantizing the gathered rows (dW1's X side)."""
    from sonic.kernels.fp8_quant import quantize_cols_grouped
    from sonic.kernels.grouped_gemm import grouped_gemm_varlen_k_fp8

    x, offsets, idx = _rows(5000, 16, 512, "ragged", True, 11)
    k_offsets = R.padded_offsets(offsets)
    gathered = quantize_cols_grouped(x, offsets, k_offsets, idx)
    copied = quantize_cols_grouped(x.index_select(0, idx.long()).contiguous(), offsets,
                                   k_offsets)
    assert torch.equal(_bits(gathered[0]), _bits(copied[0]))
    dh = quantize_cols_grouped(_rand(5000, 256, gen=torch.Generator().manual_seed(2)),
                               offsets, k_offsets)
    assert torch.equal(grouped_gemm_varlen_k_fp8(*dh, *gathered, k_offsets),
                       grouped_gemm_varlen_k_fp8(*dh, *copied, k_offsets))


def test_varlen_k_fp8_validation_on_device():
    from sonic.kernels.fp8_quant import quantize_cols_grouped
    from sonic.kernels.grouped_gemm import grouped_gemm_varlen_k_fp8

    a, b, offsets = _wgrad_problem(300, 2, 256, 128, "ragged", 0)
    k_offsets = R.padded_offsets(offsets)
    a_t, b_t = (quantize_cols_grouped(t, offsets, k_offsets) for t in (a, b))
    with pytest.raises(ValueError, match="N \\(rows of b_t_q\\) must be a positive multiple"):
        grouped_gemm_varlen_k_fp8(*a_t, b_t[0][:64].contiguous(), b_t[1][:, :64].contiguous(),
                                  k_offsets)
    with pytest.raises(ValueError, match="b_scales must have shape"):
        grouped_gemm_varlen_k_fp8(*a_t, b_t[0], a_t[1], k_offsets)
    with pytest.raises(TypeError, match="a_t_q must have dtype"):
        grouped_gemm_varlen_k_fp8(a_t[0].float(), a_t[1], *b_t, k_offsets)
    with pytest.raises(ValueError, match="must be a multiple of 128"):
        quantize_cols_grouped(a[:, :200].contiguous(), offsets, k_offsets)
    # B's scales are bulk-copied into the operand stages: 16-byte aligned.
    shifted = torch.empty(b_t[1].numel() + 1, dtype=torch.float32, device="cuda")[1:]
    shifted = shifted.view_as(b_t[1]).copy_(b_t[1])
    with pytest.raises(ValueError, match="b_scales data at .* is not 16-byte aligned"):
        grouped_gemm_varlen_k_fp8(*a_t, b_t[0], shifted, k_offsets)
