"""Hopper (sm_90a) block-scaled FP8 mainloop of the varlen-M grouped GEMM (issue 18).

Recipe of DeepSeek-V3 (arXiv 2412.19437 §3.3.2, "increasing accumulation precision"), as
DeepGEMM runs it: e4m3 operands, A scaled per ``1 x 128`` (row, k-block), B per ``128 x 128``
(n-block, k-block), fp32 scales. The WGMMA's FP8 accumulation keeps only about 14 bits of the
fp32 sum, so each k-tile of ``TILE_K_FP8 = 128`` (exactly one scale block, four
``m64n128k32`` WGMMAs per warpgroup) runs into a fresh fp32 partial accumulator, and the
partial is *promoted*: ``acc += partial · (a_scale[row] · b_scale)`` in registers with full
fp32 FMAs. The result equals ``sum_kb (A_q,kb · B_q,kbᵀ) · a_s · b_s`` up to fp32 summation
order (the reference ``grouped_mm_fp8_reference``).

Scales reach the consumer warps straight from global memory (L2), not through the operand
ring: a thread's accumulator rows are two per k-tile (cooperative ``128 x 128`` tile, 64 rows
per warpgroup), so it loads two A scales and the one B scalar of the k-block, issued before
the stage's WGMMAs and first used after them, hiding the L2 latency behind the MMAs. Through
the ring the gathered rows would need one 4-byte copy per row (below TMA's 16-byte minimum,
i.e. the LSU ``cp.async`` path the gathered operand loads left for being slow) and the
contiguous ones a TMA box at an arbitrary 4-byte row offset; the scales are ``1/128`` of
A's bytes and L2-resident, so the direct load costs nothing measurable against that.

Schedule: cooperative, ``128 x 128`` tiles only — the promoted and the partial accumulator of
a ``64 x 256`` warpgroup tile would take 256 registers per thread. Each k-tile waits for its
WGMMAs before promoting (the partial is reused), so a warpgroup's tensor-core issue pauses
for the 64 FMAs per thread of a promotion; the other warpgroup's WGMMAs fill the gap.
Epilogues: the store, SwiGLU and dSwiGLU epilogues run unchanged on the promoted accumulator
(the scales arrive as two more pointers of ``outs``, after the epilogues' own). With SwiGLU "concat" the B tile is two 64-row half boxes, gate rows ``nt·64 ..`` and up
rows ``n + nt·64 ..`` (:attr:`~.config.GroupedGemmConfig.b_halves`): each half lies inside one
128-row scale block (n is a multiple of 64), but the two halves' blocks differ, so the
promotion scales each column half by its own B scale. "interleaved" B rows are the weight's
own rows, one scale block per 128-column tile.
Imports ``cutlass``: only the dispatcher (:mod:`.interface`) imports this module, lazily.
"""

import cutlass
from cutlass import Float32 as F32, Int32, Int64, cute
from cutlass.cute.nvgpu import warpgroup

from sonic.kernels.grouped_gemm.config import (PAD, PRODUCER_THREADS, SLAB, TILE_K_FP8,
                                               TILE_M)
from sonic.kernels.grouped_gemm.sm90 import Sm90GroupedGemm, WgmmaAccumulator


