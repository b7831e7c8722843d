"""Up-proj epilogue (docs/design.md §3 forward step 1; SonicMoE arXiv 2512.14080 §4.1.2): store H and
``A = SwiGLU(H)`` from one accumulator tile.

Gate and up of one A column must sit in the same thread's accumulator. "interleaved": they are
adjacent columns of a pair. "concat": the epilogue asks for B in halves
(:attr:`~sonic.kernels.grouped_gemm.config.GroupedGemmConfig.b_halves`), so a tile's first half
of columns holds gate columns and its second half the matching up columns.
Imports ``cutlass``: only the kernel modules import this one.
"""

import cutlass
from cutlass import BFloat16 as BF16, Float32 as F32, Int32, Int64, cute

from sonic.kernels import activation
from sonic.kernels.grouped_gemm.args import (EpilogueOutputs, EpilogueThreads, StageMemory,
                                             TileCoord)
from sonic.kernels.grouped_gemm.config import PAD, SLAB
from sonic.kernels.grouped_gemm.epilogue.base import Epilogue
from sonic.kernels.grouped_gemm.protocols import AccumulatorView


class SwigluEpilogue(Epilogue):
    """H ``(P, 2n)`` (the tile, bf16) and ``A = φ(gate) ⊙ up`` ``(P, n)``, φ the gate function
    of the config's GLU variant (:func:`sonic.kernels.activation.gate`; SiLU for SwiGLU).

    Not deferred (:meth:`Epilogue.defers`): with the tile held in bf16 registers beside the
    next tile's accumulator and its H and A boxes stored during that tile's k-tiles, the
    outputs were bitwise the same but the kernel slower for both layouts, even once the spills
    (LLVM hoisting the held tile's SwiGLU out of the k-loop) were gone
    (benchmarks/RESULTS.md)."""

    @cute.jit
    def visit(self, acc: AccumulatorView, wg: EpilogueThreads, outs: EpilogueOutputs, tmas: tuple,
              tile: TileCoord, stages: StageMemory, stage: Int32, phase: Int32):
        """Store H, then A, slab by slab through the staging buffer.

        A is computed from the bf16-rounded H values with the standalone SwiGLU kernel's
        formula, so it equals what the backward recomputes from the saved H bitwise."""
        cfg = self.cfg
        h_out, act = outs.c, outs.act
        stage_c, wg_tid, wg_row0 = wg.staging, wg.tid, wg.row0
        row0, rows, nt = tile.row0, tile.rows, tile.n_tile
        n = cfg.dim_n // 2
        slabs = cfg.tile_n // SLAB
        concat = cfg.gate_up == "concat"
        h_base = Int64(row0) * cfg.dim_n
        a_base = Int64(row0) * n
        for sl in cutlass.range_constexpr(slabs):
            # Destination column of the slab's first H column.
            h_col0 = nt * cfg.tile_n + sl * SLAB
            if cutlass.const_expr(concat):
                half = slabs // 2
                h_col0 = (sl // half) * n + nt * (cfg.tile_n // 2) + (sl % half) * SLAB
            self.stage_slab(acc, stage_c, wg_row0, sl)
            self.sync(wg, acc.warp_private)
            self.flush(stage_c, wg_tid, wg_row0, SLAB, h_out, h_base, cfg.dim_n, h_col0,
                       cfg.dim_n, rows, acc.warp_private)
            self.sync(wg, acc.warp_private)
        # A: per slab of A columns (concat: the gate slab's 64; interleaved: a slab's 32).
        a_width = SLAB if concat else SLAB // 2
        for sl in cutlass.range_constexpr(slabs // 2 if concat else slabs):
            self.stage_swiglu_slab(acc, stage_c, wg_row0, sl, concat, slabs)
            self.sync(wg, acc.warp_private)
            self.flush(stage_c, wg_tid, wg_row0, a_width, act, a_base, n,
                       nt * (cfg.tile_n // 2) + sl * a_width, n, rows, acc.warp_private)
            self.sync(wg, acc.warp_private)
        return stage, phase

    @cute.jit
    def stage_swiglu_slab(self, acc, stage_c: cute.Pointer, wg_row0: Int32, sl: int,
                          concat: cutlass.Constexpr, slabs: int):
        """A values of slab ``sl`` → staging buffer (column = the A column in the slab); the
        up value is the pair's second column ("interleaved") or the same position in slab
        ``sl + slabs/2`` ("concat")."""
        gate_up = cute.make_rmem_tensor((2,), F32)
        rounded = cute.make_rmem_tensor((2,), BF16)
        for p in acc.pairs(sl):
            for v0 in cutlass.range_constexpr(2 if concat else 1):
                m, col = acc.coord(p, v0)
                gate_up[0] = acc.value(p, v0)
                if cutlass.const_expr(concat):
                    gate_up[1] = acc.value(p, v0, sl + slabs // 2)
                else:
                    gate_up[1] = acc.value(p, 1)
                rounded.store(gate_up.load().to(BF16))
                g = rounded[0].to(F32)
                value = (activation.gate(g, self.cfg.activation) * rounded[1].to(F32)).to(BF16)
                a_col = col - sl * SLAB
                if cutlass.const_expr(not concat):
                    a_col = a_col // 2
                cute.make_tensor(stage_c + (m - wg_row0) * (SLAB + PAD) + a_col,
                                 cute.make_layout(1))[0] = value
