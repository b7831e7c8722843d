"""Epilogue contract and the plain store epilogue.

A consumer warpgroup hands its finished tile to :meth:`Epilogue.visit`: the fp32 accumulator
view, the warpgroup's staging buffer, the tile's coordinates and the operand-ring position
(which an epilogue that reads ring stages, like dSwiGLU, advances and returns). Stores go
through the staging buffer: per ``SLAB`` columns the thread's column pairs are rounded to bf16
and staged, then every thread stores whole 16-byte row chunks, masked to the tile's valid rows
and columns, so a tile never writes rows of the next expert.
Imports ``cutlass``: only the kernel modules import this one.
"""

from typing import NamedTuple

import cutlass
from cutlass import BFloat16 as BF16, Float32 as F32, Int32, Int64, Uint32, cute, dsl_user_op
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync

from sonic.kernels.grouped_gemm.args import (EpilogueOutputs, EpilogueThreads, StageMemory,
                                             TileCoord, Tma)
from sonic.kernels.grouped_gemm.config import PAD, SLAB, VEC, GroupedGemmConfig, NamedBarrier
from sonic.kernels.grouped_gemm.pipeline import OperandRing
from sonic.kernels.grouped_gemm.protocols import AccumulatorView

# Rows of each 64-row block one warp holds in an accumulator with ``warp_private`` rows.
WARP_ROWS = 16


