"""Block-scaled FP8 (e4m3) quantization on the GPU: activations per 1×128, weights per 128×128.

The block-scaled FP8 recipe (DeepSeek-V3 arXiv 2412.19437 §3.3; DeepGEMM), bitwise equal to the reference
:mod:`sonic.reference.fp8` — same ``amax``, ``scale = amax / 448`` (1.0 for an all-zero block),
IEEE fp32 division ``x / scale`` (on the GPU from one reciprocal per scale by Markstein's
exact correction, bitwise the division) and round-to-nearest-even e4m3. The reference's clamp to
±448 is the conversion's saturation here (``cvt.rn.satfinite.e4m3x2.f32`` saturates finite
values beyond 448 to ±448 and keeps NaN), and the block maximum uses the NaN-propagating
``max`` so a block holding a NaN gets the reference's scale (1.0) too. Both kernels are one read of
bf16 and one write of fp8 plus 4 bytes of scale per block: bandwidth-bound.

``quantize_rows``: a CTA covers 32 rows × one 128-column k-block; 16 lanes (half a warp) own one
row's 128 columns, 8 bf16 each (one 16-byte load, one 8-byte store), and reduce ``amax`` by a
4-step butterfly inside the half-warp. Each lane quantizes two rows (``r`` and ``r + 16``), both
loads issued before any arithmetic, to keep more bytes in flight per thread. Rows past ``M`` load
row ``M − 1`` instead (so every lane takes part in the shuffles) and store nothing. The scale
writes of one CTA are 32 consecutive fp32 of the ``(K/128, M)`` scale matrix.

Gathered rows are deliberately not supported: the FP8 path quantizes ``X`` once per layer and the
up-projection GEMM gathers rows of ``q`` with their scales (one scale per row per k-block, the
same index), which costs less than re-quantizing each of the ``K`` copies of a token.

``dequantize_rows`` (the FP8 activation cache's backward): the thread layout of
``quantize_rows``; each lane converts its 8 e4m3 values to fp32, multiplies by the row's scale for
the k-block and rounds once to bf16 — one 8-byte load and one 16-byte store, so bitwise the
reference's ``(q.float() * scale).to(bfloat16)``.

``quantize_blocks``: one CTA (256 threads) per 128×128 block of ``(E, N, K)``; lane ``(rg, h)``
of warp ``w`` owns rows ``8·rg .. 8·rg + 7`` and columns ``8·(2w + h) .. + 7``, an 8 × 8 tile
(each row read as 32-byte sectors by two lanes). ``amax``: per thread, then a warp butterfly,
then the 8 warps' maxima through shared memory. A partial last row block (``N`` not a multiple
of 128) re-reads its last row in place of the missing ones — that leaves ``amax`` unchanged —
and stores only its rows. The transposed copy leaves from registers: the thread's 8 × 8 e4m3
bytes are transposed by byte permutes (``prmt``) and stored as one 8-byte piece of each of 8
rows of ``wᵀ``; the earlier transpose through shared memory read single bytes with 8-way bank
conflicts.

``quantize_cols_grouped`` (the FP8 weight gradients' operands): the same 8 × 8 thread tiles
over 128 rows of one expert (padded with zeros past its end; gathered rows read through the
index) × 64 columns per chunk of four warps, a scale per column from a butterfly over the 16
row groups of a warp (a warp holds all 128 rows of its 16 columns: the amax needs no shared
memory), the transposed tile stored as above into the K-major copy. A CTA walks a strip of up
to eight chunks of its row block (:func:`cols_chunks`): the expert search and the row indices
are loaded once per strip, and the chunks' rows arrive by 16-byte ``cp.async`` copies into
three shared-memory stages, two chunks ahead of the one being quantized. Each thread copies and
reads back only its own rows' bytes, so no barrier orders them, and the bytes in flight hold no
registers: 112 per thread, four 128-thread CTAs per SM. The column maxima are taken on the bf16
pairs (``bf16x2_max``: one instruction per two elements, exact). Each column's reciprocal is
taken once and its 8 quotients come from it (``quotient``).

``K`` (the columns) must be a multiple of 128 for all of them (the FP8 GEMMs need it too): a
``ValueError`` names the argument otherwise.
"""

