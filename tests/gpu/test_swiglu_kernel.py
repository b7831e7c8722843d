"""GPU SwiGLU and dSwiGLU-epilogue kernels against the PyTorch reference evaluated in fp32.

Tolerances (inputs of unit scale: H = 2·randn, dA' = randn, scores in [0.1, 1.1)):

* bf16 outputs: the kernel (σ from the hardware ex2/rcp approximations) and the fp32 reference
  agree to ~1e-6 relative before the kernel's single rounding to bf16, which adds at most half
  a bf16 ulp (2**-9 ≈ 0.002 relative); so ``rtol=1e-2`` leaves a margin of ~5, and
  ``atol=1e-3`` only covers values near zero (e.g. ``d_gate`` where ``1 + g(1 − σ)``
  cancels), whose absolute error is ~1e-5 at most.
* ``ds``: an fp32 sum of ``n`` products in another order than torch's; its error is a small
  multiple of ``√n · eps · Σ|dA'·A|`` (an fp32 emulation of the kernel's order and
  approximations stays below ``5e-7 · Σ|dA'·A|`` on these inputs), so ``rtol=1e-4`` plus an
  absolute term of ``1e-5 · Σ|dA'·A|`` per row (rows whose sum cancels to near zero).
"""

import pytest
import torch

from sonic.reference import ops as ref

from kernel_checks import poison_allocator, require_kernels

BF16_TOL = dict(rtol=1e-2, atol=1e-3)
LAYOUTS = ("concat", "interleaved")


def _inputs(p, n, seed, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(p, 2 * n, generator=gen)).to(torch.bfloat16).to(device)
    da_prime = torch.randn(p, n, generator=gen).to(torch.bfloat16).to(device)
    scores = (torch.rand(p, generator=gen) + 0.1).to(device)
    return da_prime, h, scores


def _assert_ds_close(ds, da_prime, h, scores, gate_up, ref_ds):
    gate, up = ref.split_gate_up(h.float(), gate_up)
    magnitude = (da_prime.float() * torch.nn.functional.silu(gate) * up).abs().sum(dim=-1)
    err = (ds - ref_ds).abs()
    bound = 1e-4 * ref_ds.abs() + 1e-5 * magnitude
    assert bool((err <= bound).all()), f"ds off by {(err - bound).max().item():.3g} over the bound"


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("n", [8, 256, 520, 1024, 2304, 4232])
@pytest.mark.parametrize("p", [1, 7, 1000, 4097])
def test_swiglu_matches_reference(p, n, gate_up):
    require_kernels()
    from sonic.kernels.swiglu import swiglu

    _, h, _ = _inputs(p, n, seed=p * 31 + n)
    h_before = h.clone()
    expected = ref.swiglu(h.float(), gate_up)
    poison_allocator()
    a = swiglu(h, gate_up)
    assert a.shape == (p, n) and a.dtype == torch.bfloat16
    assert not a.isnan().any()
    torch.testing.assert_close(a.float(), expected, **BF16_TOL)
    poison_allocator()
    assert torch.equal(a, swiglu(h, gate_up))
    assert torch.equal(h, h_before)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("n", [8, 256, 520, 1024, 2304, 4232])
@pytest.mark.parametrize("p", [1, 7, 1000, 4097])
def test_dswiglu_epilogue_matches_reference(p, n, gate_up):
    require_kernels()
    from sonic.kernels.swiglu import dswiglu_epilogue

    da_prime, h, scores = _inputs(p, n, seed=p * 17 + n)
    before = [t.clone() for t in (da_prime, h, scores)]
    ref_dh, ref_a, ref_ds = ref.dswiglu_epilogue(da_prime.float(), h.float(), scores, gate_up)
    poison_allocator()
    dh, a_scaled, ds = dswiglu_epilogue(da_prime, h, scores, gate_up)
    assert dh.shape == (p, 2 * n) and dh.dtype == torch.bfloat16
    assert a_scaled.shape == (p, n) and a_scaled.dtype == torch.bfloat16
    assert ds.shape == (p,) and ds.dtype == torch.float32
    for out in (dh, a_scaled, ds):
        assert not out.isnan().any()
    torch.testing.assert_close(dh.float(), ref_dh, **BF16_TOL)
    torch.testing.assert_close(a_scaled.float(), ref_a, **BF16_TOL)
    _assert_ds_close(ds, da_prime, h, scores, gate_up, ref_ds)
    poison_allocator()
    again = dswiglu_epilogue(da_prime, h, scores, gate_up)
    for first, second in zip((dh, a_scaled, ds), again):
        assert torch.equal(first, second)
    for b, t in zip(before, (da_prime, h, scores)):
        assert torch.equal(b, t)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("p,n", [(1, 8), (1000, 520), (4097, 1024), (7, 4232)])
