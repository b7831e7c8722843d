"""TMA producers: the operand loads of the grouped GEMM, contiguous, gathered rows, multicast.

Every operand arrives by TMA, so a ring stage is complete when its one expect-tx arrival and
all its bytes have landed (out-of-bounds boxes are zero-filled and counted).

* varlen-M: B and contiguous A as tiles (rows past the expert's end belong to the next expert or
  are TMA's zero fill; they only reach masked output rows); gathered A as one ``1 x tile_k`` box
  per tile row, written at that row's 128-byte line of the stage — the hardware applies the
  128-byte swizzle by shared-memory address, so the rows land exactly where the MMA expects
  them. This replaced 16-byte ``cp.async`` gathers, which the SM's load/store path capped (ncu:
  both pipeline ends waiting, no memory-bound sign) well below it at the docs/design.md §5
  shapes.
* varlen-K operands are MN-major: whole k-tiles of contiguous rows as ``64 x TILE_K`` boxes,
  gathered rows as ``64 x 1`` row boxes, a row outside the k-tile pointing out of bounds so
  TMA writes zeros and no stale value (possibly NaN) enters the reduction. An expert's partial
  last k-tile is its last ``TILE_K`` rows (the contiguous operand still one box; the gathered
  operand's rows already reduced are zeros), or row by row where it has fewer rows. A
  gathered operand's row indices are read one k-tile ahead.
* FP8 varlen-K: both operands are K-major copies (columns of the expert-sorted rows, each
  expert's rows padded to whole k-tiles), so a k-tile is one tile box of each, at the
  expert's padded first row plus ``kt`` k-tiles: the contiguous varlen-M loader, offset.
* 2-CTA clusters: when both CTAs' tiles are the same expert's, each loads half of the B tile and
  multicasts it, a third less L2→SM traffic per tile (128 x 256: A 128 + B 128 rows per k-tile
  instead of 128 + 256). With ``multicast_a`` the CTAs take neighbouring n-tiles of one
  m-tile and each loads half of the A tile for both (256 x 128: A 128 + B 128 rows instead of
  256 + 128; gathered A: half of the row copies, which bound the gathered bf16 GEMMs; varlen-K:
  half of A's 64-column blocks).

Imports ``cutlass``: only the kernel modules import this one.
"""

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cute.nvgpu import cpasync

from sonic.kernels.grouped_gemm.args import (KernelPointers, OperandTmas, RowSources,
                                             SchedulerArgs, StageMemory, Tma, WorkItems)
from sonic.kernels.grouped_gemm.config import TILE_K, TILE_K_FP8, TILE_M

# Arrivals on a stage's full barrier per fill: one elected producer thread's expect-tx.
FULL_ARRIVALS = 1


def mn_major_tma(ptr, rows, width: int, smem, multicast: bool = False) -> tuple[Tma, Tma]:
    """TMA copies of an MN-major varlen-K operand ``(rows, width)``: ``64 x TILE_K`` boxes
    and ``64 x 1`` row boxes (``multicast``: issued with a cluster mask)."""
    mX = cute.make_tensor(ptr, cute.make_layout((width, rows), stride=(1, width)))
    op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if multicast
          else cpasync.CopyBulkTensorTileG2SOp())
    return tuple(Tma(*cpasync.make_tiled_tma_atom(
        op, mX, cute.make_composed_layout(
            smem.inner, 0, cute.make_layout(box, stride=(1, 64))), box))
        for box in ((64, TILE_K), (64, 1)))