import functools

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register
from sonic.types import FP8_BLOCK

# Elements per lane and vector: one 16-byte bf16 load, one 8-byte fp8 store.
VEC = 8
# Lanes per 128-column slice of one row.
LANES_PER_SLICE = FP8_BLOCK // VEC
THREADS = 256
# quantize_rows: rows per lane (issued together) and rows per CTA.
ROWS_PER_LANE = 2
ROWS_PER_CTA = THREADS // LANES_PER_SLICE * ROWS_PER_LANE
# quantize_cols_grouped: columns per chunk of a CTA (a warp holds 16, with all 128 rows of the
# block), its threads, and at most this many chunks per CTA.
COLS_PER_CTA = 64
COLS_THREADS = COLS_PER_CTA // 16 * 32
MAX_COLS_CHUNKS = 8
FP8_MAX = 448.0
# Scales whose quotients x / scale come exactly from the reciprocal (see `quotient`): within
# these bounds no residual underflows and no reciprocal is subnormal. Others (tiny blocks,
# inf) take the division instruction.
FAST_SCALE_MIN = 2.0 ** -80
FAST_SCALE_MAX = 2.0 ** 100


def cols_chunks(cols: int) -> int:
    """``quantize_cols_grouped``'s 64-column chunks per CTA for ``cols`` columns (a multiple
    of 128): the largest divisor of ``cols / 64`` up to :data:`MAX_COLS_CHUNKS`, so that the
    strips cover the columns."""
    chunks = cols // COLS_PER_CTA
    return max(c for c in range(1, MAX_COLS_CHUNKS + 1) if chunks % c == 0)


def _compile(kind: str, k: int, keep_ptx: bool = False):
    """Compile one static configuration (``kind`` ``"rows"``, ``"blocks"``,
    ``"blocks_transposed"``, ``"dequant_rows"``, ``"cols"`` or ``"cols_gathered"``, ``K``: the
    columns) with placeholder arguments."""
    import cutlass

    from sonic.kernels.fp8_quant_kernel import (DequantizeRowsKernel, QuantizeBlocksKernel,
                                                QuantizeColsKernel, QuantizeRowsKernel)

    addresses = [runtime.fake_address() for _ in range(3)]
    if kind in ("cols", "cols_gathered"):
        extra = [runtime.fake_address() for _ in range(3)]
        return runtime.compile_launcher(QuantizeColsKernel(k, kind == "cols_gathered"), *addresses,
                                        *extra, cutlass.Int32(1), cutlass.Int32(128),
                                        keep_ptx=keep_ptx)
    if kind in ("rows", "dequant_rows"):
        cls = QuantizeRowsKernel if kind == "rows" else DequantizeRowsKernel
        return runtime.compile_launcher(cls(k), *addresses, cutlass.Int32(1), keep_ptx=keep_ptx)
    extra = [runtime.fake_address() for _ in range(2)]
    return runtime.compile_launcher(QuantizeBlocksKernel(k, kind == "blocks_transposed"), *addresses,
                                    *extra, cutlass.Int32(1), cutlass.Int32(1),
                                    keep_ptx=keep_ptx)


