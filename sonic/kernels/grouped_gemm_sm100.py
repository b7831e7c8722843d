"""Grouped GEMMs over expert-sorted rows on Blackwell (sm_100a): tcgen05 UMMA, TMEM accumulator.

PROTOTYPE, to become ``sonic/kernels/grouped_gemm/sm100.py``. Same operations, operand layouts
and launcher arguments as the Hopper kernel (:mod:`sonic.kernels.grouped_gemm`, DESIGN §3–4;
SonicMoE, arXiv 2512.14080, §4.1): varlen-M ``C[rows of e] = A[rows of e] · B[e]ᵀ`` (A
contiguous or gathered by row index; B K-major ``(E, N, K)`` or N-major), varlen-K
``C[e] = A_eᵀ · B_e`` (either operand gathered), the up-proj SwiGLU epilogue and the dH
epilogue (dSwiGLU, ``A' = s·A``, ds partials). ``expert_offsets`` is read on the device only.

What differs from sm_90 is the mainloop and the epilogue's source of accumulator values:

* Warp roles (288 threads): warps 0–3 run the epilogue, warps 4–7 the producers (TMA), warp 8
  issues ``tcgen05.mma`` (one thread's instruction per MMA, 128 x tile_n x 16).
* The fp32 accumulator lives in tensor memory (TMEM): 512 columns are allocated per CTA
  (``tcgen05.alloc``), two accumulator stages of ``tile_n`` columns, so the epilogue of one
  tile overlaps the MMAs of the next.
* Barriers (producer -> consumer, arrival count):
  ``full[s]``   producers -> MMA warp, 1 expect-tx arrival + the stage's TMA bytes;
  ``empty[s]``  MMA warp -> producers, 1 (``tcgen05.commit``: arrives when the MMAs that read
  the stage have completed);
  ``acc_full[a]``  MMA warp -> epilogue, 1 (``tcgen05.commit`` after a tile's last MMA);
  ``acc_empty[a]`` epilogue -> MMA warp, 4 (lane 0 of each epilogue warp, after
  ``tcgen05.wait::ld``).
* Operand loads are the sm_90 kernel's producers, inherited unchanged: the UMMA canonical
  K-major and MN-major 128-byte-swizzled shared-memory layouts are byte-for-byte the WGMMA
  ones (``tests/test_sm100_compile.py`` compares the helpers' layouts), so TMA tile boxes, gathered-row boxes
  (one ``1 x 64`` box per row, written at its 128-byte line; TMA's own gather4 mode needs
  4-row groups and would not help the ragged expert tails) and varlen-K row boxes land where
  UMMA reads them.
* Epilogue: ``tcgen05.ld`` 32x32b puts tile row ``32·warp + lane`` in thread ``lane`` of
  epilogue warp ``warp``, ``EPI_N`` consecutive fp32 columns per load, so every thread owns
  whole rows: the epilogues see fp32 values of one row (no fragment-mode indexing), masked
  to the expert's rows and to N, and store 16-byte chunks straight to global memory; rows
  past an expert's end are never written. The SwiGLU / dSwiGLU maths are the module-level
  :func:`silu_mul`, :func:`dswiglu_values`, written over fp32 scalars so an sm_90 epilogue
  hook can call the same functions.

Unfinished (see SM100_NOTES.md): 2-CTA (``cta_group::2``) MMA and B multicast; TMA stores of C
(the per-thread row stores are uncoalesced across a warp); the dH epilogue reads H from global
memory per row instead of through the operand ring. Nothing here has run on an sm_100 device:
:func:`self_check` is the gate before any dispatcher uses it.
"""

import functools
import threading

import torch

from sonic.kernels import grouped_gemm as sm90
from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant
from sonic.kernels.swiglu import LOG2_E

TILE_M = sm90.TILE_M
TILE_K = sm90.TILE_K
# fp32 accumulator columns per tcgen05.ld (a thread holds EPI_N values of its row).
EPI_N = 32
VEC = 8
EPILOGUE_WARPS = 4
PRODUCER_WARPS = 4
MMA_WARP = EPILOGUE_WARPS + PRODUCER_WARPS
THREADS = 32 * (MMA_WARP + 1)
# Accumulator stages in TMEM; 2 x 256 fp32 columns fill the 512 columns of an SM.
ACC_STAGES = 2
TMEM_COLUMNS = 512
# Named barrier of the epilogue warps (0 is __syncthreads).
_EPILOGUE_BARRIER = 1
_MAX_STAGES = 8
# Shared memory per CTA on sm_100 (227 KiB usable, as sm_90) less the tile table and barriers.
_SMEM_BYTES = 227 * 1024 - (sm90.MAX_EXPERTS + 1) * 4 - 1024


