"""GPU block-scaled FP8 up-proj with the SwiGLU epilogue (``grouped_gemm_fp8_swiglu``)
against the fp32 block-scaled reference (:func:`sonic.reference.fp8.grouped_mm_fp8_reference`)
followed by :func:`sonic.reference.ops.swiglu`.

Tolerances, and why:

* H: the mainloop of ``grouped_gemm_fp8`` (tests/gpu/test_grouped_gemm_fp8.py states the
  argument): the kernel's fp32 sum differs from the reference's only in summation order
  (~1e-5 relative), then both are rounded to bf16. Relative error (Frobenius) against
  ``bf16(ref)`` < 2^-8, and every element within one bf16 ulp (2^-7 relative) of the fp32
  reference plus 1e-4 of its largest magnitude.
* A: the epilogue computes ``A = bf16(silu(g)·u)`` from H's *bf16* g and u (so the backward's
  recomputation from the saved H matches bitwise): A is the standalone SwiGLU kernel of the
  returned H, bitwise. Against ``swiglu`` of the fp32 reference, each of g, u carries a bf16
  rounding (at most 2^-8 relative: 8 significand bits, round to nearest) and A one more:
  ``|ΔA| ≤ 2^-8·(|u|·|g|·max|silu'| + |A| + |A|)`` to first order, with
  ``max|silu'| < 1.1``; asserted with 25% slack for the second-order terms, the summation
  order and the epilogue's fast sigmoid (the emulated kernel reaches 0.9 of the bound on
  this data), plus a Frobenius bound of 2^-7 (emulated: ~3e-3).

Operands are quantized by :mod:`sonic.reference.fp8`; W1 is quantized in the layout it is
passed in (its 128 x 128 blocks are blocks of that layout's rows).
"""

import pytest
import torch

from kernel_checks import (fp8_kernels,  # noqa: F401 (fixture)
                           expert_counts as _counts, expert_offsets as _offsets, fp8_rand,
                           poison_allocator, rel_err)

from sonic.reference import ops as ref_ops
from sonic.reference.fp8 import grouped_mm_fp8_reference, quantize_blocks, quantize_rows

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp8_kernels")]