def _check_k(name: str, k: int) -> None:
    if k % FP8_BLOCK:
        raise ValueError(f"{name}'s last dimension K must be a multiple of {FP8_BLOCK} for the FP8 "
                         f"kernels, got K = {k} (the reference sonic.reference.fp8 takes any K)")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to e4m3 per 1×128 slice of each row (DeepSeek-V3 §3.3).

    Bitwise equal to :func:`sonic.reference.fp8.quantize_rows` (see the module notes).

    Args:
        x: ``(M, K)`` bf16, contiguous, CUDA, 16-byte aligned; ``K`` a multiple of 128.

    Returns:
        ``(q, scales)``: ``q (M, K)`` float8_e4m3fn and ``scales (K/128, M)`` fp32, contiguous
        (k-block-major: one k-block's scales of consecutive rows are contiguous). ``M = 0`` or
        ``K = 0`` returns empty tensors without a launch.

    Raises:
        TypeError: ``x`` is not a bf16 tensor.
        ValueError: ``x`` is not a contiguous 2-D CUDA tensor, ``K`` is not a multiple of 128,
            or ``x`` is not 16-byte aligned.
    """
    runtime.check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
    m, k = x.shape
    _check_k("x", k)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k // FP8_BLOCK, m, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    fn = runtime.compiled(("fp8_quantize_rows", k), lambda: _compile("rows", k))
    fn(runtime.address(x, 16), runtime.address(q, 16), runtime.address(scales, 4), m)
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` up to rounding, in bf16, in one pass: ``(q · scale)``
    formed in fp32 and rounded once to bf16 — bitwise
    ``sonic.reference.fp8.dequantize_rows(q, scales).to(torch.bfloat16)``. The FP8 activation
    cache dequantizes the saved H with it in backward.

    Args:
        q: ``(M, K)`` float8_e4m3fn, contiguous, CUDA, 16-byte aligned; ``K`` a multiple of 128.
        scales: ``(K/128, M)`` fp32, contiguous, on ``q``'s device.

    Returns:
        ``(M, K)`` bf16, contiguous, newly allocated. ``M = 0`` or ``K = 0``: without a launch.

    Raises:
        TypeError: wrong dtypes.
        ValueError: not contiguous 2-D CUDA tensors on one device, ``K`` not a multiple of 128,
            ``scales`` not of shape ``(K/128, M)``, or ``q`` not 16-byte aligned.
    """
    runtime.check_tensor("q", q, dtypes=(torch.float8_e4m3fn,), ndim=2)
    m, k = q.shape
    _check_k("q", k)
    runtime.check_tensor("scales", scales, dtypes=(torch.float32,), ndim=2, device=q.device)
    if tuple(scales.shape) != (k // FP8_BLOCK, m):
        raise ValueError(f"scales must have shape (K/128, M) = {(k // FP8_BLOCK, m)} for q of "
                         f"shape {(m, k)}, got {tuple(scales.shape)}")
    out = torch.empty(m, k, dtype=torch.bfloat16, device=q.device)
    if m == 0 or k == 0:
        return out
    fn = runtime.compiled(("fp8_dequantize_rows", k), lambda: _compile("dequant_rows", k))
    fn(runtime.address(q, 16), runtime.address(scales, 4), runtime.address(out, 16), m)
    return out


def quantize_blocks(w: torch.Tensor, *, transposed: bool = False) -> tuple[torch.Tensor, ...]:
    """Quantize per-expert weights to e4m3 per 128×128 block (DeepSeek-V3 §3.3).

    Bitwise equal to :func:`sonic.reference.fp8.quantize_blocks`; meant to run once per
    optimizer step on the bf16 master weights.

    Args:
        w: ``(E, N, K)`` or ``(N, K)`` bf16, contiguous, CUDA, 16-byte aligned; ``K`` a
            multiple of 128, any ``N`` (a partial last row block is scaled over its rows).
        transposed: also return the copy of ``wᵀ`` — ``(E, K, N)`` e4m3 and its scales
            ``(E, K/128, N/128)`` — in the same pass (a block's values and scale are the same
            in both orientations); needs ``N`` a multiple of 128. The backward's FP8 GEMMs
            read ``W1ᵀ`` and ``W2ᵀ`` K-major.

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn of ``w``'s shape and ``scales`` fp32 contiguous of
        shape ``(E, ceil(N/128), K/128)`` (without ``E`` for a 2-D ``w``); with ``transposed``,
        ``(q, scales, q_t, scales_t)``. Empty ``w`` returns empty tensors without a launch.

    Raises:
        TypeError: ``w`` is not a bf16 tensor.
        ValueError: ``w`` is not a contiguous 2-D or 3-D CUDA tensor, ``K`` is not a multiple
            of 128 (or, with ``transposed``, ``N``), or ``w`` is not 16-byte aligned.
    """
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return tuple(t[0] for t in quantize_blocks(w[None], transposed=transposed))
    runtime.check_tensor("w", w, dtypes=(torch.bfloat16,), ndim=3)
    e, n, k = w.shape
    _check_k("w", k)
    if transposed:
        _check_k("w (N, rows per expert, with transposed=True)", n)
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(e, -(-n // FP8_BLOCK), k // FP8_BLOCK, dtype=torch.float32, device=w.device)
    out: tuple[torch.Tensor, ...] = (q, scales)
    if transposed:
        out += (torch.empty(e, k, n, dtype=torch.float8_e4m3fn, device=w.device),
                torch.empty(e, k // FP8_BLOCK, n // FP8_BLOCK, dtype=torch.float32, device=w.device))
    if q.numel() == 0:
        return out
    kind = "blocks_transposed" if transposed else "blocks"
    fn = runtime.compiled(("fp8_quantize_" + kind, k), lambda: _compile(kind, k))
    # Without ``transposed`` the kernel never touches its transposed outputs' addresses.
    q_t, scales_t = out[-2:]
    fn(runtime.address(w, 16), runtime.address(q, 16), runtime.address(scales, 4),
       runtime.address(q_t, 16), runtime.address(scales_t, 4), e, n)
    return out


def quantize_cols_grouped(x: torch.Tensor, expert_offsets: torch.Tensor,
                          k_offsets: torch.Tensor, gather_idx: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight-gradient operand per ``128 x 1`` block of each column within each
    expert's rows, into the K-major copy the FP8 varlen-K GEMM reads (DeepSeek-V3
    §3.3: scales along the GEMM's reduction axis, here the tokens).

    Bitwise equal to :func:`sonic.reference.fp8.quantize_cols_grouped`, padding and tail
    included. One pass: a CTA reads one 128-row block of one expert (gathered rows
    included) in a strip of 64-column chunks, copied by ``cp.async`` into shared memory two
    chunks ahead of the one it quantizes; a warp holds all 128 rows of its 16 columns, so a
    column's ``amax`` is a butterfly of shuffles, and each thread's 8 x 8 e4m3 tile leaves
    through a byte transpose in registers as 8-byte pieces of rows of the copy.

    Args:
        x: ``(P, C)`` bf16 rows sorted by expert, or with ``gather_idx`` the ``(T, C)`` source
            rows; contiguous, CUDA, 16-byte aligned; ``C`` a multiple of 128.
        expert_offsets: ``(E+1,)`` int32, contiguous (rows past ``expert_offsets[E]`` are not
            read).
        k_offsets: ``(E+1,)`` int32, contiguous: :func:`sonic.reference.fp8.padded_offsets`
            of ``expert_offsets``.
        gather_idx: ``(P,)`` int32, contiguous, values in ``[0, T)``, or None.

    Returns:
        ``(q_t (C, R) float8_e4m3fn, scales (R/128, C) fp32)``, ``R =
        padded_rows_bound(P, E)``; columns from ``k_offsets[E]`` on are zeros with scale 1.

    Raises:
        TypeError: wrong dtypes.
        ValueError: not contiguous CUDA tensors of the right rank on one device, ``C`` not a
            multiple of 128, or ``x`` not 16-byte aligned.
    """
    runtime.check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
    cols = x.shape[1]
    _check_k("x", cols)
    for name, t in (("expert_offsets", expert_offsets), ("k_offsets", k_offsets)):
        runtime.check_tensor(name, t, dtypes=(torch.int32,), ndim=1, device=x.device)
    num_experts = expert_offsets.numel() - 1
    if num_experts < 1 or k_offsets.numel() != num_experts + 1:
        raise ValueError(f"expert_offsets and k_offsets must both have E+1 >= 2 entries, got "
                         f"{expert_offsets.numel()} and {k_offsets.numel()}")
    if gather_idx is not None:
        runtime.check_tensor("gather_idx", gather_idx, dtypes=(torch.int32,), ndim=1,
                             device=x.device)
    rows = x.shape[0] if gather_idx is None else gather_idx.numel()
    # sonic.reference.fp8.padded_rows_bound (kernels import nothing from the reference): each
    # expert adds at most FP8_BLOCK - 1 rows of padding.
    k_rows = (rows + (FP8_BLOCK - 1) * num_experts) // FP8_BLOCK * FP8_BLOCK
    q_t = torch.empty(cols, k_rows, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k_rows // FP8_BLOCK, cols, dtype=torch.float32, device=x.device)
    if k_rows == 0 or cols == 0:
        return q_t, scales
    if x.shape[0] == 0:         # no rows (so no pairs): all padding
        return q_t.zero_(), scales.fill_(1.0)
    kind = "cols" if gather_idx is None else "cols_gathered"
    fn = runtime.compiled(("fp8_quantize_" + kind, cols), lambda: _compile(kind, cols))
    offsets_addr = runtime.address(expert_offsets, 4)
    fn(runtime.address(x, 16), runtime.address(q_t, 16), runtime.address(scales, 4),
       runtime.address(gather_idx, 4) if gather_idx is not None else offsets_addr,
       offsets_addr, runtime.address(k_offsets, 4), num_experts, k_rows)
    return q_t, scales


# e4m3 conversion with saturation, IEEE division, 8-byte fp8 stores; 16-byte bf16 loads
# (columns: 16-byte cp.async copies into shared memory, read back as 16-byte loads).
_STORES = ("st.global.v2.b32", "st.global.v2.u32", "st.global.b64", "st.global.u64")
_MARKERS = ("cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "ld.global.v4", _STORES)
_COLS_MARKERS = ("cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "cp.async.cg.shared.global",
                 "ld.shared.v4", _STORES)
# Beyond them: the row slice's butterfly (rows); the block amax across warps (blocks); the
# column amax's butterfly and the register transpose (cols, and the transposed blocks).
_KIND_MARKERS = {"rows": ("shfl.sync.bfly",), "blocks": ("shfl.sync.bfly", "bar.sync"),
                 "blocks_transposed": ("shfl.sync.bfly", "bar.sync", "prmt.b32"),
                 "cols": ("shfl.sync.bfly", "prmt.b32"),
                 "cols_gathered": ("shfl.sync.bfly", "prmt.b32")}
for _kind, _k in (("rows", 128), ("rows", 4096), ("blocks", 1024), ("blocks", 7168),
                  ("blocks_transposed", 2048), ("cols", 768), ("cols_gathered", 2048)):
    register(KernelVariant(
        kernel="fp8_quant",
        variant=f"quantize_{_kind}_k{_k}",
        compile_fake=functools.partial(_compile, _kind, _k, keep_ptx=True),
        ptx_markers=(_COLS_MARKERS if _kind.startswith("cols") else _MARKERS)
        + _KIND_MARKERS[_kind]))
# Dequantization: an 8-byte fp8 load, e4m3 -> fp32 conversion, fp32 multiply, a rounding to
# bf16, a 16-byte store.
for _k in (256, 2048):
    register(KernelVariant(
        kernel="fp8_quant",
        variant=f"dequantize_rows_k{_k}",
        compile_fake=functools.partial(_compile, "dequant_rows", _k, keep_ptx=True),
        ptx_markers=(("ld.global.v2.b32", "ld.global.v2.u32", "ld.global.b64",
                      "ld.global.u64"), "cvt.rn.bf16x2.f32", "st.global.v4")))
