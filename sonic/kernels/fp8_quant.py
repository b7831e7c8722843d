"""Block-scaled FP8 (e4m3) quantization on the GPU: activations per 1×128, weights per 128×128.

Issue 18 recipe (DeepSeek-V3 arXiv 2412.19437 §3.3; DeepGEMM), bitwise equal to the reference
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
index) × 64 columns per CTA of four warps, a scale per column from a butterfly over the 16
row groups of a warp (a warp holds all 128 rows of its 16 columns: no shared memory), the
transposed tile stored as above into the K-major copy. The tile stays bf16 in registers until
each row is quantized: 96 registers per thread, five 128-thread CTAs per SM, where 128 columns
per CTA of eight warps with fp32 copies of the tile (128 registers, two CTAs per SM) ran
1.25–1.33× slower (H200, same run, bitwise the same copies). Each column's reciprocal is
taken once and its 8 quotients come from it (``quotient``): 2.2–2.8 TB/s of bf16 read + e4m3
written at the ANCHORS shapes, benchmarks/RESULTS.md.

``K`` (the columns) must be a multiple of 128 for all of them (the FP8 GEMMs need it too): a
``ValueError`` names the argument otherwise.
"""

import functools
import types

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register

# Side of the recipe's blocks: 1×BLOCK activation slices, BLOCK×BLOCK weight blocks.
BLOCK = 128
# Elements per lane and vector: one 16-byte bf16 load, one 8-byte fp8 store.
VEC = 8
# Lanes per 128-column slice of one row.
LANES_PER_SLICE = BLOCK // VEC
THREADS = 256
# quantize_rows: rows per lane (issued together) and rows per CTA.
ROWS_PER_LANE = 2
ROWS_PER_CTA = THREADS // LANES_PER_SLICE * ROWS_PER_LANE
# quantize_cols_grouped: columns per CTA (a warp holds 16, with all 128 rows of the block).
COLS_PER_CTA = 64
FP8_MAX = 448.0
# Scales whose quotients x / scale come exactly from the reciprocal (see `quotient`): within
# these bounds no residual underflows and no reciprocal is subnormal. Others (tiny blocks,
# inf) take the division instruction.
FAST_SCALE_MIN = 2.0 ** -80
FAST_SCALE_MAX = 2.0 ** 100
# Markstein's correctly rounded quotient (IA-64's division; Muller et al., Handbook of
# Floating-Point Arithmetic, §4.7): $1 = x, $2 = y = RN(1/s), $3 = -s. q = RN(x·y) is within 2
# ulps of x/s, one correction q + RN(x − s·q)·y makes it faithful, and from a faithful q (whose
# residual x − s·q an fma gives exactly) and the correctly rounded y one more gives RN(x/s).
# A zero x keeps its sign (the corrections would turn −0 into +0).
_QUOTIENT_PTX = ("{ .reg .f32 q, r; .reg .pred z;\n"
                 "mul.rn.f32 q, $1, $2;\n"
                 "fma.rn.f32 r, $3, q, $1;\n"
                 "fma.rn.f32 q, r, $2, q;\n"
                 "fma.rn.f32 r, $3, q, $1;\n"
                 "fma.rn.f32 q, r, $2, q;\n"
                 "setp.eq.f32 z, $1, 0f00000000;\n"
                 "selp.f32 $0, $1, q, z; }")


