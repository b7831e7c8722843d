"""Blackwell (sm_100a) mainloop of the grouped GEMM: tcgen05 UMMA, fp32 accumulator in TMEM.

The sibling of :mod:`.sm90` on the same skeleton (:mod:`.base`): the same operand ring
(:mod:`.pipeline`), TMA producers (:mod:`.load`, gathered rows included), tile schedulers
(:mod:`.tile_scheduler`) and epilogue classes (:mod:`.epilogue`); only the MMA, the warp roles
and the accumulator's home differ. Compile-checked for sm_100a on the CPU (CI) and self-checked
on an sm_100 device before use (:mod:`.self_check`); never run or benchmarked by the authors.

Warp roles (288 threads, no register reallocation):

* warps 0–3: the epilogue, one warpgroup holding all ``TILE_M`` rows of a tile (``tcgen05.ld``
  gives warp ``w`` the TMEM lanes ``32w ..``, so thread ``t`` owns tile row ``t``);
* warps 4–7: the TMA producers of :mod:`.load`, unchanged (producer warp = warp − 4);
* warp 8: issues ``tcgen05.mma`` (``128 x tile_n x 16`` per instruction, one CTA).

Barriers (arrival counts): ``full[s]`` 1 + the stage's bytes (the producers' expect-tx);
``empty[s]`` 1, the MMA warp's ``tcgen05.commit`` once the MMAs reading the stage complete, or
for a dSwiGLU H stage, epilogue thread 0 after the epilogue's named barrier;
``acc_full[a]`` 1 (commit after a tile's last MMA); ``acc_empty[a]`` 4 (lane 0 of each
epilogue warp after its last TMEM read). ``ACC_STAGES`` = 2 accumulators of ``tile_n`` fp32
columns (≤ 512 columns, allocated by warp 0 with ``tcgen05.alloc``), so the epilogue of one
tile overlaps the MMAs of the next.

Shared memory: the UMMA canonical K- and MN-major 128-byte-swizzled layouts equal the WGMMA
ones byte for byte (``tests/test_sm100_compile.py`` compares them), so the producers' tile
boxes, one-row gather boxes (one ``1 x TILE_K`` box per row at the row's 128-byte line) and
varlen-K ``64 x 1`` row boxes land where UMMA reads them.

Epilogue: the epilogue classes are sm_90's, fed by :class:`TmemAccumulator`, an
:class:`.protocols.AccumulatorView` (as :class:`.sm90.WgmmaAccumulator` is) over ``tcgen05.ld``
loads of one ``SLAB`` of columns (``32x32b.x64``: 64 consecutive fp32 columns of the thread's
row), so the SwiGLU / dSwiGLU maths, the masking (rows of the expert, columns of N, whole 16-byte chunks) and the
stores through the staging buffer are the same code. What differs follows from the layout:
a thread holds whole rows (no quad reduction of ds), and the view loads a slab when the
epilogue first asks for it (``tcgen05.ld`` is warp-collective, so the epilogues call the view
outside any per-row branch, as they do on sm_90). dSwiGLU's H arrives through the operand ring
as on sm_90; the MMA warp skips those stages. A varlen-K tile of an expert with no rows issues
no MMA: its accumulator is stale and the view yields zeros.

API notes (CuTe DSL 4.8.1, verified by compiling for sm_100a): ``tcgen05.ld`` is asynchronous,
so ``fence_view_async_tmem_load`` (``tcgen05.wait::ld``) precedes any read of its registers;
size register fragments from ``partition_D`` of an identity tensor, not from the TMEM
``partition_S`` (a warp's 32x32 view per thread: thousands of registers); ``alloc_tmem`` is
warp-wide, with one CTA per SM (shared memory) the permit is relinquished at once.

Not implemented: 2-CTA ``cta_group::2`` UMMA with B multicast (would pair two m-tiles of one
expert, as sm_90's cluster decode already does), ping-pong, TMA stores of C, tuned tiles.
Imports ``cutlass``: only the dispatcher (:mod:`.interface`) imports this module, lazily.
"""

from typing import NamedTuple

import cutlass
from cutlass import BFloat16 as BF16, Float32 as F32, Int32, Int64, cute
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.tensor_utils import LayoutEnum

