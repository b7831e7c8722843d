"""The FP8 recipe reference (sonic/reference/fp8.py): the oracle of the FP8 kernels.

Error rule checked here (derived in the module): a quantized element is within
``u·|x| + 2^-10·scale`` of ``x`` (``u = 2^-4``, e4m3 round to nearest); a block-scaled e4m3
GEMM is within :func:`fp8_error_bound` of the fp32 product elementwise, and on random normal
operands its relative Frobenius error is below ``FP8_RELATIVE_RMS_ERROR = √2·u/√3 ≈ 0.051``.
"""

import pytest
import torch

from sonic.reference.fp8 import (FP8_BLOCK, FP8_MAX, FP8_RELATIVE_RMS_ERROR,
                                 FP8_SUBNORMAL_HALF_STEP, FP8_UNIT_ROUNDOFF, dequantize_blocks,
                                 dequantize_rows,
                                 fp8_error_bound, grouped_mm_fp8_reference, quantize_blocks,
                                 quantize_rows)


def _randn(*shape, seed=0, dtype=torch.bfloat16, outliers=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    if outliers:
        mask = torch.rand(*shape, generator=gen) < 0.01
        x = torch.where(mask, x * 1000.0, x)
    return x.to(dtype)


def _per_col_row_scales(scales, k):
    return scales.t().repeat_interleave(FP8_BLOCK, dim=1)[:, :k]


@pytest.mark.parametrize("m,k", [(1, 128), (7, 128), (33, 384), (5, 200), (3, 1), (4, 1000)])
@pytest.mark.parametrize("outliers", [False, True])
def test_quantize_rows_round_trip_within_bound(m, k, outliers):
    x = _randn(m, k, seed=m * 1000 + k, outliers=outliers)
    q, scales = quantize_rows(x)
    assert q.shape == (m, k) and q.dtype == torch.float8_e4m3fn
    assert scales.shape == (-(-k // FP8_BLOCK), m) and scales.dtype == torch.float32
    assert scales.is_contiguous()
    s = _per_col_row_scales(scales, k)
    err = (dequantize_rows(q, scales) - x.float()).abs()
    assert bool((err <= FP8_UNIT_ROUNDOFF * x.float().abs() + FP8_SUBNORMAL_HALF_STEP * s).all())


def test_row_scales_are_block_amax_over_448_with_partial_block():
    x = _randn(6, 200, seed=3)
    q, scales = quantize_rows(x)
    for kb, cols in enumerate((slice(0, 128), slice(128, 200))):
        amax = x[:, cols].float().abs().amax(dim=1)
        assert torch.equal(scales[kb], amax / FP8_MAX)
        # the block maximum lands on ±448 exactly
        assert torch.equal(q[:, cols].float().abs().amax(dim=1), torch.full((6,), FP8_MAX))


def test_zero_blocks_get_scale_one_and_exact_zeros():
    x = _randn(4, 256, seed=4)
    x[1] = 0
    x[2, 128:] = 0
    q, scales = quantize_rows(x)
    assert scales[0, 1] == 1.0 and scales[1, 1] == 1.0 and scales[1, 2] == 1.0
    assert not q[1].float().any() and not q[2, 128:].float().any()
    assert torch.equal(dequantize_rows(q, scales)[1], torch.zeros(256))
    w = torch.zeros(2, 128, 256, dtype=torch.bfloat16)
    w[1, :, :128] = _randn(128, 128, seed=5)
    qw, sw = quantize_blocks(w)
    assert sw.tolist()[0] == [[1.0, 1.0]] and sw[1, 0, 1] == 1.0 and sw[1, 0, 0] != 1.0
    assert not qw[0].float().any()


def test_rounding_divides_and_ties_to_even():
    # amax 448 gives scale 1.0, so q is x rounded: 1.0625 lies halfway between 1 and 1.125
    # (even: 1.0), 1.1875 between 1.125 and 1.25 (even: 1.25); 20.5 rounds to 20.
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.1875, 20.5] + [0.0] * 123])
    q, scales = quantize_rows(x)
    assert scales.item() == 1.0
    assert q.float()[0, :5].tolist() == [448.0, 1.0, 1.25, -1.25, 20.0]
    # a quotient the division rounds just above 448 is clamped, never inf/NaN
    y = torch.tensor([[3.0e-3] * 128])
    assert q.float().isfinite().all() and quantize_rows(y)[0].float().abs().max() == FP8_MAX


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 300, 260), (1, 1, 128), (4, 128, 1)])
def test_quantize_blocks_round_trip_and_layout(shape):
    w = _randn(*shape, seed=sum(shape), outliers=True)
    q, scales = quantize_blocks(w)
    e, n, k = shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    assert q.shape == shape and scales.shape == (e, nb, kb) and scales.is_contiguous()
    for ex, i, j in ((0, 0, 0), (e - 1, nb - 1, kb - 1)):
        blk = w[ex, i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK].float()
        assert scales[ex, i, j] == blk.abs().max() / FP8_MAX
    s = scales.repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)[:, :n, :k]
    err = (dequantize_blocks(q, scales) - w.float()).abs()
    assert bool((err <= FP8_UNIT_ROUNDOFF * w.float().abs() + FP8_SUBNORMAL_HALF_STEP * s).all())
    q2, s2 = quantize_blocks(w[0])
    assert torch.equal(q2.view(torch.uint8), q[0].view(torch.uint8)) and torch.equal(s2, scales[0])
    assert torch.equal(dequantize_blocks(q2, s2), dequantize_blocks(q, scales)[0])


