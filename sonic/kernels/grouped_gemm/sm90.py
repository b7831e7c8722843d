"""Hopper (sm_90a) mainloop of the grouped GEMM: WGMMA with fp32 register accumulators.

Two consumer warpgroups run WGMMA on the operand ring's stages, either cooperatively on one
``tile_m x tile_n`` tile (``tile_m / 2`` rows each) or ping-pong, each on its own
``128 x tile_n`` tile, one warpgroup's epilogue overlapping the other's mainloop (SonicMoE
arXiv 2512.14080 §4.2). A finished
accumulator goes to the epilogue as a :class:`WgmmaAccumulator`, which hides the WGMMA fragment
layout behind sub-tiles of ``SLAB`` columns.
Imports ``cutlass``: only the dispatcher (:mod:`.interface`) imports this module, lazily.
"""

from typing import NamedTuple

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16 as BF16, Float32 as F32, Int32, cute
from cutlass.cute.nvgpu import warpgroup

from sonic.kernels.grouped_gemm.args import (EpilogueThreads, KernelPointers, OperandTmas,
                                             RowSources, SchedulerArgs, StageMemory,
                                             WorkItems)
from sonic.kernels.grouped_gemm.base import GroupedGemmKernel
from sonic.kernels.grouped_gemm.config import (CONSUMER_WARPGROUPS, PRODUCER_THREADS, SLAB,
                                               NamedBarrier)