class Sm90Fp8GroupedGemm(Sm90GroupedGemm):
    """varlen-M grouped GEMM on e4m3 operands with per-k-tile fp32 promotion (cooperative)."""

    @cute.jit
    def run_roles(self, tidx: Int32, warp: Int32, first: Int32, step: Int32, total: Int32,
                  tiled_mma: cute.TiledMma, storage, tma_a: tuple, tma_b: tuple,
                  tma_epi: tuple, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                  s_a: cute.Tensor, s_b: cute.Tensor, stage_mem: tuple, outs: tuple,
                  gidx_a: cute.Pointer, gidx_b: cute.Pointer, rows_a: Int32, rows_b: Int32,
                  m_off: cute.Tensor, table: cute.Tensor, num_experts: Int32,
                  full: cute.Pointer, empty: cute.Pointer):
        """Warpgroup 0 produces (the bf16 kernel's TMA producers, on e4m3 bytes), warpgroups
        1..2 run the promoted WGMMA mainloop, which also needs A's row sources."""
        cfg = self.cfg
        if tidx < PRODUCER_THREADS:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            self.produce(warp, first, step, total, tma_a, tma_b, tma_epi, a_smem, b_smem, s_a,
                         s_b, stage_mem, gidx_a, gidx_b, rows_a, rows_b, m_off, table,
                         num_experts, full, empty)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            self.consume_promoted(tidx - PRODUCER_THREADS, first, step, total, tiled_mma, s_a,
                                  s_b, storage.sC.data_ptr(), outs, gidx_a, rows_a, m_off,
                                  table, num_experts, full, empty, stage_mem)

    @cute.jit
    def consume_promoted(self, ctid: Int32, first: Int32, step: Int32, total: Int32,
                         tiled_mma: cute.TiledMma, s_a: cute.Tensor, s_b: cute.Tensor,
                         s_c: cute.Pointer, outs: tuple, gidx: cute.Pointer, rows_a: Int32,
                         m_off: cute.Tensor, table: cute.Tensor, num_experts: Int32,
                         full: cute.Pointer, empty: cute.Pointer, stage_mem: tuple):
        """Per tile: for each k-tile, WGMMA into the partial accumulator, promote it with the
        k-block's scales; then the epilogue on the promoted fp32 accumulator.

        ``outs[4]``: A's scales ``(K/128, rows_a)`` fp32 (row ``r`` of the tile reads column
        ``gidx[r]`` when gathered); ``outs[5]``: B's ``(E, N/128, K/128)`` fp32, one scale
        per k-tile for the tile, or with ``b_halves`` one per column half.
        """
        cfg = self.cfg
        wg = cute.arch.make_warp_uniform(ctid // 128)
        wg_tid = ctid - wg * 128
        stage_c = s_c + wg * (cfg.rows_wg * (SLAB + PAD))
        wg_row0 = wg * cfg.rows_wg
        thr_mma = tiled_mma.get_slice(ctid)
        t_ca = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        t_cb = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        acc_shape = thr_mma.partition_shape_C((TILE_M, cfg.tile_n))
        acc = cute.make_rmem_tensor(acc_shape, F32)
        partial = cute.make_rmem_tensor(acc_shape, F32)
        k_blocks = cute.size(t_ca, mode=[2])
        coords = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, cfg.tile_n)))
        n_rows = 2 * cute.size(acc, mode=[1])
        a_scales, b_scales = outs[4], outs[5]
        # Source row of each of this thread's accumulator rows (WgmmaAccumulator.row_coord),
        # and its k-block's A scale.
        src = cute.make_rmem_tensor((n_rows,), Int32)
        a_sc = cute.make_rmem_tensor((n_rows,), F32)
        halves = 2 if cfg.b_halves else 1
        b_sc = cute.make_rmem_tensor((halves,), F32)
        # Scale of (row i, column half h) at i * halves + h.
        row_scale = cute.make_rmem_tensor((n_rows * halves,), F32)
        n_blocks, k_tiles = cfg.dim_n // TILE_K_FP8, cfg.k_tiles
        lane = cute.arch.lane_idx()
        stage = Int32(0)
        phase = Int32(0)
        t = first
        while t < total:
            e, row0, rows, nt, mt, shared = self.scheduler.decode(t, m_off, table, num_experts)
            for i in cutlass.range_constexpr(n_rows):
                # Rows past the expert's end reach only masked output: any valid source does.
                m = WgmmaAccumulator(acc, coords).row_coord(i)
                r = row0
                if m < rows:
                    r = row0 + m
                if cutlass.const_expr(cfg.gather_a):
                    r = cute.make_tensor(gidx + r, cute.make_layout(1))[0]
                src[i] = r
            # The scale row of each column half's n-block: the tile's own block, or for B
            # halves (rows nt·h_rows .. and n + nt·h_rows ..) the block holding each half.
            b_rows = [b_scales + (e * n_blocks + nt) * k_tiles]
            if cutlass.const_expr(cfg.b_halves):
                h_rows = cfg.tile_n // 2
                b_rows = [b_scales + (e * n_blocks + (h * (cfg.dim_n // 2) + nt * h_rows)
                                      // TILE_K_FP8) * k_tiles for h in range(2)]
            acc.fill(0.0)
            for kt in cutlass.range(k_tiles, unroll=1):
                for i in cutlass.range_constexpr(n_rows):
                    a_sc[i] = cute.make_tensor(a_scales + (Int64(kt) * rows_a + src[i]),
                                               cute.make_layout(1))[0]
                for h in cutlass.range_constexpr(halves):
                    b_sc[h] = cute.make_tensor(b_rows[h] + kt, cute.make_layout(1))[0]
                cute.arch.mbarrier_wait(full + stage, phase)
                # The promotion below read the partial: order it before the WGMMAs rewrite it.
                warpgroup.fence()
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, partial, t_ca[None, None, kb, stage],
                              t_cb[None, None, kb, stage], partial)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                self.ring.release(empty + stage, lane)
                stage, phase = self.ring.next_stage(stage, phase)
                for i in cutlass.range_constexpr(n_rows):
                    for h in cutlass.range_constexpr(halves):
                        row_scale[i * halves + h] = a_sc[i] * b_sc[h]
                self.promote(acc, partial, row_scale, coords)
            stage, phase = self.epilogue.visit(
                WgmmaAccumulator(acc, coords), stage_c, wg_tid, wg, wg_row0, lane, outs, e, row0,
                rows, nt, mt, stage_mem, stage, phase, full, empty)
            t += step

    @cute.jit
    def promote(self, acc: cute.Tensor, partial: cute.Tensor, row_scale: cute.Tensor,
                coords: cute.Tensor):
        """``acc += partial · row_scale[row, half]`` over the thread's fragment, one fp32 FMA
        each (``row_scale`` indexed by :attr:`ColumnPair.row` and, with ``b_halves``, the
        sub-tile's column half)."""
        view = WgmmaAccumulator(acc, coords)
        slabs = self.cfg.tile_n // SLAB
        halves = 2 if self.cfg.b_halves else 1
        for sl in cutlass.range_constexpr(slabs):
            h = sl // (slabs // halves)
            for p in view.pairs(sl):
                for v0 in cutlass.range_constexpr(2):
                    mode = view.mode(p, v0)
                    acc[mode] = acc[mode] + partial[mode] * row_scale[p.row * halves + h]