def test_dswiglu_epilogue_in_place_equals_out_of_place(p, n, gate_up):
    """dH over H and A' over dA' (what the FP8 and unfused backward steps ask for) give the
    out-of-place results bit for bit; partly overlapping outputs are refused."""
    require_kernels()
    from sonic.kernels.swiglu import dswiglu_epilogue

    da_prime, h, scores = _inputs(p, n, seed=p + n)
    want = dswiglu_epilogue(da_prime, h, scores, gate_up)
    h_buf, da_buf = h.clone(), da_prime.clone()
    got = dswiglu_epilogue(da_buf, h_buf, scores, gate_up, dh_out=h_buf, a_out=da_buf)
    assert got[0].data_ptr() == h_buf.data_ptr() and got[1].data_ptr() == da_buf.data_ptr()
    for first, second in zip(want, got):
        assert torch.equal(first, second)
    a_out = torch.full_like(da_prime, float("nan"))
    only_a = dswiglu_epilogue(da_prime, h, scores, gate_up, a_out=a_out)
    assert only_a[1] is a_out and torch.equal(a_out, want[1])
    buf = torch.empty(p * 2 * n + 8, dtype=torch.bfloat16, device="cuda")
    shifted = buf[8:].view(p, 2 * n)
    shifted.copy_(h)
    with pytest.raises(ValueError, match="dh_out"):
        dswiglu_epilogue(da_prime, shifted, scores, gate_up,
                         dh_out=buf[:p * 2 * n].view(p, 2 * n))
    with pytest.raises(ValueError, match="a_out"):
        dswiglu_epilogue(da_prime, h, scores, gate_up, a_out=h.view(-1)[:p * n].view(p, n))


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("p,n", [(1, 128), (7, 384), (1000, 1024), (4097, 256), (5, 2304),
                                 (9, 4224), (3, 14336)])