class ColumnPair(NamedTuple):
    """One of a thread's column pairs in an accumulator sub-tile (trace-time handle).

    ``sl``: the sub-tile (SLAB columns); ``mm``: 64-row block; ``j``: 8-column group in the
    sub-tile; ``v1``: which of the thread's two rows in the block."""

    sl: int
    mm: int
    j: int
    v1: int

    @property
    def index(self) -> int:
        """Position of the pair among the thread's pairs of one sub-tile."""
        return (self.mm * (SLAB // 8) + self.j) * 2 + self.v1

    @property
    def row(self) -> int:
        """Which of the thread's rows (``0 .. rows_per_thread``) the pair is on."""
        return self.mm * 2 + self.v1


class WgmmaAccumulator:
    """A warpgroup's fp32 WGMMA accumulator as sub-tiles of SLAB columns: the epilogue's
    :class:`~.protocols.AccumulatorView`, whose :meth:`pairs` also takes a 64-row block (the
    deferred store and 256-row tiles stage one block at a time).

    The WGMMA accumulator holds, per 8-column group, a column pair (v0 = 0, 1) on each of two
    rows (v1 = 0, 1) for each 64-row block; a thread of a quad holds the same rows. All
    methods run at trace time and emit only the register reads and coordinate arithmetic
    that indexing the fragment directly would.

    Attributes:
        rows_per_thread: distinct tile rows this thread holds values of.
        pairs_per_slab: column pairs this thread holds per sub-tile.
    """

    # A warp holds whole rows (16 of every 64-row block), so an epilogue may stage and store
    # them without the warpgroup's other warps (Epilogue.flush ``private``).
    warp_private = True
    # Each 8-column group's pairs over a warp's 8 rows are an 8 x 8 matrix in the fragment
    # layout of stmatrix (lane 4r + q: row r, columns 2q, 2q + 1), pairs() yielding the two
    # row halves of a group in turn (Epilogue.stage_box_matrices).
    matrix_fragments = True

    def __init__(self, acc: cute.Tensor, coords: cute.Tensor):
        self.acc = acc
        self.coords = coords
        self.row_blocks = cute.size(acc, mode=[1])
        self.rows_per_thread = 2 * self.row_blocks
        self.pairs_per_slab = self.row_blocks * (SLAB // 8) * 2
        # 8-column groups per MMA N repeat: a tile wider than its MMA (the FP8 mainloop's
        # 128-wide WGMMA on a 256-wide tile) repeats the fragment along mode 2.
        self.groups_per_rep = acc.shape[0][2]

    def pairs(self, sl: int, row_block: int | None = None):
        """This thread's column pairs of sub-tile ``sl`` (of 64-row block ``row_block`` only,
        if given), in register order."""
        for mm in range(self.row_blocks) if row_block is None else (row_block,):
            for j in range(SLAB // 8):
                for v1 in range(2):
                    yield ColumnPair(sl, mm, j, v1)

    def _mode(self, p: ColumnPair, v0: int, sl: int):
        group = sl * (SLAB // 8) + p.j
        return ((v0, p.v1, group % self.groups_per_rep), p.mm, group // self.groups_per_rep)

    def mode(self, p: ColumnPair, v0: int):
        """Fragment coordinate of value ``v0`` of pair ``p`` (for a mainloop that updates the
        accumulator in place, e.g. the FP8 promotion)."""
        return self._mode(p, v0, p.sl)

    def coord(self, p: ColumnPair, v0: int = 0):
        """``(m, n)``: tile row and column of value ``v0`` of pair ``p``."""
        return self.coords[self._mode(p, v0, p.sl)]

    def value(self, p: ColumnPair, v0: int, sl: int | None = None):
        """fp32 value ``v0`` of pair ``p``, or of the same position in sub-tile ``sl``."""
        return self.acc[self._mode(p, v0, p.sl if sl is None else sl)]

    def row_coord(self, i: int):
        """Tile row of this thread's row ``i``."""
        m, _ = self.coords[((0, i % 2, 0), i // 2, 0)]
        return m

    def reduce_row(self, x):
        """Sum of ``x`` over the quad of threads holding the same rows (of each column pair)."""
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
        return x + cute.arch.shuffle_sync_bfly(x, offset=2)

    def writes_row_total(self, lane):
        """Whether this thread stores a row's reduced value: the quad's first lane."""
        return lane % 4 == 0


class Sm90GroupedGemm(GroupedGemmKernel):
    """Grouped GEMM with the WGMMA mainloop (cooperative or ping-pong consumers)."""

    def make_tiled_mma(self):
        cfg = self.cfg
        warpgroups = 1 if cfg.pingpong else CONSUMER_WARPGROUPS
        tiled = sm90_utils.make_trivial_tiled_mma(
            self.ab_type, self.ab_type, self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(), F32, (warpgroups, 1, 1),
            tiler_mn=(64, cfg.tile_n))
        blocks = cfg.rows_wg // 64
        if warpgroups == 1 or blocks == 1:
            return tiled
        # Two 64-row WGMMAs per cooperative warpgroup (256-row tiles): by default the
        # warpgroups would interleave 64-row blocks; this M permutation gives warpgroup w the
        # contiguous rows w·rows_wg .. , the block the epilogue stages.
        return cute.make_tiled_mma(tiled.op, (warpgroups, 1, 1), permutation_mnk=(
            cute.make_layout((64, warpgroups, blocks), stride=(1, cfg.rows_wg, 64)),
            None, None))

    @cute.jit
    def run_roles(self, tidx: Int32, warp_idx: Int32, work: WorkItems, tiled_mma: cute.TiledMma,
                  storage, tmas: OperandTmas, epi_tmas: tuple, stages: StageMemory,
                  pointers: KernelPointers, rows: RowSources, sched: SchedulerArgs):
        """Warpgroup 0 produces (registers handed to the consumers), warpgroups 1..2 run the
        WGMMA mainloop and the epilogue."""
        cfg = self.cfg
        if tidx < PRODUCER_THREADS:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            self.produce(warp_idx, work, tmas, epi_tmas, stages, pointers, rows, sched)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            self.consume(tidx - PRODUCER_THREADS, work, tiled_mma, stages,
                         storage.sC.data_ptr(), pointers, epi_tmas, sched, rows)

    @cute.jit
    def consume(self, ctid: Int32, work: WorkItems, tiled_mma: cute.TiledMma,
                stages: StageMemory, sC_ptr: cute.Pointer, pointers: KernelPointers,
                epi_tmas: tuple, sched: SchedulerArgs, rows: RowSources):
        """WGMMA over the k-tiles of each tile, then the epilogue. ``rows`` (A's row sources)
        and ``pointers.scales`` serve subclasses whose mainloop reads per-row data (the FP8
        mainloop's A scales); this one loads rows through the producers only.

        Cooperative: both warpgroups run every tile of the CTA; a deferring epilogue
        (:meth:`.epilogue.base.Epilogue.defers`) gets the tile in bf16 registers and stores it
        box by box after the next tile's first k-tiles' WGMMAs (the parts those k-tiles do
        not reach after its mainloop, the last tile's after the loop). Ping-pong: warpgroup ``w``
        runs the CTA's tiles ``w, w+2, ...``; two named barriers hand the tensor cores from
        one warpgroup's mainloop to the other's, so one warpgroup's epilogue overlaps the
        other's mainloop (SonicMoE §4.2). A warpgroup skips the stages of the other's tiles.
        """
        cfg = self.cfg
        first, stride, total = work
        full, empty = stages.full, stages.empty
        outs = pointers.epilogue
        wg = cute.arch.make_warp_uniform(ctid // 128)
        wg_tid = ctid - wg * 128
        stage_c = sC_ptr + wg * cfg.staged_block_elems
        # First tile row of this warpgroup's accumulator.
        wg_row0 = wg * cfg.rows_wg
        mma_tid = ctid
        step = stride
        t = first
        if cutlass.const_expr(cfg.pingpong):
            wg_row0 = Int32(0)
            mma_tid = ctid - wg * 128
            step = 2 * stride
            t = first + wg * stride
        thr_mma = tiled_mma.get_slice(mma_tid)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(stages.a))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(stages.b))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_m, cfg.tile_n)), F32)
        k_blocks = cute.size(tCrA, mode=[2])
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        lane = cute.arch.lane_idx()
        threads = EpilogueThreads(stage_c, wg_tid, wg, wg_row0, lane)
        stage = Int32(0)
        phase = Int32(0)
        deferred = self.epilogue.deferred
        if cutlass.const_expr(deferred):
            # The previous tile in bf16 and where it goes; nothing pending while rows == 0.
            packed = cute.make_rmem_tensor_like(acc, BF16)
            held = WgmmaAccumulator(packed, tCcC)
            held_row0, held_rows, held_nt = Int32(0), Int32(0), Int32(0)
            swizzle = stages.a_swizzle
        if cutlass.const_expr(cfg.pingpong):
            if wg == 1:
                if first < total:
                    stage, phase = self.ring.skip(
                        stage, phase, self.scheduler.tile_k_tiles(first, sched))
        while t < total:
            tile = self.scheduler.decode(t, sched)
            k_tiles = self.scheduler.tile_k_tiles(t, sched)
            if cutlass.const_expr(cfg.pingpong):
                if t != first:
                    cute.arch.barrier(barrier_id=NamedBarrier.MMA_TURN + wg, number_of_threads=256)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.fence()
            prev = Int32(0)
            for kt in cutlass.range(k_tiles, unroll=1):
                cute.arch.mbarrier_wait(full + stage, phase)
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, acc, tCrA[None, None, kb, stage],
                              tCrB[None, None, kb, stage], acc)
                warpgroup.commit_group()
                if cutlass.const_expr(deferred):
                    # One part of the previous tile's stores behind each of the first
                    # k-tiles' WGMMAs.
                    for part in cutlass.range_constexpr(self.epilogue.parts):
                        if kt == part:
                            self.epilogue.store_part(held, part, threads, outs, epi_tmas,
                                                     swizzle, held_row0, held_rows, held_nt)
                # Keep one WGMMA batch in flight; the previous stage is then free.
                warpgroup.wait_group(1)
                if kt > 0:
                    self.ring.release(empty + prev, lane)
                prev = stage
                stage, phase = self.ring.next_stage(stage, phase)
            warpgroup.wait_group(0)
            if cutlass.const_expr(not cfg.store_in_stage):
                if k_tiles > 0:
                    self.ring.release(empty + prev, lane)
            if cutlass.const_expr(cfg.pingpong):
                # The other warpgroup's next tile is t + stride; it may start its mainloop.
                if t + stride < total:
                    cute.arch.barrier_arrive(barrier_id=NamedBarrier.MMA_TURN + 1 - wg,
                                             number_of_threads=256)
                    stage, phase = self.ring.skip(
                        stage, phase, self.scheduler.tile_k_tiles(t + stride, sched))
            if cutlass.const_expr(deferred):
                # Parts this tile's k-tiles did not reach, then hold this tile.
                for part in cutlass.range_constexpr(self.epilogue.parts):
                    if part >= k_tiles:
                        self.epilogue.store_part(held, part, threads, outs, epi_tmas, swizzle,
                                                 held_row0, held_rows, held_nt)
                packed.store(acc.load().to(BF16))
                held_row0, held_rows, held_nt = tile.row0, tile.rows, tile.n_tile
            else:
                stage, phase = self.epilogue.visit(WgmmaAccumulator(acc, tCcC), threads,
                                                   outs, epi_tmas, tile, stages, stage, phase)
            t += step
        if cutlass.const_expr(deferred):
            for part in cutlass.range_constexpr(self.epilogue.parts):
                self.epilogue.store_part(held, part, threads, outs, epi_tmas, swizzle,
                                         held_row0, held_rows, held_nt)
        self.epilogue.finish()