from sonic.kernels.grouped_gemm.args import (EpilogueOutputs, EpilogueThreads, KernelPointers,
                                             OperandTmas, RowSources, SchedulerArgs,
                                             StageMemory, WorkItems)
from sonic.kernels.grouped_gemm.base import GroupedGemmKernel
from sonic.kernels.grouped_gemm.config import SLAB, TILE_M, NamedBarrier

EPILOGUE_WARPS = 4
MMA_WARP = EPILOGUE_WARPS + 4
THREADS = 32 * (MMA_WARP + 1)
ACC_STAGES = 2
TMEM_COLUMNS = 512


class RowPair(NamedTuple):
    """Column pair ``index`` (columns ``2·index, 2·index + 1``) of sub-tile ``sl`` on the
    thread's one row (``row`` 0)."""

    sl: int
    index: int
    row: int = 0


@cute.jit
def load_slab(tiled_copy, tTR_tAcc: cute.Tensor, tTR_rAcc: cute.Tensor, written):
    """TMEM sub-tile ``tTR_tAcc`` → registers ``tTR_rAcc``, or zeros when not ``written``."""
    if written:
        cute.copy(tiled_copy, tTR_tAcc, tTR_rAcc)
        # tcgen05.ld is asynchronous: its registers are defined after tcgen05.wait::ld.
        cute.arch.fence_view_async_tmem_load()
    else:
        tTR_rAcc.fill(0.0)


class TmemAccumulator:
    """A tile's fp32 TMEM accumulator as this thread's row, in sub-tiles of SLAB columns (the
    epilogue's :class:`~.protocols.AccumulatorView`, as
    :class:`sonic.kernels.grouped_gemm.sm90.WgmmaAccumulator`).

    A sub-tile is loaded (``tcgen05.ld`` + wait) the first time the epilogue asks for it,
    into one of two register buffers (SwiGLU "concat" reads two sub-tiles at once); when
    ``written`` is false (no MMA ran) the buffer is zero-filled instead. The bookkeeping of
    which sub-tile a buffer holds happens at trace time, in program order.

    Attributes:
        rows_per_thread: 1 (a thread owns tile row ``m``).
        pairs_per_slab: column pairs per sub-tile.
    """

    rows_per_thread = 1
    pairs_per_slab = SLAB // 2
    # One thread releases an H ring stage for the four epilogue warps: they synchronise as a
    # warpgroup before it does.
    warp_private = False
    # A thread holds one row's columns, not stmatrix fragments.
    matrix_fragments = False

    def __init__(self, tiled_copy, tTR_tAcc: cute.Tensor, m, written, buffers: tuple):
        self.tiled_copy = tiled_copy
        self.tTR_tAcc = tTR_tAcc
        self.m = m
        self.written = written
        self.buffers = buffers
        self.held = [None, None]
        self.last = 0

    def _slab(self, sl: int) -> cute.Tensor:
        if sl in self.held:
            self.last = self.held.index(sl)
            return self.buffers[self.last]
        self.last = 1 - self.last
        self.held[self.last] = sl
        load_slab(self.tiled_copy, self.tTR_tAcc[None, None, sl], self.buffers[self.last],
                  self.written)
        return self.buffers[self.last]

    def pairs(self, sl: int):
        """This thread's column pairs of sub-tile ``sl`` (loading it)."""
        self._slab(sl)
        for j in range(self.pairs_per_slab):
            yield RowPair(sl, j)

    def coord(self, p: RowPair, v0: int = 0):
        """``(m, n)``: tile row and column of value ``v0`` of pair ``p``."""
        return self.m, p.sl * SLAB + 2 * p.index + v0

    def value(self, p: RowPair, v0: int, sl: int | None = None):
        """fp32 value ``v0`` of pair ``p``, or of the same position in sub-tile ``sl``."""
        return self._slab(p.sl if sl is None else sl)[2 * p.index + v0]

    def row_coord(self, i: int):
        """Tile row of this thread's (only) row."""
        return self.m

    def reduce_row(self, x):
        """The thread holds its whole row: nothing to reduce."""
        return x

    def writes_row_total(self, lane):
        """Every thread stores its own row's reduced value."""
        return True


