"""GPU block-scaled FP8 grouped GEMM (``grouped_gemm_fp8``, issue 18) against a local fp32
block-scaled reference and against the bf16 kernel on the unquantized data.

Tolerances, and why:

* Against the block-scaled reference (the same quantized operands, the same per-k-block
  promotion in fp32): the only differences are fp32 summation order and the WGMMA's internal
  accumulation of a 128-wide k-block (DeepSeek-V3 §3.3.2: about 14 significant bits), both
  ~1e-5 relative, far below the output's bf16 rounding (2^-9 relative). So the kernel's bf16
  output is the reference rounded to bf16 except where the tiny difference flips a rounding:
  relative error (Frobenius) against ``ref.bfloat16()`` < 1e-3, and every element within one
  bf16 ulp (2^-7 relative) of the fp32 reference plus 1e-4 of its largest magnitude (for
  values cancelled to near zero).
* Against the bf16 kernel on the unquantized data: e4m3 keeps 3 mantissa bits, a rounding of
  ≈2.6% rms relative per operand element (measured on this data), ≈3.7–3.9% for a product of
  two; summed over K random terms the output's relative error stays about that. Bound: 6%.

The local reference follows the shared FP8 conventions (scale = amax / 448 per block, 1.0 for
an all-zero block; A scales ``(K/128, M)``, B scales ``(E, N/128, K/128)``); the lead replaces
it with :mod:`sonic.reference.fp8` at merge.
"""

import pytest
import torch

from kernel_checks import poison_allocator, require_kernels

pytestmark = pytest.mark.gpu

BLOCK = 128
E4M3_MAX = 448.0


@pytest.fixture(autouse=True)
def _needs_kernels(monkeypatch):
    require_kernels()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FP8 grouped GEMM runs on sm_90a only")
    # The reference's k-block products are exact in fp32 only without TF32.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _scale(amax):
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _quantize_rows(x):
    """(M, K) -> e4m3 (M, K), fp32 scales (K/128, M): one per row and 128 columns."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    scales = _scale(blocks.abs().amax(-1))
    q = (blocks / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), scales.t().contiguous()


def _quantize_blocks(w):
    """(E, N, K) -> e4m3 (E, N, K), fp32 scales (E, N/128, K/128): one per 128 x 128 block."""
    e, n, k = w.shape
    blocks = w.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scales = _scale(blocks.abs().amax(dim=(2, 4)))
    q = (blocks / scales[:, :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn).view(e, n, k), scales.contiguous()


def _reference(a_q, a_scales, b_q, b_scales, offsets, gather_idx=None):
    """fp32 ``sum_kb (A_q,kb · B_q,kbᵀ) · (a_scale · b_scale)`` per expert: the promoted
    mainloop's math (products of e4m3 values and their 128-term sums are exact in fp32)."""
    if gather_idx is not None:
        a_q, a_scales = a_q[gather_idx.long()], a_scales[:, gather_idx.long()]
    out = torch.zeros(a_q.shape[0], b_q.shape[1], dtype=torch.float32, device=a_q.device)
    off = offsets.tolist()
    for e in range(b_q.shape[0]):
        r0, r1 = off[e], off[e + 1]
        if r0 == r1:
            continue
        for kb in range(b_q.shape[2] // BLOCK):
            cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
            part = a_q[r0:r1, cols].float() @ b_q[e, :, cols].float().t()
            scale = (a_scales[kb, r0:r1, None]
                     * b_scales[e, :, kb].repeat_interleave(BLOCK)[None, :])
            out[r0:r1] += part * scale
    return out


def _counts(mode, num_experts, num_pairs, gen):
    if mode == "one":
        counts = torch.zeros(num_experts, dtype=torch.long)
        counts[num_experts // 2] = num_pairs
        return counts
    weights = torch.rand(num_experts, generator=gen) + 0.05
    if mode == "empty":
        weights[torch.randperm(num_experts, generator=gen)[: (num_experts + 1) // 2]] = 0
    choice = torch.multinomial(weights, num_pairs, replacement=True, generator=gen)
    return torch.bincount(choice, minlength=num_experts)


def _offsets(counts):
    off = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    off[1:] = counts.cumsum(0)
    return off.cuda()


def _rand(*shape, gen):
    """bf16 data whose rows (and, for weights, 128-blocks) differ in magnitude by up to ~50x,
    so that every scale matters."""
    x = torch.randn(*shape, generator=gen) + 0.1
    row_gain = torch.exp(torch.randn(*shape[:-1], 1, generator=gen))
    return (x * row_gain).to(torch.bfloat16).cuda()


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


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
    a_q, a_s = _quantize_rows(x)
    b_q, b_s = _quantize_blocks(w)
    args = (a_q, a_s, b_q, b_s, offsets)
    inputs = [t.clone() for t in args]
    ref = _reference(*args, gather_idx=idx)
    poison_allocator(512 << 20)
    out = grouped_gemm_fp8(*args, gather_idx=idx)
    assert out.shape == (num_pairs, dim_n) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    # Same math as the reference: equal up to bf16 rounding flips.
    assert _rel_err(out, ref.bfloat16()) < 1e-3
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
    a_q, a_s = _quantize_rows(x)
    b_q, b_s = _quantize_blocks(w)
    out = grouped_gemm_fp8(a_q, a_s, b_q, b_s, offsets)
    ref = _reference(a_q, a_s, b_q, b_s, offsets)
    assert _rel_err(out, ref.bfloat16()) < 1e-3
    assert torch.equal(out[150:], torch.zeros_like(out[150:]))
    assert torch.equal(out[17], torch.zeros_like(out[17]))
    empty = grouped_gemm_fp8(a_q[:0], a_s[:, :0].contiguous(), b_q, b_s,
                             _offsets(torch.tensor([0, 0])))
    assert empty.shape == (0, 256)


def test_fp8_validation_on_device():
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8

    gen = torch.Generator().manual_seed(1)
    a_q, a_s = _quantize_rows(_rand(16, 256, gen=gen))
    b_q, b_s = _quantize_blocks(_rand(2, 128, 256, gen=gen))
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
