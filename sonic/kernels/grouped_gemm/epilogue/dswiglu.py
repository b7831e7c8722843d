"""dH epilogue (docs/design.md §3 backward step 1; SonicMoE arXiv 2512.14080 §4.1.3, App. C).

On the fp32 tile of ``dA' = gather(dO)·W2`` (never stored), with the saved H ("concat" layout,
``[gate | up]``) and the row scores ``s``: store ``dH = dSwiGLU(s·dA', H)`` ``(P, 2n)`` (or
the derivative of the config's other GLU variant, :mod:`sonic.kernels.activation`),
``A' = s·A`` ``(P, n)`` and per n-tile partial sums of ``ds = ⟨dA', A⟩`` ``(P, n_tiles)``
(fp32; summed by the caller in a fixed order, so bitwise deterministic).

The tile's H arrives by TMA through the operand ring: after a tile's k-tiles the producer runs
this epilogue's :meth:`DswigluEpilogue.producer_loads`, which queues one stage per ``SLAB`` of
columns (the gate slab where A goes, the up slab at the start of B's space), so the loads
overlap the tile's last k-tiles and the epilogue reads H pairs from shared memory (4-byte loads,
swizzle-aware). Measured faster than the dA' GEMM followed by the standalone epilogue kernel
(benchmarks/RESULTS.md).

bf16 on sm_90 each warp makes one pass per slab over its own rows, writing dH over the slab's
H in the ring stage and A' beside it, and its first lane TMA-stores the three boxes; the
global writes drain while the next slab and the next tile's mainloop run (faster than
per-thread stores at the 7B, OLMoE and 30B shapes). The FP8 mainloop and sm_100 stage the
three outputs in turn and store them with their threads. The epilogue is still not overlapped
with MMAs: ping-pong, each warpgroup on its own ``128 x 128`` tile, gives bitwise the same
results but is slower, with one CTA and with 2-CTA clusters (half the FLOP per gathered row
copy, and the epilogue spills at twice the rows per warpgroup; benchmarks/RESULTS.md).
Imports ``cutlass``: only the kernel modules import this one.
"""

from typing import NamedTuple

import cutlass
from cutlass import BFloat16 as BF16, Float32 as F32, Int32, Int64, cute
from cutlass.cute.nvgpu import cpasync

from sonic.kernels import activation
from sonic.kernels.grouped_gemm.args import (EpilogueOutputs, EpilogueThreads, StageMemory,
                                             TileCoord, Tma)
from sonic.kernels.grouped_gemm.config import PAD, SLAB, TILE_M
from sonic.kernels.grouped_gemm.epilogue.base import Epilogue, swizzled
from sonic.kernels.grouped_gemm.protocols import AccumulatorView

# Bytes of one ring stage of H: a TILE_M x SLAB gate slab and its up slab.
H_STAGE_BYTES = 2 * TILE_M * SLAB * 2


class DswigluTmas(NamedTuple):
    """The dSwiGLU epilogue's TMA copies: the loads of H and, where
    :attr:`DswigluEpilogue.tma_store`, the box stores of dH's gate half, dH's up half and
    A'."""

    h: Tma
    dh_gate: Tma | None = None
    dh_up: Tma | None = None
    act: Tma | None = None


