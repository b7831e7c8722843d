"""SwiGLU and its backward epilogue on the GPU, each in one bandwidth-bound pass.

docs/design.md §3 (forward step 1 epilogue, backward step 1 epilogue; SonicMoE arXiv 2512.14080 App. C):
until the grouped GEMMs fuse them, these standalone kernels replace the PyTorch reference
(:func:`sonic.reference.ops.swiglu`, :func:`sonic.reference.ops.dswiglu_epilogue`), which builds
several ``(P, n)`` fp32 temporaries, by one read of the inputs and one write of the outputs.

One warp owns one row of ``H (P, 2n)``; each lane walks 8-column slices ``lane, lane+32, ...``
of the row's ``n`` output columns. A slice's 8 gate and 8 up values are two 16-byte loads of
``H`` — the two halves of the row (``"concat"``) or 16 consecutive elements alternating gate, up
(``"interleaved"``) — held in a ``(2, 8)`` register fragment whose mode 0 picks gate or up, so
the same arithmetic serves both layouts. Math is fp32 (:mod:`sonic.kernels.activation`, shared
with the grouped-GEMM epilogues: ``σ`` from the hardware ``ex2`` and ``rcp`` approximations,
within ~1e-6 relative of the IEEE functions); each bf16 output is rounded once.
The backward's ``ds = ⟨dA', A⟩`` is summed by each lane over its slices in slice order, then
across the warp by a butterfly shuffle with fixed offsets: the order is fixed, no atomics, so
``ds`` is bitwise deterministic. Neighbouring lanes touch neighbouring 16-byte slices, so every
row is read and written in full coalesced lines. A warp issues all loads of a row before its
first store when the row has at most :data:`ROW_PASSES` passes of 32 slices (``n ≤ 2048``);
longer rows go :data:`ROW_CHUNK` passes at a time (:data:`ROW_CHUNK_FP8_CACHE` in the FP8
activation cache's kernels) in a runtime loop, so that the registers holding them stay bounded
(a whole row of ``n = 14336`` spilled) and so does the code (unrolled, the quantizing kernels
at ``n = 14336`` took 0.3–0.6 MB of machine code). A lane writes only the elements it read, so
an output written over its input (``dh_out`` over H, ``a_out`` over dA') stays exact either
way.
"""

import functools

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register
from sonic.types import FP8_BLOCK, GATE_UP_LAYOUTS

# Output columns per lane and slice: one 16-byte bf16 vector.
VEC = 8
# Lanes that cover one FP8 scale slice of A (the recipe's 1 x FP8_BLOCK).
LANES_PER_BLOCK = FP8_BLOCK // VEC
WARP = 32
# Rows per block (one warp each): 256 threads, enough blocks per SM to hide DRAM latency.
WARPS = 8
# Passes (WARP·VEC columns each) of a row a warp holds in registers at once: the whole row
# up to ROW_PASSES (n ≤ 2048: at most 128 registers per thread), longer rows ROW_CHUNK passes
# at a time (a whole row of n = 14336 spilled about 1-2.5 KB per thread).
ROW_PASSES = 8
ROW_CHUNK = 4
# The FP8 activation cache's kernels (forward writing H in e4m3 beside A, backward reading it)
# carry two more fragments per pass: their long rows go two passes at a time (Mixtral-8x7B,
# n = 14336: 14-18% faster than four, benchmarks/RESULTS.md).
ROW_CHUNK_FP8_CACHE = 2


def _compile(n: int, gate_up: str, backward: bool, keep_ptx: bool = False,
             quantize: bool = False, quantize_h: bool = False, h_fp8: bool = False):
    """Compile one static configuration with placeholder arguments."""
    import cutlass

    from sonic.kernels.swiglu_kernel import SwigluKernel

    addresses = [runtime.fake_address() for _ in range(9)]
    return runtime.compile_launcher(SwigluKernel(n, gate_up, backward, quantize, quantize_h,
                                                 h_fp8),
                                    *addresses,
                                    cutlass.Int32(1), keep_ptx=keep_ptx)