def _stages(tile_n: int) -> int:
    """Operand ring depth: no shared-memory staging of C, so the ring takes the rest."""
    return min(_MAX_STAGES, _SMEM_BYTES // ((TILE_M + tile_n) * TILE_K * 2))


@functools.cache
def _math():
    """fp32 epilogue maths shared by every architecture's epilogue (cutlass imported lazily)."""
    import cutlass
    from cutlass import cute

    F32 = cutlass.Float32

    @cute.jit
    def sigmoid(g: F32) -> F32:
        return cute.arch.rcp_approx(1.0 + cute.math.exp2(g * -LOG2_E, fastmath=True))

    @cute.jit
    def silu_mul(g: F32, u: F32) -> F32:
        return (g * sigmoid(g)) * u

    @cute.jit
    def dswiglu_values(dap: F32, g: F32, u: F32, s: F32):
        sig = sigmoid(g)
        silu = g * sig
        da = s * dap
        act = silu * u
        return da * u * sig * (1.0 + g * (1.0 - sig)), da * silu, act * s, act

    return silu_mul, dswiglu_values


def silu_mul(g, u):
    """Inside ``@cute.jit``: ``silu(g)·u`` of fp32 scalars holding the bf16-rounded gate and
    up values — the standalone SwiGLU kernel's formula, so A equals the backward's
    recomputation from the stored H bitwise (SonicMoE §4.1.2)."""
    return _math()[0](g, u)


def dswiglu_values(dap, g, u, s):
    """Inside ``@cute.jit``: the dH epilogue of one (gate, up) pair (SonicMoE App. C) from fp32
    ``dA'``, the bf16 g, u (as fp32) and the row score s: ``(d_gate, d_up, A' = s·A, A)`` with
    ``dA = s·dA'`` and ``A = silu(g)·u``; σ is evaluated once. The caller adds ``dA'·A`` to ds.
    """
    return _math()[1](dap, g, u, s)


@functools.cache
def _kernels():
    """Build the sm_100 kernel class (imports cutlass, so only on first use)."""
    import cutlass
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import cute
    from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    Int32, Int64 = cutlass.Int32, cutlass.Int64
    BF16, F32 = cutlass.BFloat16, cutlass.Float32
    ROW, COL = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR
    Base = sm90._kernels()

    def _major(layout):
        return OperandMajorMode.MN if layout == COL else OperandMajorMode.K

    def _mn_major_atoms(ptr, rows, width: int, smem):
        """TMA atoms of an MN-major varlen-K operand ``(rows, width)``: ``64 x TILE_K`` boxes
        for whole k-tiles and ``64 x 1`` row boxes (as the sm_90 producers expect)."""
        m_x = cute.make_tensor(ptr, cute.make_layout((width, rows), stride=(1, width)))
        return tuple(cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_x, cute.make_composed_layout(
                smem.inner, 0, cute.make_layout(box, stride=(1, 64))), box)
            for box in ((64, TILE_K), (64, 1)))

    class Sm100GroupedGemm(Base):
        """One static configuration on sm_100a; the producers, tile table and work decoding
        are the sm_90 kernel's (:class:`GroupedGemmKernel`), the MMA and epilogue are new."""

        def __init__(self, varlen_k: bool, tile_n: int, dim_m: int, dim_n: int, dim_k: int,
                     gather_a: bool, gather_b: bool, b_n_major: bool = False,
                     swiglu: str | None = None, dswiglu: bool = False):
            super().__init__(varlen_k, tile_n, dim_m, dim_n, dim_k, gather_a, gather_b, False,
                             b_n_major, False, swiglu, 1, dswiglu)
            if tile_n % EPI_N or tile_n > 256:
                raise ValueError(f"tile_n must be a multiple of {EPI_N} up to 256 (UMMA N), "
                                 f"got {tile_n}")
            # A stage is released by one tcgen05.commit of the MMA warp.
            self.stage_readers = 1
            self.stages = _stages(tile_n)

        @cute.jit
        def __call__(self, a_addr: Int64, b_addr: Int64, c_addr: Int64, act_addr: Int64,
                     h_addr: Int64, scores_addr: Int64, ds_addr: Int64,
                     gidx_a_addr: Int64, gidx_b_addr: Int64, offsets_addr: Int64, rows_a: Int32,
                     rows_b: Int32, num_experts: Int32, num_ctas: Int32,
                     stream: cuda.CUstream):
            gmem = runtime.gmem_ptr
            a, b, c = gmem(BF16, a_addr, 16), gmem(BF16, b_addr, 16), gmem(BF16, c_addr, 16)
            act, h = gmem(BF16, act_addr, 16), gmem(BF16, h_addr, 16)
            scores, ds = gmem(F32, scores_addr, 4), gmem(F32, ds_addr, 4)
            gidx_a, gidx_b = gmem(Int32, gidx_a_addr, 4), gmem(Int32, gidx_b_addr, 4)
            offsets = gmem(Int32, offsets_addr, 4)
            tiled_mma = cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
                BF16, F32, (TILE_M, self.tile_n, 16), tcgen05.CtaGroup.ONE,
                tcgen05.OperandSource.SMEM, _major(self.a_layout), _major(self.b_layout)))
            # The WGMMA layouts the inherited producers address; UMMA reads the same bytes.
            a_smem = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_mnk, BF16, self.stages)
            b_smem = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_mnk, BF16, self.stages)

            # varlen-K row-box atoms; varlen-M has none.
            a_row = b_row = (None, None)
            if cutlass.const_expr(self.varlen_k):
                tma_a, a_row = _mn_major_atoms(a, rows_a, self.dim_m, a_smem)
                tma_b, b_row = _mn_major_atoms(b, rows_b, self.dim_n, b_smem)
            else:
                m_a = cute.make_tensor(a, cute.make_layout((rows_a, self.dim_k),
                                                           stride=(self.dim_k, 1)))
                a_box = (1, TILE_K) if self.gather_a else (TILE_M, TILE_K)
                a_box_smem = (cute.make_composed_layout(
                    a_smem.inner, 0, cute.make_layout(a_box, stride=(TILE_K, 1)))
                    if self.gather_a else cute.slice_(a_smem, (None, None, 0)))
                tma_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_a,
                                                    a_box_smem, a_box)
                b_stride = (1, self.dim_n) if self.b_n_major else (self.dim_k, 1)
                m_b = cute.make_tensor(b, cute.make_layout(
                    (self.dim_n, self.dim_k, num_experts),
                    stride=(*b_stride, self.dim_n * self.dim_k)))
                b_box = (self.b_rows_per_copy, TILE_K)
                b_box_smem = (cute.make_composed_layout(
                    b_smem.inner, 0, cute.make_layout(b_box, stride=(TILE_K, 1)))
                    if self.swiglu == "concat" else cute.slice_(b_smem, (None, None, 0)))
                tma_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_b,
                                                    b_box_smem, b_box)

            @cute.struct
            class SharedStorage:
                full: cute.struct.MemRange[Int64, self.stages]
                empty: cute.struct.MemRange[Int64, self.stages]
                acc_full: cute.struct.MemRange[Int64, ACC_STAGES]
                acc_empty: cute.struct.MemRange[Int64, ACC_STAGES]
                tmem_addr: Int32
                tile_start: cute.struct.MemRange[Int32, sm90.MAX_EXPERTS + 1]
                sA: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(a_smem)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(b_smem)], 1024]

            self.shared_storage = SharedStorage
            self.kernel(tiled_mma, *tma_a, *tma_b, *a_row, *b_row, a_smem, b_smem,
                        (c, act, h, scores, ds), gidx_a, gidx_b, offsets, rows_a, rows_b,
                        num_experts).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1],
                                            min_blocks_per_mp=1, stream=stream)

        @cute.kernel
        def kernel(self, tiled_mma: cute.TiledMma, tma_atom_a, tma_a, tma_atom_b, tma_b,
                   tma_atom_a_row, tma_a_row, tma_atom_b_row, tma_b_row,
                   a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, outs: tuple,
                   gidx_a: cute.Pointer, gidx_b: cute.Pointer, offsets: cute.Pointer,
                   rows_a: Int32, rows_b: Int32, num_experts: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            storage = SmemAllocator().allocate(self.shared_storage)
            full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
            acc_full, acc_empty = storage.acc_full.data_ptr(), storage.acc_empty.data_ptr()
            table = storage.tile_start.get_tensor(cute.make_layout(sm90.MAX_EXPERTS + 1))
            s_a = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            s_b = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            m_off = cute.make_tensor(offsets, cute.make_layout(num_experts + 1))

            if warp == MMA_WARP:
                cpasync.prefetch_descriptor(tma_atom_a)
                cpasync.prefetch_descriptor(tma_atom_b)
                if cutlass.const_expr(self.varlen_k):
                    cpasync.prefetch_descriptor(tma_atom_a_row)
                    cpasync.prefetch_descriptor(tma_atom_b_row)
                with cute.arch.elect_one():
                    for s in cutlass.range_constexpr(self.stages):
                        cute.arch.mbarrier_init(full + s, 1)
                        cute.arch.mbarrier_init(empty + s, 1)
                    for s in cutlass.range_constexpr(ACC_STAGES):
                        cute.arch.mbarrier_init(acc_full + s, 1)
                        cute.arch.mbarrier_init(acc_empty + s, EPILOGUE_WARPS)
                cute.arch.mbarrier_init_fence()
            if warp == 0:
                # tcgen05.alloc is warp-wide; one CTA per SM (shared memory), so all 512
                # columns are free and the permit can go at once.
                cute.arch.alloc_tmem(TMEM_COLUMNS, storage.tmem_addr)
                cute.arch.relinquish_tmem_alloc_permit()
            if warp == PRODUCER_WARPS:
                if cutlass.const_expr(not self.varlen_k):
                    self.build_tile_table(m_off, table, num_experts)
            cute.arch.sync_threads()

            total = Int32(0)
            if cutlass.const_expr(self.varlen_k):
                total = num_experts * (self.m_tiles * self.n_tiles)
            else:
                total = table[num_experts] * self.n_tiles
            acc_shape = tiled_mma.partition_shape_C((TILE_M, self.tile_n))
            acc_layout = tiled_mma.make_fragment_C(cute.append(acc_shape, ACC_STAGES)).layout
            tmem = cute.arch.retrieve_tmem_ptr(F32, 16, storage.tmem_addr)
            acc = cute.make_tensor(tmem, acc_layout)

            if warp >= EPILOGUE_WARPS and warp < MMA_WARP:
                pwarp = warp - EPILOGUE_WARPS
                if cutlass.const_expr(self.varlen_k):
                    self.produce_varlen_k(
                        pwarp, bidx, grid, total, (tma_atom_a, tma_a, tma_atom_a_row, tma_a_row),
                        (tma_atom_b, tma_b, tma_atom_b_row, tma_b_row), a_smem, b_smem,
                        storage.sA.data_ptr(), storage.sB.data_ptr(), gidx_a, gidx_b, rows_a,
                        rows_b, m_off, table, num_experts, full, empty)
                elif cutlass.const_expr(self.gather_a):
                    self.produce_gather_m(pwarp, bidx, grid, total, tma_atom_a, tma_a,
                                          (tma_atom_b, tma_b, None, None), a_smem, b_smem,
                                          storage.sA.data_ptr(), storage.sB.data_ptr(), s_b,
                                          gidx_a, m_off, table, num_experts, full, empty,
                                          None, None)
                else:
                    if pwarp == 0:
                        self.produce_tma(bidx, grid, total, tma_atom_a, tma_a,
                                         (tma_atom_b, tma_b, None, None), s_a, s_b, m_off,
                                         table, num_experts, full, empty)
            elif warp == MMA_WARP:
                self.mma(bidx, grid, total, tiled_mma, s_a, s_b, acc, m_off, num_experts, full,
                         empty, acc_full, acc_empty)
            else:
                self.epilogue(tidx, bidx, grid, total, tiled_mma, acc, outs, m_off, table,
                              num_experts, acc_full, acc_empty)
                # Every tile's accumulator has been read: the MMA warp has no work left.
                cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER,
                                  number_of_threads=32 * EPILOGUE_WARPS)
                if warp == 0:
                    cute.arch.dealloc_tmem(tmem, TMEM_COLUMNS)

        @cute.jit
        def load_h(self, warp: Int32, tma_h: tuple, h_raw: tuple, row0: Int32, nt: Int32,
                   stage: Int32, phase: Int32, full: cute.Pointer, empty: cute.Pointer):
            """sm_100: the dH epilogue reads H from global memory itself (each thread owns whole
            rows), so the producers queue no H stages."""
            return stage, phase

        @cute.jit
        def mma(self, first: Int32, step: Int32, total: Int32, tiled_mma: cute.TiledMma,
                s_a: cute.Tensor, s_b: cute.Tensor, acc: cute.Tensor, m_off: cute.Tensor,
                num_experts: Int32, full: cute.Pointer, empty: cute.Pointer,
                acc_full: cute.Pointer, acc_empty: cute.Pointer):
            """MMA warp: per tile, wait for a free accumulator stage, issue the UMMAs of every
            k-tile (each stage released by ``tcgen05.commit`` once its MMAs complete), then
            commit the accumulator stage to the epilogue. A varlen-K tile of an expert with no
            rows issues no MMA; the epilogue stores zeros for it."""
            thr_mma = tiled_mma.get_slice(0)
            t_ca = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
            t_cb = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
            k_blocks = cute.size(t_ca, mode=[2])
            stage = Int32(0)
            phase = Int32(0)
            acc_stage = Int32(0)
            acc_phase = Int32(1)
            t = first
            while t < total:
                k_tiles = self.tile_k_tiles(t, m_off, num_experts)
                cute.arch.mbarrier_wait(acc_empty + acc_stage, acc_phase)
                tile_acc = acc[None, None, None, acc_stage]
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for kt in cutlass.range(k_tiles, unroll=1):
                    cute.arch.mbarrier_wait(full + stage, phase)
                    for kb in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled_mma, tile_acc, t_ca[None, None, kb, stage],
                                  t_cb[None, None, kb, stage], tile_acc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    with cute.arch.elect_one():
                        tcgen05.commit(empty + stage)
                    stage, phase = self.next_stage(stage, phase)
                with cute.arch.elect_one():
                    tcgen05.commit(acc_full + acc_stage)
                acc_stage += 1
                if acc_stage == ACC_STAGES:
                    acc_stage = 0
                    acc_phase ^= 1
                t += step

        @cute.jit
        def epilogue(self, tidx: Int32, first: Int32, step: Int32, total: Int32,
                     tiled_mma: cute.TiledMma, acc: cute.Tensor, outs: tuple,
                     m_off: cute.Tensor, table: cute.Tensor, num_experts: Int32,
                     acc_full: cute.Pointer, acc_empty: cute.Pointer):
            """Epilogue warps: per tile, wait for its accumulator stage, read it ``EPI_N``
            columns at a time (thread ``tidx`` holds tile row ``tidx``), store, then hand the
            stage back to the MMA warp."""
            thr_mma = tiled_mma.get_slice(0)
            coords = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, self.tile_n)))
            sub = ((cute.size(acc, mode=[0, 0]), EPI_N),)
            atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(EPI_N)), F32)
            copy = tcgen05.make_tmem_copy(atom, cute.zipped_divide(
                acc[None, None, None, 0], sub)[None, 0])
            thr_copy = copy.get_slice(tidx)
            t_coords = thr_copy.partition_D(cute.zipped_divide(coords, sub))
            # Registers of one sub-tile: EPI_N consecutive columns of row ``m``.
            frag = cute.make_rmem_tensor(t_coords[None, None, 0].shape, F32)
            m = t_coords[0][0]
            lane = cute.arch.lane_idx()
            acc_stage = Int32(0)
            acc_phase = Int32(0)
            t = first
            while t < total:
                e, row0, rows, nt, mt, shared = self.decode(t, m_off, table, num_experts)
                k_tiles = self.tile_k_tiles(t, m_off, num_experts)
                cute.arch.mbarrier_wait(acc_full + acc_stage, acc_phase)
                t_acc = thr_copy.partition_S(cute.zipped_divide(acc[None, None, None, acc_stage],
                                                                sub))
                self.store_tile((copy, t_acc, frag), m, e, row0, rows, nt, mt, k_tiles > 0,
                                outs)
                # Every load of the stage has completed (load_sub waits on each).
                if lane == 0:
                    cute.arch.mbarrier_arrive(acc_empty + acc_stage)
                acc_stage += 1
                if acc_stage == ACC_STAGES:
                    acc_stage = 0
                    acc_phase ^= 1
                t += step

        @cute.jit
        def load_sub(self, t2r: tuple, j: int, any_rows, vals: cute.Tensor):
            """fp32 accumulator columns ``j·EPI_N ..`` of this thread's row (zeros when the tile
            had no k-tiles: its accumulator stage was never written)."""
            copy, t_acc, frag = t2r
            if any_rows:
                cute.copy(copy, t_acc[None, None, j], frag)
                # tcgen05.ld is asynchronous: its registers are defined only after
                # tcgen05.wait::ld (which also lets the stage go back to the MMA warp).
                cute.arch.fence_view_async_tmem_load()
                for i in cutlass.range_constexpr(EPI_N):
                    vals[i] = frag[i]
            else:
                vals.fill(0.0)

        @cute.jit
        def store_tile(self, t2r: tuple, m: Int32, e: Int32, row0: Int32,
                       rows: Int32, nt: Int32, mt: Int32, any_rows, outs: tuple):
            """This thread's row ``m`` of the tile through the configured epilogue.

            ``tcgen05.ld`` is warp-collective, so every thread loads every sub-tile and only
            the stores are predicated on the row being inside the expert (varlen-M) or M."""
            c, act = outs[0], outs[1]
            vals = cute.make_rmem_tensor((EPI_N,), F32)
            if cutlass.const_expr(self.dswiglu):
                self.store_dswiglu(t2r, vals, m, row0, m < rows, nt, outs)
            elif cutlass.const_expr(self.swiglu is not None):
                self.store_swiglu(t2r, vals, row0 + m, m < rows, nt, c, act)
            else:
                inside = m < rows
                base = Int64(row0 + m) * self.dim_n
                if cutlass.const_expr(self.varlen_k):
                    inside = m < self.dim_m - mt * TILE_M
                    base = (Int64(e) * self.dim_m + mt * TILE_M + m) * self.dim_n
                for j in cutlass.range_constexpr(self.tile_n // EPI_N):
                    self.load_sub(t2r, j, any_rows, vals)
                    if inside:
                        self.store_row(vals, c, base, nt * self.tile_n + j * EPI_N, self.dim_n,
                                       1)

        @cute.jit
        def store_row(self, vals: cute.Tensor, dst: cute.Pointer, base: Int64, col0: Int32,
                      col_limit: int, every: cutlass.Constexpr):
            """bf16 of ``vals[0], vals[every], ...`` → ``dst[base + col0 ..]`` as 16-byte
            chunks, those at or past ``col_limit`` skipped (widths are multiples of 8, so a
            chunk is entirely inside or outside)."""
            chunk = cute.make_rmem_tensor((VEC,), F32)
            out = cute.make_rmem_tensor((VEC,), BF16)
            for q in cutlass.range_constexpr(EPI_N // every // VEC):
                if col0 + q * VEC < col_limit:
                    for i in cutlass.range_constexpr(VEC):
                        chunk[i] = vals[(q * VEC + i) * every]
                    out.store(chunk.load().to(BF16))
                    cute.autovec_copy(out, cute.make_tensor(
                        dst + cute.assume(base + col0 + q * VEC, divby=VEC),
                        cute.make_layout(VEC)))

        @cute.jit
        def store_swiglu(self, t2r: tuple, vals: cute.Tensor, row: Int32,
                         inside, nt: Int32, h_out: cute.Pointer, act: cute.Pointer):
            """Up-proj epilogue: H ``(P, 2n)`` and ``A = silu(gate) ⊙ up`` ``(P, n)`` from H's
            bf16 values. "interleaved": gate and up are adjacent columns of a sub-tile;
            "concat": the tile's first half holds gate columns ``nt·tile_n/2 ..`` and its
            second half the matching up columns, so sub-tile ``j`` pairs with ``j + subs/2``."""
            n = self.dim_n // 2
            subs = self.tile_n // EPI_N
            h_base = Int64(row) * self.dim_n
            a_base = Int64(row) * n
            a_vals = cute.make_rmem_tensor((EPI_N,), F32)
            g = cute.make_rmem_tensor((EPI_N,), BF16)
            if cutlass.const_expr(self.swiglu == "concat"):
                up = cute.make_rmem_tensor((EPI_N,), F32)
                u = cute.make_rmem_tensor((EPI_N,), BF16)
                for j in cutlass.range_constexpr(subs // 2):
                    col = nt * (self.tile_n // 2) + j * EPI_N
                    self.load_sub(t2r, j, True, vals)
                    self.load_sub(t2r, j + subs // 2, True, up)
                    if inside:
                        self.store_row(vals, h_out, h_base, col, n, 1)
                        self.store_row(up, h_out, h_base + n, col, n, 1)
                        g.store(vals.load().to(BF16))
                        u.store(up.load().to(BF16))
                        for i in cutlass.range_constexpr(EPI_N):
                            a_vals[i] = silu_mul(g[i].to(F32), u[i].to(F32))
                        self.store_row(a_vals, act, a_base, col, n, 1)
            else:
                for j in cutlass.range_constexpr(subs):
                    col = nt * self.tile_n + j * EPI_N
                    self.load_sub(t2r, j, True, vals)
                    if inside:
                        self.store_row(vals, h_out, h_base, col, self.dim_n, 1)
                        g.store(vals.load().to(BF16))
                        for i in cutlass.range_constexpr(EPI_N // 2):
                            a_vals[2 * i] = silu_mul(g[2 * i].to(F32), g[2 * i + 1].to(F32))
                        self.store_row(a_vals, act, a_base, col // 2, n, 2)

        @cute.jit
        def store_dswiglu(self, t2r: tuple, vals: cute.Tensor, m: Int32,
                          row0: Int32, inside, nt: Int32, outs: tuple):
            """dH epilogue on fp32 ``dA'`` (N = n): per 8 columns, read this row's gate and up
            values of H (16-byte loads), store dH's gate and up chunks and A', and add
            ``dA'·A`` to the row's ds partial, stored once per tile at ``ds[row, nt]``. dH may
            be H itself: each chunk of H is read before the same thread overwrites it."""
            dh, a_scaled, h, scores, ds = outs
            n = self.dim_n
            row = Int64(row0 + m)
            s = F32(0.0)
            if inside:
                s = cute.make_tensor(scores + row0, cute.make_layout(TILE_M))[m]
            g = cute.make_rmem_tensor((VEC,), BF16)
            u = cute.make_rmem_tensor((VEC,), BF16)
            d_gate = cute.make_rmem_tensor((VEC,), F32)
            d_up = cute.make_rmem_tensor((VEC,), F32)
            a_s = cute.make_rmem_tensor((VEC,), F32)
            out = cute.make_rmem_tensor((VEC,), BF16)
            partial = F32(0.0)
            for j in cutlass.range_constexpr(self.tile_n // EPI_N):
                self.load_sub(t2r, j, True, vals)
                for q in cutlass.range_constexpr(EPI_N // VEC):
                    col = nt * self.tile_n + j * EPI_N + q * VEC
                    if inside and col < n:
                        cute.autovec_copy(cute.make_tensor(
                            h + cute.assume(row * (2 * n) + col, divby=VEC),
                            cute.make_layout(VEC)), g)
                        cute.autovec_copy(cute.make_tensor(
                            h + cute.assume(row * (2 * n) + n + col, divby=VEC),
                            cute.make_layout(VEC)), u)
                        for i in cutlass.range_constexpr(VEC):
                            r = dswiglu_values(vals[q * VEC + i], g[i].to(F32), u[i].to(F32),
                                               s)
                            d_gate[i] = r[0]
                            d_up[i] = r[1]
                            a_s[i] = r[2]
                            partial = partial + vals[q * VEC + i] * r[3]
                        self.store_chunk(d_gate, out, dh, row * (2 * n) + col)
                        self.store_chunk(d_up, out, dh, row * (2 * n) + n + col)
                        self.store_chunk(a_s, out, a_scaled, row * n + col)
            # An attribute read inside a run-time `if` would be carried as `self`; read it here.
            n_tiles = self.n_tiles
            if inside:
                cute.make_tensor(ds + (row * n_tiles + nt), cute.make_layout(1))[0] = partial

        @cute.jit
        def store_chunk(self, frag: cute.Tensor, out: cute.Tensor, dst: cute.Pointer,
                        offset: Int64):
            """bf16 of the ``VEC`` fp32 values of ``frag`` → ``dst[offset ..]`` (16 bytes)."""
            out.store(frag.load().to(BF16))
            cute.autovec_copy(out, cute.make_tensor(dst + cute.assume(offset, divby=VEC),
                                                    cute.make_layout(VEC)))

    return Sm100GroupedGemm


def _compile(varlen_k: bool, tile_n: int, dim_m: int, dim_n: int, dim_k: int, gather_a: bool,
             gather_b: bool, b_n_major: bool = False, swiglu: str | None = None,
             dswiglu: bool = False, keep_ptx: bool = False):
    """Compile one static configuration for the architecture in ``CUTE_DSL_ARCH`` (or the
    current device) with placeholder arguments."""
    import cutlass

    kernel = _kernels()(varlen_k, tile_n, dim_m, dim_n, dim_k, gather_a, gather_b, b_n_major,
                        swiglu, dswiglu)
    addresses = [runtime.fake_address() for _ in range(10)]
    sizes = [cutlass.Int32(1) for _ in range(4)]
    return runtime.compile_launcher(kernel, *addresses, *sizes, keep_ptx=keep_ptx)


def _tile_n(dim_n: int) -> int:
    """UMMA N of a tile: 256 (the largest single-CTA UMMA, 2 x 256 TMEM columns) unless N is
    small and not a multiple of 256. Untuned: no sm_100 measurement exists yet."""
    return 256 if dim_n % 256 == 0 or dim_n >= 1024 else 128


def sm100_available(device=None) -> tuple[bool, str]:
    """Whether these kernels can run on ``device``: a CUDA device of compute capability 10.x
    (sm_100a: B200, GB200) with the CuTe DSL importable.

    Args:
        device: a CUDA device (``torch.device``, string or index); ``None``: the current one.

    Returns:
        ``(ok, reason)``; ``reason`` says why not, empty when ``ok``.
    """
    if not torch.cuda.is_available():
        return False, "no CUDA device is available (torch.cuda.is_available() is False)"
    if device is None:
        device = torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return False, f"tensors are on {device}, the sm_100 kernels need a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 10:
        return False, (f"{torch.cuda.get_device_name(device)} has compute capability "
                       f"{major}.{minor}; the tcgen05 kernels need sm_100a (10.x)")
    try:
        import cutlass.cute  # noqa: F401
    except ImportError as err:
        return False, f"the CuTe DSL is not importable ({err})"
    return True, ""


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
                 gather_idx: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """varlen-M grouped GEMM on sm_100a: ``out[r] = A[r] · b[e]ᵀ`` for every row ``r`` of expert
    ``e``; arguments, shapes, dtypes and errors exactly as
    :func:`sonic.kernels.grouped_gemm.grouped_gemm` (``a (P, K)`` or gathered ``(T, K)``,
    ``b (E, N, K)`` K-major or the N-major view of a contiguous ``(E, K, N)``, ``expert_offsets
    (E+1,)`` int32, ``gather_idx (P,)`` int32; returns ``(P, N)`` bf16). DESIGN §3;
    SonicMoE §4.1."""
    return _varlen_m(a, b, expert_offsets, gather_idx, out, None)[0]


def grouped_gemm_swiglu(x: torch.Tensor, w1: torch.Tensor, expert_offsets: torch.Tensor,
                        gather_idx: torch.Tensor,
                        gate_up: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Up-proj with the SwiGLU epilogue on sm_100a: ``(H (P, 2n), A (P, n))`` bf16; arguments
    and errors as :func:`sonic.kernels.grouped_gemm.grouped_gemm_swiglu`. SonicMoE §4.1.2."""
    if gate_up not in ("concat", "interleaved"):
        raise ValueError(f"gate_up must be 'concat' or 'interleaved', got {gate_up!r}")
    if gather_idx is None:
        raise ValueError("gather_idx is required: the SwiGLU epilogue serves the gathered "
                         "up-proj")
    n = w1.shape[1] // 2 if w1.ndim == 3 else 0
    if n <= 0 or n % (64 if gate_up == "concat" else VEC) or w1.shape[1] % 2:
        raise ValueError(f"w1 must have 2n rows per expert with n a multiple of "
                         f"{64 if gate_up == 'concat' else VEC}, got shape {tuple(w1.shape)}")
    return _varlen_m(x, w1, expert_offsets, gather_idx, None, gate_up)


def grouped_gemm_dswiglu(dout: torch.Tensor, w2: torch.Tensor, expert_offsets: torch.Tensor,
                         gather_idx: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor, *,
                         dh_out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's dH kernel on sm_100a: ``dA' = gather(dO)·W2`` with the dSwiGLU epilogue;
    returns ``(dH (P, 2n) bf16, A' (P, n) bf16, ds (P,) fp32)``; arguments (``dh_out`` may be
    ``h``) and errors as :func:`sonic.kernels.grouped_gemm.grouped_gemm_dswiglu`.
    SonicMoE §4.1.3, App. C."""
    runtime.check_tensor("w2", w2, dtypes=(torch.bfloat16,), ndim=3)
    runtime.check_tensor("gather_idx", gather_idx, dtypes=(torch.int32,), ndim=1,
                         device=w2.device)
    runtime.check_tensor("h", h, dtypes=(torch.bfloat16,), ndim=2, device=w2.device)
    runtime.check_tensor("row_scores", row_scores, dtypes=(torch.float32,), ndim=1,
                         device=w2.device)
    num_pairs, n = gather_idx.numel(), w2.shape[2]
    if tuple(h.shape) != (num_pairs, 2 * n):
        raise ValueError(f"h must have shape (P, 2n) = {(num_pairs, 2 * n)}, got "
                         f"{tuple(h.shape)}")
    if row_scores.numel() != num_pairs:
        raise ValueError(f"row_scores must have P = {num_pairs} entries, got "
                         f"{row_scores.numel()}")
    if dh_out is not None and dh_out.data_ptr() != h.data_ptr() and sm90._overlap(dh_out, h):
        raise ValueError("dh_out must be h itself or a buffer that does not overlap h")
    return _varlen_m(dout, w2.transpose(1, 2), expert_offsets, gather_idx, dh_out, None,
                     (h, row_scores))


def _varlen_m(a, b, expert_offsets, gather_idx, out, swiglu, dswiglu=None):
    """Validate, allocate and launch a varlen-M variant (see the sm_90 ``_varlen_m``)."""
    runtime.check_tensor("a", a, dtypes=(torch.bfloat16,), ndim=2)
    device = a.device
    b_n_major = b.ndim == 3 and not b.is_contiguous() and b.transpose(1, 2).is_contiguous()
    runtime.check_tensor("b", b.transpose(1, 2) if b_n_major else b, dtypes=(torch.bfloat16,),
                         ndim=3, device=device)
    num_experts = sm90._check_offsets(expert_offsets, device)
    if b.shape[0] != num_experts:
        raise ValueError(f"b must have E = {num_experts} experts (expert_offsets has E+1 "
                         f"entries), got shape {tuple(b.shape)}")
    dim_n, dim_k = b.shape[1], b.shape[2]
    if a.shape[1] != dim_k:
        raise ValueError(f"a must have K = {dim_k} columns (b is (E, N, K)), got shape "
                         f"{tuple(a.shape)}")
    sm90._check_width("K", dim_k)
    sm90._check_width("N", dim_n)
    gathered = gather_idx is not None
    if gathered:
        runtime.check_tensor("gather_idx", gather_idx, dtypes=(torch.int32,), ndim=1,
                             device=device)
    num_pairs = gather_idx.numel() if gathered else a.shape[0]
    out_name, out_cols = ("dh_out", 2 * dim_n) if dswiglu is not None else ("out", dim_n)
    if out is None:
        out = torch.empty(num_pairs, out_cols, dtype=torch.bfloat16, device=device)
    else:
        runtime.check_tensor(out_name, out, dtypes=(torch.bfloat16,), ndim=2, device=device)
        if tuple(out.shape) != (num_pairs, out_cols):
            raise ValueError(f"{out_name} must have shape ({num_pairs}, {out_cols}), got "
                             f"{tuple(out.shape)}")
    tile_n = _tile_n(dim_n)
    if swiglu == "concat" and (dim_n // 2) % (tile_n // 2):
        tile_n = 128    # a tile's gate half must not run past n
    n_tiles = (dim_n + tile_n - 1) // tile_n
    act = ds_parts = None
    if swiglu is not None:
        act = torch.empty(num_pairs, dim_n // 2, dtype=torch.bfloat16, device=device)
    if dswiglu is not None:
        act = torch.empty(num_pairs, dim_n, dtype=torch.bfloat16, device=device)
        ds_parts = torch.zeros(num_pairs, n_tiles, dtype=torch.float32, device=device)
    if num_pairs == 0 or a.shape[0] == 0:
        return (out, act) if dswiglu is None else (out.zero_(), act.zero_(), ds_parts.sum(1))
    key = ("grouped_gemm_sm100_varlen_m", tile_n, dim_n, dim_k, gathered, b_n_major, swiglu,
           dswiglu is not None)
    fn = runtime.compiled(key, lambda: _compile(False, tile_n, 0, dim_n, dim_k, gathered, False,
                                                b_n_major, swiglu, dswiglu is not None))
    work_items = ((num_pairs + TILE_M - 1) // TILE_M + num_experts) * n_tiles
    addr = runtime.address
    offsets_addr = addr(expert_offsets, 4)
    idx = addr(gather_idx, 4) if gathered else offsets_addr
    out_addr = addr(out, 16)
    h_addr, scores_addr, ds_addr = (
        (addr(dswiglu[0], 16), addr(dswiglu[1], 4), addr(ds_parts, 4)) if dswiglu is not None
        else (out_addr,) * 3)
    fn(addr(a, 16), addr(b, 16), out_addr, addr(act, 16) if act is not None else out_addr,
       h_addr, scores_addr, ds_addr, idx, idx, offsets_addr, a.shape[0], 0, num_experts,
       sm90._num_ctas(device, work_items))
    if dswiglu is not None:
        return out, act, ds_parts.sum(1)
    return out, act


def grouped_gemm_varlen_k(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
                          gather_idx_a: torch.Tensor | None = None,
                          gather_idx_b: torch.Tensor | None = None) -> torch.Tensor:
    """varlen-K grouped GEMM on sm_100a: ``C[e] = A_eᵀ · B_e`` ``(E, M, N)`` bf16 over the rows
    of each expert (zeros for an expert with no rows); arguments and errors as
    :func:`sonic.kernels.grouped_gemm.grouped_gemm_varlen_k`. DESIGN §3 (dW1, dW2)."""
    runtime.check_tensor("a", a, dtypes=(torch.bfloat16,), ndim=2)
    device = a.device
    runtime.check_tensor("b", b, dtypes=(torch.bfloat16,), ndim=2, device=device)
    num_experts = sm90._check_offsets(expert_offsets, device)
    dim_m, dim_n = a.shape[1], b.shape[1]
    sm90._check_width("M (columns of a)", dim_m)
    sm90._check_width("N (columns of b)", dim_n)
    rows = []
    for name, x, idx in (("a", a, gather_idx_a), ("b", b, gather_idx_b)):
        if idx is not None:
            runtime.check_tensor(f"gather_idx_{name}", idx, dtypes=(torch.int32,), ndim=1,
                                 device=device)
        rows.append(idx.numel() if idx is not None else x.shape[0])
    if rows[0] != rows[1]:
        raise ValueError(f"a and b must have the same number of rows P (after gathering), got "
                         f"{rows[0]} and {rows[1]}")
    out = torch.empty(num_experts, dim_m, dim_n, dtype=torch.bfloat16, device=device)
    if rows[0] == 0:
        return out.zero_()
    ga, gb = gather_idx_a is not None, gather_idx_b is not None
    tile_n = _tile_n(dim_n)
    key = ("grouped_gemm_sm100_varlen_k", tile_n, dim_m, dim_n, ga, gb)
    fn = runtime.compiled(key, lambda: _compile(True, tile_n, dim_m, dim_n, 0, ga, gb))
    work_items = (num_experts * ((dim_m + TILE_M - 1) // TILE_M)
                  * ((dim_n + tile_n - 1) // tile_n))
    addr = runtime.address
    offsets_addr = addr(expert_offsets, 4)
    out_addr = addr(out, 16)
    fn(addr(a, 16), addr(b, 16), out_addr, out_addr, out_addr, out_addr, out_addr,
       addr(gather_idx_a, 4) if ga else offsets_addr,
       addr(gather_idx_b, 4) if gb else offsets_addr, offsets_addr, a.shape[0], b.shape[0],
       num_experts, sm90._num_ctas(device, work_items))
    return out



# ---- compile check (CPU, CUTE_DSL_ARCH=sm_100a) ----------------------------------------------

SM100_MARKERS = ("tcgen05.mma", "tcgen05.alloc", "tcgen05.ld", "cp.async.bulk.tensor")


def _variant(name: str, varlen_k: bool, dim_m: int, dim_n: int, dim_k: int, gather_a: bool,
             gather_b: bool, b_n_major: bool = False, swiglu: str | None = None,
             dswiglu: bool = False) -> KernelVariant:
    tile_n = _tile_n(dim_n)
    if swiglu == "concat" and (dim_n // 2) % (tile_n // 2):
        tile_n = 128
    return KernelVariant(
        kernel="grouped_gemm_sm100", variant=name,
        compile_fake=lambda: _compile(varlen_k, tile_n, dim_m, dim_n, dim_k, gather_a,
                                      gather_b, b_n_major, swiglu, dswiglu, keep_ptx=True),
        ptx_markers=SM100_MARKERS)


# The six GEMMs of DESIGN §3 and both fused epilogues, at ANCHORS-like sizes. Not registered
# in sonic.kernels.registry (whose compile check targets sm_90a); see :func:`compile_check`.
SM100_VARIANTS = (
    _variant("varlen_m_n512_k1536_gather", False, 0, 512, 1536, True, False),
    _variant("varlen_m_n1536_k256_contig", False, 0, 1536, 256, False, False),
    _variant("varlen_m_n1536_k512_contig_bn", False, 0, 1536, 512, False, False, True),
    _variant("varlen_m_n512_k1536_gather_swiglu_concat", False, 0, 512, 1536, True, False,
             swiglu="concat"),
    _variant("varlen_m_n2048_k1536_gather_swiglu_interleaved", False, 0, 2048, 1536, True,
             False, swiglu="interleaved"),
    _variant("varlen_m_n1024_k4096_gather_bn_dswiglu", False, 0, 1024, 4096, True, False, True,
             dswiglu=True),
    _variant("varlen_m_n192_k4096_gather_bn_dswiglu", False, 0, 192, 4096, True, False, True,
             dswiglu=True),
    _variant("varlen_k_m1536_n256_gather_a", True, 1536, 256, 0, True, False),
    _variant("varlen_k_m512_n1536_gather_b", True, 512, 1536, 0, False, True),
    _variant("varlen_k_m256_n128_contig", True, 256, 128, 0, False, False),
)


def compile_check(arch: str = "sm_100a", out=None) -> int:
    """Compile every :data:`SM100_VARIANTS` entry for ``arch`` without a GPU, print kernel,
    variant, seconds and PTX marker counts, and return the number of failures (a compile error
    or a missing marker). Must run in a process that has not imported cutlass for another
    architecture (:func:`sonic.kernels.runtime.set_compile_arch`)::

        python -m sonic.kernels.grouped_gemm_sm100
    """
    import sys
    import time
    import traceback

    out = out or sys.stdout
    runtime.set_compile_arch(arch)
    failures = 0
    for v in SM100_VARIANTS:
        start = time.perf_counter()
        try:
            ptx = v.compile_fake().artifacts.PTX or ""
        except Exception:  # a failing variant must not hide the others
            traceback.print_exc()
            failures += 1
            print(f"{v.kernel:<18} {v.variant:<48} COMPILE FAILED", file=out)
            continue
        counts = {m: ptx.count(m) for m in v.ptx_markers}
        missing = [m for m, c in counts.items() if c == 0]
        failures += bool(missing)
        print(f"{v.kernel:<18} {v.variant:<48} {time.perf_counter() - start:>6.2f}  "
              + " ".join(f"{m}={c}" for m, c in counts.items())
              + ("  ok" if not missing else "  MISSING " + ", ".join(missing)), file=out)
    print(f"{len(SM100_VARIANTS)} variant(s), {failures} failure(s), arch {arch}", file=out)
    return failures


# ---- on-device self-check: the gate before a dispatcher may use a variant -------------------

# Ragged counts with an empty expert, a 1-row expert and one above two m-tiles.
_CHECK_COUNTS = (37, 0, 300, 1, 130)
_CHECK_TOKENS, _CHECK_D, _CHECK_N = 250, 192, 128
_CHECK_TOLERANCE = 2e-2
_SELF_CHECKS: dict = {}
_SELF_CHECK_LOCK = threading.Lock()


def _check_problem(device):
    """Fresh random inputs of the self-check (fixed seed, never zeros)."""
    gen = torch.Generator().manual_seed(17)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) + 0.1).to(torch.bfloat16).to(device)

    counts = torch.tensor(_CHECK_COUNTS)
    offsets = torch.zeros(len(_CHECK_COUNTS) + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    num_pairs = int(offsets[-1])
    gidx = torch.randint(0, _CHECK_TOKENS, (num_pairs,), generator=gen, dtype=torch.int32)
    return rand, offsets.to(device), gidx.to(device), offsets.tolist()


def _ref_m(a_rows, w, off):
    """Per-expert fp32 ``a_rows[e rows] · w[e]ᵀ`` (w ``(E, N, K)``)."""
    return torch.cat([a_rows[off[e]:off[e + 1]].float() @ w[e].float().t()
                      for e in range(len(off) - 1)])


def _ref_k(a_rows, b_rows, off):
    return torch.stack([a_rows[off[e]:off[e + 1]].float().t() @ b_rows[off[e]:off[e + 1]].float()
                        for e in range(len(off) - 1)])


def _silu_mul_ref(g, u):
    g, u = g.float(), u.float()
    return (g * torch.sigmoid(g) * u)


def _check_varlen_m(device, gather: bool, b_n_major: bool):
    rand, offsets, gidx, off = _check_problem(device)
    x = rand(_CHECK_TOKENS if gather else gidx.numel(), _CHECK_D)
    w = (rand(len(off) - 1, _CHECK_D, 2 * _CHECK_N).transpose(1, 2) if b_n_major
         else rand(len(off) - 1, 2 * _CHECK_N, _CHECK_D))
    out = torch.full((gidx.numel(), 2 * _CHECK_N), float("nan"), dtype=torch.bfloat16,
                     device=device)
    got = grouped_gemm(x, w, offsets, gather_idx=gidx if gather else None, out=out)
    return [("out", got, _ref_m(x[gidx.long()] if gather else x, w, off))]


def _check_swiglu(device, gate_up: str):
    rand, offsets, gidx, off = _check_problem(device)
    x, w1 = rand(_CHECK_TOKENS, _CHECK_D), rand(len(off) - 1, 2 * _CHECK_N, _CHECK_D)
    h, act = grouped_gemm_swiglu(x, w1, offsets, gidx, gate_up)
    h_ref = _ref_m(x[gidx.long()], w1, off)
    hb = h_ref.to(torch.bfloat16)
    gate, up = ((hb[:, :_CHECK_N], hb[:, _CHECK_N:]) if gate_up == "concat"
                else (hb[:, 0::2], hb[:, 1::2]))
    return [("H", h, h_ref), ("A", act, _silu_mul_ref(gate, up))]


def _check_dswiglu(device):
    rand, offsets, gidx, off = _check_problem(device)
    n = _CHECK_N
    dout, w2 = rand(_CHECK_TOKENS, _CHECK_D), rand(len(off) - 1, _CHECK_D, n)
    h = rand(gidx.numel(), 2 * n)
    scores = torch.rand(gidx.numel(), device=device) + 0.1
    dh, a_scaled, ds = grouped_gemm_dswiglu(dout, w2, offsets, gidx, h, scores)
    dap = _ref_m(dout[gidx.long()], w2.transpose(1, 2), off)
    g, u = h[:, :n].float(), h[:, n:].float()
    sig = torch.sigmoid(g)
    s = scores[:, None]
    act = g * sig * u
    dh_ref = torch.cat([s * dap * u * sig * (1 + g * (1 - sig)), s * dap * g * sig], 1)
    return [("dH", dh, dh_ref), ("A'", a_scaled, act * s), ("ds", ds, (dap * act).sum(1))]


def _check_varlen_k(device, gather_a: bool, gather_b: bool):
    rand, offsets, gidx, off = _check_problem(device)
    rows = _CHECK_TOKENS
    a = rand(rows if gather_a else gidx.numel(), 2 * _CHECK_N)
    b = rand(rows if gather_b else gidx.numel(), _CHECK_D)
    got = grouped_gemm_varlen_k(a, b, offsets, gather_idx_a=gidx if gather_a else None,
                                gather_idx_b=gidx if gather_b else None)
    return [("C", got, _ref_k(a[gidx.long()] if gather_a else a,
                              b[gidx.long()] if gather_b else b, off))]


# Variant name -> check: the six GEMMs of DESIGN §3 and both fused epilogues.
SELF_CHECK_VARIANTS = {
    "up_proj": lambda dev: _check_varlen_m(dev, True, False),
    "up_proj_swiglu_concat": lambda dev: _check_swiglu(dev, "concat"),
    "up_proj_swiglu_interleaved": lambda dev: _check_swiglu(dev, "interleaved"),
    "down_proj": lambda dev: _check_varlen_m(dev, False, False),
    "dx": lambda dev: _check_varlen_m(dev, False, True),
    "dh_dswiglu": _check_dswiglu,
    "dw1": lambda dev: _check_varlen_k(dev, False, True),
    "dw2": lambda dev: _check_varlen_k(dev, True, False),
}


def self_check(variant: str, device=None) -> tuple[bool, str]:
    """Run ``variant`` once on a small ragged problem (an empty expert, a 1-row expert, an
    expert over two m-tiles; unwritten outputs read as NaN) against a PyTorch fp32 reference,
    on ``device``; the result is cached per (variant, device) for the process.

    A dispatcher must call this before using a variant on an sm_100 device (no sm_100 GPU
    has run these kernels yet) and fall back, with one warning carrying the message, when it
    fails.

    Args:
        variant: a key of :data:`SELF_CHECK_VARIANTS`.
        device: CUDA device; ``None``: the current one.

    Returns:
        ``(ok, message)``: the worst relative error per output, or why it failed (the device
        is not sm_100, a compile or launch error, a mismatch).

    Raises:
        KeyError: ``variant`` is unknown.
    """
    if variant not in SELF_CHECK_VARIANTS:
        raise KeyError(f"unknown sm100 variant {variant!r}; known: "
                       f"{', '.join(SELF_CHECK_VARIANTS)}")
    ok, reason = sm100_available(device)
    if not ok:
        return False, reason
    if device is None:
        device = torch.cuda.current_device()
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (variant, dev.index)
    with _SELF_CHECK_LOCK:
        if key not in _SELF_CHECKS:
            _SELF_CHECKS[key] = _run_check(variant, dev)
        return _SELF_CHECKS[key]


def _run_check(variant: str, device) -> tuple[bool, str]:
    try:
        with torch.cuda.device(device):
            results = SELF_CHECK_VARIANTS[variant](device)
            torch.cuda.synchronize(device)
    except Exception as err:  # a failing kernel must become a fallback, not a crash
        return False, f"sm100 {variant}: {type(err).__name__}: {err}"
    report = []
    for name, got, ref in results:
        err = ((got.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        report.append(f"{name} rel err {err:.2e}")
        if not err < _CHECK_TOLERANCE:  # NaN (an unwritten element) fails too
            return False, f"sm100 {variant}: {name} mismatch: {', '.join(report)}"
    return True, f"sm100 {variant}: " + ", ".join(report)


if __name__ == "__main__":
    raise SystemExit(1 if compile_check() else 0)