class Sm100GroupedGemm(GroupedGemmKernel):
    """Grouped GEMM with the tcgen05 UMMA mainloop (one CTA, cooperative tiles)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.threads = THREADS

    def make_tiled_mma(self):
        def major(layout):
            return OperandMajorMode.MN if layout == LayoutEnum.COL_MAJOR else OperandMajorMode.K

        return cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
            BF16, F32, (TILE_M, self.cfg.tile_n, 16), tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM, major(self.a_layout), major(self.b_layout)))

    def check_contract(self, tiled_mma) -> None:
        """The ring's barriers as initialised (:func:`barrier_contract`) against the arrivals
        the roles make: one expect-tx per fill, one ``tcgen05.commit`` (or one epilogue
        thread) per release.

        Raises:
            AssertionError: the counts differ.
        """
        assert (self.contract.full, self.contract.empty) == (1, 1), (
            f"sm_100 ring barriers initialised for {self.contract}, its roles make one "
            f"arrival on full and one on empty")

    def extra_storage(self) -> dict:
        """The accumulator barriers and the TMEM address ``tcgen05.alloc`` writes."""
        return {"acc_full": cute.struct.MemRange[Int64, ACC_STAGES],
                "acc_empty": cute.struct.MemRange[Int64, ACC_STAGES],
                "tmem_addr": Int32}

    @cute.jit
    def setup_warp0(self, storage):
        """Accumulator barriers, then the TMEM allocation (warp-wide)."""
        with cute.arch.elect_one():
            for a in cutlass.range_constexpr(ACC_STAGES):
                cute.arch.mbarrier_init(storage.acc_full.data_ptr() + a, 1)
                cute.arch.mbarrier_init(storage.acc_empty.data_ptr() + a, EPILOGUE_WARPS)
        cute.arch.mbarrier_init_fence()
        cute.arch.alloc_tmem(TMEM_COLUMNS, storage.tmem_addr)
        cute.arch.relinquish_tmem_alloc_permit()

    @cute.jit
    def run_roles(self, tidx: Int32, warp_idx: Int32, work: WorkItems, tiled_mma: cute.TiledMma,
                  storage, tmas: OperandTmas, epi_tmas: tuple, stages: StageMemory,
                  pointers: KernelPointers, rows: RowSources, sched: SchedulerArgs):
        """Producers (warps 4–7), the MMA warp (8), the epilogue warpgroup (0–3), which frees
        the tensor memory once every tile's accumulator has been read."""
        acc_layout = tiled_mma.make_fragment_C(cute.append(
            tiled_mma.partition_shape_C((TILE_M, self.cfg.tile_n)), ACC_STAGES)).layout
        tmem = cute.arch.retrieve_tmem_ptr(F32, 16, storage.tmem_addr)
        tCtAcc = cute.make_tensor(tmem, acc_layout)
        acc_bars = (storage.acc_full.data_ptr(), storage.acc_empty.data_ptr())
        if warp_idx >= EPILOGUE_WARPS and warp_idx < MMA_WARP:
            self.produce(warp_idx - EPILOGUE_WARPS, work, tmas, epi_tmas, stages, pointers, rows,
                         sched)
        elif warp_idx == MMA_WARP:
            self.mma(work, tiled_mma, stages, tCtAcc, sched, acc_bars)
        else:
            self.epilogue_warps(tidx, work, tiled_mma, tCtAcc, storage.sC.data_ptr(),
                                pointers.epilogue, epi_tmas, sched, stages, acc_bars)
            cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE,
                              number_of_threads=32 * EPILOGUE_WARPS)
            if warp_idx == 0:
                cute.arch.dealloc_tmem(tmem, TMEM_COLUMNS)

    @cute.jit
    def mma(self, work: WorkItems, tiled_mma: cute.TiledMma, stages: StageMemory,
            tCtAcc: cute.Tensor, sched: SchedulerArgs, acc_bars: tuple):
        """Per tile: wait for a free accumulator, issue the UMMAs of every k-tile (each stage
        freed by ``tcgen05.commit`` once its MMAs complete), commit the accumulator to the
        epilogue, and skip the ring stages the epilogue's own loads take."""
        acc_full, acc_empty = acc_bars
        full, empty = stages.full, stages.empty
        thr_mma = tiled_mma.get_slice(0)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(stages.a))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(stages.b))
        k_blocks = cute.size(tCrA, mode=[2])
        stage = Int32(0)
        phase = Int32(0)
        acc_stage = Int32(0)
        acc_phase = Int32(1)
        t = work.first
        while t < work.total:
            k_tiles = self.scheduler.tile_k_tiles(t, sched)
            cute.arch.mbarrier_wait(acc_empty + acc_stage, acc_phase)
            tCtAcc_tile = tCtAcc[None, None, None, acc_stage]
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for kt in cutlass.range(k_tiles, unroll=1):
                cute.arch.mbarrier_wait(full + stage, phase)
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, tCtAcc_tile, tCrA[None, None, kb, stage],
                              tCrB[None, None, kb, stage], tCtAcc_tile)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                with cute.arch.elect_one():
                    tcgen05.commit(empty + stage)
                stage, phase = self.ring.next_stage(stage, phase)
            with cute.arch.elect_one():
                tcgen05.commit(acc_full + acc_stage)
            if cutlass.const_expr(self.epilogue.has_producer_loads):
                stage, phase = self.ring.skip(stage, phase, self.epilogue.producer_stages)
            acc_stage, acc_phase = self.next_acc(acc_stage, acc_phase)
            t += work.step

    @cute.jit
    def next_acc(self, acc_stage: Int32, acc_phase: Int32):
        """The accumulator stage after ``acc_stage``."""
        acc_stage += 1
        if acc_stage == ACC_STAGES:
            acc_stage = Int32(0)
            acc_phase ^= 1
        return acc_stage, acc_phase

    @cute.jit
    def epilogue_warps(self, tidx: Int32, work: WorkItems, tiled_mma: cute.TiledMma,
                       tCtAcc: cute.Tensor, sC_ptr: cute.Pointer, outs: EpilogueOutputs,
                       epi_tmas: tuple,
                       sched: SchedulerArgs, stages: StageMemory, acc_bars: tuple):
        """Per tile: wait for its accumulator, run the epilogue on a :class:`TmemAccumulator`
        (the ring position follows the producers' when the epilogue reads ring stages), then
        hand the accumulator back to the MMA warp."""
        acc_full, acc_empty = acc_bars
        tCcC = tiled_mma.get_slice(0).partition_C(
            cute.make_identity_tensor((TILE_M, self.cfg.tile_n)))
        sub = ((cute.size(tCtAcc, mode=[0, 0]), SLAB),)
        atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x64), F32)
        tiled_copy = tcgen05.make_tmem_copy(atom, cute.zipped_divide(
            tCtAcc[None, None, None, 0], sub)[None, 0])
        thr_copy = tiled_copy.get_slice(tidx)
        tTR_cC = thr_copy.partition_D(cute.zipped_divide(tCcC, sub))
        # Two sub-tiles of this thread's row; m: its tile row.
        buffers = (cute.make_rmem_tensor(tTR_cC[None, None, 0].shape, F32),
                   cute.make_rmem_tensor(tTR_cC[None, None, 0].shape, F32))
        m = tTR_cC[0][0]
        lane = cute.arch.lane_idx()
        stage = Int32(0)
        phase = Int32(0)
        acc_stage = Int32(0)
        acc_phase = Int32(0)
        t = work.first
        while t < work.total:
            tile = self.scheduler.decode(t, sched)
            k_tiles = self.scheduler.tile_k_tiles(t, sched)
            cute.arch.mbarrier_wait(acc_full + acc_stage, acc_phase)
            written = True
            if cutlass.const_expr(self.cfg.varlen_k):
                written = k_tiles > 0
            view = TmemAccumulator(tiled_copy, thr_copy.partition_S(cute.zipped_divide(
                tCtAcc[None, None, None, acc_stage], sub)), m, written, buffers)
            if cutlass.const_expr(self.epilogue.has_producer_loads):
                stage, phase = self.ring.skip(stage, phase, k_tiles)
            # wg 0, first row 0; the thread index stands for the lane so that one thread
            # releases an H stage (the empty barriers expect one arrival).
            stage, phase = self.epilogue.visit(
                view, EpilogueThreads(sC_ptr, tidx, Int32(0), Int32(0), tidx), outs, epi_tmas,
                tile, stages, stage, phase)
            # Every TMEM load of the tile was waited for inside the view.
            if lane == 0:
                cute.arch.mbarrier_arrive(acc_empty + acc_stage)
            acc_stage, acc_phase = self.next_acc(acc_stage, acc_phase)
            t += work.step
