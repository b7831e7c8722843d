"""The padding-rows kernel class (imports ``cutlass``).

:mod:`sonic.kernels.padding` describes the algorithm, validates arguments and launches; it
imports this module on the first compile, so ``import sonic`` does not need ``cutlass``.
"""

import cutlass
from cutlass import Int32, Int64, cute
from cuda.bindings import driver as cuda

from sonic.kernels import runtime
from sonic.kernels.padding import THREADS


class PaddingKernel:
    """One static configuration: the store width, ``vec`` 4-byte words (4: 16-byte stores)."""

    def __init__(self, vec: int):
        self.vec = vec

    @cute.jit
    def __call__(self, base: Int64, offsets: Int64, num_experts: Int32, rows: Int32,
                 row_units: Int32, outer: Int32, word: Int32, blocks: Int32,
                 stream: cuda.CUstream):
        gmem = runtime.gmem_ptr
        self.kernel(gmem(Int32, base, 4 * self.vec), gmem(Int32, offsets, 4), num_experts,
                    rows, row_units, outer, word).launch(
            grid=[blocks, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, base: cute.Pointer, offsets: cute.Pointer, num_experts: Int32,
               rows: Int32, row_units: Int32, outer: Int32, word: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        # Clamped into [0, rows]: offsets not from a valid routing (the ops do not check them
        # against the data) store nothing past the rows, and nothing before the tensor.
        first = cutlass.max(cutlass.min(
            cute.make_tensor(offsets, cute.make_layout(num_experts + 1))[num_experts], rows), 0)
        # Units of one outer slice past `first`; none when the routing has no padding.
        per_outer = (rows - first) * row_units
        fill = cute.make_rmem_tensor((self.vec,), Int32)
        fill.fill(word)
        for i in cutlass.range(bidx * THREADS + tidx, per_outer * outer, grid * THREADS,
                               unroll=1):
            o = i // per_outer
            # 64-bit unit index: outer·P·row words exceed 2**31 for a large H.
            unit = (Int64(o) * rows + first) * row_units + (i - o * per_outer)
            cute.autovec_copy(fill, cute.make_tensor(
                base + cute.assume(unit * self.vec, divby=self.vec), cute.make_layout(self.vec)))