def test_quantize_accepts_fp32_and_strided_inputs():
    x = _randn(8, 512, seed=6, dtype=torch.float32)
    q, s = quantize_rows(x.t().contiguous().t())
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_empty_inputs():
    q, s = quantize_rows(torch.empty(0, 256, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and s.shape == (2, 0)
    q, s = quantize_blocks(torch.empty(0, 128, 128, dtype=torch.bfloat16))
    assert q.shape == (0, 128, 128) and s.shape == (0, 1, 1)


def _grouped_inputs(num_rows, k, n, counts, seed, gather=None):
    x = _randn(num_rows, k, seed=seed)
    w = _randn(len(counts), n, k, seed=seed + 1)
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    return x, w, offsets


@pytest.mark.parametrize("counts,gathered", [
    ([5, 0, 17, 3], False),            # ragged, one empty expert
    ([0, 40, 0], False),               # one expert takes every row
    ([1], False),                      # T = 1
    ([9, 0, 14], True),                # gathered rows (duplicates, as top-K routing makes)
    ([0, 0], False),                   # no rows at all
])
def test_grouped_reference_equals_dequantize_then_matmul(counts, gathered):
    k, n = 300, 200  # partial k- and n-blocks
    p = sum(counts)
    t = 11 if gathered else p
    x, w, offsets = _grouped_inputs(t, k, n, counts, seed=p + 7)
    gather_idx = torch.randint(0, t, (p,), generator=torch.Generator().manual_seed(1)) \
        if gathered else None
    aq, a_s = quantize_rows(x)
    bq, b_s = quantize_blocks(w)
    out = grouped_mm_fp8_reference(aq, a_s, bq, b_s, offsets, gather_idx, out_dtype=torch.float32)
    assert out.shape == (p, n) and out.dtype == torch.float32
    a_deq = dequantize_rows(aq, a_s).double()
    if gathered:
        a_deq = a_deq[gather_idx]
    b_deq = dequantize_blocks(bq, b_s).double()
    bounds = offsets.tolist()
    for e in range(len(counts)):
        rows = slice(bounds[e], bounds[e + 1])
        expected = a_deq[rows] @ b_deq[e].t()
        # same math up to the fp32 rounding of the sums and of the scale products
        torch.testing.assert_close(out[rows].double(), expected, rtol=1e-5, atol=1e-4)
    again = grouped_mm_fp8_reference(aq, a_s, bq, b_s, offsets, gather_idx,
                                     out_dtype=torch.float32)
    assert torch.equal(out, again)


@pytest.mark.parametrize("k", [128, 512, 2048])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_grouped_reference_error_against_fp32_within_stated_bounds(k, out_dtype):
    counts = [70, 0, 58]
    x, w, offsets = _grouped_inputs(sum(counts), k, 256, counts, seed=k)
    x[3, 5] = 2000.0      # an outlier: its row's block loses resolution, the bound follows
    aq, a_s = quantize_rows(x)
    bq, b_s = quantize_blocks(w)
    out = grouped_mm_fp8_reference(aq, a_s, bq, b_s, offsets, out_dtype=out_dtype).double()
    bounds = offsets.tolist()
    for e in range(len(counts)):
        lo, hi = bounds[e], bounds[e + 1]
        exact = x[lo:hi].double() @ w[e].double().t()
        bound = fp8_error_bound(x[lo:hi], w[e], a_s[:, lo:hi], b_s[e], out_dtype)
        assert bool(((out[lo:hi] - exact).abs() <= bound).all())
        if hi > lo and lo > 3:  # rows without the outlier: random normal data
            rel = (out[lo:hi] - exact).norm() / exact.norm()
            assert rel < FP8_RELATIVE_RMS_ERROR, rel


def test_reference_validation():
    x = _randn(4, 256)
    aq, a_s = quantize_rows(x)
    bq, b_s = quantize_blocks(_randn(2, 128, 256))
    off = torch.tensor([0, 1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="block must be a positive int"):
        quantize_rows(x, block=0)
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_rows(x.to(torch.int32))
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        quantize_rows(x[0])
    with pytest.raises(ValueError, match="w must have 2 or 3 dimensions"):
        quantize_blocks(x[0])
    with pytest.raises(TypeError, match="q must have dtype float8_e4m3fn"):
        dequantize_rows(x, a_s)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 4\)"):
        dequantize_rows(aq, a_s.t().contiguous())
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize_blocks(bq, b_s[:, :, :1])
    with pytest.raises(ValueError, match="a_q has K = 128 columns but b_q"):
        grouped_mm_fp8_reference(aq[:, :128], a_s[:1], bq, b_s, off)
    with pytest.raises(ValueError, match="a_scales must have shape"):
        grouped_mm_fp8_reference(aq, a_s[:, :2], bq, b_s, off)
    with pytest.raises(TypeError, match="b_scales must have dtype float32"):
        grouped_mm_fp8_reference(aq, a_s, bq, b_s.double(), off)
    with pytest.raises(ValueError, match="expert_offsets must rise from 0 to the 4 rows"):
        grouped_mm_fp8_reference(aq, a_s, bq, b_s, torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="expert_offsets must be an integer tensor"):
        grouped_mm_fp8_reference(aq, a_s, bq, b_s, off[:2])
    with pytest.raises(ValueError, match=r"gather_idx must index rows of a_q in \[0, 4\)"):
        grouped_mm_fp8_reference(aq, a_s, bq, b_s, off, torch.tensor([0, 1, 4, 2]))
    with pytest.raises(TypeError, match="out_dtype must be"):
        grouped_mm_fp8_reference(aq, a_s, bq, b_s, off, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="a \\(M, K\\) and b \\(N, K\\)"):
        fp8_error_bound(x, x[:, :128], a_s, b_s[0])


def test_kernel_entry_points_reject_cpu_and_dtype():
    from sonic.kernels.fp8_quant import quantize_blocks as k_blocks, quantize_rows as k_rows

    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        k_rows(_randn(4, 256))
    with pytest.raises(TypeError, match="x must have dtype bfloat16"):
        k_rows(_randn(4, 256, dtype=torch.float32))
    with pytest.raises(ValueError, match="w must be on a CUDA device"):
        k_blocks(_randn(2, 128, 256))
    with pytest.raises(ValueError, match="w must have 3 dimension"):
        k_blocks(_randn(2, 2, 128, 256))


def test_error_bound_grows_with_accumulation_roundoff():
    x, w = _randn(16, 512, seed=8), _randn(128, 512, seed=9)
    (_, a_s), (_, b_s) = quantize_rows(x), quantize_blocks(w)
    fp32 = fp8_error_bound(x, w, a_s, b_s)
    wgmma = fp8_error_bound(x, w, a_s, b_s, accum_roundoff=2.0 ** -14)
    assert bool((wgmma > fp32).all())
    with pytest.raises(ValueError, match="accum_roundoff must be in"):
        fp8_error_bound(x, w, a_s, b_s, accum_roundoff=1.5)


def _expert_rows(counts, cols, gathered, seed):
    g = torch.Generator().manual_seed(seed)
    off = torch.zeros(len(counts) + 1, dtype=torch.int32)
    off[1:] = torch.tensor(counts).cumsum(0)
    rows = int(off[-1])
    x = torch.randn(max(rows // 2, 1) if gathered else rows, cols, generator=g)
    x = (x * torch.exp(torch.randn(x.shape[0], 1, generator=g))).to(torch.bfloat16)
    idx = (torch.randint(0, x.shape[0], (rows,), generator=g, dtype=torch.int32)
           if gathered else None)
    return x, off, idx


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("counts", [[1], [0, 300, 0, 128, 5], [257, 1, 0], [0, 0, 7]])
def test_quantize_cols_grouped_is_per_expert_column_blocks(counts, gathered):
    """Each expert's rows, transposed, quantized per 1 x 128 slice (= 128 x 1 blocks of the
    rows), zero-padded to whole blocks, at the padded offsets; the tail zeros with scale 1."""
    from sonic.reference.fp8 import padded_offsets, padded_rows_bound, quantize_cols_grouped

    x, off, idx = _expert_rows(counts, 256, gathered, sum(counts))
    k_off = padded_offsets(off)
    assert k_off.dtype == torch.int32
    assert (k_off[1:] - k_off[:-1]).tolist() == [-(-c // FP8_BLOCK) * FP8_BLOCK for c in counts]
    q_t, scales = quantize_cols_grouped(x, off, k_off, idx)
    bound = padded_rows_bound(int(off[-1]), len(counts))
    assert q_t.shape == (256, bound) and scales.shape == (bound // FP8_BLOCK, 256)
    rows = x if idx is None else x[idx.long()]
    for e, c in enumerate(counts):
        lo, k0 = int(off[e]), int(k_off[e])
        padded = torch.zeros(-(-c // FP8_BLOCK) * FP8_BLOCK, 256, dtype=torch.bfloat16)
        padded[:c] = rows[lo:lo + c]
        want_q, want_s = quantize_rows(padded.t())
        got = q_t[:, k0:k0 + padded.shape[0]]
        assert torch.equal(got.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scales[k0 // FP8_BLOCK:k0 // FP8_BLOCK + want_s.shape[0]], want_s)
    tail = int(k_off[-1])
    assert not q_t[:, tail:].float().any() and (scales[tail // FP8_BLOCK:] == 1).all()


def test_varlen_k_fp8_reference_against_fp32():
    """The promoted reference equals the per-expert product of the dequantized copies (fp32
    order aside), is an e4m3 rounding away from the unquantized product, and gives zeros for
    an empty expert."""
    from sonic.reference.fp8 import (grouped_mm_varlen_k_fp8_reference, padded_offsets,
                                     quantize_cols_grouped)

    counts = [300, 0, 129, 64]
    a, off, _ = _expert_rows(counts, 256, False, 1)
    b, _, _ = _expert_rows(counts, 128, False, 2)
    k_off = padded_offsets(off)
    a_t, b_t = quantize_cols_grouped(a, off, k_off), quantize_cols_grouped(b, off, k_off)
    out = grouped_mm_varlen_k_fp8_reference(*a_t, *b_t, k_off, out_dtype=torch.float32)
    assert out.shape == (4, 256, 128) and not out[1].any()
    deq_a = a_t[0].float() * a_t[1].t().repeat_interleave(FP8_BLOCK, 1)
    deq_b = b_t[0].float() * b_t[1].t().repeat_interleave(FP8_BLOCK, 1)
    bounds = off.tolist()
    for e in range(4):
        lo, hi = int(k_off[e]), int(k_off[e + 1])
        want = deq_a[:, lo:hi] @ deq_b[:, lo:hi].t()
        torch.testing.assert_close(out[e], want, rtol=1e-4,
                                   atol=1e-5 * want.abs().max().item())
        if hi > lo:
            exact = a[bounds[e]:bounds[e + 1]].float().t() @ b[bounds[e]:bounds[e + 1]].float()
            rel = ((out[e] - exact).norm() / exact.norm()).item()
            assert rel < 1.5 * FP8_RELATIVE_RMS_ERROR, (e, rel)
    with pytest.raises(ValueError, match="must share R"):
        grouped_mm_varlen_k_fp8_reference(a_t[0], a_t[1], b_t[0][:, :128], b_t[1][:1], k_off)


def test_set_fp8_weight_grads_validates_and_returns_the_previous_choice():
    from sonic.backend import fp8_weight_grads, set_fp8_weight_grads

    assert fp8_weight_grads() == "auto"
    with pytest.raises(ValueError, match="kind"):
        set_fp8_weight_grads("e4m3")
    assert set_fp8_weight_grads("fp8") == "auto" and fp8_weight_grads() == "fp8"
    assert set_fp8_weight_grads("bf16") == "fp8"
    assert set_fp8_weight_grads("auto") == "bf16"