def _check_h(h: torch.Tensor, gate_up: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Validate ``h`` and ``gate_up``; return ``n``."""
    if gate_up not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up must be one of {GATE_UP_LAYOUTS}, got {gate_up!r}")
    runtime.check_tensor("h", h, dtypes=(dtype,), ndim=2)
    if h.shape[1] % (2 * VEC):
        raise ValueError(f"h's last dimension 2n must have n a multiple of {VEC}, "
                         f"got 2n = {h.shape[1]}")
    return h.shape[1] // 2


def _output(name: str, out: torch.Tensor | None, like: torch.Tensor,
            others: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``out`` checked to be a buffer for ``like``'s values — ``like`` itself, or disjoint
    from it and from ``others`` — or a new one."""
    if out is None:
        return torch.empty_like(like)
    runtime.check_tensor(name, out, dtypes=(torch.bfloat16,), ndim=2, device=like.device)
    if out.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(out.shape)}")
    if any(runtime.overlaps(out, t) for t in others) or (
            out.data_ptr() != like.data_ptr() and runtime.overlaps(out, like)):
        raise ValueError(f"{name} must be the input it replaces or a buffer overlapping no "
                         "input: a partial overlap would overwrite elements other lanes still "
                         "read")
    return out


def swiglu(h: torch.Tensor, gate_up: str = "concat", *, quantize: bool = False,
           quantize_h: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """SwiGLU activation ``A = silu(gate) ⊙ up`` of ``H`` (docs/design.md §3; SonicMoE App. C).

    Same function as :func:`sonic.reference.ops.swiglu`: fp32 math, one rounding to bf16
    (``σ`` within ~1e-6 relative of the reference's, see the module notes).

    With ``quantize``, A is written as the FP8 path's down-proj reads it (the
    quantization where the data is produced): e4m3 with one fp32 scale per 1×128 slice of
    each row, bitwise ``sonic.kernels.fp8_quant.quantize_rows(swiglu(h))`` (the bf16-rounded
    A is quantized) without writing and reading A in bf16: the FP8 layer's default
    (:func:`sonic.backend.set_fp8_epilogues`). With ``quantize_h`` as well, H itself is also
    written in e4m3 per 1×128 slice, bitwise ``quantize_rows(h)``: the FP8 activation cache
    (``activation_cache="fp8"``) made in the same read of H.

    Args:
        h: ``(P, 2n)`` bf16, contiguous, CUDA, 16-byte aligned; ``n`` a multiple of 8 (of
            128 with ``quantize``).
        gate_up: ``"concat"`` (gate = columns ``[0, n)``, up = ``[n, 2n)``) or
            ``"interleaved"`` (gate = even columns, up = odd columns).
        quantize: return A in e4m3 with its scales instead of bf16.
        quantize_h: with ``quantize``, also return H in e4m3 with its scales.

    Returns:
        ``A (P, n)`` bf16; with ``quantize``, ``(q (P, n) float8_e4m3fn, scales (n/128, P)
        fp32)``, with ``quantize_h`` followed by ``(h_q (P, 2n) float8_e4m3fn, h_scales
        (2n/128, P) fp32)``. ``P = 0`` returns empty tensors without a launch.

    Raises:
        TypeError: ``h`` is not a bf16 tensor.
        ValueError: ``h`` is not a contiguous 2-D CUDA tensor, ``n`` is not a multiple of 8
            (of 128 with ``quantize``), ``h`` is not 16-byte aligned, ``gate_up`` is
            unknown, or ``quantize_h`` without ``quantize``.
    """
    n = _check_h(h, gate_up)
    if quantize_h and not quantize:
        raise ValueError("swiglu(quantize_h=True) needs quantize=True (H is quantized in the "
                         "FP8 path's pass, which writes A in e4m3)")
    if quantize:
        return _swiglu_quantized(h, gate_up, n, quantize_h)
    num_rows = h.shape[0]
    a = torch.empty(num_rows, n, dtype=h.dtype, device=h.device)
    if num_rows == 0 or n == 0:
        return a
    fn = runtime.compiled(("swiglu", n, gate_up), lambda: _compile(n, gate_up, False))
    ha, aa = runtime.address(h, 16), runtime.address(a, 16)
    # The forward never touches the backward-only addresses; h's stands in for them.
    fn(ha, ha, ha, aa, ha, ha, ha, ha, ha, num_rows)
    return a


def _quantized_like(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 ``(rows, cols)`` and its ``(cols/128, rows)`` fp32 scales."""
    return (torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(cols // FP8_BLOCK, rows, dtype=torch.float32, device=device))


def _swiglu_quantized(h: torch.Tensor, gate_up: str, n: int, quantize_h: bool):
    if n % FP8_BLOCK:
        raise ValueError(f"swiglu(quantize=True) needs n a multiple of {FP8_BLOCK} (whole 1x"
                         f"{FP8_BLOCK} scale slices), got n = {n}")
    num_rows = h.shape[0]
    out: tuple[torch.Tensor, ...] = _quantized_like(num_rows, n, h.device)
    if quantize_h:
        out += _quantized_like(num_rows, 2 * n, h.device)
    if num_rows == 0 or n == 0:
        return out
    fn = runtime.compiled(("swiglu_quantized", n, gate_up, quantize_h),
                          lambda: _compile(n, gate_up, False, quantize=True,
                                           quantize_h=quantize_h))
    adr = runtime.address
    ha = adr(h, 16)
    # The forward never touches the backward-only addresses; h's stands in for them (and for
    # H's e4m3 copy without quantize_h).
    h_q = (adr(out[2], 16), adr(out[3], 4)) if quantize_h else (ha, ha)
    fn(ha, ha, ha, adr(out[0], 16), ha, adr(out[1], 4), *h_q, ha, num_rows)
    return out


def dswiglu_epilogue(da_prime: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor,
                     gate_up: str = "concat", *, h_scales: torch.Tensor | None = None,
                     dh_out: torch.Tensor | None = None, a_out: torch.Tensor | None = None,
                     quantize_dh: bool = False) -> tuple[torch.Tensor, ...]:
    """Backward epilogue of the dH step (docs/design.md §3, backward step 1; SonicMoE App. C).

    Same function as :func:`sonic.reference.ops.dswiglu_epilogue`: per row, with ``g, u`` from
    ``h``, ``σ = sigmoid(g)``, ``A = g·σ·u`` (fp32, never rounded) and ``dA = s·dA'``:
    ``dH = merge(dA·u·σ·(1 + g(1 − σ)), dA·g·σ)``, ``A' = s·A``, ``ds = Σ_n dA'·A`` (fp32, fixed
    reduction order, bitwise deterministic).

    Args:
        da_prime: ``(P, n)`` bf16, contiguous, CUDA, 16-byte aligned.
        h: ``(P, 2n)`` bf16, contiguous, same device, 16-byte aligned; ``n`` a multiple of 8.
            With ``h_scales``: H in e4m3 (the FP8 activation cache), 8-byte aligned, ``2n`` a
            multiple of 128.
        row_scores: ``(P,)`` fp32, contiguous, same device — the score of each row.
        gate_up: ``"concat"`` or ``"interleaved"`` (see :func:`swiglu`).
        h_scales: ``(2n/128, P)`` fp32, contiguous: the 1×128 scales of an e4m3 ``h``
            (:func:`sonic.kernels.fp8_quant.quantize_rows`'s layout). H is dequantized as it
            is loaded, bitwise :func:`~sonic.kernels.fp8_quant.dequantize_rows` (the same dH,
            A' and ds as dequantizing first), without writing and reading a bf16 H.
        dh_out: ``(P, 2n)`` bf16, contiguous, 16-byte aligned: where dH is written, allocated if
            None. It may be ``h`` itself (dH then overwrites H; not with ``h_scales``).
        a_out: ``(P, n)`` bf16, contiguous, 16-byte aligned: where A' is written, allocated if
            None. It may be ``da_prime`` itself (A' then overwrites dA').
        In place is safe because each lane loads every element of its row slices (H's gate
        and up, dA') before it stores any, and stores exactly the elements it loaded; rows
        belong to one warp each. A buffer that overlaps an input without being it would
        overwrite elements other lanes still read: refused.
        quantize_dh: also write dH as the FP8 path's dX GEMM reads it: e4m3 with
            one fp32 scale per 1×128 slice of each dH row, bitwise
            ``sonic.kernels.fp8_quant.quantize_rows(dH)``, without reading dH again; needs
            ``n`` a multiple of 128. The FP8 layer's default for its dX GEMM
            (:func:`sonic.backend.set_fp8_epilogues`).

    Returns:
        ``(dH (P, 2n) bf16, A' (P, n) bf16, ds (P,) fp32)``, with ``quantize_dh`` followed by
        ``dH_q (P, 2n) float8_e4m3fn, dH_scales (2n/128, P) fp32``; dH is ``dh_out`` and A' is
        ``a_out`` when given. ``P = 0`` returns empty tensors without a launch (``n = 0``:
        ``ds`` is zeros).

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor is not a contiguous CUDA tensor of the right rank, the tensors are
            on different devices, shapes disagree, ``n`` is not a multiple of 8, a bf16 tensor is
            not 16-byte aligned, ``gate_up`` is unknown, ``dh_out`` / ``a_out`` overlaps an
            input without being ``h`` / ``da_prime``, ``quantize_dh`` with ``n`` not a
            multiple of 128, or ``h_scales`` of another shape than ``(2n/128, P)``.
    """
    if h_scales is not None:
        n = _check_h(h, gate_up, torch.float8_e4m3fn)
        if (2 * n) % FP8_BLOCK:
            raise ValueError(f"an e4m3 h needs 2n a multiple of {FP8_BLOCK} (whole 1x"
                             f"{FP8_BLOCK} scale slices), got 2n = {2 * n}")
        runtime.check_tensor("h_scales", h_scales, dtypes=(torch.float32,), ndim=2,
                             device=h.device)
        if tuple(h_scales.shape) != (2 * n // FP8_BLOCK, h.shape[0]):
            raise ValueError(f"h_scales must have shape (2n/128, P) = "
                             f"{(2 * n // FP8_BLOCK, h.shape[0])}, got {tuple(h_scales.shape)}")
    else:
        n = _check_h(h, gate_up)
    if quantize_dh and n % FP8_BLOCK:
        raise ValueError(f"dswiglu_epilogue(quantize_dh=True) needs n a multiple of {FP8_BLOCK}"
                         f" (whole 1x{FP8_BLOCK} scale slices), got n = {n}")
    runtime.check_tensor("da_prime", da_prime, dtypes=(torch.bfloat16,), ndim=2, device=h.device)
    runtime.check_tensor("row_scores", row_scores, dtypes=(torch.float32,), ndim=1,
                         device=h.device)
    num_rows = h.shape[0]
    if tuple(da_prime.shape) != (num_rows, n):
        raise ValueError(f"da_prime must have shape (P, n) = {(num_rows, n)} to match h "
                         f"{tuple(h.shape)}, got {tuple(da_prime.shape)}")
    if row_scores.numel() != num_rows:
        raise ValueError(f"row_scores must have one entry per row of h ({num_rows}), "
                         f"got {row_scores.numel()}")
    if h_scales is not None and dh_out is None:   # bf16 dH beside the e4m3 H
        dh = torch.empty(h.shape, dtype=torch.bfloat16, device=h.device)
    else:
        dh = _output("dh_out", dh_out, h, (da_prime,) + ((h,) if h_scales is not None else ()))
    a_scaled = _output("a_out", a_out, da_prime, (h,))
    ds = torch.empty(num_rows, dtype=torch.float32, device=h.device)
    quantized: tuple[torch.Tensor, ...] = ()
    if quantize_dh:
        quantized = _quantized_like(num_rows, 2 * n, h.device)
    if num_rows == 0:
        return dh, a_scaled, ds, *quantized
    if n == 0:
        return dh, a_scaled, ds.zero_(), *quantized
    h_fp8 = h_scales is not None
    fn = runtime.compiled(("dswiglu_epilogue", n, gate_up, quantize_dh, h_fp8),
                          lambda: _compile(n, gate_up, True, quantize=quantize_dh, h_fp8=h_fp8))
    adr = runtime.address
    ha = adr(h, 8 if h_fp8 else 16)
    # Without quantize_dh the kernel never touches dH_q and its scales, without h_scales
    # never H's scales; h's address stands in.
    q_addresses = ((adr(quantized[0], 16), adr(quantized[1], 4)) if quantize_dh
                   else (ha,) * 2)
    fn(ha, adr(da_prime, 16), adr(row_scores, 4), adr(a_scaled, 16), adr(dh, 16),
       adr(ds, 4), *q_addresses, ha if h_scales is None else adr(h_scales, 4), num_rows)
    return dh, a_scaled, ds, *quantized


_MARKERS = ("ld.global.v4", "st.global.v4")
# n = 4232: a row in a loop of ROW_CHUNK passes, then the last pass, partial.
for _n, _gate_up, _backward in ((256, "concat", False), (1024, "interleaved", False),
                                (256, "interleaved", True), (1024, "concat", True),
                                (4232, "interleaved", True)):
    register(KernelVariant(
        kernel="swiglu",
        variant=f"{'dswiglu' if _backward else 'swiglu'}_n{_n}_{_gate_up}",
        compile_fake=functools.partial(_compile, _n, _gate_up, _backward, keep_ptx=True),
        ptx_markers=_MARKERS + (("shfl.sync.bfly",) if _backward else ())))
# With quantize (A, or dH as well): the saturating e4m3 conversion, the block amax shuffles and
# 8-byte fp8 stores beside each kernel's own markers. n = 384: a partial last pass (lanes past
# n shuffle, store nothing); n = 4224: a row in chunks, the last pass partial.
_FP8_STORES = ("st.global.v2.b32", "st.global.v2.u32", "st.global.b64", "st.global.u64")
for _backward, _h in ((False, False), (True, False), (False, True)):
    for _n, _gate_up in ((384, "concat"), (1024, "interleaved"), (4224, "concat")):
        register(KernelVariant(
            kernel="swiglu",
            variant=f"{'dswiglu' if _backward else 'swiglu'}_quantized{'_h' if _h else ''}"
                    f"_n{_n}_{_gate_up}",
            compile_fake=functools.partial(_compile, _n, _gate_up, _backward, keep_ptx=True,
                                           quantize=True, quantize_h=_h),
            ptx_markers=(_MARKERS if _backward else _MARKERS[:1])
            + ("cvt.rn.satfinite.e4m3x2.f32", "shfl.sync.bfly", _FP8_STORES)))
# The backward reading H in e4m3 (the FP8 activation cache): the e4m3 upcast beside the
# backward's markers; with and without dH quantized.
for _n, _gate_up, _q in ((384, "concat", True), (1024, "interleaved", False)):
    register(KernelVariant(
        kernel="swiglu",
        variant=f"dswiglu_h_fp8{'_quantized' if _q else ''}_n{_n}_{_gate_up}",
        compile_fake=functools.partial(_compile, _n, _gate_up, True, keep_ptx=True,
                                       quantize=_q, h_fp8=True),
        ptx_markers=_MARKERS + ("shfl.sync.bfly", "e4m3x2")))