class TmaProducers:
    """Producer-warp role of the grouped GEMM kernel (a mixin of
    :class:`sonic.kernels.grouped_gemm.base.GroupedGemmKernel`, whose ``cfg``, ``scheduler``,
    ``ring`` and ``epilogue`` it uses)."""

    def make_operand_tmas(self, a, b, rows_a, rows_b, num_experts, a_smem,
                          b_smem) -> OperandTmas:
        """Host side: the TMA copies of A and B.

        varlen-M: B by tiles, A by tiles or (gathered) one row per box. varlen-K: both operands
        MN-major, by 64 x TILE_K boxes (whole k-tiles of contiguous rows) or by 64 x 1 row boxes
        (gathered rows, and an expert's last partial k-tile, whose rows past the expert's end
        take an out-of-bounds row and so arrive as zeros).
        """
        cfg = self.cfg
        if cfg.mn_major_k:
            a_box, a_row = mn_major_tma(a, rows_a, cfg.dim_m, a_smem)
            b_box, b_row = mn_major_tma(b, rows_b, cfg.dim_n, b_smem)
            mc = mc_row = None
            if cfg.multicast_a:
                mc, mc_row = mn_major_tma(a, rows_a, cfg.dim_m, a_smem, multicast=True)
            elif cfg.cluster > 1:
                mc, mc_row = mn_major_tma(b, rows_b, cfg.dim_n, b_smem, multicast=True)
            return OperandTmas(a_box, b_box, a_row, b_row, mc, mc_row)
        if cfg.varlen_k:
            # FP8 varlen-K: K-major copies Aᵀ (M, R) and Bᵀ (N, R), R = rows_a = rows_b
            # (a multiple of 128), tiled like varlen-M's contiguous A and one expert's B.
            k_rows = cute.assume(rows_a, divby=TILE_K_FP8)
            mA = cute.make_tensor(a, cute.make_layout((cfg.dim_m, k_rows), stride=(k_rows, 1)))
            mB = cute.make_tensor(b, cute.make_layout((cfg.dim_n, k_rows, 1),
                                                      stride=(k_rows, 1, 0)))
        else:
            mA = cute.make_tensor(a, cute.make_layout((rows_a, cfg.dim_k),
                                                      stride=(cfg.dim_k, 1)))
            b_stride = ((1, cfg.dim_n) if cfg.b_n_major else (cfg.dim_k, 1))
            mB = cute.make_tensor(b, cute.make_layout(
                (cfg.dim_n, cfg.dim_k, num_experts),
                stride=(*b_stride, cfg.dim_n * cfg.dim_k)))
        # Gathered: a box of one row, written at the row's 128-byte line of the stage (the
        # 128-byte swizzle of a TMA write follows the shared-memory address).
        a_box = ((1, cfg.tile_k) if cfg.gather_a else (cfg.tile_m, cfg.tile_k))
        a_box_smem = (cute.make_composed_layout(
            a_smem.inner, 0, cute.make_layout(a_box, stride=(cfg.tile_k, 1)))
            if cfg.gather_a else cute.slice_(a_smem, (None, None, 0)))
        tma_a = Tma(*cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, a_box_smem, a_box))
        b_box = (cfg.tile_n // 2 if cfg.b_halves else cfg.tile_n, cfg.tile_k)
        b_box_smem = (cute.make_composed_layout(
            b_smem.inner, 0, cute.make_layout(b_box, stride=(cfg.tile_k, 1)))
            if cfg.b_halves else cute.slice_(b_smem, (None, None, 0)))
        tma_b = Tma(*cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, b_box_smem, b_box))
        mc = None
        if cfg.multicast_a:
            # The shared A tile: each CTA multicasts half of its rows (gathered: each of its
            # row boxes whole).
            mc = Tma(*cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(), mA, a_box_smem, a_box,
                num_multicast=1 if cfg.gather_a else cfg.cluster))
        elif cfg.cluster > 1:
            # A shared B tile: each CTA multicasts its half (a B tile of two half boxes is
            # split already, so each CTA multicasts one of them).
            mc = Tma(*cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(), mB, b_box_smem, b_box,
                num_multicast=1 if cfg.b_halves else cfg.cluster))
        return OperandTmas(tma_a, tma_b, mc=mc)

    @cute.jit
    def produce(self, warp: Int32, work: WorkItems, tmas: OperandTmas, epi_tmas: tuple,
                stages: StageMemory, pointers: KernelPointers, rows: RowSources,
                sched: SchedulerArgs):
        """The producer warpgroup: the loader of the configuration's mode and gathers.

        On a cluster the shared operand, B's or (``multicast_a``) A's, arrives by
        ``tmas.mc`` / ``tmas.mc_row`` (see :meth:`make_operand_tmas`). FP8 varlen-K also
        copies B's column scales (``pointers.scales.b``) into ``stages.col_scales``.
        """
        cfg = self.cfg
        if cutlass.const_expr(cfg.mn_major_k):
            # The operand the cluster shares arrives by the multicast atoms.
            shared_a = cfg.multicast_a
            shared_b = cfg.cluster > 1 and not shared_a
            self.produce_varlen_k(
                warp, work, (tmas.mc, tmas.mc_row) if shared_a else (tmas.a, tmas.a_row),
                (tmas.mc, tmas.mc_row) if shared_b else (tmas.b, tmas.b_row), stages, rows,
                sched)
        elif cutlass.const_expr(cfg.gather_a):
            self.produce_gather_m(warp, work, tmas.mc if cfg.multicast_a else tmas.a, tmas.b,
                                  tmas.mc, stages, rows.gather_a, sched, epi_tmas)
        else:
            if warp == 0:
                if cutlass.const_expr(cfg.multicast_a):
                    self.produce_tma(work, tmas.mc, tmas.b, None, stages, sched)
                else:
                    col_scales = None
                    if cutlass.const_expr(cfg.col_scale_bytes):
                        col_scales = (pointers.scales.b, stages.col_scales)
                    self.produce_tma(work, tmas.a, tmas.b, tmas.mc, stages, sched, col_scales)

    @cute.jit
    def produce_tma(self, work: WorkItems, tma_a: Tma, tma_b: Tma, tma_b_mc: Tma | None,
                    stages: StageMemory, sched: SchedulerArgs, col_scales=None):
        """varlen-M with contiguous A, or FP8 varlen-K: one warp issues the TMA loads of A
        and B tiles. FP8 varlen-K's expert ``e`` is the k-tiles from its padded first row
        ``row0`` of the K-major copies: A tile rows ``mt·tile_m ..``, B's of the one
        ``(N, R)`` copy, and (``col_scales``: B's scales ``(R/128, N)`` and the stages'
        scale slots) the k-tile's scales of the tile's columns. With ``multicast_a``,
        ``tma_a`` is A's multicast copy: this CTA loads its rank's half of the A tile into
        both CTAs, and its whole B tile (``tma_b_mc``: the cluster's share of a B tile)."""
        cfg = self.cfg
        full, empty = stages.full, stages.empty
        rank, a_ctas = 0, 1
        if cutlass.const_expr(cfg.multicast_a):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            a_ctas = cfg.cluster
        stage = Int32(0)
        phase = Int32(1)
        t = work.first
        while t < work.total:
            e, row0, rows, nt, mt, shared = self.scheduler.decode(t, sched)
            origin = (row0, 0)
            k_tiles, kt0, e_b = Int32(cfg.k_tiles), Int32(0), e
            if cutlass.const_expr(cfg.varlen_k):
                origin = (mt * cfg.tile_m, row0)
                k_tiles, kt0, e_b = rows // cfg.tile_k, row0 // cfg.tile_k, Int32(0)
            gA = cute.local_tile(cute.domain_offset(origin, tma_a.tensor),
                                 (cfg.tile_m, cfg.tile_k), (0, None))
            tAsA, tAgA = cpasync.tma_partition(tma_a.atom, rank, cute.make_layout(a_ctas),
                                               cute.group_modes(stages.a, 0, 2),
                                               cute.group_modes(gA, 0, 2))
            for kt in cutlass.range(k_tiles, unroll=1):
                cute.arch.mbarrier_wait(empty + stage, phase)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.cfg.tma_bytes)
                self.tma_copy(tma_a.atom, tAgA[None, kt], tAsA[None, stage], full + stage,
                              cfg.multicast_a)
                self.load_b(tma_b, tma_b_mc, stages, nt, kt0 + kt, e_b, stage, shared)
                if cutlass.const_expr(col_scales is not None):
                    self.copy_col_scales(col_scales, nt, kt0 + kt, stage, full)
                stage, phase = self.ring.next_stage(stage, phase)
            t += work.step

    @cute.jit
    def copy_col_scales(self, col_scales: tuple, nt: Int32, kt: Int32, stage: Int32,
                        full: cute.Pointer):
        """FP8 varlen-K: k-tile ``kt``'s B scales of n-tile ``nt``'s columns (``tile_n``
        contiguous fp32 of row ``kt`` of ``(R/128, N)``) into ring stage ``stage``'s scale slot,
        one bulk copy completing on the stage's full barrier (each CTA of a cluster loads its
        own). In the stage, the consumers read them from shared memory instead of ``tile_n /
        4`` scalar global loads per thread per k-tile, whose latency the k-tile's WGMMAs did
        not hide."""
        src, slots = col_scales
        n = self.cfg.tile_n
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32, num_bits_per_copy=n * 32)
        g = cute.make_tensor(src + (Int64(kt) * self.cfg.dim_n + nt * n), cute.make_layout(n))
        s = cute.make_tensor(slots + stage * n, cute.make_layout(n))
        # Bulk copies do no thread election.
        with cute.arch.elect_one():
            cute.copy(atom, g, s, mbar_ptr=full + stage)

    @cute.jit
    def produce_gather_m(self, warp: Int32, work: WorkItems, tma_a: Tma, tma_b: Tma,
                         tma_b_mc: Tma | None, stages: StageMemory, gidx: cute.Pointer,
                         sched: SchedulerArgs, epi_tmas: tuple):
        """varlen-M, gathered A: every tile row arrives by its own TMA row copy.

        Producer warp ``w`` owns tile rows ``32w .. 32w+31``; lane ``l`` reads the source
        row of row ``32w + l`` once per tile and the warp then issues the 32 row copies of
        each k-tile in turn (a TMA copy takes warp-uniform coordinates). Rows past the
        expert's end copy the tile's first source row: they only reach masked output rows,
        and every stage then receives the same byte count. Compared with 16-byte cp.async
        copies this keeps the row loads off the SM's load/store path (faster at the
        docs/design.md §5 shapes). With ``multicast_a`` (both CTAs of the cluster on one
        m-tile) CTA ``c`` copies rows ``64c .. 64c+63`` only, 16 per warp, each into both
        CTAs: half the row copies per CTA, whose issue bounds the bf16 gathered GEMMs (the
        same kernel on an identity index is as slow as on a random one, and slower than on
        the rows gathered beforehand; benchmarks/RESULTS.md). A phantom CTA (no rows of
        its own) still copies its half for its peer. After a tile's k-tiles the epilogue may
        queue its own loads into the ring (:meth:`Epilogue.producer_loads`). ``tma_a``: A's
        row copy, or with ``multicast_a`` its multicast one.
        """
        cfg = self.cfg
        full, empty = stages.full, stages.empty
        tile_k = cfg.tile_k
        gA = cute.group_modes(cute.local_tile(tma_a.tensor, (1, tile_k), (None, None)), 0, 2)
        row_layout = cute.make_layout((1, tile_k), stride=(tile_k, 1))
        lane = cute.arch.lane_idx()
        warp_rows = TILE_M // 4
        first_row = warp * warp_rows
        if cutlass.const_expr(cfg.multicast_a):
            warp_rows = TILE_M // 4 // cfg.cluster
            first_row = (cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                         * (TILE_M // cfg.cluster) + warp * warp_rows)
        stage = Int32(0)
        phase = Int32(1)
        t = work.first
        while t < work.total:
            e, row0, rows, nt, mt, shared = self.scheduler.decode(t, sched)
            if cutlass.const_expr(cfg.multicast_a):
                rows = sched.offsets[e + 1] - row0
            r = first_row + lane % warp_rows
            if r >= rows:
                r = Int32(0)
            src_row = cute.make_tensor(gidx + row0, cute.make_layout(TILE_M))[r]
            for kt in cutlass.range(cfg.k_tiles, unroll=1):
                cute.arch.mbarrier_wait(empty + stage, phase)
                if warp == 0:
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(full + stage, cfg.tma_bytes)
                    self.load_b(tma_b, tma_b_mc, stages, nt, kt, e, stage, shared)
                for i in cutlass.range_constexpr(warp_rows):
                    src = cute.arch.shuffle_sync(src_row, i)
                    sA_row = cute.make_tensor(cute.recast_ptr(
                        stages.a_base + (stage * TILE_M + first_row + i) * tile_k,
                        stages.a_swizzle), row_layout)
                    tAsA, tAgA = cpasync.tma_partition(tma_a.atom, 0, cute.make_layout(1),
                                                       cute.group_modes(sA_row, 0, 2), gA)
                    self.tma_copy(tma_a.atom, tAgA[None, src, kt], tAsA, full + stage,
                                  cfg.multicast_a)
                stage, phase = self.ring.next_stage(stage, phase)
            if cutlass.const_expr(self.epilogue.has_producer_loads):
                stage, phase = self.epilogue.producer_loads(warp, epi_tmas, stages, row0, nt,
                                                            stage, phase)
            t += work.step

    @cute.jit
    def load_b(self, tma_b: Tma, tma_b_mc: Tma | None, stages: StageMemory, nt: Int32,
               kt: Int32, e: Int32, stage: Int32, shared):
        """varlen-M: B n-tile ``nt`` of expert ``e``, k-tile ``kt`` → ``stage``: one box, or
        with ``b_halves`` two half boxes (rows ``nt·tile_n/2 ..`` and ``N/2 + nt·tile_n/2 ..``).
        On a cluster with ``shared``, this CTA loads its share (its rank's half of the box, or
        its rank's half box, by ``tma_b_mc``) and multicasts it to both CTAs (never with
        ``multicast_a``, where the CTAs share A instead)."""
        bar = stages.full + stage
        if cutlass.const_expr(self.cfg.cluster > 1 and not self.cfg.multicast_a):
            if shared:
                rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                if cutlass.const_expr(self.cfg.b_halves):
                    self.copy_b_half(tma_b_mc, stages, rank, nt, kt, e, stage, bar, True)
                else:
                    self.copy_b_tile(tma_b_mc, stages.b, rank, nt, kt, e, stage, bar, True)
            else:
                self.load_b_whole(tma_b, stages, nt, kt, e, stage, bar)
        else:
            self.load_b_whole(tma_b, stages, nt, kt, e, stage, bar)

    @cute.jit
    def load_b_whole(self, tma: Tma, stages: StageMemory, nt: Int32, kt: Int32, e: Int32,
                     stage: Int32, bar: cute.Pointer):
        """The whole B tile into this CTA only."""
        if cutlass.const_expr(self.cfg.b_halves):
            for h in cutlass.range_constexpr(2):
                self.copy_b_half(tma, stages, h, nt, kt, e, stage, bar, False)
        else:
            self.copy_b_tile(tma, stages.b, 0, nt, kt, e, stage, bar, False)

    @cute.jit
    def copy_b_tile(self, tma: Tma, sB: cute.Tensor, rank, nt: Int32, kt: Int32,
                    e: Int32, stage: Int32, bar: cute.Pointer, multicast: cutlass.Constexpr):
        """B tile as one box into this CTA, or (``multicast``) this CTA's ``rank`` share of
        it into both CTAs of the cluster."""
        gB = cute.group_modes(
            cute.local_tile(tma.tensor, (self.cfg.tile_n, self.cfg.tile_k),
                            (None, None, None)), 0, 2)
        tBsB, tBgB = cpasync.tma_partition(
            tma.atom, rank, cute.make_layout(self.cfg.cluster if multicast else 1),
            cute.group_modes(sB, 0, 2), gB)
        self.tma_copy(tma.atom, tBgB[None, nt, kt, e], tBsB[None, stage], bar, multicast)

    @cute.jit
    def copy_b_half(self, tma: Tma, stages: StageMemory, h, nt: Int32, kt: Int32, e: Int32,
                    stage: Int32, bar: cute.Pointer, multicast: cutlass.Constexpr):
        """``b_halves``: half box ``h`` (0: rows of the first half of N, 1: the matching rows
        of the second half) of B n-tile ``nt``, to this CTA or (``multicast``) to both CTAs of
        the cluster."""
        half = self.cfg.tile_n // 2
        tile_k = self.cfg.tile_k
        gB = cute.group_modes(cute.local_tile(tma.tensor, (half, tile_k),
                                              (None, None, None)), 0, 2)
        sB_half = cute.make_tensor(cute.recast_ptr(
            stages.b_base + (stage * self.cfg.tile_n + h * half) * tile_k, stages.b_swizzle),
            cute.make_layout((half, tile_k), stride=(tile_k, 1)))
        tBsB, tBgB = cpasync.tma_partition(tma.atom, 0, cute.make_layout(1),
                                           cute.group_modes(sB_half, 0, 2), gB)
        self.tma_copy(tma.atom, tBgB[None, h * (self.cfg.dim_n // 2 // half) + nt, kt, e], tBsB,
                      bar, multicast)

    @cute.jit
    def produce_varlen_k(self, warp: Int32, work: WorkItems, tmas_a: tuple, tmas_b: tuple,
                         stages: StageMemory, sources: RowSources, sched: SchedulerArgs):
        """varlen-K: both operands are ``TILE_K`` rows of the expert per k-tile, MN-major in
        shared memory, loaded by TMA.

        A contiguous operand's whole k-tiles arrive as ``64 x TILE_K`` boxes issued by warp
        0. Gathered rows arrive as one ``64 x 1`` box per row and 64 columns, spread over the
        four producer warps (16 rows each); a row that is not the k-tile's reads row ``rows``
        of the source — out of bounds, so TMA writes zeros and no stale value enters the
        reduction. An expert's last partial k-tile, where one operand is gathered and the
        other contiguous, is the expert's last ``TILE_K`` rows: the contiguous operand's box
        ends at the expert's end, and the gathered operand's rows that the k-tile before
        already reduced are zeros (an expert of fewer than ``TILE_K`` rows, or two operands
        alike, load that k-tile row by row, zeros past the end): copied row by row, out of
        bounds rows included, it would cost several whole k-tiles (docs/performance.md). Lane ``l``
        holds the source row of the warp's row ``l mod 16``; those of k-tile ``kt + 1`` are
        read right after the copies of ``kt`` are issued, overlapping the wait for the next
        free stage.
        On a cluster, B (the same rows of the same expert for both CTAs) is split by columns:
        each CTA loads its half of the 64-column blocks and multicasts them; with
        ``multicast_a`` A is, so each CTA issues half of a gathered A's row copies.
        ``tmas_a``, ``tmas_b``: each operand's (box, row box) copies.
        """
        full, empty = stages.full, stages.empty
        gidx_a, gidx_b, rows_a, rows_b = sources
        lane = cute.arch.lane_idx()
        row_in_tile = warp * (TILE_K // 4) + lane % (TILE_K // 4)
        stage = Int32(0)
        phase = Int32(1)
        t = work.first
        while t < work.total:
            e, row0, rows, nt, mt, shared = self.scheduler.decode(t, sched)
            k_tiles = (rows + TILE_K - 1) // TILE_K
            src_a = self.row_source(gidx_a, self.cfg.gather_a, row0, rows, row_in_tile, Int32(0),
                                    rows_a)
            src_b = self.row_source(gidx_b, self.cfg.gather_b, row0, rows, row_in_tile, Int32(0),
                                    rows_b)
            for kt in cutlass.range(k_tiles, unroll=1):
                cute.arch.mbarrier_wait(empty + stage, phase)
                if warp == 0:
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.cfg.tma_bytes)
                boxed = (kt + 1) * TILE_K <= rows
                if cutlass.const_expr(self.shifted_tail):
                    boxed = rows >= TILE_K
                box_row = row0 + self.k_tile_start(kt, rows)
                self.load_k_tile(warp, tmas_a, stages.a_swizzle, stages.a_base, self.cfg.tile_m,
                                 mt * self.cfg.tile_m, self.cfg.gather_a, boxed, src_a, box_row,
                                 stage, full, self.cfg.multicast_a)
                self.load_k_tile(warp, tmas_b, stages.b_swizzle, stages.b_base, self.cfg.tile_n,
                                 nt * self.cfg.tile_n, self.cfg.gather_b, boxed, src_b, box_row,
                                 stage, full, self.cfg.cluster > 1 and not self.cfg.multicast_a)
                src_a = self.row_source(gidx_a, self.cfg.gather_a, row0, rows, row_in_tile,
                                        kt + 1, rows_a)
                src_b = self.row_source(gidx_b, self.cfg.gather_b, row0, rows, row_in_tile,
                                        kt + 1, rows_b)
                stage, phase = self.ring.next_stage(stage, phase)
            t += work.step

    @property
    def shifted_tail(self) -> bool:
        """Whether an expert's partial last k-tile is its last ``TILE_K`` rows (one operand
        gathered, the other contiguous: the gathered one's zeros keep the contiguous one's
        repeated rows out of the reduction)."""
        return self.cfg.gather_a != self.cfg.gather_b

    @cute.jit
    def k_tile_start(self, kt: Int32, rows: Int32) -> Int32:
        """The expert row of k-tile ``kt``'s first stage row: ``kt * TILE_K``, except a
        partial last k-tile under :attr:`shifted_tail`, which starts ``TILE_K`` rows before
        the expert's end."""
        start = kt * TILE_K
        if cutlass.const_expr(self.shifted_tail):
            if start + TILE_K > rows and rows >= TILE_K:
                start = rows - TILE_K
        return start

    @cute.jit
    def row_source(self, gidx: cute.Pointer, gathered: cutlass.Constexpr, row0: Int32,
                   rows: Int32, row_in_tile: Int32, kt: Int32, oob: Int32) -> Int32:
        """Source row of tile row ``row_in_tile`` of k-tile ``kt``; ``oob`` past the
        expert's end and, in a shifted partial k-tile, before the k-tile's own rows."""
        r = self.k_tile_start(kt, rows) + row_in_tile
        src = oob
        if r >= kt * TILE_K and r < rows:
            src = row0 + r
            if cutlass.const_expr(gathered):
                src = cute.make_tensor(gidx, cute.make_layout(row0 + rows))[row0 + r]
        return src

    @cute.jit
    def load_k_tile(self, warp: Int32, tmas: tuple, swizzle, sX_ptr: cute.Pointer,
                    tile_mn: cutlass.Constexpr, col0: Int32, gathered: cutlass.Constexpr,
                    boxed, src: Int32, box_row: Int32, stage: Int32,
                    full: cute.Pointer, split: cutlass.Constexpr):
        """Issue the TMA copies of one operand's k-tile into ``stage``; with ``split`` only
        this CTA's share of the 64-column blocks, multicast to the cluster. ``tmas``: the
        operand's (box, row box) copies; a contiguous operand loads ``TILE_K`` rows from
        ``box_row`` as boxes where ``boxed``, else row by row from ``src``."""
        box, row = tmas
        stage_base = sX_ptr + stage * (tile_mn * TILE_K)
        blocks = tile_mn // 64 // (self.cfg.cluster if split else 1)
        j0 = Int32(0)
        if cutlass.const_expr(split):
            j0 = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) * blocks
        if cutlass.const_expr(gathered):
            self.copy_rows(warp, row, swizzle, stage_base, blocks, j0, col0, src,
                           full + stage, split)
        else:
            if boxed:
                if warp == 0:
                    gX = cute.group_modes(cute.local_tile(
                        cute.domain_offset((0, box_row), box.tensor), (64, TILE_K),
                        (None, None)), 0, 2)
                    for jj in cutlass.range_constexpr(blocks):
                        j = j0 + jj
                        sX = cute.make_tensor(
                            cute.recast_ptr(stage_base + j * (64 * TILE_K), swizzle),
                            cute.make_layout((64, TILE_K), stride=(1, 64)))
                        tXsX, tXgX = cpasync.tma_partition(
                            box.atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                            gX)
                        self.tma_copy(box.atom, tXgX[None, col0 // 64 + j, 0], tXsX,
                                      full + stage, split)
            else:
                self.copy_rows(warp, row, swizzle, stage_base, blocks, j0, col0, src,
                               full + stage, split)

    @cute.jit
    def copy_rows(self, warp: Int32, tma_row: Tma, swizzle, stage_base: cute.Pointer,
                  blocks: cutlass.Constexpr, j0: Int32, col0: Int32, src: Int32,
                  bar: cute.Pointer, multicast: cutlass.Constexpr):
        """This warp's ``TILE_K / 4`` rows of a k-tile, one ``64 x 1`` box per 64 columns of
        blocks ``j0 .. j0 + blocks``."""
        gX = cute.group_modes(cute.local_tile(tma_row.tensor, (64, 1), (None, None)), 0, 2)
        for i in cutlass.range_constexpr(TILE_K // 4):
            row = cute.arch.shuffle_sync(src, i)
            for jj in cutlass.range_constexpr(blocks):
                j = j0 + jj
                sX = cute.make_tensor(cute.recast_ptr(
                    stage_base + j * (64 * TILE_K) + (warp * (TILE_K // 4) + i) * 64,
                    swizzle), cute.make_layout((64, 1), stride=(1, 64)))
                tXsX, tXgX = cpasync.tma_partition(
                    tma_row.atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), gX)
                self.tma_copy(tma_row.atom, tXgX[None, col0 // 64 + j, row], tXsX, bar, multicast)

    @cute.jit
    def tma_copy(self, atom, src: cute.Tensor, dst: cute.Tensor, bar: cute.Pointer,
                 multicast: cutlass.Constexpr):
        """One TMA load into this CTA, or (``multicast``) into every CTA of the cluster."""
        if cutlass.const_expr(multicast):
            cute.copy(atom, src, dst, tma_bar_ptr=bar,
                      mcast_mask=cutlass.Int16((1 << self.cfg.cluster) - 1))
        else:
            cute.copy(atom, src, dst, tma_bar_ptr=bar)

