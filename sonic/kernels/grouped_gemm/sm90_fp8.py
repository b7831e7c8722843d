"""Hopper (sm_90a) block-scaled FP8 mainloop of the grouped GEMM.

Recipe of DeepSeek-V3 (arXiv 2412.19437 §3.3.2, "increasing accumulation precision"), as
DeepGEMM runs it: e4m3 operands, A scaled per ``1 x 128`` (row, k-block), B per ``128 x 128``
(n-block, k-block), fp32 scales. The WGMMA's FP8 accumulation keeps only about 14 bits of the
fp32 sum, so each k-tile of ``TILE_K_FP8 = 128`` (exactly one scale block, four
``m64n128k32`` WGMMAs per warpgroup) runs into a fresh fp32 partial accumulator, and the
partial is *promoted*: ``acc += partial · (a_scale[row] · b_scale)`` in registers with full
fp32 FMAs. The result equals ``sum_kb (A_q,kb · B_q,kbᵀ) · a_s · b_s`` up to fp32 summation
order (the reference ``grouped_mm_fp8_reference``).

Scales reach the consumer warps straight from global memory (L2), not through the operand
ring: a thread's accumulator rows are two per k-tile (cooperative tile, 64 rows per
warpgroup), so it loads two A scales and one B scalar per sub-tile of the k-block. Loaded at
their own k-tile's start, ptxas places their product before or among that k-tile's WGMMAs,
and the L2 round trip holds up the warpgroup's WGMMA turn; where
:attr:`~.config.GroupedGemmConfig.scale_prefetch` says so they are loaded a whole k-tile
before their promotion instead, into the other of two register slots (the k-tiles taken in
pairs so that each slot is a compile-time index). Through the ring the gathered rows would
need one 4-byte copy per row (below TMA's 16-byte minimum, i.e. the LSU ``cp.async`` path
the gathered operand loads left for being slow) and the contiguous ones a TMA box at an
arbitrary 4-byte row offset; the scales are ``1/128`` of A's bytes and L2-resident, so the
direct load costs nothing measurable against that.

Schedule: cooperative ``128 x tile_n`` tiles on 2-CTA clusters. The WGMMA is
``m64n128k32`` whatever the tile width, so a partial accumulator always spans one B scale
block. ``128 x 256`` tiles (N a multiple of 256) run each k-tile as two 128-column sub-tiles
into one partial accumulator, each waited for and promoted into its half of the 128-register
promoted accumulator before the next is queued; they read half the A bytes per FLOP of
``128 x 128`` tiles; the store and SwiGLU GEMMs are faster on ``128 x 256`` at the OLMoE and
30B shapes, the fused dSwiGLU one level, results bitwise the same (benchmarks/RESULTS.md).
With one partial accumulator the two warpgroups queue their WGMMAs in turn (two named
barriers, :attr:`~.config.GroupedGemmConfig.wgmma_turns`): left free, both queue theirs at
once, the tensor cores interleave them, both wait and both promote while the tensor cores
idle; in turn, one warpgroup promotes while the tensor cores run the other's (the gathered
GEMMs faster, results bitwise the same). Not on gathered ``128 x 128`` tiles: there ptxas
compiled the turns' kernel with its producers' TMA loads in waterfall loops, 3x slower, so the
warpgroups queue at once.
``128 x 128`` tiles (N not a multiple of 256) with contiguous A
(:attr:`GroupedGemmConfig.overlapped_promotion`) alternate two partial accumulators over
the k-tiles: the WGMMAs of k-tile ``kt`` are queued into one before the thread waits for
those of ``kt - 1`` (``wait_group(1)``) and promotes the other, so the tensor cores have work
while a warpgroup runs its 64 promotion FMAs per thread. That k-loop is unrolled (K is a
compile-time size): in a rolled loop ptxas cannot tell which group a wait retires and
serialises every WGMMA (its C7514 warning). Gathered A keeps one partial accumulator: its
row-copy producers need registers the third accumulator would take.
Epilogues: the store, SwiGLU and dSwiGLU epilogues run unchanged on the promoted accumulator
(the scales reach the mainloop beside the epilogues' pointers, :class:`~.args.BlockScales`);
with :attr:`~.config.GroupedGemmConfig.store_in_stage` (varlen-K) a tile's last k-tile keeps
its ring stage, which the store epilogue stages C in and releases.
With SwiGLU "concat" the B tile is two half boxes, gate rows ``nt·tile_n/2 ..`` and up rows
``n + nt·tile_n/2 ..`` (:attr:`~.config.GroupedGemmConfig.b_halves`): on a 256-wide tile each
half is one sub-tile and one scale block; on a 128-wide one (n a multiple of 64 only) each
64-row half lies inside one block, but the two halves' blocks differ, so the promotion scales
each column half by its own B scale. "interleaved" B rows are the weight's own rows, one
scale block per 128-column sub-tile.
varlen-K (the weight gradients, :func:`~.interface.grouped_gemm_varlen_k_fp8`) reads K-major
copies of both operands (:func:`sonic.kernels.fp8_quant.quantize_cols_grouped`: scales per
``128 x 1`` block along the tokens, each expert's rows padded to whole k-tiles), loaded as
tiles from the expert's padded first row; both operands carry a scale per row of their copy,
so each element of a partial is promoted with its row's A scale times its column's B scale.
The producer bulk-copies the k-tile's ``tile_n`` column scales into the ring stage with its
operands (:attr:`~.config.GroupedGemmConfig.col_scale_bytes`), and the promotion reads each
column pair's two scales from there as it reaches them (the stage is handed back after the
promotion): loaded per thread from global memory (32 scalar loads per k-tile) their latency
stalled the promotion, and held in registers for a whole sub-tile they
spilled beside a 256-wide tile's accumulators. One partial accumulator, as the 256-wide
varlen-M tiles (no overlapped promotion: the k-loop is the expert's); ``128 x 256`` tiles
where N is a multiple of 256 (faster than the bf16 varlen-K GEMM: benchmarks/RESULTS.md).
Imports ``cutlass``: only the dispatcher (:mod:`.interface`) imports this module, lazily.
"""

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32 as F32, Int32, Int64, cute
from cutlass.cute.nvgpu import warpgroup