@functools.cache
def device_helpers() -> types.SimpleNamespace:
    """The device functions of the recipe, traced inline by the kernels that quantize
    (these and :mod:`sonic.kernels.swiglu`'s): ``slice_amax``, ``butterfly_max``,
    ``scale_of``, ``fast_scale``, ``quotient``, ``divide``, ``quantize``,
    ``quantize_store``, ``transpose_8x8`` (imports cutlass, so only on first use)."""
    import cutlass
    from cutlass import Float8E4M3FN, Float32, Uint32, cute
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op

    def slice_amax(frag):
        """NaN-propagating max of ``|x|`` over an 8-element fp32 register fragment."""
        amax = Float32(0.0)
        for j in range(VEC):
            amax = cute.arch.fmax(amax, cute.math.absf(frag[j]), nan=True)
        return amax

    def butterfly_max(amax, lanes: int):
        """Max over ``lanes`` consecutive lanes (a power of two ≤ 32) by butterfly shuffles."""
        offset = lanes // 2
        while offset:
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset), nan=True)
            offset //= 2
        return amax

    def scale_of(amax):
        """``amax / 448``; 1.0 for an all-zero block (and, as in the reference, a NaN one)."""
        return Float32(cutlass.select_(amax > Float32(0.0), amax / Float32(FP8_MAX), Float32(1.0)))

    def fast_scale(scale):
        """Whether :func:`quotient` is exact for ``scale`` (false for NaN)."""
        return (scale >= Float32(FAST_SCALE_MIN)) & (scale <= Float32(FAST_SCALE_MAX))

    @dsl_user_op
    def quotient(x, recip, scale, *, loc=None, ip=None):
        """IEEE ``x / scale`` (round to nearest, bitwise the division instruction's) from
        ``recip = 1 / scale`` (IEEE) for a :func:`fast_scale` ``scale``: seven instructions
        without a branch, where each division instruction carries a range check and a slow
        path. Same-run A/B on the H200, outputs bitwise equal: column-wise quantization
        1.13–1.28× faster, the quantizing SwiGLU 1.13–1.15×, ``quantize_rows`` 1.06–1.09×
        (benchmarks/RESULTS.md, eighteenth session)."""
        ops = [Float32(v).ir_value(loc=loc, ip=ip) for v in (x, recip, -scale)]
        return Float32(llvm.inline_asm(Float32.mlir_type, ops, _QUOTIENT_PTX, "=f,f,f,f",
                                       loc=loc, ip=ip))

    @cute.jit
    def divide(frag, scale):
        """``frag / scale`` in place, IEEE (by :func:`quotient` where it is exact)."""
        if fast_scale(scale):
            recip = Float32(1.0) / scale
            for j in cutlass.range_constexpr(cute.size(frag)):
                frag[j] = quotient(frag[j], recip, scale)
        else:
            frag.store(frag.load() / scale)

    def quantize(frag, scale):
        """``round_e4m3(frag / scale)`` (IEEE division, saturating conversion): an 8-element
        fp8 register fragment."""
        divide(frag, scale)
        out = cute.make_rmem_tensor((VEC,), Float8E4M3FN)
        out.store(frag.load().to(Float8E4M3FN))
        return out

    def quantize_store(frag, scale, dst):
        """:func:`quantize` into the 8-element fp8 global tensor ``dst``."""
        cute.autovec_copy(quantize(frag, scale), dst)

    def transpose_8x8(words):
        """8 x 8 bytes in 16 words, ``words[2i + h]`` = row ``i``'s bytes ``4h .. 4h+3``
        (little-endian) → a new fragment whose ``[2j + h]`` is column ``j``'s bytes of rows
        ``4h .. 4h+3``: four 4 x 4 byte transposes of two byte-permute rounds each, in
        registers (a transpose through shared memory costs bank-conflicted byte loads)."""
        out = cute.make_rmem_tensor((2 * VEC,), Uint32)
        for hc in range(2):            # column half: which word of each row
            for hr in range(2):        # row half
                w = [words[2 * (4 * hr + r) + hc] for r in range(4)]
                # Interleave rows 0/1 and 2/3 byte by byte, then take byte pairs.
                t = [cute.arch.prmt(w[2 * q], w[2 * q + 1], sel)
                     for q in range(2) for sel in (0x5140, 0x7362)]
                for c in range(4):
                    lo, hi = (t[0], t[2]) if c < 2 else (t[1], t[3])
                    out[2 * (4 * hc + c) + hr] = Uint32(cute.arch.prmt(
                        lo, hi, 0x5410 if c % 2 == 0 else 0x7632))
        return out

    return types.SimpleNamespace(slice_amax=slice_amax, butterfly_max=butterfly_max,
                                 scale_of=scale_of, fast_scale=fast_scale, quotient=quotient,
                                 divide=divide, quantize=quantize,
                                 quantize_store=quantize_store, transpose_8x8=transpose_8x8)


