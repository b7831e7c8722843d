"""The block-scaled FP8 quantization kernels and the recipe's device functions (imports
``cutlass``).

:mod:`sonic.kernels.fp8_quant` describes the recipe, validates arguments and launches; it
imports this module on the first compile, so ``import sonic`` does not need ``cutlass``. The
device functions (``slice_amax`` ... ``transpose_8x8``) are traced inline by these kernels and
by :mod:`sonic.kernels.swiglu_kernel`'s quantizing variants.
"""

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from sonic.kernels import runtime
from sonic.kernels.grouped_gemm.tile_scheduler import last_at_most
from sonic.types import FP8_BLOCK
from sonic.kernels.fp8_quant import (COLS_PER_CTA, COLS_THREADS, FAST_SCALE_MAX, FAST_SCALE_MIN,
                                     FP8_MAX, LANES_PER_SLICE, ROWS_PER_CTA, ROWS_PER_LANE,
                                     THREADS, VEC, cols_chunks)

# quantize_cols_grouped: shared-memory stages of a CTA's chunks in flight.
STAGES = 3

# Markstein's correctly rounded quotient (IA-64's division; Muller et al., Handbook of
# Floating-Point Arithmetic, §4.7): $1 = x, $2 = y = RN(1/s), $3 = s. q = RN(x·y) is within 2
# ulps of x/s, one correction q − RN(s·q − x)·y makes it faithful, and from a faithful q (whose
# residual s·q − x an fma gives exactly) and the correctly rounded y one more gives RN(x/s).
# The residual is s·q − x rather than x − s·q (exactly its negation: round to nearest is
# symmetric) so that a zero x keeps its sign through both corrections without a select:
# RN(s·(−0) + 0) = +0, then −(+0)·y + (−0) = −0. The negations are operand modifiers in SASS.
_QUOTIENT_PTX = ("{ .reg .f32 q, r, nx;\n"
                 "neg.f32 nx, $1;\n"
                 "mul.rn.f32 q, $1, $2;\n"
                 "fma.rn.f32 r, $3, q, nx;\n"
                 "neg.f32 r, r;\n"
                 "fma.rn.f32 q, r, $2, q;\n"
                 "fma.rn.f32 r, $3, q, nx;\n"
                 "neg.f32 r, r;\n"
                 "fma.rn.f32 $0, r, $2, q; }")


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


# NaN-propagating max of two pairs of bf16 packed in 32-bit words, the second taken in
# absolute value (its sign bits cleared): one instruction for two elements of a column amax,
# exact, so the same maxima as fp32's.
_ABS_MAX_BF16X2_PTX = ("{ .reg .b32 t;\n"
                       "and.b32 t, $2, 0x7FFF7FFF;\n"
                       "max.NaN.bf16x2 $0, $1, t; }")


@dsl_user_op
def bf16x2_max(acc, word, *, loc=None, ip=None):
    """``max(acc, |word|)`` per bf16 half of two 32-bit words (``acc`` non-negative),
    NaN-propagating (a canonical NaN)."""
    ops = [Uint32(v).ir_value(loc=loc, ip=ip) for v in (acc, word)]
    return Uint32(llvm.inline_asm(Uint32.mlir_type, ops, _ABS_MAX_BF16X2_PTX, "=r,r,r",
                                  loc=loc, ip=ip))


def scale_of(amax):
    """``amax / 448``; 1.0 for an all-zero block (and, as in the reference, a NaN one)."""
    return Float32(cutlass.select_(amax > Float32(0.0), amax / Float32(FP8_MAX), Float32(1.0)))


def fast_scale(scale):
    """Whether :func:`quotient` is exact for ``scale`` (false for NaN)."""
    return (scale >= Float32(FAST_SCALE_MIN)) & (scale <= Float32(FAST_SCALE_MAX))


