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

Schedule: cooperative, ``128 x 128`` tiles only — a ``64 x 256`` warpgroup tile's promoted
and partial accumulators would take 256 registers per thread. With contiguous A
(:attr:`GroupedGemmConfig.overlapped_promotion`) two partial accumulators alternate over
the k-tiles: the WGMMAs of k-tile ``kt`` are queued into one before the thread waits for
those of ``kt - 1`` (``wait_group(1)``) and promotes the other, so the tensor cores have work
while a warpgroup runs its 64 promotion FMAs per thread. That k-loop is unrolled (K is a
compile-time size): in a rolled loop ptxas cannot tell which group a wait retires and
serialises every WGMMA (its C7514 warning). Gathered A keeps one partial accumulator and
waits for each k-tile's WGMMAs before promoting it (the other warpgroup's WGMMAs fill the
gap): its row-copy producers need registers the third accumulator would take.
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

from sonic.kernels.grouped_gemm.config import PAD, SLAB, TILE_K_FP8, TILE_M
from sonic.kernels.grouped_gemm.sm90 import Sm90GroupedGemm, WgmmaAccumulator


class Sm90Fp8GroupedGemm(Sm90GroupedGemm):
    """varlen-M grouped GEMM on e4m3 operands with per-k-tile fp32 promotion (cooperative)."""

    @cute.jit
    def consume(self, ctid: Int32, first: Int32, step: Int32, total: Int32,
                tiled_mma: cute.TiledMma, s_a: cute.Tensor, s_b: cute.Tensor, s_c: cute.Pointer,
                outs: tuple, m_off: cute.Tensor, table: cute.Tensor, num_experts: Int32,
                full: cute.Pointer, empty: cute.Pointer, stage_mem: tuple, gidx: cute.Pointer,
                rows_a: Int32):
        """Per tile: for each k-tile, WGMMA into the partial accumulator, promote it with the
        k-block's scales (overlapped with the next k-tile's WGMMAs where
        :attr:`~.config.GroupedGemmConfig.overlapped_promotion`); then the epilogue on the
        promoted fp32 accumulator.

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
        # With overlapped promotion, two partial accumulators: the WGMMAs of k-tile kt run
        # into one while the thread promotes k-tile kt-1 from the other.
        parts = [cute.make_rmem_tensor(acc_shape, F32), cute.make_rmem_tensor(acc_shape, F32)]
        coords = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, cfg.tile_n)))
        n_rows = 2 * cute.size(acc, mode=[1])
        a_scales, b_scales = outs[4], outs[5]
        # Source row of each of this thread's accumulator rows (WgmmaAccumulator.row_coord);
        # the A and B scales of the k-tile in flight in each partial's slot s: A's of row i
        # at s * n_rows + i, B's of column half h at s * halves + h.
        src = cute.make_rmem_tensor((n_rows,), Int32)
        a_sc = cute.make_rmem_tensor((2 * n_rows,), F32)
        halves = 2 if cfg.b_halves else 1
        b_sc = cute.make_rmem_tensor((2 * halves,), F32)
        # Scale of (row i, column half h) at i * halves + h.
        row_scale = cute.make_rmem_tensor((n_rows * halves,), F32)
        n_blocks, k_tiles = cfg.dim_n // TILE_K_FP8, cfg.k_tiles
        lane = cute.arch.lane_idx()
        stage = Int32(0)
        phase = Int32(0)
        prev = Int32(0)
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
            if cutlass.const_expr(cfg.overlapped_promotion):
                # Unrolled, so that ptxas sees which WGMMA group each wait_group retires:
                # k-tile kt-1's promotion waits only for its own WGMMAs while kt's run.
                for kt in cutlass.range_constexpr(k_tiles):
                    h = kt % 2
                    tiled_mma = self.issue(tiled_mma, parts[h], t_ca, t_cb, a_sc, b_sc, h, kt,
                                           src, a_scales, b_rows, rows_a, full, stage, phase)
                    if cutlass.const_expr(kt > 0):
                        self.retire(acc, parts[1 - h], a_sc, b_sc, 1 - h, row_scale, coords, 1,
                                    empty + prev, lane)
                    prev = stage
                    stage, phase = self.ring.next_stage(stage, phase)
                last = (k_tiles - 1) % 2
                self.retire(acc, parts[last], a_sc, b_sc, last, row_scale, coords, 0,
                            empty + prev, lane)
            else:
                for kt in cutlass.range(k_tiles, unroll=1):
                    tiled_mma = self.issue(tiled_mma, parts[0], t_ca, t_cb, a_sc, b_sc, 0, kt,
                                           src, a_scales, b_rows, rows_a, full, stage, phase)
                    self.retire(acc, parts[0], a_sc, b_sc, 0, row_scale, coords, 0,
                                empty + stage, lane)
                    stage, phase = self.ring.next_stage(stage, phase)
            stage, phase = self.epilogue.visit(
                WgmmaAccumulator(acc, coords), stage_c, wg_tid, wg, wg_row0, lane, outs, e, row0,
                rows, nt, mt, stage_mem, stage, phase, full, empty)
            t += step

    @cute.jit
    def issue(self, tiled_mma: cute.TiledMma, partial: cute.Tensor, t_ca: cute.Tensor,
              t_cb: cute.Tensor, a_sc: cute.Tensor, b_sc: cute.Tensor, h: cutlass.Constexpr,
              kt: Int32, src: cute.Tensor, a_scales: cute.Pointer,
              b_rows: list, rows_a: Int32, full: cute.Pointer, stage: Int32,
              phase: Int32):
        """Load k-tile ``kt``'s scales into slot ``h`` (first used at its promotion, one
        k-tile later, so the L2 latency hides behind the MMAs), wait for its operands and
        queue its WGMMAs into ``partial`` as one group. Returns ``tiled_mma``, whose
        accumulate field this sets: the caller rebinds it, so the DSL's tracer carries the
        new state across the loops (an attribute set only inside a helper escapes them)."""
        n_rows = cute.size(src)
        for i in cutlass.range_constexpr(n_rows):
            a_sc[h * n_rows + i] = cute.make_tensor(a_scales + (Int64(kt) * rows_a + src[i]),
                                                    cute.make_layout(1))[0]
        halves = len(b_rows)
        for hv in cutlass.range_constexpr(halves):
            b_sc[h * halves + hv] = cute.make_tensor(b_rows[hv] + kt, cute.make_layout(1))[0]
        cute.arch.mbarrier_wait(full + stage, phase)
        # The promotion two k-tiles back read this partial: order it before the WGMMAs
        # rewrite it.
        warpgroup.fence()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(cute.size(t_ca, mode=[2])):
            cute.gemm(tiled_mma, partial, t_ca[None, None, kb, stage], t_cb[None, None, kb, stage],
                      partial)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        return tiled_mma

    @cute.jit
    def retire(self, acc: cute.Tensor, partial: cute.Tensor, a_sc: cute.Tensor,
               b_sc: cute.Tensor, h: cutlass.Constexpr, row_scale: cute.Tensor,
               coords: cute.Tensor, pending: cutlass.Constexpr, empty_stage: cute.Pointer,
               lane: Int32):
        """Wait until at most ``pending`` WGMMA groups remain (the oldest, ``partial``'s, is
        done), hand its operand stage back to the producers and promote ``partial`` with the
        scales of slot ``h``."""
        warpgroup.wait_group(pending)
        self.ring.release(empty_stage, lane)
        halves = cute.size(b_sc) // 2
        n_rows = cute.size(row_scale) // halves
        for i in cutlass.range_constexpr(n_rows):
            for hv in cutlass.range_constexpr(halves):
                row_scale[i * halves + hv] = a_sc[h * n_rows + i] * b_sc[h * halves + hv]
        self.promote(acc, partial, row_scale, coords)

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