def swizzled(r, c):
    """Element offset of bf16 column ``c`` of row ``r`` in shared memory of 128-byte rows
    swizzled as TMA's 128-byte mode does (16-byte chunk ``c // 8`` at ``c // 8 ^ r mod 8``;
    bases 1024-byte aligned): a thread quad's column pairs over 8 rows hit distinct banks."""
    return r * SLAB + ((c // 8) ^ (r % 8)) * 8 + c % 8


def stmatrix_row(warp, lane, k: int, transposed: bool):
    """Element offset, in a :func:`swizzled` ``64 x SLAB`` box, of the 16-byte row that
    ``lane`` of warpgroup warp ``warp`` addresses in ``stmatrix`` ``k`` of
    :meth:`Epilogue.stage_box_matrices`: row ``lane % 8`` of matrix ``i = lane // 8``, the
    matrix of 8-column group ``2k + i // 2`` and 8-row half ``i % 2`` of the warp's 16 rows;
    ``transposed``: the box's rows are the accumulator's columns. Plain arithmetic, for
    trace-time integers or Python ones."""
    half, r, group = (lane // 8) % 2, lane % 8, 2 * k + lane // 16
    if transposed:
        return swizzled(8 * group + r, 16 * warp + 8 * half)
    return swizzled(16 * warp + 8 * half + r, 8 * group)


@dsl_user_op
def stmatrix_x4(dst: cute.Pointer, words, transposed: bool, *, loc=None, ip=None):
    """``stmatrix.x4`` of one warp's four ``8 x 8`` bf16 matrices: the four 32-bit ``words``
    (two adjacent columns of one row each, matrix ``i`` in word ``i``) of each lane, stored as
    16-byte rows at the shared addresses ``dst`` of lanes ``8i .. 8i+7``; ``transposed``
    (``.trans``) stores each matrix's columns as the rows."""
    nvvm.stmatrix(dst.llvm_ptr, [Uint32(w).ir_value(loc=loc, ip=ip) for w in words],
                  nvvm.MMALayout.col if transposed else nvvm.MMALayout.row, loc=loc, ip=ip)


class Epilogue:
    """Hooks with their defaults; subclasses implement :meth:`visit`.

    Attributes:
        cfg: the kernel configuration.
        ring: the operand ring (an epilogue that reads ring stages releases them).
        has_producer_loads: the producer calls :meth:`producer_loads` after each tile's
            k-tiles (class attribute).
    """

    has_producer_loads = False
    # Whether the consumer defers this epilogue into the next tile's mainloop (calls
    # store_part for each of its ``parts`` boxes per tile instead of visit); see defers().
    deferred = False
    parts = 0
    # Ring stages the producer queues per tile through producer_loads.
    producer_stages = 0

    def __init__(self, cfg: GroupedGemmConfig, ring: OperandRing):
        self.cfg = cfg
        self.ring = ring

    def staging_elems(self) -> int:
        """bf16 elements of shared memory the epilogue stages its stores in."""
        return self.cfg.staging_elems

    def make_tma(self, h, c, act, rows, experts, a_smem) -> tuple:
        """Host side: the epilogue's own TMA copies, a named tuple of :class:`~.args.Tma`
        (``None`` where a configuration has none), or ``()`` (``h``, ``c``, ``act``: H, C
        and act; ``rows``: varlen-M's rows of them; ``experts``: E, varlen-K C's leading
        extent; ``a_smem``: A's staged layout, whose 128-byte swizzle the copies share)."""
        return ()

    def prefetch(self, tmas: tuple):
        """Prefetch the descriptors of the epilogue's TMA copies (warp 0)."""
        for copy in tmas:
            if copy is not None:
                cpasync.prefetch_descriptor(copy.atom)

    @cute.jit
    def finish(self):
        """Each consumer warp after its last tile (sm_90): the TMA stores of C complete
        before the kernel ends (waited for by the lane that issued them: election is
        deterministic for a full warp)."""
        if cutlass.const_expr("c" in self.cfg.tma_stored):
            with cute.arch.elect_one():
                cute.arch.cp_async_bulk_wait_group(0)

    def defers(self) -> bool:
        """Whether this configuration can defer its stores: cooperative bf16 sm_90 varlen-M
        tiles. Deferred, the consumer rounds a finished accumulator to bf16 registers and
        stores it during its next tile's mainloop, one ``WARP_ROWS x SLAB`` box per warp
        after each of the first k-tiles' WGMMAs (:meth:`store_part`: staged 128-byte
        swizzled, then TMA-stored), so a tile's stores drain while the tensor cores run
        instead of between tiles. varlen-K is left out (it stages C in its last k-tile's
        ring stage, :attr:`~.config.GroupedGemmConfig.store_in_stage`): with a per-expert
        k-tile count ptxas serialized the WGMMAs (C7514)."""
        return "c" in self.cfg.tma_stored and not self.cfg.varlen_k

    def tma_atom(self, op, ptr, rows, width: int, pitch: int, a_smem,
                 box: tuple = (WARP_ROWS, SLAB)) -> Tma:
        """TMA copies ``op`` of ``box`` boxes (rows x SLAB columns) of ``(rows, width)`` of
        row pitch ``pitch`` at ``ptr``, 128-byte swizzled like the operand stages
        (``a_smem``'s swizzle; TMA clips a box at ``width`` and ``rows``)."""
        tensor = cute.make_tensor(ptr, cute.make_layout((rows, width), stride=(pitch, 1)))
        return Tma(*cpasync.make_tiled_tma_atom(op, tensor, cute.make_composed_layout(
            a_smem.inner, 0, cute.make_layout(box, stride=(SLAB, 1))), box))

    def store_part(self, packed, part: int, wg: EpilogueThreads, outs: EpilogueOutputs,
                   tmas: tuple, swizzle, row0: Int32, rows: Int32, nt: Int32):
        """Deferred: box ``part`` of ``parts`` of this warp's rows of the held tile
        (``packed``: the accumulator view of its bf16-rounded registers; ``row0``, ``rows``,
        ``nt``: its scheduler coordinates; ``tmas``: :meth:`make_tma`'s copies;
        ``swizzle``: the staging block's)."""
        raise NotImplementedError

    @cute.jit
    def begin_box(self):
        """Before a warp stages a deferred box: TMA has read the warp's previous one."""
        with cute.arch.elect_one():
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()

    @cute.jit
    def store_warp_box(self, stage_c: cute.Pointer, wg_tid: Int32, block_row0: Int32,
                       tma: Tma, swizzle, dst: cute.Pointer, pitch: int, row0: Int32,
                       rows: Int32, col0: Int32, col_limit):
        """After a warp staged its ``WARP_ROWS x SLAB`` box of the 64-row staging block of
        tile rows ``block_row0 ..`` (swizzled, :func:`swizzled`): its first lane TMA-stores
        it to ``dst`` rows ``row0 + ..``, columns ``col0 ..``. A warp whose rows reach past
        the expert's end (``rows``) stores its valid rows with its threads instead, masked to
        ``col_limit``."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        warp_row0, whole, thread_rows = self.warp_rows(wg_tid, block_row0, rows)
        if whole:
            with cute.arch.elect_one():
                self.tma_box(tma, swizzle, stage_c + (warp_row0 - block_row0) * SLAB,
                             row0 + warp_row0, col0)
                cute.arch.cp_async_bulk_commit_group()
        # Not under a branch: a divergent region here makes ptxas serialize the WGMMAs.
        self.flush(stage_c, wg_tid, block_row0, SLAB, dst, Int64(row0) * pitch, pitch, col0,
                   col_limit, thread_rows, True, True)

    @cute.jit
    def warp_rows(self, wg_tid: Int32, block_row0: Int32, rows: Int32):
        """``(warp_row0, whole, thread_rows)`` of this warp's ``WARP_ROWS`` rows of the 64-row
        block at tile row ``block_row0``: its first tile row, whether all its rows are the
        expert's (``< rows``: TMA may store them), and the row bound of the threads' own
        stores (none of its rows when whole: later rows belong to the next expert's tiles)."""
        warp = cute.arch.make_warp_uniform(wg_tid // 32)
        warp_row0 = block_row0 + warp * WARP_ROWS
        whole = warp_row0 + WARP_ROWS <= rows
        thread_rows = rows
        if whole:
            thread_rows = warp_row0
        return warp_row0, whole, thread_rows

    @cute.jit
    def tma_box(self, tma: Tma, swizzle, src: cute.Pointer, row: Int32, col: Int32,
                box: cutlass.Constexpr = (WARP_ROWS, SLAB)):
        """TMA store of the swizzled ``box`` (rows x SLAB columns) at ``src`` to rows
        ``row ..``, columns ``col ..`` of ``tma``'s tensor (one lane)."""
        sD = cute.make_tensor(cute.recast_ptr(src, swizzle),
                              cute.make_layout(box, stride=(SLAB, 1)))
        gD = cute.local_tile(cute.domain_offset((row, col), tma.tensor), box, (0, 0))
        bSG_sD, bSG_gD = cpasync.tma_partition(tma.atom, 0, cute.make_layout(1),
                                               cute.group_modes(sD, 0, 2),
                                               cute.group_modes(gD, 0, 2))
        cute.copy(tma.atom, bSG_sD, bSG_gD)

    def visit(self, acc: AccumulatorView, wg: EpilogueThreads, outs: EpilogueOutputs,
              tmas: tuple, tile: TileCoord, stages: StageMemory, stage: Int32, phase: Int32):
        """The one hook: store this warpgroup's part of a finished tile.

        Args:
            acc: the fp32 accumulator: sm_90's WGMMA registers or sm_100's TMEM loads.
            wg: the warpgroup running the epilogue and its staging buffer.
            outs: the epilogues' global pointers.
            tmas: :meth:`make_tma`'s copies, as kernel parameters.
            tile: the scheduler's tile coordinates.
            stages, stage, phase: the operand ring and this warpgroup's position in it.

        Returns:
            The ring position ``(stage, phase)`` after the epilogue.
        """
        raise NotImplementedError

    @cute.jit
    def stage_slab(self, acc, stage_c: cute.Pointer, wg_row0: Int32, sl: int,
                   transposed: cutlass.Constexpr = False, row_block: int | None = None,
                   swizzled_rows: cutlass.Constexpr = False):
        """bf16 accumulator columns ``sl·SLAB ..`` of this warpgroup's rows (of its 64-row
        block ``row_block`` only, if given, whose first row ``wg_row0`` then is) → staging
        buffer (``transposed``: staged row = column, staged column = row;
        staged_rows == SLAB). ``swizzled_rows``: the block is dense 128-byte lines swizzled
        as :func:`swizzled` (a TMA store's source), else rows padded by PAD."""
        pair_f32 = cute.make_rmem_tensor((2,), F32)
        pair = cute.make_rmem_tensor((2,), BF16)
        for p in (acc.pairs(sl) if row_block is None else acc.pairs(sl, row_block)):
            m, n = acc.coord(p)
            pair_f32[0] = acc.value(p, 0)
            pair_f32[1] = acc.value(p, 1)
            pair.store(pair_f32.load().to(BF16))
            if cutlass.const_expr(transposed):
                # A quad's column pairs over 8 rows: 16 distinct banks (swizzled: the four
                # staged rows' 16-byte chunks differ, 64 bytes in distinct banks).
                for v0 in cutlass.range_constexpr(2):
                    offset = (n + v0 - sl * SLAB) * (SLAB + PAD) + (m - wg_row0)
                    if cutlass.const_expr(swizzled_rows):
                        offset = swizzled(n + v0 - sl * SLAB, m - wg_row0)
                    cute.make_tensor(stage_c + offset, cute.make_layout(1))[0] = pair[v0]
            else:
                offset = (m - wg_row0) * (SLAB + PAD) + (n - sl * SLAB)
                if cutlass.const_expr(swizzled_rows):
                    offset = swizzled(m - wg_row0, n - sl * SLAB)
                cute.autovec_copy(pair, cute.make_tensor(
                    stage_c + cute.assume(offset, divby=2), cute.make_layout(2)))

    @cute.jit
    def stage_box_matrices(self, acc, dst: cute.Pointer, wg_tid: Int32, sl: int, mm: int,
                           transposed: cutlass.Constexpr):
        """Box ``(sl, mm)`` of an accumulator with :attr:`matrix_fragments` (fp32, or bf16
        already rounded) as a swizzled ``64 x SLAB`` block at ``dst`` (``transposed``: staged
        row = column; each warp writes only its own 16 rows' values), by ``stmatrix``:
        four 8 x 8 matrices per instruction where :meth:`stage_slab` stores each value (or
        pair) on its own, the transposed ones as 2-byte stores.

        Warp ``w`` holds rows ``16w .. 16w+15`` of the block; each of its 8-column groups
        ``j`` is two matrices, rows ``16w + 8·v1 ..`` (``v1`` = 0, 1), whose row ``r`` lane
        ``4r + q`` holds at columns ``8j + 2q, +1`` (the WGMMA accumulator's fragment). A
        matrix row stored is 16 bytes: 8 columns of one row, or (``transposed``) 8 rows of
        one column, a swizzled chunk of the block either way."""
        warp, lane = wg_tid // 32, wg_tid % 32
        words = cute.make_rmem_tensor((4,), Uint32)
        pair_f32 = cute.make_rmem_tensor((2,), F32)
        pair = cute.make_rmem_tensor((2,), BF16)
        pairs = list(acc.pairs(sl, mm))
        for k in cutlass.range_constexpr(len(pairs) // 4):
            for i in cutlass.range_constexpr(4):
                p = pairs[4 * k + i]
                if cutlass.const_expr(acc.acc.element_type == BF16):
                    # Rounded already (the deferred store's held tile).
                    pair[0] = acc.value(p, 0)
                    pair[1] = acc.value(p, 1)
                else:
                    pair_f32[0] = acc.value(p, 0)
                    pair_f32[1] = acc.value(p, 1)
                    pair.store(pair_f32.load().to(BF16))
                words[i] = cute.recast_tensor(pair, Uint32)[0]
            stmatrix_x4(dst + stmatrix_row(warp, lane, k, transposed),
                        [words[i] for i in range(4)], transposed)

    @cute.jit
    def sync(self, wg: EpilogueThreads, private: bool):
        """Order a staging buffer's writes before its reads (and the reads before the next
        writes): among the warp when ``private``, else among the warpgroup."""
        if cutlass.const_expr(private):
            cute.arch.sync_warp()
        else:
            cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE + wg.index, number_of_threads=128)

    @cute.jit
    def flush(self, stage_c: cute.Pointer, wg_tid: Int32, wg_row0: Int32, width: int,
              dst: cute.Pointer, base: Int64, pitch: int, col0: int, col_limit: Int32,
              rows: Int32, private: bool = False, swizzled_rows: bool = False):
        """Staged ``staged_rows x width`` block → ``dst[base + m·pitch + col0 + col]`` as
        16-byte row chunks, masked to tile rows ``< rows`` and to ``col0 + col < col_limit``
        (widths are multiples of 8, so a chunk is entirely inside or outside).

        ``private`` (an accumulator whose ``warp_private`` is true): each warp stores only
        the staged rows it wrote itself, its ``WARP_ROWS`` of every 64-row block, so it
        synchronises with itself only (:meth:`sync`) and the warpgroup's four warps run
        their compute and store phases out of step; else the warpgroup's 128 threads store
        the whole block. ``swizzled_rows``: the block's rows are dense 128-byte lines
        swizzled like the operand stages (:func:`swizzled`) instead of padded."""
        chunk = cute.make_rmem_tensor((VEC,), BF16)
        chunks_per_row = width // VEC
        # (first staged row, rows) of each group of rows this thread's threads store.
        threads, tid, groups = 128, wg_tid, ((Int32(0), self.cfg.staged_rows),)
        if cutlass.const_expr(private):
            warp = wg_tid // 32
            threads, tid = 32, wg_tid - warp * 32
            groups = tuple((block * 64 + warp * WARP_ROWS, WARP_ROWS)
                           for block in range(self.cfg.staged_rows // 64))
        for first, count in groups:
            for q in cutlass.range_constexpr(count * chunks_per_row // threads):
                index = tid + q * threads
                r = first + index // chunks_per_row
                col = (index % chunks_per_row) * VEC
                m = wg_row0 + r
                if m < rows and col0 + col < col_limit:
                    offset = r * (SLAB + PAD) + col
                    if cutlass.const_expr(swizzled_rows):
                        offset = swizzled(r, col)
                    cute.autovec_copy(cute.make_tensor(
                        stage_c + cute.assume(offset, divby=VEC), cute.make_layout(VEC)), chunk)
                    cute.autovec_copy(chunk, cute.make_tensor(
                        dst + cute.assume(base + (Int64(m) * pitch + col0 + col), divby=VEC),
                        cute.make_layout(VEC)))


class StoreTmas(NamedTuple):
    """The store epilogue's TMA copies: deferred, the box stores into C."""

    c: Tma | None


class StoreEpilogue(Epilogue):
    """C = the accumulator in bf16 (varlen-M ``(P, N)``, varlen-K ``C[e]`` or ``C[e]ᵀ``);
    deferred where :meth:`Epilogue.defers`."""

    def __init__(self, cfg: GroupedGemmConfig, ring: OperandRing):
        super().__init__(cfg, ring)
        self.deferred = self.defers()

    @property
    def parts(self) -> int:
        """Boxes a warp stores per deferred tile: its 64-row blocks × SLAB-column slabs."""
        return self.cfg.tile_boxes

    def make_tma(self, h, c, act, rows, experts, a_smem) -> StoreTmas:
        """Deferred: the ``WARP_ROWS x SLAB`` box stores into C ``(P, N)`` (``rows`` = P).
        varlen-K with :attr:`~.config.GroupedGemmConfig.store_in_stage`: the ``64 x SLAB``
        box stores into C ``(E·M, N)`` (``C[e]ᵀ``: ``(E·N, M)``); TMA clips a box at the last
        column, and no box crosses an expert's last row (their count is a multiple of 64)."""
        cfg = self.cfg
        store = cpasync.CopyBulkTensorTileS2GOp()
        if cfg.store_in_stage:
            rows_e, width = cfg.c_per_expert
            return StoreTmas(self.tma_atom(store, c, experts * rows_e, width, width, a_smem,
                                           (64, SLAB)))
        if not self.deferred:
            return StoreTmas(None)
        return StoreTmas(self.tma_atom(store, c, rows, cfg.dim_n, cfg.dim_n, a_smem))

    @cute.jit
    def store_part(self, packed, part: int, wg: EpilogueThreads, outs: EpilogueOutputs,
                   tmas: StoreTmas, swizzle, row0: Int32, rows: Int32, nt: Int32):
        """Box ``part``: 64-row block ``part // slabs``, slab ``part % slabs`` of C."""
        cfg = self.cfg
        stage_c = wg.staging
        slabs = cfg.tile_n // SLAB
        mm, sl = part // slabs, part % slabs
        block_row0 = wg.row0 + mm * 64
        self.begin_box()
        if cutlass.const_expr(packed.matrix_fragments):
            self.stage_box_matrices(packed, stage_c, wg.tid, sl, mm, False)
        else:
            pair = cute.make_rmem_tensor((2,), BF16)
            for p in packed.pairs(sl, mm):
                m, n = packed.coord(p)
                pair[0] = packed.value(p, 0)
                pair[1] = packed.value(p, 1)
                cute.autovec_copy(pair, cute.make_tensor(
                    stage_c + cute.assume(swizzled(m - block_row0, n - sl * SLAB), divby=2),
                    cute.make_layout(2)))
        self.store_warp_box(stage_c, wg.tid, block_row0, tmas.c, swizzle, outs.c,
                            cfg.dim_n, row0, rows, nt * cfg.tile_n + sl * SLAB, cfg.dim_n)

    @cute.jit
    def visit(self, acc: AccumulatorView, wg: EpilogueThreads, outs: EpilogueOutputs,
              tmas: StoreTmas, tile: TileCoord, stages: StageMemory, stage: Int32,
              phase: Int32):
        """bf16 store of this warpgroup's rows of the tile, masked to the expert's rows
        (varlen-M) or to M (varlen-K), and to N.

        A row of a slab is one 128-byte line. With ``transpose_c`` the slab is staged
        transposed, so the chunks are 8 consecutive rows of one column — contiguous in
        ``C[e]ᵀ``, 8 threads covering a 128-byte line of it.
        """
        cfg = self.cfg
        if cutlass.const_expr(cfg.store_in_stage):
            self.store_by_tma(acc, wg, tmas, tile, stages, stage)
            return stage, phase
        c = outs.c
        e, row0, rows, nt, mt, _ = tile
        stage_c, wg_tid, wg_row0 = wg.staging, wg.tid, wg.row0
        cols = cfg.dim_n - nt * cfg.tile_n
        if cutlass.const_expr(cfg.varlen_k):
            rows = cfg.dim_m - mt * cfg.tile_m
            base = (Int64(e) * cfg.dim_m + mt * cfg.tile_m) * cfg.dim_n + nt * cfg.tile_n
        else:
            base = Int64(row0) * cfg.dim_n + nt * cfg.tile_n
        # 256-row tiles stage a warpgroup's rows one 64-row block at a time.
        blocks = cfg.rows_wg // cfg.staged_rows
        # A transposed block's staged rows are columns: every warp wrote part of each.
        private = acc.warp_private and not cfg.transpose_c
        for sl in cutlass.range_constexpr(cfg.tile_n // SLAB):
            for mm in cutlass.range_constexpr(blocks):
                block_row0 = wg_row0 if mm == 0 else wg_row0 + mm * cfg.staged_rows
                self.stage_slab(acc, stage_c, block_row0, sl, cfg.transpose_c,
                                None if blocks == 1 else mm)
                self.sync(wg, private)
                if cutlass.const_expr(cfg.transpose_c):
                    # Staged row r is column nt·tile_n + sl·SLAB + r of C[e]: a row of C[e]ᵀ,
                    # whose staged part starts at M index mt·tile_m + block_row0.
                    self.flush(stage_c, wg_tid, Int32(0), cfg.staged_rows, c,
                               (Int64(e) * cfg.dim_n + nt * cfg.tile_n + sl * SLAB)
                               * cfg.dim_m + mt * cfg.tile_m, cfg.dim_m, block_row0, rows,
                               cols - sl * SLAB)
                else:
                    self.flush(stage_c, wg_tid, block_row0, SLAB, c, base, cfg.dim_n,
                               sl * SLAB, cols, rows, private)
                # The next slab (or row block) overwrites the staging buffer.
                self.sync(wg, private)
        return stage, phase

    @cute.jit
    def store_by_tma(self, acc: AccumulatorView, wg: EpilogueThreads, tmas: StoreTmas,
                     tile: TileCoord, stages: StageMemory, stage: Int32):
        """varlen-K with :attr:`~.config.GroupedGemmConfig.store_in_stage`: this warpgroup's
        part of the tile as ``64 x SLAB`` boxes (``C[e]ᵀ``'s with ``transpose_c``), each
        staged swizzled and TMA-stored by one lane. All boxes but the last go to the ring
        stage of the tile's last k-tile (``stage`` is the one after it), so none waits for a
        store; the consumer warps release that stage once TMA has read them, and the last
        box, staged in the warpgroup's own box, drains under the next tile's mainloop. A
        tile without k-tiles (an expert without rows) has no such stage: its zeros go box
        by box through the warpgroup's own box. A box whose rows lie past the expert's (the
        last m- or n-tile of M or N) is not stored."""
        cfg = self.cfg
        boxes = [(sl, mm) for sl in range(cfg.tile_n // SLAB) for mm in range(cfg.rows_wg // 64)]
        if tile.rows > 0:
            last = stage - 1
            if stage == 0:
                last = Int32(cfg.stages - 1)
            # The other warpgroup's WGMMAs have read the stage too.
            cute.arch.barrier(barrier_id=NamedBarrier.CONSUMERS, number_of_threads=256)
            a_base = cute.recast_ptr(stages.a_base, dtype=BF16)
            b_base = cute.recast_ptr(stages.b_base, dtype=BF16)
            for i, box in enumerate(boxes):
                if cutlass.const_expr(i < len(boxes) - 1):
                    self.store_box(acc, wg, tmas, tile, stages.a_swizzle, box,
                                   self.stage_box(a_base, b_base, last, wg.index, i), None)
                else:
                    # Its previous contents: the previous tile's last box, committed before
                    # this tile's other boxes.
                    self.store_box(acc, wg, tmas, tile, stages.a_swizzle, box, wg.staging,
                                   len(boxes) - 1)
            # TMA has read the stage's boxes (all but the last group): it may be refilled.
            if cute.arch.make_warp_uniform(wg.tid // 32) == 0:
                with cute.arch.elect_one():
                    cute.arch.cp_async_bulk_wait_group(1, read=True)
            self.sync(wg, False)
            self.ring.release(stages.empty + last, wg.lane)
        else:
            for box in boxes:
                self.store_box(acc, wg, tmas, tile, stages.a_swizzle, box, wg.staging, 0)

    def stage_box(self, a_base, b_base, stage: Int32, wg_index: Int32, i: int):
        """Box ``i`` of warpgroup ``wg_index``'s ``tile_boxes - 1`` boxes in ring stage
        ``stage`` of the A and B spaces at ``a_base``, ``b_base`` (bf16 views). A stage's
        k-tiles have 128-byte rows (64 bf16 or 128 e4m3), so each 64 of their rows hold one
        ``64 x SLAB`` bf16 box (1024-byte aligned); each warpgroup takes half of A's boxes
        first, then of B's."""
        cfg = self.cfg
        box = 64 * SLAB
        # bf16 elements of one row of a k-tile.
        row = cfg.tile_k * cfg.ab_bytes // 2
        a_per = min(cfg.tile_m // 128, cfg.tile_boxes - 1)
        if i < a_per:
            return a_base + stage * (cfg.tile_m * row) + (wg_index * a_per + i) * box
        b_per = cfg.tile_boxes - 1 - a_per
        return b_base + stage * (cfg.tile_n * row) + (wg_index * b_per + i - a_per) * box

    @cute.jit
    def store_box(self, acc: AccumulatorView, wg: EpilogueThreads, tmas: StoreTmas,
                  tile: TileCoord, swizzle, box: tuple, dst: cute.Pointer,
                  allowance: cutlass.Constexpr):
        """Stage box ``box`` = ``(slab, 64-row block)`` of this warpgroup's accumulator at
        ``dst`` and TMA-store it (one lane, one committed group). ``allowance``: the lane
        first waits until at most that many of its groups are still being read (``dst``'s
        previous contents among the older ones); None: ``dst`` is free."""
        cfg = self.cfg
        sl, mm = box
        e, _, _, nt, mt, _ = tile
        leader = cute.arch.make_warp_uniform(wg.tid // 32) == 0
        block_row0 = wg.row0 + mm * 64
        if cutlass.const_expr(allowance is not None):
            if leader:
                with cute.arch.elect_one():
                    cute.arch.cp_async_bulk_wait_group(allowance, read=True)
            self.sync(wg, False)
        if cutlass.const_expr(acc.matrix_fragments):
            self.stage_box_matrices(acc, dst, wg.tid, sl, mm, cfg.transpose_c)
        else:
            self.stage_slab(acc, dst, block_row0, sl, cfg.transpose_c,
                            None if cfg.rows_wg == 64 else mm, True)
        # The threads' shared-memory writes, then the TMA unit's reads.
        cute.arch.fence_proxy("async.shared", space="cta")
        self.sync(wg, False)
        if cutlass.const_expr(cfg.transpose_c):
            first = nt * cfg.tile_n + sl * SLAB
            inside = first < cfg.dim_n
            row, col = e * cfg.dim_n + first, mt * cfg.tile_m + block_row0
        else:
            first = mt * cfg.tile_m + block_row0
            inside = first < cfg.dim_m
            row, col = e * cfg.dim_m + first, nt * cfg.tile_n + sl * SLAB
        if leader:
            with cute.arch.elect_one():
                if inside:
                    self.tma_box(tmas.c, swizzle, dst, row, col, (64, SLAB))
                # Committed even when empty: the waits count one group per box.
                cute.arch.cp_async_bulk_commit_group()