@dsl_user_op
def quotient(x, recip, scale, *, loc=None, ip=None):
    """IEEE ``x / scale`` (round to nearest, bitwise the division instruction's) from
    ``recip = 1 / scale`` (IEEE) for a :func:`fast_scale` ``scale``: five instructions
    without a branch, where each division instruction carries a range check and a slow
    path. Faster for column-wise quantization, the quantizing SwiGLU and ``quantize_rows``
    alike, outputs bitwise equal (benchmarks/RESULTS.md)."""
    ops = [Float32(v).ir_value(loc=loc, ip=ip) for v in (x, recip, scale)]
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
            grid=[(num_rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, self.k // FP8_BLOCK, 1],
            block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, q: cute.Pointer, scales: cute.Pointer,
               num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tile, kb, _ = cute.arch.block_idx()
        lane = tidx % LANES_PER_SLICE
        col = kb * FP8_BLOCK + lane * VEC
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
            grid=[(num_rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, self.k // FP8_BLOCK, 1],
            block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, q: cute.Pointer, scales: cute.Pointer, out: cute.Pointer,
               num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tile, kb, _ = cute.arch.block_idx()
        col = kb * FP8_BLOCK + (tidx % LANES_PER_SLICE) * VEC
        first = tile * ROWS_PER_CTA + tidx // LANES_PER_SLICE
        gScales = cute.make_tensor(scales + Int64(kb) * num_rows.to(Int64),
                                        cute.make_layout(num_rows))
        frags = [cute.make_rmem_tensor((VEC,), Float8E4M3FN) for _ in range(ROWS_PER_LANE)]
        row_scale = [Float32(1.0) for _ in range(ROWS_PER_LANE)]
        for i in cutlass.range_constexpr(ROWS_PER_LANE):
            # Loads of both rows first (rows past M re-read row M − 1, stored nowhere).
            row = cutlass.min(first + i * (THREADS // LANES_PER_SLICE), num_rows - 1)
            src = q + (Int64(row) * self.k + col)
            cute.autovec_copy(cute.make_tensor(src, cute.make_layout(VEC)), frags[i])
            row_scale[i] = gScales[row]
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
        self.kb = k // FP8_BLOCK
        self.transposed = transposed

    @cute.jit
    def __call__(self, w: Int64, q: Int64, scales: Int64, qt: Int64, scales_t: Int64,
                 num_experts: Int32, n: Int32, stream: cuda.CUstream):
        gmem = runtime.gmem_ptr
        self.kernel(gmem(BFloat16, w, 16), gmem(Float8E4M3FN, q, 16),
                    gmem(Float32, scales, 4), gmem(Uint32, qt, 16),
                    gmem(Float32, scales_t, 4),
                    n).launch(
            grid=[(n + FP8_BLOCK - 1) // FP8_BLOCK, self.kb, num_experts], block=[THREADS, 1, 1],
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
        col = kb * FP8_BLOCK + c0
        first = nb * FP8_BLOCK + r0
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
        sWarpMax = smem.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)
        if tidx % 32 == 0:
            sWarpMax[tidx // 32] = amax
        cute.arch.barrier()
        # Every thread folds the 8 warp maxima in the same order: one broadcast read each.
        amax = sWarpMax[0]
        for j in cutlass.range_constexpr(1, warps):
            amax = cute.arch.fmax(amax, sWarpMax[j], nan=True)
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
            num_nb = (n + FP8_BLOCK - 1) // FP8_BLOCK
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
    expert's rows padded to whole blocks; ``C`` static. A CTA takes one 128-row block and a
    strip of :func:`~sonic.kernels.fp8_quant.cols_chunks` 64-column chunks, copied into
    shared memory :data:`STAGES` - 1 chunks ahead of the one it quantizes."""

    def __init__(self, cols: int, gathered: bool):
        self.cols = cols
        self.gathered = gathered
        self.chunks = cols_chunks(cols)

    @cute.jit
    def __call__(self, x: Int64, q_t: Int64, scales: Int64, gidx: Int64, offsets: Int64,
                 k_offsets: Int64, num_experts: Int32, k_rows: Int32,
                 stream: cuda.CUstream):
        gmem = runtime.gmem_ptr
        self.kernel(gmem(BFloat16, x, 16), gmem(Uint32, q_t, 16), gmem(Float32, scales, 4),
                    gmem(Int32, gidx, 4), gmem(Int32, offsets, 4),
                    gmem(Int32, k_offsets, 4), num_experts, k_rows).launch(
            grid=[self.cols // (COLS_PER_CTA * self.chunks), k_rows // FP8_BLOCK, 1],
            block=[COLS_THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, q_t: cute.Pointer, scales: cute.Pointer,
               gidx: cute.Pointer, offsets: cute.Pointer, k_offsets: cute.Pointer,
               num_experts: Int32, k_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        strip, kb, _ = cute.arch.block_idx()
        mOffsets = cute.make_tensor(offsets, cute.make_layout(num_experts + 1))
        mKOffsets = cute.make_tensor(k_offsets, cute.make_layout(num_experts + 1))
        row0 = kb * FP8_BLOCK
        # The expert whose padded range holds the block: the largest e with
        # mKOffsets[e] <= row0 (an empty expert shares its start with the next one).
        # Blocks past the last expert's padded rows land on expert E - 1 past its
        # rows: all padding, written as zeros with scale 1 like the reference's.
        e = last_at_most(mKOffsets, row0, num_experts)
        first = mOffsets[e] + (row0 - mKOffsets[e])
        last = mOffsets[e + 1]
        # Lane (rg, h): rows 8·rg .. 8·rg + 7 of the block; warp w: columns
        # 8·(2w + h) .. + 7 of each chunk. A warp holds all 128 rows of its 16 columns, so a
        # column's amax needs only shuffles, and each thread's 8 x 8 bytes leave by rows of q_t.
        lane = tidx % 32
        r0 = (lane // 2) * VEC
        col = strip * (COLS_PER_CTA * self.chunks) + ((tidx // 32) * 2 + lane % 2) * VEC
        # Source row of each of the thread's rows, once for the strip; -1: the block's zero
        # padding past the expert's end.
        src = cute.make_rmem_tensor((VEC,), Int32)
        for i in cutlass.range_constexpr(VEC):
            p = first + r0 + i
            src[i] = Int32(-1)
            if p < last:
                src[i] = p
                if cutlass.const_expr(self.gathered):
                    src[i] = cute.make_tensor(gidx + p, cute.make_layout(1))[0]
        # The strip's chunks arrive by cp.async into STAGES shared-memory stages, STAGES - 1
        # chunks ahead; each thread copies and later reads only its own 8 rows' 16 bytes
        # (slot (stage, i, tid): a warp's reads are 512 contiguous bytes), so no barrier.
        smem = cutlass.utils.SmemAllocator()
        sRows = smem.allocate_tensor(
            BFloat16, cute.make_layout((VEC, COLS_THREADS, VEC, STAGES),
                                       stride=(1, VEC, COLS_THREADS * VEC,
                                               VEC * COLS_THREADS * VEC)),
            byte_alignment=16)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   BFloat16, num_bits_per_copy=128)
        for c in cutlass.range_constexpr(STAGES - 1):
            self.issue(atom, x, src, sRows, col + c * COLS_PER_CTA, c, tidx)
        tile = [cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(VEC)]
        for c in cutlass.range(self.chunks, unroll=1):
            # Chunk c's copies are done (committed groups: chunks 0 .. c + STAGES - 2).
            cute.arch.cp_async_wait_group(STAGES - 2)
            stage = c % STAGES
            for i in cutlass.range_constexpr(VEC):
                tile[i].fill(0.0)
                if src[i] >= 0:
                    cute.autovec_copy(sRows[None, tidx, i, stage], tile[i])
            # Into the stage chunk c - 1 left (its reads are done); an empty group past the
            # strip's end keeps the count.
            if c + STAGES - 1 < self.chunks:
                self.issue(atom, x, src, sRows, col + (c + STAGES - 1) * COLS_PER_CTA,
                           (c + STAGES - 1) % STAGES, tidx)
            else:
                cute.arch.cp_async_commit_group()
            self.quantize_chunk(tile, q_t, scales, col + c * COLS_PER_CTA, row0 + r0, kb,
                                k_rows, lane)

    @cute.jit
    def issue(self, atom, x: cute.Pointer, src: cute.Tensor, sRows: cute.Tensor, col: Int32,
              stage: Int32, tidx: Int32):
        """cp.async of the thread's 8 rows (``src``; none for -1) of columns ``col .. col +
        7`` into its slots of ``stage``, as one committed group."""
        for i in cutlass.range_constexpr(VEC):
            if src[i] >= 0:
                at = cute.assume(Int64(src[i]) * self.cols + col, divby=VEC)
                cute.copy(atom, cute.make_tensor(x + at, cute.make_layout(VEC)),
                          sRows[None, tidx, i, stage])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def quantize_chunk(self, tile: list, q_t: cute.Pointer, scales: cute.Pointer, col: Int32,
                       row: Int32, kb: Int32, k_rows: Int32, lane: Int32):
        """Scales of columns ``col .. col + 7`` over the block (``amax`` of the bf16 pairs,
        folded over the warp's 16 row groups), then the thread's 8 x 8 tile quantized and
        stored as 8-byte pieces of rows ``col .. col + 7`` of ``q_t`` from row ``row`` on."""
        pairs = cute.make_rmem_tensor((VEC // 2,), Uint32)
        pairs.fill(0)
        for i in cutlass.range_constexpr(VEC):
            words = cute.recast_tensor(tile[i], Uint32)
            for w in cutlass.range_constexpr(VEC // 2):
                pairs[w] = bf16x2_max(pairs[w], words[w])
        # Fold the 16 row groups (lanes of the same parity).
        for w in cutlass.range_constexpr(VEC // 2):
            for offset in (2, 4, 8, 16):
                pairs[w] = bf16x2_max(pairs[w], cute.arch.shuffle_sync_bfly(pairs[w],
                                                                            offset=offset))
        col_scale = cute.make_rmem_tensor((VEC,), Float32)
        col_scale.store(cute.recast_tensor(pairs, BFloat16).load().to(Float32))
        for j in cutlass.range_constexpr(VEC):
            col_scale[j] = scale_of(col_scale[j])
        if lane < 2:
            gScales = cute.make_tensor(scales + (Int64(kb) * self.cols + col),
                                       cute.make_layout(VEC))
            for j in cutlass.range_constexpr(VEC):
                gScales[j] = col_scale[j]
        # Each column's reciprocal once; the thread's 64 quotients from them unless one of
        # its 8 scales is outside fast_scale's range.
        recips = cute.make_rmem_tensor((VEC,), Float32)
        fast = fast_scale(col_scale[0])
        for j in cutlass.range_constexpr(VEC):
            recips[j] = Float32(1.0) / col_scale[j]
            fast = fast & fast_scale(col_scale[j])
        words = cute.make_rmem_tensor((2 * VEC,), Uint32)
        for i in cutlass.range_constexpr(VEC):
            vals = cute.make_rmem_tensor((VEC,), Float32)
            vals.store(tile[i].load().to(Float32))
            if fast:
                for j in cutlass.range_constexpr(VEC):
                    vals[j] = quotient(vals[j], recips[j], col_scale[j])
            else:
                vals.store(vals.load() / col_scale.load())
            out = cute.make_rmem_tensor((VEC,), Float8E4M3FN)
            out.store(vals.load().to(Float8E4M3FN))
            packed = cute.recast_tensor(out, Uint32)
            words[2 * i] = packed[0]
            words[2 * i + 1] = packed[1]
        columns = transpose_8x8(words)
        for j in cutlass.range_constexpr(VEC):
            # Column col + j's rows row .. row + 7: one 8-byte store into row col + j of q_t.
            at = Int64(col + j) * k_rows.to(Int64) + row
            pair = cute.make_rmem_tensor((2,), Uint32)
            pair[0] = columns[2 * j]
            pair[1] = columns[2 * j + 1]
            cute.autovec_copy(pair, cute.make_tensor(q_t + cute.assume(at // 4, divby=2),
                                                     cute.make_layout(2)))