class DswigluEpilogue(Epilogue):
    """dH, A' and ds partials; declares its H loads into the operand ring."""

    has_producer_loads = True

    @property
    def producer_stages(self) -> int:
        """Ring stages :meth:`producer_loads` queues per tile: one per SLAB of columns."""
        return self.cfg.tile_n // SLAB

    @property
    def tma_store(self) -> bool:
        """bf16 sm_90: one pass per slab writes dH and A' in shared memory (dH over the slab's
        H in its ring stage) and TMA stores them. The FP8 mainloop (it spills with this
        epilogue and measured slower) and sm_100 (one thread per row, one release per stage)
        stage and store them with their threads."""
        return bool(self.cfg.tma_stored)

    def make_tma(self, h, c, act, rows, experts, a_smem) -> DswigluTmas:
        """H ``(P, 2n)`` (``P`` = ``rows``): loads of ``TILE_M x SLAB`` boxes, 128-byte
        swizzled like A (SLAB == TILE_K) so the reads of a thread quad's column pairs over 8
        rows hit distinct banks. With :attr:`tma_store` also the stores of ``WARP_ROWS x SLAB``
        boxes, swizzled the same way, into dH's gate half, dH's up half (``(P, n)`` views of
        pitch 2n, so TMA clips a box at column n) and A' ``(P, n)`` (``c``: dH, ``act``: A')."""
        n = self.cfg.dim_n
        load = self.tma_atom(cpasync.CopyBulkTensorTileG2SOp(), h, rows, 2 * n, 2 * n, a_smem,
                             (TILE_M, SLAB))
        if not self.tma_store:
            return DswigluTmas(load)
        store = cpasync.CopyBulkTensorTileS2GOp()
        return DswigluTmas(load, self.tma_atom(store, c, rows, n, 2 * n, a_smem),
                           self.tma_atom(store, c + n, rows, n, 2 * n, a_smem),
                           self.tma_atom(store, act, rows, n, n, a_smem))

    @cute.jit
    def finish(self):
        """bf16 sm_90: each consumer warp's TMA stores complete before the kernel ends (waited
        for by the elected lane that issued them: election is deterministic for a full warp)."""
        if cutlass.const_expr(self.tma_store):
            with cute.arch.elect_one():
                cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def h_slabs(self, stages: StageMemory, stage: Int32):
        """Where ring stage ``stage`` holds the gate and up ``TILE_M x SLAB`` slabs of H
        (unswizzled pointers): gate where the stage's A k-tile goes, up at the start of
        its B k-tile."""
        cfg = self.cfg
        a_space, b_space = stages.a_base, stages.b_base
        if cutlass.const_expr(cfg.fp8):
            # The ring's pointers count e4m3 elements, H is bf16: recast the (1024-byte
            # aligned) bases, not the stage pointers, so 4-byte pair loads keep their alignment.
            a_space, b_space = (cute.recast_ptr(a_space, dtype=BF16),
                                cute.recast_ptr(b_space, dtype=BF16))
        # bf16 elements per operand row of a stage: 128 bytes, a SLAB row of H.
        row = cfg.tile_k * cfg.ab_bytes // 2
        return (a_space + stage * (TILE_M * row), b_space + stage * (cfg.tile_n * row))

    @cute.jit
    def producer_loads(self, warp: Int32, tmas: DswigluTmas, stages: StageMemory,
                       row0: Int32, nt: Int32, stage: Int32, phase: Int32):
        """Queue the tile's H, one ring stage per SLAB of columns (the gate columns
        ``nt·tile_n + sl·SLAB ..`` and the matching up columns ``n + ..``). Rows past P and
        columns past 2n arrive as zeros; the rest beyond the tile's expert or n only reach
        masked outputs. Returns the producer's ring position after them."""
        atom, tensor = tmas.h
        full, empty = stages.full, stages.empty
        for sl in cutlass.range_constexpr(self.cfg.tile_n // SLAB):
            cute.arch.mbarrier_wait(empty + stage, phase)
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(full + stage, H_STAGE_BYTES)
                slabs = self.h_slabs(stages, stage)
                for half in cutlass.range_constexpr(2):
                    sH = cute.make_tensor(cute.recast_ptr(slabs[half], stages.a_swizzle),
                                          cute.make_layout((TILE_M, SLAB), stride=(SLAB, 1)))
                    gH = cute.local_tile(cute.domain_offset(
                        (row0, half * self.cfg.dim_n + nt * self.cfg.tile_n + sl * SLAB),
                        tensor), (TILE_M, SLAB), (0, None))
                    tHsH, tHgH = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                       cute.group_modes(sH, 0, 2),
                                                       cute.group_modes(gH, 0, 2))
                    cute.copy(atom, tHgH[None, 0], tHsH, tma_bar_ptr=full + stage)
            stage, phase = self.ring.next_stage(stage, phase)
        return stage, phase

    @cute.jit
    def visit(self, acc: AccumulatorView, wg: EpilogueThreads, outs: EpilogueOutputs,
              tmas: DswigluTmas, tile: TileCoord, stages: StageMemory, stage: Int32,
              phase: Int32):
        """Per SLAB of columns, this thread's gate and up values of H are read from the slab's
        ring stage (which is then released to the producer) and dH's gate half, dH's up half
        and A' are computed from fp32 dA', g, u and s and stored (:meth:`store_slabs` or
        :meth:`stage_slabs`); the ds partial of each of the thread's rows is reduced over the
        quad of threads holding the row and stored once per tile. Returns the ring position
        after the tile's H stages."""
        scores, ds = outs.scores, outs.ds
        row0, rows, nt = tile.row0, tile.rows, tile.n_tile
        row_count = acc.rows_per_thread
        # Score of each of this thread's rows, zero past the expert.
        rScore = cute.make_rmem_tensor((row_count,), F32)
        partial = cute.make_rmem_tensor((row_count,), F32)
        partial.fill(0.0)
        for i in cutlass.range_constexpr(row_count):
            m = acc.row_coord(i)
            rScore[i] = 0.0
            if m < rows:
                rScore[i] = cute.make_tensor(scores + row0, cute.make_layout(TILE_M))[m]
        if cutlass.const_expr(self.tma_store):
            stage, phase = self.store_slabs(acc, wg, outs, tmas, tile, stages, stage, phase,
                                            rScore, partial)
        else:
            stage, phase = self.stage_slabs(acc, wg, outs, tile, stages, stage, phase, rScore,
                                            partial)
        n_tiles = self.cfg.n_tiles
        for i in cutlass.range_constexpr(row_count):
            total = acc.reduce_row(partial[i])
            m = acc.row_coord(i)
            if acc.writes_row_total(wg.lane):
                if m < rows:
                    cute.make_tensor(ds + (Int64(row0 + m) * n_tiles + nt),
                                     cute.make_layout(1))[0] = total
        return stage, phase

    @cute.jit
    def store_slabs(self, acc, wg: EpilogueThreads, outs: EpilogueOutputs, tmas: DswigluTmas,
                    tile: TileCoord, stages: StageMemory, stage: Int32, phase: Int32,
                    rScore: cute.Tensor, partial: cute.Tensor):
        """sm_90, warp by warp (each warp holds ``WARP_ROWS`` whole rows of the tile): one
        pass per slab writes d_gate over g and d_up over u in the slab's ring stage and A' into
        the warpgroup's staging block, all swizzled like the stage; then the warp's first lane
        stores its three ``WARP_ROWS x SLAB`` boxes by TMA and waits only until TMA has read
        them, so the ring stage and the staging block can be reused while the global writes
        drain behind the next slab and the next tile's mainloop. A warp whose rows reach past
        the expert's end (they belong to the next expert's tiles) stores its valid rows with
        its threads instead."""
        assert acc.warp_private, "TMA-stored dSwiGLU slabs need warp-private accumulator rows"
        dh, a_scaled = outs.c, outs.act
        stage_c, wg_tid, wg_row0, lane = wg.staging, wg.tid, wg.row0, wg.lane
        row0, rows, nt = tile.row0, tile.rows, tile.n_tile
        full, empty, swizzle = stages.full, stages.empty, stages.a_swizzle
        n = self.cfg.dim_n
        cols = n - nt * self.cfg.tile_n
        warp_row0, whole, thread_rows = self.warp_rows(wg_tid, wg_row0, rows)
        # 256-wide tiles: A' fits in the stage beside up (B's k-tile is 256 rows), so a
        # stage is released one slab later, once TMA has read it, and the next slab is
        # computed meanwhile; else A' shares the staging block and each slab waits.
        deferred = self.cfg.tile_n >= 2 * TILE_M
        prev = stage
        for sl in cutlass.range_constexpr(self.cfg.tile_n // SLAB):
            cute.arch.mbarrier_wait(full + stage, phase)
            gate, up = self.h_slabs(stages, stage)
            # A' block and the tile row of its first row.
            act_block, act_row0 = stage_c, wg_row0
            if cutlass.const_expr(deferred):
                act_block, act_row0 = up + TILE_M * SLAB, Int32(0)
            col0 = nt * self.cfg.tile_n + sl * SLAB
            self.dswiglu_slab_in_place(acc, gate, up, act_block, act_row0, sl, cols, rScore,
                                       partial)
            # The threads' shared-memory writes, then the TMA unit's reads.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            if whole:
                with cute.arch.elect_one():
                    row = row0 + warp_row0
                    self.tma_box(tmas.dh_gate, swizzle, gate + warp_row0 * SLAB, row, col0)
                    self.tma_box(tmas.dh_up, swizzle, up + warp_row0 * SLAB, row, col0)
                    self.tma_box(tmas.act, swizzle, act_block + (warp_row0 - act_row0) * SLAB,
                                 row, col0)
                    cute.arch.cp_async_bulk_commit_group()
                    # Deferred: the previous slab's boxes have been read; else this one's.
                    if cutlass.const_expr(not deferred):
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    elif cutlass.const_expr(sl > 0):
                        cute.arch.cp_async_bulk_wait_group(1, read=True)
            # Not under a branch: a divergent region here makes ptxas serialize the WGMMAs.
            self.flush(gate + wg_row0 * SLAB, wg_tid, wg_row0, SLAB, dh,
                       Int64(row0) * (2 * n), 2 * n, col0, n, thread_rows, True, True)
            self.flush(up + wg_row0 * SLAB, wg_tid, wg_row0, SLAB, dh,
                       Int64(row0) * (2 * n), 2 * n, col0 + n, 2 * n, thread_rows, True, True)
            self.flush(act_block + (wg_row0 - act_row0) * SLAB, wg_tid, wg_row0, SLAB,
                       a_scaled, Int64(row0) * n, n, col0, n, thread_rows, True, True)
            # The warp's rows of the released stage have been read (by TMA and the threads).
            cute.arch.sync_warp()
            if cutlass.const_expr(not deferred):
                self.ring.release(empty + stage, lane)
            elif cutlass.const_expr(sl > 0):
                self.ring.release(empty + prev, lane)
            prev = stage
            stage, phase = self.ring.next_stage(stage, phase)
        if cutlass.const_expr(deferred):
            if whole:
                with cute.arch.elect_one():
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            self.ring.release(empty + prev, lane)
        return stage, phase

    @cute.jit
    def dswiglu_slab_in_place(self, acc, gate: cute.Pointer, up: cute.Pointer,
                              act_block: cute.Pointer, act_row0: Int32, sl: int, cols: Int32,
                              rScore: cute.Tensor, partial: cute.Tensor):
        """One pass over this thread's column pairs of slab ``sl``: g and u are read from the
        slab's ring stage and replaced there by d_gate and d_up; A' goes to ``act_block``
        (row ``m - act_row0``) at the same swizzled position; ``dA'·A`` is added to the row
        partials. The formulas and their order are :meth:`stage_dswiglu_slab`'s,
        so the outputs are bitwise the same."""
        gate_pair = cute.make_rmem_tensor((2,), BF16)
        up_pair = cute.make_rmem_tensor((2,), BF16)
        d_gate = cute.make_rmem_tensor((2,), F32)
        d_up = cute.make_rmem_tensor((2,), F32)
        a_out = cute.make_rmem_tensor((2,), F32)
        for p in acc.pairs(sl):
            s = rScore[p.row]
            m, col = acc.coord(p)
            c = col - sl * SLAB
            self.h_pair(gate, m, c, col < cols, gate_pair)
            self.h_pair(up, m, c, col < cols, up_pair)
            for v0 in cutlass.range_constexpr(2):
                dap = acc.value(p, v0)
                g = gate_pair[v0].to(F32)
                u = up_pair[v0].to(F32)
                phi, dg = activation.gate_grad(g, u, s, dap, self.cfg.activation)
                d_gate[v0] = dg
                d_up[v0] = (s * dap) * phi
                act = phi * u
                partial[p.row] = partial[p.row] + dap * act
                a_out[v0] = act * s
            for dst, row, values in ((gate, m, d_gate), (up, m, d_up),
                                     (act_block, m - act_row0, a_out)):
                gate_pair.store(values.load().to(BF16))
                cute.autovec_copy(gate_pair, cute.make_tensor(
                    dst + cute.assume(swizzled(row, c), divby=2), cute.make_layout(2)))

    @cute.jit
    def stage_slabs(self, acc, wg: EpilogueThreads, outs: EpilogueOutputs, tile: TileCoord,
                    stages: StageMemory, stage: Int32, phase: Int32, rScore: cute.Tensor,
                    partial: cute.Tensor):
        """FP8 and sm_100: per slab, dH's gate half, dH's up half and A' staged (padded) and
        stored by the threads in turn (:meth:`stage_dswiglu_slab`), the slab's ring stage
        released after the last."""
        dh, a_scaled = outs.c, outs.act
        stage_c, wg_tid, wg_row0, lane = wg.staging, wg.tid, wg.row0, wg.lane
        row0, rows, nt = tile.row0, tile.rows, tile.n_tile
        full, empty = stages.full, stages.empty
        n = self.cfg.dim_n
        phis = cute.make_rmem_tensor((acc.pairs_per_slab * 2,), F32)
        private = acc.warp_private
        cols = n - nt * self.cfg.tile_n
        for sl in cutlass.range_constexpr(self.cfg.tile_n // SLAB):
            cute.arch.mbarrier_wait(full + stage, phase)
            slabs = self.h_slabs(stages, stage)
            col0 = nt * self.cfg.tile_n + sl * SLAB
            for part in cutlass.range_constexpr(3):
                self.stage_dswiglu_slab(acc, stage_c, wg_row0, sl, slabs, cols, phis, rScore,
                                        partial, part)
                self.sync(wg, private)
                if cutlass.const_expr(part == 2):
                    # The warp (private) or warpgroup has read its rows of the slab's H: the
                    # stage is refilled once every reader has released it.
                    self.ring.release(empty + stage, lane)
                    stage, phase = self.ring.next_stage(stage, phase)
                    self.flush(stage_c, wg_tid, wg_row0, SLAB, a_scaled, Int64(row0) * n, n,
                               col0, n, rows, private)
                else:
                    self.flush(stage_c, wg_tid, wg_row0, SLAB, dh, Int64(row0) * (2 * n),
                               2 * n, col0 + part * n, (part + 1) * n, rows, private)
                self.sync(wg, private)
        return stage, phase

    @cute.jit
    def h_pair(self, slab: cute.Pointer, m: Int32, col: Int32, inside, pair: cute.Tensor):
        """The H values at row ``m``, columns ``col, col + 1`` (``col`` even) of a slab in
        a ring stage, one 4-byte load, or zeros when not ``inside``. The slab's rows are
        128-byte lines whose 16-byte chunks TMA's 128-byte swizzle permutes by the row
        (chunk ``c`` at ``c ^ (m mod 8)``; stage bases are 1024-byte aligned). The load is
        not under the branch (the address is inside the stage either way), so the compiler
        can issue a slab's loads together instead of one branch at a time."""
        cute.autovec_copy(cute.make_tensor(slab + cute.assume(swizzled(m, col), divby=2),
                                           cute.make_layout(2)), pair)
        if not inside:
            pair.fill(0.0)

    @cute.jit
    def stage_dswiglu_slab(self, acc, stage_c: cute.Pointer, wg_row0: Int32, sl: int,
                           slabs: tuple, cols: Int32, phis: cute.Tensor, rScore: cute.Tensor,
                           partial: cute.Tensor, part: int):
        """Slab ``sl`` of dH's gate half (``part`` 0, which also keeps ``φ(g)``), up half
        (1) or A' (2, also adding ``dA'·A`` to the row partials) → staging buffer. With
        ``dA = s·dA'``: ``d_gate = dA·u·φ′(g)``, ``d_up = dA·φ(g)``, ``A' = s·φ(g)·u``
        (:func:`sonic.kernels.activation.gate_grad` with the config's activation; for SwiGLU
        as the one-pass :func:`sonic.kernels.swiglu.dswiglu_epilogue`, σ evaluated once per
        value). g and u are read from the slab's ring stage, as zeros on columns past n (a
        column pair is entirely inside or outside: n is a multiple of 8), so no value of the
        neighbouring columns enters ds."""
        out = cute.make_rmem_tensor((2,), F32)
        pair = cute.make_rmem_tensor((2,), BF16)
        gate = cute.make_rmem_tensor((2,), BF16)
        up = cute.make_rmem_tensor((2,), BF16)
        for p in acc.pairs(sl):
            slot = p.index * 2
            s = rScore[p.row]
            m, col = acc.coord(p)
            if cutlass.const_expr(part != 1):
                self.h_pair(slabs[1], m, col - sl * SLAB, col < cols, up)
            if cutlass.const_expr(part == 0):
                self.h_pair(slabs[0], m, col - sl * SLAB, col < cols, gate)
            for v0 in cutlass.range_constexpr(2):
                dap = acc.value(p, v0)
                if cutlass.const_expr(part == 0):
                    g = gate[v0].to(F32)
                    u = up[v0].to(F32)
                    phi, dg = activation.gate_grad(g, u, s, dap, self.cfg.activation)
                    phis[slot + v0] = phi
                    out[v0] = dg
                elif cutlass.const_expr(part == 1):
                    out[v0] = (s * dap) * phis[slot + v0]
                else:
                    act = phis[slot + v0] * up[v0].to(F32)
                    partial[p.row] = partial[p.row] + dap * act
                    out[v0] = act * s
            pair.store(out.load().to(BF16))
            offset = (m - wg_row0) * (SLAB + PAD) + (col - sl * SLAB)
            cute.autovec_copy(pair, cute.make_tensor(
                stage_c + cute.assume(offset, divby=2), cute.make_layout(2)))
