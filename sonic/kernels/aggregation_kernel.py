"""The expert-aggregation kernel class (imports ``cutlass``).

:mod:`sonic.kernels.aggregation` describes the algorithm, validates arguments and launches;
it imports this module on the first compile, so ``import sonic`` does not need ``cutlass``.
"""

import cutlass
from cutlass import Int32, cute
from cuda.bindings import driver as cuda

from sonic.kernels import runtime
from sonic.kernels.aggregation import THREADS, UNROLL, VEC


class AggregationKernel:
    """One static configuration: element type, ``d``, with or without row scores."""

    def __init__(self, dtype, d: int, scored: bool):
        self.dtype = dtype
        self.d = d
        self.scored = scored
        self.slices = d // VEC

    @cute.jit
    def __call__(self, y: cutlass.Int64, token_rows: cutlass.Int64, token_offsets: cutlass.Int64,
                 row_scores: cutlass.Int64, out: cutlass.Int64, num_tokens: Int32,
                 stream: cuda.CUstream):
        blocks = (num_tokens * self.slices + THREADS - 1) // THREADS
        gmem = runtime.gmem_ptr
        self.kernel(gmem(self.dtype, y, 16), gmem(Int32, token_rows, 4),
                    gmem(Int32, token_offsets, 4), gmem(cutlass.Float32, row_scores, 4),
                    gmem(self.dtype, out, 16), num_tokens).launch(
            grid=[blocks, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, y: cute.Pointer, token_rows: cute.Pointer, token_offsets: cute.Pointer,
               row_scores: cute.Pointer, out: cute.Pointer, num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        item = bidx * THREADS + tidx
        t = item // self.slices
        col = (item - t * self.slices) * VEC
        if t < num_tokens:
            mOffsets = cute.make_tensor(token_offsets, cute.make_layout(num_tokens + 1))
            lo = mOffsets[t]
            hi = mOffsets[t + 1]
            mRows = cute.make_tensor(token_rows, cute.make_layout(hi))
            acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            acc.fill(0.0)
            frag = cute.make_rmem_tensor((VEC,), self.dtype)
            for j in cutlass.range(lo, hi, unroll=UNROLL):
                r = mRows[j]
                # 64-bit row offset: P·d exceeds 2**31 elements at large T and d.
                gY = cute.make_tensor(y + (cutlass.Int64(r) * self.d + col), cute.make_layout(VEC))
                cute.autovec_copy(gY, frag)
                x = frag.load().to(cutlass.Float32)
                if cutlass.const_expr(self.scored):
                    mScores = cute.make_tensor(row_scores, cute.make_layout(r + 1))
                    acc.store(acc.load() + x * mScores[r])
                else:
                    acc.store(acc.load() + x)
            res = cute.make_rmem_tensor((VEC,), self.dtype)
            res.store(acc.load().to(self.dtype))
            gOut = cute.make_tensor(out + (cutlass.Int64(t) * self.d + col), cute.make_layout(VEC))
            cute.autovec_copy(res, gOut)