from sonic.kernels.grouped_gemm.args import (EpilogueThreads, KernelPointers, RowSources,
                                             SchedulerArgs, StageMemory, WorkItems)
from sonic.kernels.grouped_gemm.config import (CONSUMER_WARPGROUPS, SLAB, TILE_K_FP8, TILE_M,
                                               NamedBarrier)
from sonic.kernels.grouped_gemm.sm90 import ColumnPair, Sm90GroupedGemm, WgmmaAccumulator

# N of one WGMMA and of a partial accumulator: one B scale block.
SUB_N = TILE_K_FP8
# varlen-K: column-scale pairs the promotion reads ahead of their use (promote_cols).
COL_PAIRS_AHEAD = 2


class Sm90Fp8GroupedGemm(Sm90GroupedGemm):
    """Grouped GEMM (varlen-M, and varlen-K on K-major copies) on e4m3 operands with
    per-k-tile fp32 promotion (cooperative)."""

    def extra_storage(self) -> dict:
        """varlen-K: the B column scales of each ring stage (:attr:`~.config.GroupedGemmConfig.
        col_scale_bytes`), which the producer loads with the stage's operands."""
        cfg = self.cfg
        if not cfg.col_scale_bytes:
            return {}
        return {"sBs": cute.struct.Align[cute.struct.MemRange[
            F32, cfg.stages * cfg.col_scale_bytes // 4], 128]}

    def col_scale_stages(self, storage):
        return storage.sBs.data_ptr() if self.cfg.col_scale_bytes else None

    def make_tiled_mma(self):
        """``m64n128k32`` per warpgroup whatever the tile width: one WGMMA's N is one B scale
        block, so a partial accumulator holds products of one B scale (a 256-wide tile runs
        one per 128-column sub-tile)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_type, self.ab_type, self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(), F32, (CONSUMER_WARPGROUPS, 1, 1),
            tiler_mn=(64, SUB_N))

    @cute.jit
    def consume(self, ctid: Int32, work: WorkItems, tiled_mma: cute.TiledMma,
                stages: StageMemory, sC_ptr: cute.Pointer, pointers: KernelPointers,
                epi_tmas: tuple, sched: SchedulerArgs, sources: RowSources):
        """Per tile: for each k-tile and 128-column sub-tile, WGMMA into a partial accumulator,
        promote it with the k-block's scales (overlapped with the next k-tile's WGMMAs where
        :attr:`~.config.GroupedGemmConfig.overlapped_promotion`); then the epilogue on the
        promoted fp32 accumulator.

        ``pointers.scales.a``: A's scales ``(K/128, rows_a)`` fp32 (row ``r`` of the tile reads
        column ``gather_a[r]`` when gathered); ``pointers.scales.b``: B's ``(E, N/128, K/128)``
        fp32, one scale per k-tile and sub-tile, or with ``b_halves`` on a 128-wide tile one
        per column half. varlen-K (K-major copies ``(M, R)``, ``(N, R)``): A's ``(R/128, M)``
        and B's ``(R/128, N)``, one scale per k-tile and row of each copy, so the promotion
        scales each column by its own B scale (32 per thread, read from the stage's copy,
        ``stages.col_scales``).
        """
        cfg = self.cfg
        first, step, total = work
        full, empty = stages.full, stages.empty
        gidx, rows_a = sources.gather_a, sources.rows_a
        wg = cute.arch.make_warp_uniform(ctid // 128)
        wg_tid = ctid - wg * 128
        stage_c = sC_ptr + wg * cfg.staged_block_elems
        wg_row0 = wg * cfg.rows_wg
        thr_mma = tiled_mma.get_slice(ctid)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(stages.a))
        # (V, sub-tiles, k-blocks, stages): sub-tile g is B rows g·SUB_N ..
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(stages.b))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, cfg.tile_n)), F32)
        part_shape = thr_mma.partition_shape_C((TILE_M, SUB_N))
        # With overlapped promotion, two partial accumulators: the WGMMAs of k-tile kt run
        # into one while the thread promotes k-tile kt-1 from the other.
        parts = [cute.make_rmem_tensor(part_shape, F32), cute.make_rmem_tensor(part_shape, F32)]
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, cfg.tile_n)))
        tCcPartial = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, SUB_N)))
        n_rows = 2 * cute.size(acc, mode=[1])
        a_scales, b_scales = pointers.scales
        subs = cfg.tile_n // SUB_N
        # B scale segments of a tile: one per sub-tile, or a 128-wide tile's two column halves
        # with b_halves (each half in its own scale block).
        segs = 2 if cfg.b_halves else subs
        # Source row of each of this thread's accumulator rows (WgmmaAccumulator.row_coord);
        # the A and B scales of the k-tile in flight in each partial's slot s: A's of row i
        # at s * n_rows + i, B's of segment g at s * segs + g.
        src = cute.make_rmem_tensor((n_rows,), Int32)
        a_sc = cute.make_rmem_tensor((2 * n_rows,), F32)
        b_sc = cute.make_rmem_tensor((2 * segs,), F32)
        # Scale of (row i, column half h) of the partial being promoted, at i * halves + h.
        row_scale = cute.make_rmem_tensor((n_rows * (segs // subs),), F32)
        n_blocks, k_tiles = cfg.dim_n // SUB_N, cfg.k_tiles
        a_stride = rows_a
        if cutlass.const_expr(cfg.varlen_k):
            a_stride = Int32(cfg.dim_m)
        lane = cute.arch.lane_idx()
        threads = EpilogueThreads(stage_c, wg_tid, wg, wg_row0, lane)
        stage = Int32(0)
        phase = Int32(0)
        prev = Int32(0)
        t = first
        if cutlass.const_expr(cfg.wgmma_turns):
            # Warpgroup 0 queues first.
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.MMA_TURN, number_of_threads=256)
        while t < total:
            tile = self.scheduler.decode(t, sched)
            e, row0, rows, nt, mt, _ = tile
            # First k-tile of the tile's scale rows: varlen-K's expert starts at its padded row.
            kt0 = Int32(0)
            tile_k_tiles = Int32(k_tiles)
            if cutlass.const_expr(cfg.varlen_k):
                kt0, tile_k_tiles = row0 // TILE_K_FP8, rows // TILE_K_FP8
            for i in cutlass.range_constexpr(n_rows):
                m = WgmmaAccumulator(acc, tCcC).row_coord(i)
                if cutlass.const_expr(cfg.varlen_k):
                    src[i] = mt * TILE_M + m
                else:
                    # Rows past the expert's end reach only masked output: any valid source
                    # does.
                    r = row0
                    if m < rows:
                        r = row0 + m
                    if cutlass.const_expr(cfg.gather_a):
                        r = cute.make_tensor(gidx + r, cute.make_layout(1))[0]
                    src[i] = r
            # The scale row of each segment's n-block: for B halves (rows nt·tile_n/2 .. and
            # N/2 + nt·tile_n/2 ..) the block holding each half, else the sub-tile's own.
            b_rows = [b_scales + (e * n_blocks + nt * subs + g) * k_tiles for g in range(segs)]
            if cutlass.const_expr(cfg.b_halves):
                b_rows = [b_scales + (e * n_blocks + (g * (cfg.dim_n // 2) + nt * (cfg.tile_n // 2))
                                      // SUB_N) * k_tiles for g in range(segs)]
            if cutlass.const_expr(cfg.varlen_k):
                b_rows = []
            acc.fill(0.0)
            if cutlass.const_expr(cfg.overlapped_promotion):
                # Unrolled, so that ptxas sees which WGMMA group each wait_group retires:
                # k-tile kt-1's promotion waits only for its own WGMMAs while kt's run.
                for kt in cutlass.range_constexpr(k_tiles):
                    h = kt % 2
                    self.load_scales(a_sc, b_sc, h, kt, src, a_scales, b_rows, a_stride)
                    cute.arch.mbarrier_wait(full + stage, phase)
                    tiled_mma = self.issue(tiled_mma, parts[h], tCrA, tCrB, 0, stage)
                    if cutlass.const_expr(kt > 0):
                        self.retire(acc, parts[1 - h], a_sc, b_sc, 1 - h, row_scale,
                                    tCcPartial, 0, 1, empty + prev, lane)
                    prev = stage
                    stage, phase = self.ring.next_stage(stage, phase)
                last = (k_tiles - 1) % 2
                self.retire(acc, parts[last], a_sc, b_sc, last, row_scale, tCcPartial, 0, 0,
                            empty + prev, lane)
            else:
                # One partial: each sub-tile's WGMMAs are waited for and promoted before the
                # next sub-tile's are queued; with wgmma_turns the warpgroups queue theirs in
                # turn, so the other warpgroup's WGMMAs fill the gap.
                scales = (a_sc, b_sc, src, a_scales, b_rows, a_stride, row_scale)
                ring = (full, empty, stages)
                if cutlass.const_expr(cfg.scale_prefetch):
                    # k-tiles in pairs, so that each one's scale slot is a compile-time index.
                    self.load_scales(a_sc, b_sc, 0, kt0, src, a_scales, b_rows, a_stride)
                    for kp in cutlass.range(tile_k_tiles // 2, unroll=1):
                        for h in cutlass.range_constexpr(2):
                            tiled_mma, stage, phase = self.k_tile(
                                tiled_mma, acc, parts[0], tCrA, tCrB, tCcPartial, scales, ring,
                                stage, phase, 2 * kp + h, h, kt0, tile_k_tiles, wg, lane)
                    if tile_k_tiles % 2 == 1:
                        tiled_mma, stage, phase = self.k_tile(
                            tiled_mma, acc, parts[0], tCrA, tCrB, tCcPartial, scales, ring,
                            stage, phase, tile_k_tiles - 1, 0, kt0, tile_k_tiles, wg, lane)
                else:
                    for kt in cutlass.range(tile_k_tiles, unroll=1):
                        tiled_mma, stage, phase = self.k_tile(
                            tiled_mma, acc, parts[0], tCrA, tCrB, tCcPartial, scales, ring,
                            stage, phase, kt, 0, kt0, tile_k_tiles, wg, lane)
            stage, phase = self.epilogue.visit(WgmmaAccumulator(acc, tCcC), threads,
                                               pointers.epilogue, epi_tmas, tile, stages,
                                               stage, phase)
            t += step
        self.epilogue.finish()
        if cutlass.const_expr(cfg.wgmma_turns):
            # Warpgroup 1's arrival after its last WGMMAs.
            if wg == 0:
                cute.arch.barrier(barrier_id=NamedBarrier.MMA_TURN, number_of_threads=256)

    @cute.jit
    def k_tile(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, partial: cute.Tensor,
               tCrA: cute.Tensor, tCrB: cute.Tensor, tCcPartial: cute.Tensor, scales: tuple,
               ring: tuple, stage: Int32, phase: Int32, kt: Int32, h: cutlass.Constexpr,
               kt0: Int32, tile_k_tiles: Int32, wg: Int32, lane: Int32):
        """k-tile ``kt`` of a one-partial tile (see :meth:`consume`): its scales into slot
        ``h`` or, with :attr:`~.config.GroupedGemmConfig.scale_prefetch`, the next k-tile's
        (the last one's again at the end) into slot ``1 - h``; then for each sub-tile the
        WGMMAs (queued in turn with :attr:`~.config.GroupedGemmConfig.wgmma_turns`) and the
        promotion with slot ``h``'s. Returns ``(tiled_mma,
        stage, phase)`` of the next k-tile."""
        cfg = self.cfg
        a_sc, b_sc, src, a_scales, b_rows, a_stride, row_scale = scales
        full, empty, stages = ring
        subs = cfg.tile_n // SUB_N
        if cutlass.const_expr(cfg.scale_prefetch):
            self.load_scales(a_sc, b_sc, 1 - h, kt0 + cutlass.min(kt + 1, tile_k_tiles - 1),
                             src, a_scales, b_rows, a_stride)
        else:
            self.load_scales(a_sc, b_sc, h, kt0 + kt, src, a_scales, b_rows, a_stride)
        cute.arch.mbarrier_wait(full + stage, phase)
        for g in cutlass.range_constexpr(subs):
            if cutlass.const_expr(cfg.wgmma_turns):
                cute.arch.barrier(barrier_id=NamedBarrier.MMA_TURN + wg, number_of_threads=256)
            tiled_mma = self.issue(tiled_mma, partial, tCrA, tCrB, g, stage)
            if cutlass.const_expr(cfg.wgmma_turns):
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.MMA_TURN + 1 - wg,
                                         number_of_threads=256)
            col_scales = None
            if cutlass.const_expr(cfg.varlen_k):
                col_scales = stages.col_scales + stage * cfg.tile_n + g * SUB_N
            # With store_in_stage the tile's last stage stays: the epilogue stages C there
            # and releases it.
            release = True
            if cutlass.const_expr(cfg.store_in_stage):
                release = kt + 1 < tile_k_tiles
            self.retire(acc, partial, a_sc, b_sc, h, row_scale, tCcPartial, g, 0,
                        empty + stage if g == subs - 1 else None, lane, col_scales, release)
        stage, phase = self.ring.next_stage(stage, phase)
        return tiled_mma, stage, phase

    @cute.jit
    def load_scales(self, a_sc: cute.Tensor, b_sc: cute.Tensor, h: cutlass.Constexpr,
                    kt: Int32, src: cute.Tensor, a_scales: cute.Pointer, b_rows: list,
                    rows_a: Int32):
        """Load k-tile ``kt``'s A scales (this thread's rows) and B scales (each segment) into
        slot ``h``; first used at the promotion, after the k-tile's WGMMAs (a k-tile later
        with :attr:`~.config.GroupedGemmConfig.scale_prefetch`)."""
        n_rows = cute.size(src)
        for i in cutlass.range_constexpr(n_rows):
            a_sc[h * n_rows + i] = cute.make_tensor(a_scales + (Int64(kt) * rows_a + src[i]),
                                                    cute.make_layout(1))[0]
        segs = len(b_rows)
        for g in cutlass.range_constexpr(segs):
            b_sc[h * segs + g] = cute.make_tensor(b_rows[g] + kt, cute.make_layout(1))[0]

    @cute.jit
    def issue(self, tiled_mma: cute.TiledMma, partial: cute.Tensor, tCrA: cute.Tensor,
              tCrB: cute.Tensor, sub: cutlass.Constexpr, stage: Int32):
        """Queue the WGMMAs of stage ``stage``'s A and B sub-tile ``sub`` into ``partial`` as
        one group (the stage is full). Returns ``tiled_mma``, whose accumulate field this
        sets: the caller rebinds it, so the DSL's tracer carries the new state across the
        loops (an attribute set only inside a helper escapes them)."""
        # The promotion two k-tiles back read this partial: order it before the WGMMAs
        # rewrite it.
        warpgroup.fence()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            # B's (V, 1) fragment of sub-tile ``sub`` (indexing drops the N mode).
            b = cute.append_ones(tCrB[None, sub, kb, stage], up_to_rank=2)
            cute.gemm(tiled_mma, partial, tCrA[None, None, kb, stage], b, partial)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        return tiled_mma

    @cute.jit
    def retire(self, acc: cute.Tensor, partial: cute.Tensor, a_sc: cute.Tensor,
               b_sc: cute.Tensor, h: cutlass.Constexpr, row_scale: cute.Tensor,
               tCcPartial: cute.Tensor, sub: cutlass.Constexpr, pending: cutlass.Constexpr,
               empty_stage, lane: Int32, col_scales=None, release=True):
        """Wait until at most ``pending`` WGMMA groups remain (the oldest, ``partial``'s, is
        done), hand its operand stage back to the producers (unless ``empty_stage`` is None:
        a later sub-tile still reads it; or ``release`` is false: the epilogue will) and
        promote ``partial`` into sub-tile ``sub`` with the scales of slot ``h`` (varlen-K:
        A's row scales and the stage's column scales at ``col_scales``, read during the
        promotion, so the stage is handed back after it)."""
        if cutlass.const_expr(col_scales is not None):
            self.promote_cols(acc, partial, a_sc, col_scales, tCcPartial, sub, pending)
            if cutlass.const_expr(empty_stage is not None):
                if release:
                    self.ring.release(empty_stage, lane)
        else:
            warpgroup.wait_group(pending)
            if cutlass.const_expr(empty_stage is not None):
                self.ring.release(empty_stage, lane)
            segs = cute.size(b_sc) // 2
            halves = cute.size(row_scale) * 2 // cute.size(a_sc)
            n_rows = cute.size(a_sc) // 2
            for i in cutlass.range_constexpr(n_rows):
                for hv in cutlass.range_constexpr(halves):
                    # A partial spans one segment (its sub-tile's) or, with b_halves on a 128-wide
                    # tile, both.
                    g = hv if halves > 1 else sub
                    row_scale[i * halves + hv] = a_sc[h * n_rows + i] * b_sc[h * segs + g]
            self.promote(acc, partial, row_scale, tCcPartial, sub)

    @cute.jit
    def promote(self, acc: cute.Tensor, partial: cute.Tensor, row_scale: cute.Tensor,
                tCcPartial: cute.Tensor, sub: cutlass.Constexpr):
        """``acc[sub-tile sub] += partial · row_scale[row, half]`` over the thread's fragment,
        one fp32 FMA each (``row_scale`` indexed by :attr:`ColumnPair.row` and, with
        ``b_halves`` on a 128-wide tile, the column half)."""
        view = WgmmaAccumulator(partial, tCcPartial)
        slabs = SUB_N // SLAB
        halves = cute.size(row_scale) // view.rows_per_thread
        for sl in cutlass.range_constexpr(slabs):
            hv = sl // (slabs // halves)
            for p in view.pairs(sl):
                for v0 in cutlass.range_constexpr(2):
                    mode = view.mode(p, v0)
                    # The partial's fragment is the accumulator's at MMA N repeat ``sub``.
                    acc_mode = (mode[0], mode[1], sub)
                    acc[acc_mode] = acc[acc_mode] + partial[mode] * row_scale[p.row * halves + hv]

    @cute.jit
    def promote_cols(self, acc: cute.Tensor, partial: cute.Tensor, a_sc: cute.Tensor,
                     col_scales: cute.Pointer, tCcPartial: cute.Tensor, sub: cutlass.Constexpr,
                     pending: cutlass.Constexpr):
        """varlen-K: wait until at most ``pending`` WGMMA groups remain, then
        ``acc[sub-tile sub] += partial · (a_scale[row] · b_scale[column])`` over the thread's
        fragment (slot 0's A scales; one fp32 multiply and one FMA each). The B scales of each
        column pair are read from the stage's copy ``col_scales`` (the sub-tile's first
        column) :data:`COL_PAIRS_AHEAD` pairs ahead of their use, the first ones before the
        wait, so the shared-memory latency hides behind the WGMMAs and the promotion (held in
        registers for the whole sub-tile, 32 of them beside a 256-wide tile's accumulators
        spilled)."""
        view = WgmmaAccumulator(partial, tCcPartial)
        groups = [(sl, j) for sl in range(SUB_N // SLAB) for j in range(SLAB // 8)]
        ahead = min(COL_PAIRS_AHEAD, len(groups))
        pairs = [cute.make_rmem_tensor((2,), F32) for _ in range(ahead)]
        for i in cutlass.range_constexpr(ahead):
            self.load_col_pair(view, col_scales, groups[i], pairs[i])
        warpgroup.wait_group(pending)
        for i in cutlass.range_constexpr(len(groups)):
            sl, j = groups[i]
            pair = pairs[i % ahead]
            for mm in cutlass.range_constexpr(view.row_blocks):
                for v1 in cutlass.range_constexpr(2):
                    p = ColumnPair(sl, mm, j, v1)
                    for v0 in cutlass.range_constexpr(2):
                        mode = view.mode(p, v0)
                        # The partial's fragment is the accumulator's at MMA N repeat ``sub``.
                        acc_mode = (mode[0], mode[1], sub)
                        acc[acc_mode] = (acc[acc_mode]
                                         + partial[mode] * (a_sc[p.row] * pair[v0]))
            if cutlass.const_expr(i + ahead < len(groups)):
                self.load_col_pair(view, col_scales, groups[i + ahead], pair)

    @staticmethod
    def load_col_pair(view, col_scales: cute.Pointer, group: tuple, pair: cute.Tensor):
        """``pair`` = the B scales of the thread's column pair in 8-column group ``group``
        (``(slab, j)``) of the sub-tile whose first column's scale is at ``col_scales``.
        Traced inline."""
        sl, j = group
        _, n = view.coord(ColumnPair(sl, 0, j, 0))
        cute.autovec_copy(cute.make_tensor(col_scales + cute.assume(n, divby=2),
                                           cute.make_layout(2)), pair)