@functools.cache
def _kernels():
    """Build the CuTe-DSL kernel classes (imports cutlass, so only on first use)."""
    import cutlass
    from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32, cute
    from cuda.bindings import driver as cuda

    from sonic.kernels.grouped_gemm.tile_scheduler import last_at_most

    fp8 = device_helpers()
    slice_amax, butterfly_max, scale_of = fp8.slice_amax, fp8.butterfly_max, fp8.scale_of
    quantize, quantize_store = fp8.quantize, fp8.quantize_store
    transpose_8x8 = fp8.transpose_8x8

    class QuantizeRowsKernel:
        """``(M, K)`` bf16 → ``q (M, K)`` e4m3 and ``scales (K/128, M)`` fp32; ``K`` static."""

        def __init__(self, k: int):
            self.k = k

        @cute.jit
        def __call__(self, x: Int64, q: Int64, scales: Int64, num_rows: Int32,
                     stream: cuda.CUstream):
            gmem = runtime.gmem_ptr
            self.kernel(gmem(BFloat16, x, 16), gmem(Float8E4M3FN, q, 16),
                        gmem(Float32, scales, 4), num_rows).launch(
                grid=[(num_rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, self.k // BLOCK, 1],
                block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, x: cute.Pointer, q: cute.Pointer, scales: cute.Pointer,
                   num_rows: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            tile, kb, _ = cute.arch.block_idx()
            lane = tidx % LANES_PER_SLICE
            col = kb * BLOCK + lane * VEC
            first = tile * ROWS_PER_CTA + tidx // LANES_PER_SLICE
            frags = [cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(ROWS_PER_LANE)]
            for i in cutlass.range_constexpr(ROWS_PER_LANE):
                # 64-bit offsets: M·K passes 2**31 elements at large M.
                row = Int64(cutlass.min(first + i * (THREADS // LANES_PER_SLICE), num_rows - 1))
                cute.autovec_copy(cute.make_tensor(x + (row * self.k + col), cute.make_layout(VEC)),
                                  frags[i])
            for i in cutlass.range_constexpr(ROWS_PER_LANE):
                row = first + i * (THREADS // LANES_PER_SLICE)
                vals = cute.make_rmem_tensor((VEC,), Float32)
                vals.store(frags[i].load().to(Float32))
                scale = scale_of(butterfly_max(slice_amax(vals), LANES_PER_SLICE))
                if row < num_rows:
                    dst = q + (Int64(row) * self.k + col)
                    quantize_store(vals, scale, cute.make_tensor(dst, cute.make_layout(VEC)))
                    if lane == 0:
                        cute.make_tensor(scales + Int64(kb) * num_rows.to(Int64),
                                         cute.make_layout(num_rows))[row] = scale

    class DequantizeRowsKernel:
        """``q (M, K)`` e4m3 and ``scales (K/128, M)`` fp32 → ``(M, K)`` bf16; ``K`` static.
        The thread layout of :class:`QuantizeRowsKernel`: 16 lanes per 128-column slice of a
        row, 8 values per lane (an 8-byte fp8 load, a 16-byte bf16 store), two rows per lane."""

        def __init__(self, k: int):
            self.k = k

        @cute.jit
        def __call__(self, q: Int64, scales: Int64, out: Int64, num_rows: Int32,
                     stream: cuda.CUstream):
            gmem = runtime.gmem_ptr
            self.kernel(gmem(Float8E4M3FN, q, 16), gmem(Float32, scales, 4),
                        gmem(BFloat16, out, 16), num_rows).launch(
                grid=[(num_rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, self.k // BLOCK, 1],
                block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, q: cute.Pointer, scales: cute.Pointer, out: cute.Pointer,
                   num_rows: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            tile, kb, _ = cute.arch.block_idx()
            col = kb * BLOCK + (tidx % LANES_PER_SLICE) * VEC
            first = tile * ROWS_PER_CTA + tidx // LANES_PER_SLICE
            block_scales = cute.make_tensor(scales + Int64(kb) * num_rows.to(Int64),
                                            cute.make_layout(num_rows))
            frags = [cute.make_rmem_tensor((VEC,), Float8E4M3FN) for _ in range(ROWS_PER_LANE)]
            row_scale = [Float32(1.0) for _ in range(ROWS_PER_LANE)]
            for i in cutlass.range_constexpr(ROWS_PER_LANE):
                # Loads of both rows first (rows past M re-read row M − 1, stored nowhere).
                row = cutlass.min(first + i * (THREADS // LANES_PER_SLICE), num_rows - 1)
                src = q + (Int64(row) * self.k + col)
                cute.autovec_copy(cute.make_tensor(src, cute.make_layout(VEC)), frags[i])
                row_scale[i] = block_scales[row]
            for i in cutlass.range_constexpr(ROWS_PER_LANE):
                row = first + i * (THREADS // LANES_PER_SLICE)
                if row < num_rows:
                    # The product in fp32, one rounding to bf16: the reference's
                    # ``(q.float() * scale).to(bfloat16)``.
                    vals = cute.make_rmem_tensor((VEC,), Float32)
                    vals.store(frags[i].load().to(Float32) * row_scale[i])
                    res = cute.make_rmem_tensor((VEC,), BFloat16)
                    res.store(vals.load().to(BFloat16))
                    dst = out + (Int64(row) * self.k + col)
                    cute.autovec_copy(res, cute.make_tensor(dst, cute.make_layout(VEC)))

    class QuantizeBlocksKernel:
        """``(E, N, K)`` bf16 → ``q`` e4m3 and ``scales (E, ceil(N/128), K/128)`` fp32;
        ``K`` static. With ``transposed``, also ``qt (E, K, N)`` and ``scales_t (E, K/128,
        N/128)``, the copy of ``wᵀ`` (``N`` a multiple of 128): the block goes through shared
        memory and leaves by rows of ``wᵀ``."""

        def __init__(self, k: int, transposed: bool = False):
            self.k = k
            self.kb = k // BLOCK
            self.transposed = transposed

        @cute.jit
        def __call__(self, w: Int64, q: Int64, scales: Int64, qt: Int64, scales_t: Int64,
                     num_experts: Int32, n: Int32, stream: cuda.CUstream):
            gmem = runtime.gmem_ptr
            self.kernel(gmem(BFloat16, w, 16), gmem(Float8E4M3FN, q, 16),
                        gmem(Float32, scales, 4), gmem(Uint32, qt, 16),
                        gmem(Float32, scales_t, 4),
                        n).launch(
                grid=[(n + BLOCK - 1) // BLOCK, self.kb, num_experts], block=[THREADS, 1, 1],
                stream=stream)

        @cute.kernel
        def kernel(self, w: cute.Pointer, q: cute.Pointer, scales: cute.Pointer,
                   qt: cute.Pointer, scales_t: cute.Pointer, n: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            nb, kb, expert = cute.arch.block_idx()
            warps = THREADS // 32
            # Lane (rg, h): rows 8·rg .. + 7 of the block; warp w: columns 8·(2w + h) .. + 7
            # (the layout of QuantizeColsKernel: a thread's 8 x 8 bytes leave by rows of wᵀ).
            lane = tidx % 32
            r0 = (lane // 2) * VEC
            c0 = ((tidx // 32) * 2 + lane % 2) * VEC
            col = kb * BLOCK + c0
            first = nb * BLOCK + r0
            base = Int64(expert) * n.to(Int64) * self.k
            frags = [cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(VEC)]
            for i in cutlass.range_constexpr(VEC):
                # A partial last row block re-reads row n - 1: amax is unchanged.
                row = Int64(cutlass.min(first + i, n - 1))
                src = w + (base + row * self.k + col)
                cute.autovec_copy(cute.make_tensor(src, cute.make_layout(VEC)), frags[i])
            vals = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(VEC)]
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(VEC):
                vals[i].store(frags[i].load().to(Float32))
                amax = cute.arch.fmax(amax, slice_amax(vals[i]), nan=True)
            amax = butterfly_max(amax, 32)
            smem = cutlass.utils.SmemAllocator()
            warp_max = smem.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)
            if tidx % 32 == 0:
                warp_max[tidx // 32] = amax
            cute.arch.barrier()
            # Every thread folds the 8 warp maxima in the same order: one broadcast read each.
            amax = warp_max[0]
            for j in cutlass.range_constexpr(1, warps):
                amax = cute.arch.fmax(amax, warp_max[j], nan=True)
            scale = scale_of(amax)
            words = cute.make_rmem_tensor((2 * VEC,), Uint32)
            for i in cutlass.range_constexpr(VEC):
                row = first + i
                out = quantize(vals[i], scale)
                if row < n:
                    dst = q + (base + Int64(row) * self.k + col)
                    cute.autovec_copy(out, cute.make_tensor(dst, cute.make_layout(VEC)))
                packed = cute.recast_tensor(out, Uint32)
                words[2 * i] = packed[0]
                words[2 * i + 1] = packed[1]
            if tidx == 0:
                num_nb = (n + BLOCK - 1) // BLOCK
                flat = (Int64(expert) * num_nb + nb) * self.kb + kb
                cute.make_tensor(scales + flat, cute.make_layout(1))[0] = scale
                if cutlass.const_expr(self.transposed):
                    flat_t = (Int64(expert) * self.kb + kb) * num_nb + nb
                    cute.make_tensor(scales_t + flat_t, cute.make_layout(1))[0] = scale
            if cutlass.const_expr(self.transposed):
                # Row col + j of wᵀ (N a multiple of 128: every row exists) holds column j's
                # rows first .. first + 7: one 8-byte store each.
                columns = transpose_8x8(words)
                base_t = Int64(expert) * self.k * n.to(Int64)
                for j in cutlass.range_constexpr(VEC):
                    at = base_t + Int64(col + j) * n.to(Int64) + first
                    pair = cute.make_rmem_tensor((2,), Uint32)
                    pair[0] = columns[2 * j]
                    pair[1] = columns[2 * j + 1]
                    cute.autovec_copy(pair, cute.make_tensor(
                        qt + cute.assume(at // 4, divby=2), cute.make_layout(2)))

    class QuantizeColsKernel:
        """Rows of ``(rows, C)`` bf16 grouped by expert (gathered or not) → ``q_t (C, R)`` e4m3
        and ``scales (R/128, C)`` fp32, one scale per 128-row block of each column within an
        expert's rows padded to whole blocks; ``C`` static."""

        def __init__(self, cols: int, gathered: bool):
            self.cols = cols
            self.gathered = gathered

        @cute.jit
        def __call__(self, x: Int64, q_t: Int64, scales: Int64, gidx: Int64, offsets: Int64,
                     k_offsets: Int64, num_experts: Int32, k_rows: Int32,
                     stream: cuda.CUstream):
            gmem = runtime.gmem_ptr
            self.kernel(gmem(BFloat16, x, 16), gmem(Uint32, q_t, 16), gmem(Float32, scales, 4),
                        gmem(Int32, gidx, 4), gmem(Int32, offsets, 4),
                        gmem(Int32, k_offsets, 4), num_experts, k_rows).launch(
                grid=[self.cols // COLS_PER_CTA, k_rows // BLOCK, 1],
                block=[COLS_PER_CTA // 16 * 32, 1, 1],
                stream=stream)

        @cute.kernel
        def kernel(self, x: cute.Pointer, q_t: cute.Pointer, scales: cute.Pointer,
                   gidx: cute.Pointer, offsets: cute.Pointer, k_offsets: cute.Pointer,
                   num_experts: Int32, k_rows: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            cb, kb, _ = cute.arch.block_idx()
            off = cute.make_tensor(offsets, cute.make_layout(num_experts + 1))
            k_off = cute.make_tensor(k_offsets, cute.make_layout(num_experts + 1))
            row0 = kb * BLOCK
            # The expert whose padded range holds the block: the largest e with
            # k_off[e] <= row0 (an empty expert shares its start with the next one).
            # Blocks past the last expert's padded rows land on expert E - 1 past its
            # rows: all padding, written as zeros with scale 1 like the reference's.
            e = last_at_most(k_off, row0, num_experts)
            first = off[e] + (row0 - k_off[e])
            last = off[e + 1]
            # Lane (rg, h): rows 8·rg .. 8·rg + 7 of the block; warp w: columns
            # 8·(2w + h) .. + 7. A warp holds all 128 rows of its 16 columns, so a column's
            # amax needs only shuffles, and each thread's 8 x 8 bytes leave by rows of q_t.
            lane = tidx % 32
            r0 = (lane // 2) * VEC
            c0 = ((tidx // 32) * 2 + lane % 2) * VEC
            col = cb * COLS_PER_CTA + c0
            frags = [cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(VEC)]
            for i in cutlass.range_constexpr(VEC):
                # Rows past the expert's end are the block's zero padding.
                frags[i].fill(0.0)
                p = first + r0 + i
                if p < last:
                    src = Int64(p)
                    if cutlass.const_expr(self.gathered):
                        src = Int64(cute.make_tensor(gidx + p, cute.make_layout(1))[0])
                    cute.autovec_copy(cute.make_tensor(x + (src * self.cols + col),
                                                       cute.make_layout(VEC)), frags[i])
            # The rows stay bf16 until each is quantized (fp32 copies of all 64 values took
            # a third of the registers).
            col_scale = cute.make_rmem_tensor((VEC,), Float32)
            col_scale.fill(0.0)
            for i in cutlass.range_constexpr(VEC):
                for j in cutlass.range_constexpr(VEC):
                    col_scale[j] = cute.arch.fmax(col_scale[j],
                                                  cute.math.absf(frags[i][j].to(Float32)),
                                                  nan=True)
            # Fold the 16 row groups (lanes of the same parity), then amax -> scale.
            for j in cutlass.range_constexpr(VEC):
                amax = col_scale[j]
                for offset in (2, 4, 8, 16):
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset),
                                          nan=True)
                col_scale[j] = scale_of(amax)
            if lane < 2:
                block_scales = cute.make_tensor(scales + (Int64(kb) * self.cols + col),
                                                cute.make_layout(VEC))
                for j in cutlass.range_constexpr(VEC):
                    block_scales[j] = col_scale[j]
            # Each column's reciprocal once; the thread's 64 quotients from them unless one of
            # its 8 scales is outside fast_scale's range.
            recips = cute.make_rmem_tensor((VEC,), Float32)
            fast = fp8.fast_scale(col_scale[0])
            for j in cutlass.range_constexpr(VEC):
                recips[j] = Float32(1.0) / col_scale[j]
                fast = fast & fp8.fast_scale(col_scale[j])
            words = cute.make_rmem_tensor((2 * VEC,), Uint32)
            for i in cutlass.range_constexpr(VEC):
                vals = cute.make_rmem_tensor((VEC,), Float32)
                vals.store(frags[i].load().to(Float32))
                if fast:
                    for j in cutlass.range_constexpr(VEC):
                        vals[j] = fp8.quotient(vals[j], recips[j], col_scale[j])
                else:
                    vals.store(vals.load() / col_scale.load())
                out = cute.make_rmem_tensor((VEC,), Float8E4M3FN)
                out.store(vals.load().to(Float8E4M3FN))
                packed = cute.recast_tensor(out, Uint32)
                words[2 * i] = packed[0]
                words[2 * i + 1] = packed[1]
            columns = transpose_8x8(words)
            for j in cutlass.range_constexpr(VEC):
                # Column c0 + j's rows r0 .. r0 + 7: one 8-byte store into row col + j of q_t.
                at = Int64(col + j) * k_rows.to(Int64) + row0 + r0
                pair = cute.make_rmem_tensor((2,), Uint32)
                pair[0] = columns[2 * j]
                pair[1] = columns[2 * j + 1]
                cute.autovec_copy(pair, cute.make_tensor(q_t + cute.assume(at // 4, divby=2),
                                                         cute.make_layout(2)))

    return QuantizeRowsKernel, QuantizeBlocksKernel, DequantizeRowsKernel, QuantizeColsKernel


def _compile(kind: str, k: int, keep_ptx: bool = False):
    """Compile one static configuration (``kind`` ``"rows"``, ``"blocks"``,
    ``"blocks_transposed"``, ``"dequant_rows"``, ``"cols"`` or ``"cols_gathered"``, ``K``: the
    columns) with placeholder arguments."""
    import cutlass

    rows_cls, blocks_cls, dequant_cls, cols_cls = _kernels()
    addresses = [runtime.fake_address() for _ in range(3)]
    if kind in ("cols", "cols_gathered"):
        extra = [runtime.fake_address() for _ in range(3)]
        return runtime.compile_launcher(cols_cls(k, kind == "cols_gathered"), *addresses,
                                        *extra, cutlass.Int32(1), cutlass.Int32(128),
                                        keep_ptx=keep_ptx)
    if kind in ("rows", "dequant_rows"):
        cls = rows_cls if kind == "rows" else dequant_cls
        return runtime.compile_launcher(cls(k), *addresses, cutlass.Int32(1), keep_ptx=keep_ptx)
    extra = [runtime.fake_address() for _ in range(2)]
    return runtime.compile_launcher(blocks_cls(k, kind == "blocks_transposed"), *addresses,
                                    *extra, cutlass.Int32(1), cutlass.Int32(1),
                                    keep_ptx=keep_ptx)


def _check_k(name: str, k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"{name}'s last dimension K must be a multiple of {BLOCK} for the FP8 "
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
    scales = torch.empty(k // BLOCK, m, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    fn = runtime.compiled(("fp8_quantize_rows", k), lambda: _compile("rows", k))
    fn(runtime.address(x, 16), runtime.address(q, 16), runtime.address(scales, 4), m)
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` up to rounding, in bf16, in one pass: ``(q · scale)``
    formed in fp32 and rounded once to bf16 — bitwise
    ``sonic.reference.fp8.dequantize_rows(q, scales).to(torch.bfloat16)``. The FP8 activation
    cache (issue 18) dequantizes the saved H with it in backward.

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
    if tuple(scales.shape) != (k // BLOCK, m):
        raise ValueError(f"scales must have shape (K/128, M) = {(k // BLOCK, m)} for q of "
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
    scales = torch.empty(e, -(-n // BLOCK), k // BLOCK, dtype=torch.float32, device=w.device)
    out = (q, scales)
    if transposed:
        out += (torch.empty(e, k, n, dtype=torch.float8_e4m3fn, device=w.device),
                torch.empty(e, k // BLOCK, n // BLOCK, dtype=torch.float32, device=w.device))
    if q.numel() == 0:
        return out
    kind = "blocks_transposed" if transposed else "blocks"
    fn = runtime.compiled(("fp8_quantize_" + kind, k), lambda: _compile(kind, k))
    # Without ``transposed`` the kernel never touches its transposed outputs' addresses.
    q_t, scales_t = out[2:] if transposed else out
    fn(runtime.address(w, 16), runtime.address(q, 16), runtime.address(scales, 4),
       runtime.address(q_t, 16), runtime.address(scales_t, 4), e, n)
    return out


def quantize_cols_grouped(x: torch.Tensor, expert_offsets: torch.Tensor,
                          k_offsets: torch.Tensor, gather_idx: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight-gradient operand per ``128 x 1`` block of each column within each
    expert's rows, into the K-major copy the FP8 varlen-K GEMM reads (issue 18; DeepSeek-V3
    §3.3: scales along the GEMM's reduction axis, here the tokens).

    Bitwise equal to :func:`sonic.reference.fp8.quantize_cols_grouped`, padding and tail
    included. One pass: a CTA reads one 128-row block of one expert (gathered rows
    included) by 64 columns; a warp holds all 128 rows of its 16 columns, so a column's
    ``amax`` is a butterfly of shuffles, and each thread's 8 x 8 e4m3 tile leaves through a
    byte transpose in registers as 8-byte pieces of rows of the copy.

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
    # expert adds at most BLOCK - 1 rows of padding.
    k_rows = (rows + (BLOCK - 1) * num_experts) // BLOCK * BLOCK
    q_t = torch.empty(cols, k_rows, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k_rows // BLOCK, cols, dtype=torch.float32, device=x.device)
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


# e4m3 conversion with saturation, IEEE division, 16-byte bf16 loads, 8-byte fp8 stores.
_MARKERS = ("cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "ld.global.v4",
            ("st.global.v2.b32", "st.global.v2.u32", "st.global.b64", "st.global.u64"))
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
        compile_fake=lambda kind=_kind, k=_k: _compile(kind, k, keep_ptx=True),
        ptx_markers=_MARKERS + _KIND_MARKERS[_kind]))
# Dequantization: an 8-byte fp8 load, e4m3 -> fp32 conversion, fp32 multiply, a rounding to
# bf16, a 16-byte store.
for _k in (256, 2048):
    register(KernelVariant(
        kernel="fp8_quant",
        variant=f"dequantize_rows_k{_k}",
        compile_fake=lambda k=_k: _compile("dequant_rows", k, keep_ptx=True),
        ptx_markers=(("ld.global.v2.b32", "ld.global.v2.u32", "ld.global.b64",
                      "ld.global.u64"), "cvt.rn.bf16x2.f32", "st.global.v4")))
