"""GPU block-scaled FP8 dH kernel (``grouped_gemm_fp8_dswiglu``): ``dA' = gather(dO)·W2``
on e4m3 operands with the dSwiGLU epilogue, against the fp32 block-scaled reference
(:func:`sonic.reference.fp8.grouped_mm_fp8_reference` on the quantized ``W2ᵀ``) followed by
:func:`sonic.reference.ops.dswiglu_epilogue`.

Tolerances, and why: the kernel's fp32 dA' equals the reference's up to summation order
(~1e-5 relative, tests/gpu/test_grouped_gemm_fp8.py), and the epilogue's inputs H and the
scores are the same tensors, so the outputs differ by their final rounding: dH and A' are
rounded once to bf16 (at most 2^-8 relative each) — Frobenius relative error < 2^-7 —;
ds stays fp32 (a sum over n of products, differences ~1e-5 relative unless it cancels) —
Frobenius < 1e-3. Against the bf16 dH kernel on the unquantized dO and W2: the e4m3 rounding of
dA' (≈4% rms, see the FP8 GEMM test), which dH inherits linearly — bound 6%.
"""

import pytest
import torch

from kernel_checks import (fp8_kernels,  # noqa: F401 (fixture)
                           dh_problem, expert_offsets as _offsets, force_n_band, fp8_rand,
                           poison_allocator, rel_err)

from sonic.reference import ops as ref_ops
from sonic.reference.fp8 import grouped_mm_fp8_reference, quantize_blocks, quantize_rows

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp8_kernels")]



def _problem(num_pairs, num_experts, n, dim_k, mode):
    offsets, w2, dout, idx, h, scores = dh_problem(num_pairs, num_experts, n, dim_k, mode,
                                                   num_pairs + 5 * n + dim_k, rand=fp8_rand)
    return dout, w2, offsets, idx, h, scores


@pytest.mark.parametrize("num_pairs,num_experts,n,dim_k,mode", [
    (1, 1, 128, 128, "ragged"),           # P = 1, one n-tile
    (4096, 8, 128, 128, "ragged"),        # sonic.train's defaults: one k-tile, many rows
    (3001, 16, 256, 1536, "empty"),       # half the experts empty
    (2000, 4, 1024, 512, "one"),          # one expert takes every row
    (4097, 128, 384, 256, "ragged"),      # odd n-tile count
    (2500, 8, 256, 384, "ragged"),        # three k-tiles: a pair, then the odd one
    (6000, 64, 768, 2048, "ragged"),      # 30B-A3B widths (d = 2048, n = 768)
])
def test_fp8_dh_dswiglu(num_pairs, num_experts, n, dim_k, mode):
    from sonic.kernels.grouped_gemm import grouped_gemm_dswiglu, grouped_gemm_fp8_dswiglu

    dout, w2, offsets, idx, h, scores = _problem(num_pairs, num_experts, n, dim_k, mode)
    dout_q, dout_s = quantize_rows(dout)
    w2t_q, w2t_s = quantize_blocks(w2.transpose(1, 2).contiguous())
    args = (dout_q, dout_s, w2t_q, w2t_s, offsets, idx, h, scores)
    da_prime = grouped_mm_fp8_reference(dout_q, dout_s, w2t_q, w2t_s, offsets, gather_idx=idx,
                                        out_dtype=torch.float32)
    ref_dh, ref_a, ref_ds = ref_ops.dswiglu_epilogue(da_prime, h.float(), scores, "concat")
    poison_allocator(512 << 20)
    dh, a_scaled, ds = grouped_gemm_fp8_dswiglu(*args)
    assert dh.shape == (num_pairs, 2 * n) and a_scaled.shape == (num_pairs, n)
    assert ds.shape == (num_pairs,) and ds.dtype == torch.float32
    for out, expected, bound in ((dh, ref_dh, 2 ** -7), (a_scaled, ref_a, 2 ** -7),
                                 (ds, ref_ds, 1e-3)):
        assert not out.isnan().any()
        assert rel_err(out, expected.float()) < bound
    exact_dh = grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores)[0]
    assert rel_err(dh, exact_dh) < 0.06
    # Bitwise repeatable; dH written over H itself gives the same results.
    poison_allocator(512 << 20)
    again = grouped_gemm_fp8_dswiglu(*args)
    assert all(torch.equal(x, y) for x, y in zip(again, (dh, a_scaled, ds)))
    a_pre = torch.full_like(a_scaled, float("nan"))
    in_place = grouped_gemm_fp8_dswiglu(*args, dh_out=h, a_out=a_pre)
    assert in_place[0].data_ptr() == h.data_ptr() and in_place[1] is a_pre
    assert all(torch.equal(x, y) for x, y in zip(in_place, (dh, a_scaled, ds)))


@pytest.mark.parametrize("width", [1, 3])
def test_fp8_dh_dswiglu_banded_is_bitwise_the_plain_one(monkeypatch, width):
    """Banded (``n_band``, the last band narrower: n = 1280 is five 256-wide n-tiles) the
    fused FP8 dH kernel computes every tile once with the same math: dH, A' and ds bitwise
    the unbanded ones; half the experts empty."""
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8_dswiglu

    dout, w2, offsets, idx, h, scores = _problem(3001, 16, 1280, 512, "empty")
    dout_q, dout_s = quantize_rows(dout)
    w2t_q, w2t_s = quantize_blocks(w2.transpose(1, 2).contiguous())
    args = (dout_q, dout_s, w2t_q, w2t_s, offsets, idx, h, scores)
    plain = grouped_gemm_fp8_dswiglu(*args)
    force_n_band(monkeypatch, "e4m3", width)
    banded = grouped_gemm_fp8_dswiglu(*args)
    assert all(torch.equal(x, y) for x, y in zip(banded, plain))


def test_fp8_dswiglu_empty_and_validation():
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8_dswiglu

    dout, w2, offsets, idx, h, scores = _problem(16, 2, 128, 256, "ragged")
    dout_q, dout_s = quantize_rows(dout)
    w2t_q, w2t_s = quantize_blocks(w2.transpose(1, 2).contiguous())
    q = (dout_q, dout_s, w2t_q, w2t_s)
    empty = torch.empty(0, dtype=torch.int32, device="cuda")
    dh, a_scaled, ds = grouped_gemm_fp8_dswiglu(
        *q, _offsets(torch.tensor([0, 0])), empty, h[:0], scores[:0])
    assert dh.shape == (0, 256) and a_scaled.shape == (0, 128) and ds.shape == (0,)
    with pytest.raises(ValueError, match=r"h must have shape \(P, 2n\)"):
        grouped_gemm_fp8_dswiglu(*q, offsets, idx, h[:, :128].contiguous(), scores)
    with pytest.raises(ValueError, match="row_scores must have P = 16 entries"):
        grouped_gemm_fp8_dswiglu(*q, offsets, idx, h, scores[:4].contiguous())
    buf = torch.zeros(17 * 256, dtype=torch.bfloat16, device="cuda")
    h_in_buf, shifted = buf[:16 * 256].view(16, 256), buf[256:].view(16, 256)
    h_in_buf.copy_(h)
    with pytest.raises(ValueError, match="dh_out must be h itself"):
        grouped_gemm_fp8_dswiglu(*q, offsets, idx, h_in_buf, scores, dh_out=shifted)