def _problem(num_pairs, num_experts, n, dim_k, mode):
    gen = torch.Generator().manual_seed(num_pairs + 7 * n + dim_k)
    offsets = _offsets(_counts(mode, num_experts, num_pairs, gen))
    w1 = fp8_rand(num_experts, 2 * n, dim_k, gen=gen)
    num_tokens = max(num_pairs // 3, 1)
    x = fp8_rand(num_tokens, dim_k, gen=gen)
    idx = torch.randint(0, num_tokens, (num_pairs,), generator=gen, dtype=torch.int32).cuda()
    x_q, x_s = quantize_rows(x)
    w_q, w_s = quantize_blocks(w1)
    return (x_q, x_s, w_q, w_s, offsets, idx)


def _check_h_and_a(h, a, ref_h, gate_up):
    from sonic.kernels.swiglu import swiglu

    assert not h.isnan().any() and not a.isnan().any()
    assert rel_err(h, ref_h.bfloat16()) < 2 ** -8
    torch.testing.assert_close(h.float(), ref_h, rtol=2 ** -7,
                               atol=1e-4 * ref_h.abs().max().item())
    # A is the standalone SwiGLU of the stored H, bitwise (the backward recomputes it so).
    assert torch.equal(a, swiglu(h, gate_up))
    ref_a = ref_ops.swiglu(ref_h, gate_up)
    gate, up = ref_ops.split_gate_up(ref_h, gate_up)
    # bf16 roundings of H and A, plus H's allowed fp32-order difference (the atol above)
    # carried through SwiGLU (|silu'| <= 1.1): large on data whose k-blocks cancel.
    h_atol = 1e-4 * ref_h.abs().max().item()
    bound = (1.25 * 2 ** -8 * (1.1 * (gate * up).abs() + 2 * ref_a.abs())
             + h_atol * (1.1 * up.abs() + torch.nn.functional.silu(gate).abs()))
    excess = (a.float() - ref_a).abs() - bound
    assert excess.max().item() <= 1e-6 * ref_a.abs().max().item(), excess.max().item()
    assert rel_err(a, ref_a) < 2 ** -7


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
@pytest.mark.parametrize("num_pairs,num_experts,n,dim_k,mode", [
    (1, 1, 64, 128, "ragged"),            # P = 1, the smallest 2n (one n-tile)
    (4096, 8, 128, 128, "ragged"),        # sonic.train's defaults: one k-tile, many rows
    (3001, 16, 256, 1536, "empty"),       # half the experts empty
    (2000, 4, 1024, 512, "one"),          # one expert takes every row
    (4097, 128, 192, 256, "ragged"),      # n = 192: concat up halves start mid scale block
    (2500, 8, 256, 384, "ragged"),        # three k-tiles: a pair, then the odd one
    (6000, 64, 768, 2048, "ragged"),      # 30B-A3B widths (d = 2048, n = 768)
])
def test_fp8_up_proj_swiglu(num_pairs, num_experts, n, dim_k, mode, gate_up):
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8_swiglu

    args = _problem(num_pairs, num_experts, n, dim_k, mode)
    x_q, x_s, w_q, w_s, offsets, idx = args
    inputs = [t.clone() for t in args]
    ref_h = grouped_mm_fp8_reference(x_q, x_s, w_q, w_s, offsets, gather_idx=idx,
                                     out_dtype=torch.float32)
    poison_allocator(512 << 20)
    h, a = grouped_gemm_fp8_swiglu(*args, gate_up=gate_up)
    assert h.shape == (num_pairs, 2 * n) and a.shape == (num_pairs, n)
    assert h.dtype == a.dtype == torch.bfloat16
    _check_h_and_a(h, a, ref_h, gate_up)
    # Bitwise repeatable, writes into given buffers, leaves the inputs alone.
    h_pre = torch.full_like(h, float("nan"))
    a_pre = torch.full_like(a, float("nan"))
    poison_allocator(512 << 20)
    h2, a2 = grouped_gemm_fp8_swiglu(*args, gate_up=gate_up, h_out=h_pre, act_out=a_pre)
    assert h2 is h_pre and a2 is a_pre
    assert torch.equal(h, h2) and torch.equal(a, a2)
    for before, after in zip(inputs, args):
        view = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
        assert torch.equal(view(before), view(after))


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_fp8_swiglu_matches_the_fp8_store_kernel(gate_up):
    """The same mainloop: H equals ``grouped_gemm_fp8`` on W1 in the layout given, bitwise
    ("interleaved": same B tiles; "concat": B in halves, per-half scales, same sums)."""
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8, grouped_gemm_fp8_swiglu

    args = _problem(2500, 8, 320, 768, "ragged")
    h, _ = grouped_gemm_fp8_swiglu(*args, gate_up=gate_up)
    x_q, x_s, w_q, w_s, offsets, idx = args
    assert torch.equal(h, grouped_gemm_fp8(x_q, x_s, w_q, w_s, offsets, gather_idx=idx))


def test_fp8_swiglu_empty_input():
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8_swiglu

    x_q, x_s, w_q, w_s, _, _ = _problem(10, 2, 128, 256, "ragged")
    offsets = _offsets(torch.tensor([0, 0]))
    idx = torch.empty(0, dtype=torch.int32, device="cuda")
    h, a = grouped_gemm_fp8_swiglu(x_q, x_s, w_q, w_s, offsets, idx)
    assert h.shape == (0, 256) and a.shape == (0, 128)


def test_fp8_swiglu_validation_on_device():
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8_swiglu

    args = _problem(16, 2, 128, 256, "ragged")
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"h_out must have shape \(16, 256\)"):
        grouped_gemm_fp8_swiglu(*args, h_out=torch.empty(16, 128, **bf16))
    with pytest.raises(TypeError, match="act_out must have dtype bfloat16"):
        grouped_gemm_fp8_swiglu(*args, act_out=torch.empty(16, 128, device="cuda"))
    with pytest.raises(ValueError, match=r"act_out must have shape \(16, 128\)"):
        grouped_gemm_fp8_swiglu(*args, act_out=torch.empty(16, 256, **bf16))
    with pytest.raises(TypeError, match="gather_idx must have dtype int32"):
        grouped_gemm_fp8_swiglu(*args[:5], args[5].long())
    with pytest.raises(ValueError, match="x_scales must be contiguous"):
        grouped_gemm_fp8_swiglu(args[0], args[1].t().contiguous().t(), *args[2:])