def test_swiglu_quantized_is_quantize_rows_of_swiglu(p, n, gate_up):
    """A written in e4m3 with its 1x128 scales equals quantizing the bf16 A afterwards, bit
    for bit (kernel and reference quantization alike): rows six decades apart in magnitude
    (each row and block gets its own scale), an all-zero row (scale 1), and n = 384 (a last
    pass where half the lanes have no columns but join the amax shuffles)."""
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_rows
    from sonic.kernels.swiglu import swiglu
    from sonic.reference import fp8 as fp8_reference

    _, h, _ = _inputs(p, n, seed=p + 3 * n)
    magnitudes = torch.logspace(-3, 3, p, device="cuda")[:, None]
    h = (h.float() * magnitudes).to(torch.bfloat16)
    h[p // 2] = 0
    poison_allocator()
    q, scales = swiglu(h, gate_up, quantize=True)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (p, n)
    assert scales.dtype == torch.float32 and scales.shape == (n // 128, p)
    a = swiglu(h, gate_up)
    for want_q, want_scales in (quantize_rows(a), fp8_reference.quantize_rows(a)):
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scales, want_scales)
    assert torch.all(scales[:, p // 2] == 1.0)
    with pytest.raises(ValueError, match="multiple of 128"):
        swiglu(h[:, :2 * 64].contiguous(), gate_up, quantize=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("p,n", [(1, 128), (7, 384), (1000, 1024), (4097, 256), (5, 2304),
                                 (9, 4224), (3, 14336)])
def test_swiglu_quantize_h_is_quantize_rows_of_h(p, n, gate_up):
    """With quantize_h the same pass also writes H in e4m3 with its 1x128 scales (the FP8
    activation cache): bitwise quantize_rows(h), kernel and reference alike, and A's e4m3 and
    scales are those of quantize=True alone. The first n columns of H are scaled up 64x so
    that neighbouring blocks (concat: gate and up) get different scales."""
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_rows
    from sonic.kernels.swiglu import swiglu
    from sonic.reference import fp8 as fp8_reference

    _, h, _ = _inputs(p, n, seed=p + 7 * n)
    h = (h.float() * torch.logspace(-3, 3, p, device="cuda")[:, None]).to(torch.bfloat16)
    h[:, :n] *= 64
    h[p // 2] = 0
    h_before = h.clone()
    want_a = swiglu(h, gate_up, quantize=True)
    poison_allocator()
    got = swiglu(h, gate_up, quantize=True, quantize_h=True)
    assert len(got) == 4 and torch.equal(h, h_before)
    assert torch.equal(got[0].view(torch.uint8), want_a[0].view(torch.uint8))
    assert torch.equal(got[1], want_a[1])
    h_q, h_scales = got[2:]
    assert h_q.dtype == torch.float8_e4m3fn and h_q.shape == (p, 2 * n)
    assert h_scales.shape == (2 * n // 128, p)
    for want_q, want_scales in (quantize_rows(h), fp8_reference.quantize_rows(h)):
        assert torch.equal(h_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(h_scales, want_scales)
    assert torch.all(h_scales[:, p // 2] == 1.0)
    with pytest.raises(ValueError, match="quantize_h=True\\) needs quantize=True"):
        swiglu(h, gate_up, quantize_h=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("p,n", [(1, 128), (7, 384), (1000, 1024), (4097, 256), (5, 2304),
                                 (9, 4224), (3, 14336)])
def test_dswiglu_quantize_dh_is_quantize_rows_of_dh(p, n, gate_up):
    """dH also written in e4m3 with its 1x128 scales (concat: a slice's gate and up values in
    two blocks; interleaved: 16 consecutive columns) equals quantizing the bf16 dH afterwards,
    bit for bit; dH, A' and ds are those of the plain call, also with dH written over H."""
    require_kernels()
    from sonic.kernels.fp8_quant import quantize_rows
    from sonic.kernels.swiglu import dswiglu_epilogue
    from sonic.reference import fp8 as fp8_reference

    da_prime, h, scores = _inputs(p, n, seed=p + 5 * n)
    da_prime = (da_prime.float() * torch.logspace(-3, 3, p, device="cuda")[:, None]).to(
        torch.bfloat16)
    da_prime[p // 2] = 0                      # a row whose dH is all zero: scale 1
    want = dswiglu_epilogue(da_prime, h, scores, gate_up)
    poison_allocator()
    got = dswiglu_epilogue(da_prime, h, scores, gate_up, quantize_dh=True)
    assert len(got) == 5
    for first, second in zip(want, got[:3]):
        assert torch.equal(first, second)
    dh_q, dh_scales = got[3:]
    assert dh_q.dtype == torch.float8_e4m3fn and dh_q.shape == (p, 2 * n)
    assert dh_scales.shape == (2 * n // 128, p)
    for want_q, want_scales in (quantize_rows(want[0]), fp8_reference.quantize_rows(want[0])):
        assert torch.equal(dh_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(dh_scales, want_scales)
    assert torch.all(dh_scales[:, p // 2] == 1.0)
    h_buf = h.clone()
    in_place = dswiglu_epilogue(da_prime, h_buf, scores, gate_up, dh_out=h_buf,
                                quantize_dh=True)
    assert in_place[0].data_ptr() == h_buf.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(in_place, got))
    with pytest.raises(ValueError, match="multiple of 128"):
        dswiglu_epilogue(da_prime[:, :64].contiguous(), h[:, :128].contiguous(), scores,
                         gate_up, quantize_dh=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("p,n,quantize_dh", [(1, 128, True), (5, 64, False), (7, 384, True),
                                              (1000, 1024, True), (4097, 256, False),
                                              (5, 2304, True), (9, 4224, True),
                                              (3, 14336, True)])
def test_dswiglu_reads_the_fp8_cache(p, n, quantize_dh, gate_up):
    """With h_scales the kernel reads H in e4m3 (the FP8 activation cache) and dequantizes it
    as it loads it: dH, A', ds (and dH_q) are bitwise those of the bf16 call on
    dequantize_rows(H_q), and H_q is left alone. n = 64: in "concat" one 128-column block
    holds both the gate and the up values of a row; a row of zeros has scale 1."""
    require_kernels()
    from sonic.kernels.fp8_quant import dequantize_rows, quantize_rows
    from sonic.kernels.swiglu import dswiglu_epilogue

    da_prime, h, scores = _inputs(p, n, seed=p + 11 * n)
    h = (h.float() * torch.logspace(-3, 3, p, device="cuda")[:, None]).to(torch.bfloat16)
    h[:, :n] *= 64
    h[p // 2] = 0
    h_q, h_scales = quantize_rows(h)
    h_q_before = h_q.clone()
    want = dswiglu_epilogue(da_prime, dequantize_rows(h_q, h_scales), scores, gate_up,
                            quantize_dh=quantize_dh)
    poison_allocator()
    got = dswiglu_epilogue(da_prime, h_q, scores, gate_up, h_scales=h_scales,
                           quantize_dh=quantize_dh)
    assert len(got) == len(want) and got[0].dtype == torch.bfloat16
    for name, a, b in zip(("dh", "a", "ds", "dh_q", "dh_scales"), got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name
    assert torch.equal(h_q.view(torch.uint8), h_q_before.view(torch.uint8))
    dap = da_prime.clone()                     # A' over dA', as the FP8 layer calls it
    in_place = dswiglu_epilogue(dap, h_q, scores, gate_up, h_scales=h_scales, a_out=dap)
    assert in_place[1].data_ptr() == dap.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(in_place, want[:3]))
    with pytest.raises(ValueError, match="h_scales must have shape"):
        dswiglu_epilogue(da_prime, h_q, scores, gate_up, h_scales=h_scales[:-1])
    with pytest.raises(TypeError, match="h must have dtype float8_e4m3fn"):
        dswiglu_epilogue(da_prime, h, scores, gate_up, h_scales=h_scales)
    with pytest.raises(TypeError, match="dh_out must have dtype bfloat16"):
        dswiglu_epilogue(da_prime, h_q, scores, gate_up, h_scales=h_scales, dh_out=h_q)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
def test_rows_past_2_31_elements(gate_up):
    """P·2n > 2**31: the last rows are addressed with 64-bit offsets (checked on a tail slice)."""
    require_kernels()
    from sonic.kernels.swiglu import dswiglu_epilogue, swiglu

    n = 1024
    p = (1 << 31) // (2 * n) + 5
    gen = torch.Generator(device="cuda").manual_seed(7)
    h = torch.randn(p, 2 * n, device="cuda", generator=gen, dtype=torch.bfloat16)
    da_prime = torch.randn(p, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    scores = torch.rand(p, device="cuda", generator=gen) + 0.1
    tail = slice(p - 16, p)
    a = swiglu(h, gate_up)
    torch.testing.assert_close(a[tail].float(), ref.swiglu(h[tail].float(), gate_up), **BF16_TOL)
    del a
    dh, a_scaled, ds = dswiglu_epilogue(da_prime, h, scores, gate_up)
    ref_dh, ref_a, ref_ds = ref.dswiglu_epilogue(da_prime[tail].float(), h[tail].float(),
                                                 scores[tail], gate_up)
    torch.testing.assert_close(dh[tail].float(), ref_dh, **BF16_TOL)
    torch.testing.assert_close(a_scaled[tail].float(), ref_a, **BF16_TOL)
    _assert_ds_close(ds[tail], da_prime[tail], h[tail], scores[tail], gate_up, ref_ds)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", LAYOUTS)
def test_zero_rows_returns_empty(gate_up):
    require_kernels()
    from sonic.kernels.swiglu import dswiglu_epilogue, swiglu

    da_prime, h, scores = _inputs(0, 64, seed=0)
    assert swiglu(h, gate_up).shape == (0, 64)
    dh, a_scaled, ds = dswiglu_epilogue(da_prime, h, scores, gate_up)
    assert dh.shape == (0, 128) and a_scaled.shape == (0, 64) and ds.shape == (0,)


@pytest.mark.gpu
def test_validation_on_gpu():
    require_kernels()
    from sonic.kernels.swiglu import dswiglu_epilogue, swiglu

    da_prime, h, scores = _inputs(16, 64, seed=1)
    with pytest.raises(ValueError, match="multiple of 8"):
        swiglu(torch.randn(16, 20, device="cuda").to(torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 8"):
        dswiglu_epilogue(da_prime[:, :10].contiguous(), h[:, :20].contiguous(), scores)
    with pytest.raises(ValueError, match="da_prime must have shape"):
        dswiglu_epilogue(da_prime[:, :32].contiguous(), h, scores)
    with pytest.raises(ValueError, match="da_prime must have shape"):
        dswiglu_epilogue(da_prime[:8].contiguous(), h, scores)
    with pytest.raises(ValueError, match="row_scores must have one entry per row"):
        dswiglu_epilogue(da_prime, h, scores[:8].contiguous())
    with pytest.raises(TypeError, match="row_scores must have dtype float32"):
        dswiglu_epilogue(da_prime, h, scores.to(torch.bfloat16))
    with pytest.raises(TypeError, match="da_prime must have dtype bfloat16"):
        dswiglu_epilogue(da_prime.float(), h, scores)
    with pytest.raises(ValueError, match="h must be contiguous"):
        swiglu(h[:, ::2])
    with pytest.raises(ValueError, match="da_prime must be on a CUDA device"):
        dswiglu_epilogue(da_prime.cpu(), h, scores)


def test_validation_without_gpu():
    from sonic.kernels.swiglu import dswiglu_epilogue, swiglu

    da_prime, h, scores = _inputs(4, 16, seed=2, device="cpu")
    with pytest.raises(TypeError, match="h must have dtype bfloat16"):
        swiglu(h.float())
    with pytest.raises(TypeError, match="h must have dtype bfloat16"):
        dswiglu_epilogue(da_prime, h.half(), scores)
    with pytest.raises(ValueError, match="h must be on a CUDA device"):
        swiglu(h)
    with pytest.raises(ValueError, match="h must be on a CUDA device"):
        dswiglu_epilogue(da_prime, h, scores)
    with pytest.raises(ValueError, match="h must have 2 dimension"):
        swiglu(h[0])
    with pytest.raises(ValueError, match="gate_up must be one of"):
        swiglu(h, "split")
