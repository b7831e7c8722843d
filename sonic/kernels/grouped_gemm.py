"""Grouped GEMMs over expert-sorted rows on Hopper (sm_90a): varlen-M and varlen-K.

DESIGN §3–4; SonicMoE (arXiv 2512.14080) §4.1: every expert's GEMM runs in ONE persistent,
warp-specialised launch whose tile scheduler reads the per-expert row ranges ``expert_offsets``
on the device, so no host synchronisation and no per-expert launch is needed.

* **varlen-M** (forward up/down-proj, backward dX̃ and dH):
  ``C[rows of e] = A[rows of e] · B[e]ᵀ``
  with ``A (P, K)`` — or, gathered, row ``r`` of ``A`` is ``X[gather_idx[r]]`` — ``B (E, N, K)``
  (the ``nn.Linear`` layout, K-major, or an N-major view of a contiguous ``(E, K, N)``) and
  ``C (P, N)``.
* **varlen-K** (weight gradients dW1, dW2): ``C[e] = A_eᵀ · B_e``, the reduction running over
  expert ``e``'s rows of ``A (P, M)`` and ``B (P, N)`` (either optionally gathered by row
  index), ``C (E, M, N)``.

Kernel structure (one class, the mode a static choice): a producer warpgroup fills a ring of
shared-memory stages; two consumer warpgroups run WGMMA with fp32 accumulators and store bf16,
either cooperatively on one ``128 × tile_n`` tile (64 rows each) or ping-pong, each on its own
``128 × 128`` tile, one warpgroup's epilogue overlapping the other's mainloop (SonicMoE §4.2).
Stages are handed over through two mbarriers each (full: data landed; empty: the consumer
warps are done reading it).

* Every operand arrives by TMA, so a stage is complete when its one expect-tx arrival and all
  its bytes have landed. varlen-M: B and contiguous A as tiles (rows past the expert's end
  belong to the next expert or are TMA's zero fill; they only reach masked output rows);
  gathered A as one ``1 x TILE_K`` box per tile row, written at that row's 128-byte line of the
  stage — the hardware applies the 128-byte swizzle by shared-memory address, so the rows land
  exactly where WGMMA expects them. This replaced 16-byte ``cp.async`` gathers, which were
  capped near 10 GB/s per SM by the load/store path (ncu: both pipeline ends waiting, no
  memory-bound sign), 1.5–1.9× slower at the ANCHORS shapes.
* varlen-K operands are MN-major: whole k-tiles of contiguous rows as ``64 x TILE_K`` boxes;
  gathered rows and an expert's last partial k-tile as ``64 x 1`` row boxes, a row past the
  expert's end pointing out of bounds so TMA writes zeros and no stale value (possibly NaN)
  enters the reduction. A gathered operand's row indices are read one k-tile ahead. With only
  B gathered (dW1), the kernel computes ``C[e]ᵀ`` with the gathered rows on the 128-wide M side
  (half the row copies) and stores it transposed.
* Up-proj epilogue (:func:`grouped_gemm_swiglu`): besides H, the epilogue stores
  ``A = SwiGLU(H)`` from H's bf16 values; with the "concat" gate/up layout a tile's B is two
  half boxes (gate rows and the matching up rows), so both halves of an A column are in the
  same thread's accumulator.
* 2-CTA clusters (see :func:`_plan`): the CTAs of a cluster take consecutive m-tiles of one
  n-tile and, when both are the same expert's, each loads half of the B tile and multicasts
  it, a third less L2→SM traffic per tile; consumers release a stage on the empty barrier of
  both CTAs, since both producers write into it.
* dH epilogue (:func:`grouped_gemm_dswiglu`): dA' stays in registers; the epilogue reads H and
  the scores and stores dH, A' and per-n-tile ds partials. H arrives by TMA through the operand
  ring — after a tile's k-tiles the producer queues one stage per 64-column slab (the gate
  slab where A goes, the up slab where B goes) — so the loads overlap the tile's last k-tiles
  and the epilogue reads H pairs from shared memory (4-byte loads, swizzle-aware). Measured
  faster than the dA' GEMM followed by the standalone epilogue kernel (RESULTS.md). The
  epilogue is not hidden behind a mainloop: ping-pong would need ``128 x 128`` tiles, which
  carry 2/3 of the FLOP per loaded byte of the clustered ``128 x 256`` ones on an L2-bound
  mainloop (see :func:`_plan`).
* The tile scheduler is static round-robin over a linear tile index. For varlen-M it maps an
  index to (expert, m-tile, n-tile) with a per-CTA table of each expert's first m-tile built in
  shared memory from ``expert_offsets`` (a warp scan) and a binary search: experts with no rows
  own no tile. Ragged last tiles are masked in the epilogue (predicated 16-byte stores from a
  shared-memory staging buffer), so a tile never writes rows of the next expert.
"""

import functools

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register
from sonic.kernels.swiglu import LOG2_E

TILE_M = 128
TILE_K = 64
# Elements per cp.async copy: 16 bytes of bf16.
VEC = 8
# Largest E: the varlen-M tile table lives in shared memory (4 bytes per expert).
MAX_EXPERTS = 1024
PRODUCER_THREADS = 128
CONSUMER_WARPGROUPS = 2
# CTAs per cluster of the multicast varlen-M kernels.
CLUSTER = 2
THREADS = PRODUCER_THREADS + 128 * CONSUMER_WARPGROUPS
# Epilogue: a warpgroup stages SLAB columns of its rows in shared memory, then stores them as
# 16-byte row chunks; PAD elements per staged row keep the accumulator writes free of bank
# conflicts.
SLAB = 64
PAD = 8
# Shared memory per CTA on sm_90 (227 KiB) less room for barriers and the tile table.
_SMEM_BYTES = 227 * 1024 - (MAX_EXPERTS + 1) * 4 - 1024
_MAX_STAGES = 8
# dH epilogue: bytes of one ring stage of H (a TILE_M x SLAB gate slab and its up slab).
H_STAGE_BYTES = 2 * TILE_M * SLAB * 2


def _rows_per_warpgroup(pingpong: bool) -> int:
    return TILE_M if pingpong else TILE_M // CONSUMER_WARPGROUPS


def _stages(tile_n: int, pingpong: bool) -> int:
    stage_bytes = (TILE_M + tile_n) * TILE_K * 2
    epilogue_bytes = CONSUMER_WARPGROUPS * _rows_per_warpgroup(pingpong) * (SLAB + PAD) * 2
    return min(_MAX_STAGES, (_SMEM_BYTES - epilogue_bytes) // stage_bytes)


@functools.cache
def _kernels():
    """Build the CuTe-DSL kernel class (imports cutlass, so only on first use)."""
    import cutlass
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import cute
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    Int32, Int64 = cutlass.Int32, cutlass.Int64
    BF16, F32 = cutlass.BFloat16, cutlass.Float32
    ROW, COL = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR

    def _mn_major_tma(ptr, rows, width: int, smem, multicast: bool = False):
        """TMA atoms for an MN-major varlen-K operand ``(rows, width)``: ``64 x TILE_K`` boxes
        and ``64 x 1`` row boxes (``multicast``: issued with a cluster mask)."""
        m_x = cute.make_tensor(ptr, cute.make_layout((width, rows), stride=(1, width)))
        op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if multicast
              else cpasync.CopyBulkTensorTileG2SOp())
        return tuple(cpasync.make_tiled_tma_atom(
            op, m_x, cute.make_composed_layout(
                smem.inner, 0, cute.make_layout(box, stride=(1, 64))), box)
            for box in ((64, TILE_K), (64, 1)))

    class GroupedGemmKernel:
        """One static configuration of the grouped GEMM.

        varlen-M: ``dim_k`` (K) and ``dim_n`` (N) static, ``gather_a`` selects cp.async rows.
        varlen-K: ``dim_m`` (M) and ``dim_n`` (N) static, ``gather_a``/``gather_b`` select
        gathered rows of either operand.
        """

        def __init__(self, varlen_k: bool, tile_n: int, dim_m: int, dim_n: int, dim_k: int,
                     gather_a: bool, gather_b: bool, pingpong: bool, b_n_major: bool = False,
                     transpose_c: bool = False, swiglu: str | None = None, cluster: int = 1,
                     dswiglu: bool = False):
            if pingpong and tile_n != 128:
                raise ValueError("the ping-pong schedule holds a 128 x 128 tile per warpgroup")
            if cluster not in (1, CLUSTER) or (cluster > 1 and pingpong):
                raise ValueError("a 2-CTA cluster serves the cooperative kernels")
            if varlen_k and cluster > 1 and (dim_m + TILE_M - 1) // TILE_M % cluster:
                raise ValueError("varlen-K on a cluster pairs the m-tiles of M")
            # On a 2-CTA cluster the two CTAs take consecutive m-tiles of one n-tile; when both
            # belong to the same expert (varlen-K: always) each loads half of the shared B tile
            # and multicasts it to both, cutting the L2→SM traffic per tile by a third (128 x 256:
            # A 128 + B 128 rows per k-tile instead of 128 + 256). A stage of either CTA is then
            # written by both producers, so it is free only when the consumers of both CTAs
            # have released it: every consumer warp arrives on the empty barrier of each CTA.
            self.cluster = cluster
            self.varlen_k = varlen_k
            self.tile_n = tile_n
            self.pingpong = pingpong
            # Cooperative: both warpgroups share a tile (64 rows each) and every stage.
            # Ping-pong: each warpgroup owns every other tile, so a stage has one reader.
            self.stage_readers = (4 if pingpong else 4 * CONSUMER_WARPGROUPS) * cluster
            self.dim_m, self.dim_n, self.dim_k = dim_m, dim_n, dim_k
            self.gather_a, self.gather_b = gather_a, gather_b
            self.stages = _stages(tile_n, pingpong)
            self.rows_wg = _rows_per_warpgroup(pingpong)
            self.tile_mnk = (TILE_M, tile_n, TILE_K)
            self.n_tiles = (dim_n + tile_n - 1) // tile_n
            self.m_tiles = (dim_m + TILE_M - 1) // TILE_M
            self.k_tiles = (dim_k + TILE_K - 1) // TILE_K
            # Every operand arrives by TMA, so a stage is complete when its one expect-tx arrival
            # and all its bytes have landed (out-of-bounds boxes are zero-filled and counted).
            self.tma_bytes = (tile_n + TILE_M) * TILE_K * 2
            # Producers that spread row copies over four warps keep row indices in registers.
            self.row_copies = varlen_k or gather_a
            self.producer_regs = 56 if self.row_copies else 40
            self.consumer_regs = 224 if self.row_copies else 232
            # Operand majorness: varlen-M reads K-major rows, varlen-K MN-major rows.
            self.a_layout = COL if varlen_k else ROW
            # varlen-M B is K-major ``(E, N, K)`` or, with ``b_n_major``, N-major (a contiguous
            # ``(E, K, N)``: the backward's W2 and W1 used without a transposed copy).
            self.b_n_major = b_n_major
            # varlen-K: write C[e]ᵀ, ``(E, N, M)`` — a gathered right operand is passed as the
            # left one (its rows on the 128-wide M side need half the row copies), C transposed.
            self.transpose_c = transpose_c
            if transpose_c and (not varlen_k or pingpong):
                raise ValueError("a transposed C serves the cooperative varlen-K kernel")
            # Up-proj epilogue (SonicMoE §4.1.2): besides H = C, store A = SwiGLU(H) ``(P, N/2)``.
            # "concat": a tile's B is two half boxes, gate rows ``nt·tile_n/2 ..`` and the
            # matching up rows ``N/2 + nt·tile_n/2 ..``, so gate and up of one A column sit in
            # the same thread's accumulator; "interleaved": they are adjacent columns.
            if swiglu is not None and (varlen_k or not gather_a or b_n_major or pingpong):
                raise ValueError("the SwiGLU epilogue serves the gathered up-proj (cooperative)")
            self.swiglu = swiglu
            # dH epilogue (SonicMoE §4.1.3, App. C) on dA' = gather(dO)·W2: from the fp32 dA'
            # tile, the saved H ("concat" layout) and the row scores, store dH ``(P, 2n)``,
            # A' = s·A ``(P, n)`` and per n-tile partial sums of ds = ⟨dA', A⟩ ``(P, n_tiles)``
            # (fp32; summed by the caller in a fixed order). The tile's H arrives by TMA through
            # the operand ring: after a tile's k-tiles the producer queues one stage per SLAB of
            # columns (gate slab where A goes, up slab at the start of B's space), so the loads
            # overlap the tile's last k-tiles and the epilogue reads H from shared memory.
            if dswiglu and (varlen_k or not gather_a or not b_n_major or pingpong
                            or tile_n < TILE_M):
                raise ValueError("the dSwiGLU epilogue serves the gathered dA' GEMM "
                                 "(cooperative, tile_n >= 128)")
            self.dswiglu = dswiglu
            self.b_rows_per_copy = tile_n // 2 if swiglu == "concat" else tile_n
            self.b_layout = COL if varlen_k or b_n_major else ROW

        @cute.jit
        def __call__(self, a_addr: Int64, b_addr: Int64, c_addr: Int64, act_addr: Int64,
                     h_addr: Int64, scores_addr: Int64, ds_addr: Int64,
                     gidx_a_addr: Int64, gidx_b_addr: Int64, offsets_addr: Int64, rows_a: Int32,
                     rows_b: Int32, num_experts: Int32, num_ctas: Int32,
                     stream: cuda.CUstream):
            gmem = runtime.gmem_ptr
            a, b, c = gmem(BF16, a_addr, 16), gmem(BF16, b_addr, 16), gmem(BF16, c_addr, 16)
            act = gmem(BF16, act_addr, 16)
            h, scores, ds = gmem(BF16, h_addr, 16), gmem(F32, scores_addr, 4), gmem(F32, ds_addr, 4)
            gidx_a, gidx_b = gmem(Int32, gidx_a_addr, 4), gmem(Int32, gidx_b_addr, 4)
            offsets = gmem(Int32, offsets_addr, 4)
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                BF16, BF16, self.a_layout.sm90_mma_major_mode(),
                self.b_layout.sm90_mma_major_mode(), F32,
                (1 if self.pingpong else CONSUMER_WARPGROUPS, 1, 1),
                tiler_mn=(64, self.tile_n))
            a_smem = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_mnk, BF16, self.stages)
            b_smem = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_mnk, BF16, self.stages)

            # varlen-M: B by tiles, A by tiles or (gathered) one row per box. varlen-K: both
            # operands MN-major, by 64 x TILE_K boxes (whole k-tiles of contiguous rows) or by
            # 64 x 1 row boxes (gathered rows, and an expert's last partial k-tile, whose rows
            # past the expert's end take an out-of-bounds row and so arrive as zeros).
            tma = {"a_row": (None, None), "b_row": (None, None), "b_mc": (None, None),
                   "b_mc_row": (None, None), "h": (None, None)}
            if cutlass.const_expr(self.varlen_k):
                tma["a"], tma["a_row"] = _mn_major_tma(a, rows_a, self.dim_m, a_smem)
                tma["b"], tma["b_row"] = _mn_major_tma(b, rows_b, self.dim_n, b_smem)
                if cutlass.const_expr(self.cluster > 1):
                    tma["b_mc"], tma["b_mc_row"] = _mn_major_tma(b, rows_b, self.dim_n, b_smem,
                                                                 multicast=True)
            else:
                m_a = cute.make_tensor(a, cute.make_layout((rows_a, self.dim_k),
                                                           stride=(self.dim_k, 1)))
                # Gathered: a box of one row, written at the row's 128-byte line of the stage
                # (the 128-byte swizzle of a TMA write follows the shared-memory address).
                a_box = ((1, TILE_K) if self.gather_a else (TILE_M, TILE_K))
                a_box_smem = (cute.make_composed_layout(
                    a_smem.inner, 0, cute.make_layout(a_box, stride=(TILE_K, 1)))
                    if self.gather_a else cute.slice_(a_smem, (None, None, 0)))
                tma["a"] = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileG2SOp(), m_a, a_box_smem, a_box)
                b_stride = ((1, self.dim_n) if self.b_n_major else (self.dim_k, 1))
                m_b = cute.make_tensor(b, cute.make_layout(
                    (self.dim_n, self.dim_k, num_experts),
                    stride=(*b_stride, self.dim_n * self.dim_k)))
                b_box = (self.b_rows_per_copy, TILE_K)
                b_box_smem = (cute.make_composed_layout(
                    b_smem.inner, 0, cute.make_layout(b_box, stride=(TILE_K, 1)))
                    if self.swiglu == "concat" else cute.slice_(b_smem, (None, None, 0)))
                tma["b"] = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileG2SOp(), m_b, b_box_smem, b_box)
                if cutlass.const_expr(self.cluster > 1):
                    # A shared B tile: each CTA multicasts its half (the "concat" SwiGLU tile
                    # is two half boxes already, so each CTA multicasts one of them).
                    tma["b_mc"] = cpasync.make_tiled_tma_atom(
                        cpasync.CopyBulkTensorTileG2SMulticastOp(), m_b, b_box_smem, b_box,
                        num_multicast=1 if self.swiglu == "concat" else self.cluster)
                if cutlass.const_expr(self.dswiglu):
                    # H ``(P, 2n)``, P passed as ``rows_b``: TILE_M x SLAB boxes, 128-byte
                    # swizzled like A (SLAB == TILE_K) so the epilogue's reads of a thread
                    # quad's column pairs over 8 rows hit distinct banks.
                    m_h = cute.make_tensor(h, cute.make_layout((rows_b, 2 * self.dim_n),
                                                               stride=(2 * self.dim_n, 1)))
                    tma["h"] = cpasync.make_tiled_tma_atom(
                        cpasync.CopyBulkTensorTileG2SOp(), m_h, cute.make_composed_layout(
                            a_smem.inner, 0, cute.make_layout((TILE_M, SLAB), stride=(SLAB, 1))),
                        (TILE_M, SLAB))

            @cute.struct
            class SharedStorage:
                full: cute.struct.MemRange[Int64, self.stages]
                empty: cute.struct.MemRange[Int64, self.stages]
                tile_start: cute.struct.MemRange[Int32, MAX_EXPERTS + 1]
                sA: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(a_smem)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(b_smem)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[
                    BF16, CONSUMER_WARPGROUPS * self.rows_wg * (SLAB + PAD)], 128]

            self.shared_storage = SharedStorage
            self.kernel(tiled_mma, *tma["a"], *tma["b"], *tma["a_row"], *tma["b_row"],
                        *tma["b_mc"], *tma["b_mc_row"], *tma["h"], a_smem, b_smem, c, act,
                        scores, ds,
                        gidx_a, gidx_b, offsets, rows_a,
                        rows_b, num_experts).launch(
                grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], cluster=[self.cluster, 1, 1],
                min_blocks_per_mp=1, stream=stream)

        @cute.kernel
        def kernel(self, tiled_mma: cute.TiledMma, tma_atom_a, tma_a, tma_atom_b, tma_b,
                   tma_atom_a_row, tma_a_row, tma_atom_b_row, tma_b_row, tma_atom_b_mc, tma_b_mc,
                   tma_atom_b_mc_row, tma_b_mc_row, tma_atom_h, tma_h,
                   a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, c: cute.Pointer,
                   act: cute.Pointer, scores: cute.Pointer, ds: cute.Pointer, gidx_a: cute.Pointer,
                   gidx_b: cute.Pointer, offsets: cute.Pointer,
                   rows_a: Int32, rows_b: Int32, num_experts: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            smem = SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            full = storage.full.data_ptr()
            empty = storage.empty.data_ptr()
            table = storage.tile_start.get_tensor(cute.make_layout(MAX_EXPERTS + 1))
            s_a = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            # Raw stage memory for the H slabs of the dH epilogue.
            h_raw = (storage.sA.data_ptr(), storage.sB.data_ptr(), a_smem.inner)
            s_b = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            m_off = cute.make_tensor(offsets, cute.make_layout(num_experts + 1))

            if warp == 0:
                cpasync.prefetch_descriptor(tma_atom_a)
                cpasync.prefetch_descriptor(tma_atom_b)
                if cutlass.const_expr(self.varlen_k):
                    cpasync.prefetch_descriptor(tma_atom_a_row)
                    cpasync.prefetch_descriptor(tma_atom_b_row)
                if cutlass.const_expr(self.dswiglu):
                    cpasync.prefetch_descriptor(tma_atom_h)
                with cute.arch.elect_one():
                    for s in cutlass.range_constexpr(self.stages):
                        cute.arch.mbarrier_init(full + s, 1)
                        cute.arch.mbarrier_init(empty + s, self.stage_readers)
                cute.arch.mbarrier_init_fence()
                if cutlass.const_expr(not self.varlen_k):
                    self.build_tile_table(m_off, table, num_experts)
            self.sync_cluster()

            # Work items: tiles, or on a cluster pairs of m-tiles (one per CTA) of an n-tile.
            first, step = bidx, grid
            if cutlass.const_expr(self.cluster > 1):
                first, step = bidx // self.cluster, grid // self.cluster
            if cutlass.const_expr(self.varlen_k):
                total = num_experts * (self.m_tiles // self.cluster * self.n_tiles)
            else:
                total = (table[num_experts] + self.cluster - 1) // self.cluster * self.n_tiles

            if tidx < PRODUCER_THREADS:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if cutlass.const_expr(self.varlen_k):
                    self.produce_varlen_k(
                        warp, first, step, total, (tma_atom_a, tma_a, tma_atom_a_row, tma_a_row),
                        (tma_atom_b, tma_b, tma_atom_b_row, tma_b_row) if self.cluster == 1 else
                        (tma_atom_b_mc, tma_b_mc, tma_atom_b_mc_row, tma_b_mc_row), a_smem, b_smem,
                        storage.sA.data_ptr(), storage.sB.data_ptr(), gidx_a, gidx_b, rows_a,
                        rows_b, m_off, table, num_experts, full, empty)
                elif cutlass.const_expr(self.gather_a):
                    self.produce_gather_m(warp, first, step, total, tma_atom_a, tma_a,
                                          (tma_atom_b, tma_b, tma_atom_b_mc, tma_b_mc), a_smem,
                                          b_smem, storage.sA.data_ptr(), storage.sB.data_ptr(),
                                          s_b, gidx_a, m_off, table, num_experts, full, empty,
                                          (tma_atom_h, tma_h), h_raw)
                else:
                    if warp == 0:
                        self.produce_tma(first, step, total, tma_atom_a, tma_a,
                                         (tma_atom_b, tma_b, tma_atom_b_mc, tma_b_mc), s_a, s_b,
                                         m_off, table, num_experts, full, empty)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume(tidx - PRODUCER_THREADS, first, step, total, tiled_mma, s_a, s_b,
                             storage.sC.data_ptr(), (c, act, scores, ds), m_off, table,
                             num_experts, full, empty, h_raw)
            # On a cluster no CTA may exit while the other can still arrive on its barriers.
            if cutlass.const_expr(self.cluster > 1):
                self.sync_cluster()

        @cute.jit
        def sync_cluster(self):
            """Barrier over the CTA, or over the cluster (barrier init and tile table visible
            to the peer before its first multicast or remote arrive)."""
            if cutlass.const_expr(self.cluster > 1):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            else:
                cute.arch.sync_threads()

        @cute.jit
        def release(self, empty_stage: cute.Pointer, lane: Int32):
            """A consumer warp is done reading a stage: arrive on its empty barrier in every CTA
            of the cluster (each CTA's producers write into the stage of both)."""
            if cutlass.const_expr(self.cluster > 1):
                if lane < self.cluster:
                    cute.arch.mbarrier_arrive(empty_stage, lane)
            else:
                if lane == 0:
                    cute.arch.mbarrier_arrive(empty_stage)

        @cute.jit
        def build_tile_table(self, m_off: cute.Tensor, table: cute.Tensor, num_experts: Int32):
            """``table[e]`` = first linear m-tile of expert ``e``; ``table[E]`` = all m-tiles.

            One warp: each lane sums the m-tile counts of a contiguous chunk of experts, a
            shuffle scan turns the sums into chunk starts, then each lane writes its chunk.
            """
            lane = cute.arch.lane_idx()
            chunk = (num_experts + 31) // 32
            lo = lane * chunk
            hi = lo + chunk
            if hi > num_experts:
                hi = num_experts
            local = Int32(0)
            for e in cutlass.range(lo, hi, unroll=1):
                local += (m_off[e + 1] - m_off[e] + TILE_M - 1) // TILE_M
            inclusive = local
            for i in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(inclusive, 1 << i)
                if lane >= (1 << i):
                    inclusive += other
            run = inclusive - local
            for e in cutlass.range(lo, hi, unroll=1):
                table[e] = run
                run += (m_off[e + 1] - m_off[e] + TILE_M - 1) // TILE_M
            if lane == 31:
                table[num_experts] = inclusive

        @cute.jit
        def decode(self, t: Int32, m_off: cute.Tensor, table: cute.Tensor, num_experts: Int32):
            """Work item ``t`` → (expert, first row of the tile, rows, n-tile, m-tile, shared).

            varlen-M: the first row is a row of ``P`` and ``rows`` the rows of the expert left
            from it; varlen-K: the first row is the expert's first row of ``P``, ``rows`` its
            row count and the m-tile indexes ``M``. On a cluster, ``t`` is a pair of linear
            m-tiles and this CTA takes the one of its rank; ``shared``: both are the same
            expert's, so the B tile is multicast. With an odd m-tile count the last pair's
            second CTA repeats the first one's tile with no rows (it loads its half of B and
            stores nothing).
            """
            e = Int32(0)
            row0 = Int32(0)
            rows = Int32(0)
            nt = Int32(0)
            mt = Int32(0)
            shared = False
            if cutlass.const_expr(self.varlen_k):
                per_expert = self.m_tiles // self.cluster * self.n_tiles
                e = t // per_expert
                rest = t - e * per_expert
                mt = rest // self.n_tiles
                nt = rest - mt * self.n_tiles
                row0 = m_off[e]
                rows = m_off[e + 1] - row0
                if cutlass.const_expr(self.cluster > 1):
                    shared = True
                    mt = mt * self.cluster + cute.arch.make_warp_uniform(
                        cute.arch.block_idx_in_cluster())
            else:
                mg = t // self.n_tiles
                nt = t - mg * self.n_tiles
                phantom = False
                e_peer = Int32(0)
                if cutlass.const_expr(self.cluster > 1):
                    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                    last = table[num_experts] - 1
                    peer = mg * self.cluster + 1 - rank
                    mg = mg * self.cluster + rank
                    if peer > last:
                        peer = last
                    if mg > last:
                        phantom = True
                        mg = peer
                    e_peer = self.expert_of(peer, table, num_experts)
                e = self.expert_of(mg, table, num_experts)
                mt = mg - table[e]
                row0 = m_off[e] + mt * TILE_M
                rows = m_off[e + 1] - row0
                if cutlass.const_expr(self.cluster > 1):
                    shared = e == e_peer
                    if phantom:
                        rows = Int32(0)
            return e, row0, rows, nt, mt, shared

        @cute.jit
        def expert_of(self, mg: Int32, table: cute.Tensor, num_experts: Int32) -> Int32:
            """The expert owning linear m-tile ``mg``: the largest ``e`` with ``table[e] <= mg``
            (empty experts share their start with the next expert, so the search lands on the
            one that owns the tile)."""
            lo = Int32(0)
            hi = num_experts - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if table[mid] <= mg:
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        @cute.jit
        def produce_tma(self, first: Int32, step: Int32, total: Int32, tma_atom_a, tma_a,
                        tma_b: tuple, s_a: cute.Tensor, s_b: cute.Tensor,
                        m_off: cute.Tensor, table: cute.Tensor, num_experts: Int32,
                        full: cute.Pointer, empty: cute.Pointer):
            """varlen-M, contiguous A: one warp issues the TMA loads of A and B."""
            stage = Int32(0)
            phase = Int32(1)
            t = first
            while t < total:
                e, row0, rows, nt, mt, shared = self.decode(t, m_off, table, num_experts)
                g_a = cute.local_tile(cute.domain_offset((row0, 0), tma_a), (TILE_M, TILE_K),
                                      (0, None))
                t_sa, t_ga = cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1),
                                                   cute.group_modes(s_a, 0, 2),
                                                   cute.group_modes(g_a, 0, 2))
                for kt in cutlass.range(self.k_tiles, unroll=1):
                    cute.arch.mbarrier_wait(empty + stage, phase)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.tma_bytes)
                    cute.copy(tma_atom_a, t_ga[None, kt], t_sa[None, stage],
                              tma_bar_ptr=full + stage)
                    self.load_b(tma_b, s_b, None, nt, kt, e, stage, full, shared)
                    stage, phase = self.next_stage(stage, phase)
                t += step

        @cute.jit
        def produce_gather_m(self, warp: Int32, first: Int32, step: Int32, total: Int32,
                             tma_atom_a, tma_a, tma_b: tuple, a_smem: cute.ComposedLayout,
                             b_smem: cute.ComposedLayout, s_a_base: cute.Pointer,
                             s_b_base: cute.Pointer, s_b: cute.Tensor, gidx: cute.Pointer,
                             m_off: cute.Tensor, table: cute.Tensor, num_experts: Int32,
                             full: cute.Pointer, empty: cute.Pointer, tma_h: tuple,
                             h_raw: tuple):
            """varlen-M, gathered A: every tile row arrives by its own TMA row copy.

            Producer warp ``w`` owns tile rows ``32w .. 32w+31``; lane ``l`` reads the source
            row of row ``32w + l`` once per tile and the warp then issues the 32 row copies of
            each k-tile in turn (a TMA copy takes warp-uniform coordinates). Rows past the
            expert's end copy the tile's first source row: they only reach masked output rows,
            and every stage then receives the same byte count. Compared with 16-byte cp.async
            copies this keeps the row loads off the SM's load/store path (measured ~2× faster
            on H200 at the ANCHORS shapes).
            """
            g_a = cute.group_modes(cute.local_tile(tma_a, (1, TILE_K), (None, None)), 0, 2)
            row_layout = cute.make_layout((1, TILE_K), stride=(TILE_K, 1))
            lane = cute.arch.lane_idx()
            stage = Int32(0)
            phase = Int32(1)
            t = first
            while t < total:
                e, row0, rows, nt, mt, shared = self.decode(t, m_off, table, num_experts)
                r = warp * 32 + lane
                if r >= rows:
                    r = Int32(0)
                src_row = cute.make_tensor(gidx + row0, cute.make_layout(TILE_M))[r]
                for kt in cutlass.range(self.k_tiles, unroll=1):
                    cute.arch.mbarrier_wait(empty + stage, phase)
                    if warp == 0:
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.tma_bytes)
                        self.load_b(tma_b, s_b, (s_b_base, b_smem.inner), nt, kt, e, stage,
                                    full, shared)
                    for i in cutlass.range_constexpr(32):
                        src = cute.arch.shuffle_sync(src_row, i)
                        dst = cute.make_tensor(cute.recast_ptr(
                            s_a_base + (stage * TILE_M + warp * 32 + i) * TILE_K,
                            a_smem.inner), row_layout)
                        t_sa, t_ga = cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1),
                                                           cute.group_modes(dst, 0, 2), g_a)
                        cute.copy(tma_atom_a, t_ga[None, src, kt], t_sa,
                                  tma_bar_ptr=full + stage)
                    stage, phase = self.next_stage(stage, phase)
                if cutlass.const_expr(self.dswiglu):
                    stage, phase = self.load_h(warp, tma_h, h_raw, row0, nt, stage, phase, full,
                                               empty)
                t += step

        @cute.jit
        def h_slabs(self, h_raw: tuple, stage: Int32):
            """Where ring stage ``stage`` holds the gate and up ``TILE_M x SLAB`` slabs of H
            (unswizzled pointers): gate where the stage's A k-tile goes, up at the start of
            its B k-tile."""
            return (h_raw[0] + stage * (TILE_M * TILE_K),
                    h_raw[1] + stage * (self.tile_n * TILE_K))

        @cute.jit
        def load_h(self, warp: Int32, tma_h: tuple, h_raw: tuple, row0: Int32, nt: Int32,
                   stage: Int32, phase: Int32, full: cute.Pointer, empty: cute.Pointer):
            """dH epilogue: queue the tile's H, one ring stage per SLAB of columns (the gate
            columns ``nt·tile_n + sl·SLAB ..`` and the matching up columns ``n + ..``). Rows
            past P and columns past 2n arrive as zeros; the rest beyond the tile's expert or
            n only reach masked outputs."""
            atom, tensor = tma_h
            for sl in cutlass.range_constexpr(self.tile_n // SLAB):
                cute.arch.mbarrier_wait(empty + stage, phase)
                if warp == 0:
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(full + stage, H_STAGE_BYTES)
                    slabs = self.h_slabs(h_raw, stage)
                    for half in cutlass.range_constexpr(2):
                        dst = cute.make_tensor(cute.recast_ptr(slabs[half], h_raw[2]),
                                               cute.make_layout((TILE_M, SLAB), stride=(SLAB, 1)))
                        g_h = cute.local_tile(cute.domain_offset(
                            (row0, half * self.dim_n + nt * self.tile_n + sl * SLAB), tensor),
                            (TILE_M, SLAB), (0, None))
                        t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                         cute.group_modes(dst, 0, 2),
                                                         cute.group_modes(g_h, 0, 2))
                        cute.copy(atom, t_g[None, 0], t_s, tma_bar_ptr=full + stage)
                stage, phase = self.next_stage(stage, phase)
            return stage, phase

        @cute.jit
        def load_b(self, tma_b: tuple, s_b: cute.Tensor, s_b_raw: tuple, nt: Int32, kt: Int32,
                   e: Int32, stage: Int32, full: cute.Pointer, shared):
            """varlen-M: B n-tile ``nt`` of expert ``e``, k-tile ``kt`` → ``stage``: one box, or
            with SwiGLU "concat" the gate rows and the matching up rows as two half boxes. On a
            cluster with ``shared``, this CTA loads its share (its rank's half of the box, or
            its rank's half box with "concat") and multicasts it to both CTAs."""
            atom, tensor, atom_mc, tensor_mc = tma_b
            bar = full + stage
            if cutlass.const_expr(self.cluster > 1):
                if shared:
                    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                    if cutlass.const_expr(self.swiglu == "concat"):
                        self.copy_b_half(atom_mc, tensor_mc, s_b_raw, rank, nt, kt, e, stage,
                                         bar, True)
                    else:
                        self.copy_b_tile(atom_mc, tensor_mc, s_b, rank, nt, kt, e, stage, bar,
                                         True)
                else:
                    self.load_b_whole(atom, tensor, s_b, s_b_raw, nt, kt, e, stage, bar)
            else:
                self.load_b_whole(atom, tensor, s_b, s_b_raw, nt, kt, e, stage, bar)

        @cute.jit
        def load_b_whole(self, atom, tensor, s_b: cute.Tensor, s_b_raw: tuple, nt: Int32,
                         kt: Int32, e: Int32, stage: Int32, bar: cute.Pointer):
            """The whole B tile into this CTA only."""
            if cutlass.const_expr(self.swiglu == "concat"):
                for h in cutlass.range_constexpr(2):
                    self.copy_b_half(atom, tensor, s_b_raw, h, nt, kt, e, stage, bar, False)
            else:
                self.copy_b_tile(atom, tensor, s_b, 0, nt, kt, e, stage, bar, False)

        @cute.jit
        def copy_b_tile(self, atom, tensor, s_b: cute.Tensor, rank, nt: Int32, kt: Int32,
                        e: Int32, stage: Int32, bar: cute.Pointer, multicast: cutlass.Constexpr):
            """B tile as one box into this CTA, or (``multicast``) this CTA's ``rank`` share of
            it into both CTAs of the cluster."""
            g_b = cute.group_modes(
                cute.local_tile(tensor, (self.tile_n, TILE_K), (None, None, None)), 0, 2)
            t_s, t_g = cpasync.tma_partition(
                atom, rank, cute.make_layout(self.cluster if multicast else 1),
                cute.group_modes(s_b, 0, 2), g_b)
            self.tma_copy(atom, t_g[None, nt, kt, e], t_s[None, stage], bar, multicast)

        @cute.jit
        def copy_b_half(self, atom, tensor, s_b_raw: tuple, h, nt: Int32, kt: Int32, e: Int32,
                        stage: Int32, bar: cute.Pointer, multicast: cutlass.Constexpr):
            """SwiGLU "concat": half box ``h`` (0: gate rows, 1: the matching up rows) of B
            n-tile ``nt``, to this CTA or (``multicast``) to both CTAs of the cluster."""
            half = self.tile_n // 2
            g_b = cute.group_modes(cute.local_tile(tensor, (half, TILE_K), (None, None, None)),
                                   0, 2)
            s_b_base, swizzle = s_b_raw
            dst = cute.make_tensor(cute.recast_ptr(
                s_b_base + (stage * self.tile_n + h * half) * TILE_K, swizzle),
                cute.make_layout((half, TILE_K), stride=(TILE_K, 1)))
            t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                             cute.group_modes(dst, 0, 2), g_b)
            self.tma_copy(atom, t_g[None, h * (self.dim_n // 2 // half) + nt, kt, e], t_s, bar,
                          multicast)

        @cute.jit
        def produce_varlen_k(self, warp: Int32, first: Int32, step: Int32, total: Int32,
                             tma_a: tuple, tma_b: tuple, a_smem: cute.ComposedLayout,
                             b_smem: cute.ComposedLayout, s_a_base: cute.Pointer,
                             s_b_base: cute.Pointer, gidx_a: cute.Pointer, gidx_b: cute.Pointer,
                             rows_a: Int32, rows_b: Int32, m_off: cute.Tensor, table: cute.Tensor,
                             num_experts: Int32, full: cute.Pointer, empty: cute.Pointer):
            """varlen-K: both operands are ``TILE_K`` rows of the expert per k-tile, MN-major in
            shared memory, loaded by TMA.

            A contiguous operand's whole k-tiles arrive as ``64 x TILE_K`` boxes issued by warp
            0. Gathered rows, and the rows of an expert's last partial k-tile, arrive as one
            ``64 x 1`` box per row and 64 columns, spread over the four producer warps (16 rows
            each); a row past the expert's end reads row ``rows`` of the source — out of bounds,
            so TMA writes zeros and no stale value enters the reduction. Lane ``l`` holds the
            source row of the warp's row ``l mod 16``; those of k-tile ``kt + 1`` are read right
            after the copies of ``kt`` are issued, overlapping the wait for the next free stage.
            On a cluster, B (the same rows of the same expert for both CTAs) is split by columns:
            each CTA loads its half of the 64-column blocks and multicasts them.
            """
            lane = cute.arch.lane_idx()
            row_in_tile = warp * (TILE_K // 4) + lane % (TILE_K // 4)
            stage = Int32(0)
            phase = Int32(1)
            t = first
            while t < total:
                e, row0, rows, nt, mt, shared = self.decode(t, m_off, table, num_experts)
                k_tiles = (rows + TILE_K - 1) // TILE_K
                src_a = self.row_source(gidx_a, self.gather_a, row0, rows, row_in_tile, Int32(0),
                                        rows_a)
                src_b = self.row_source(gidx_b, self.gather_b, row0, rows, row_in_tile, Int32(0),
                                        rows_b)
                for kt in cutlass.range(k_tiles, unroll=1):
                    cute.arch.mbarrier_wait(empty + stage, phase)
                    if warp == 0:
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.tma_bytes)
                    whole = (kt + 1) * TILE_K <= rows
                    self.load_k_tile(warp, tma_a, a_smem.inner, s_a_base, TILE_M, mt * TILE_M,
                                     self.gather_a, whole, src_a, row0, kt, stage, full, False)
                    self.load_k_tile(warp, tma_b, b_smem.inner, s_b_base, self.tile_n,
                                     nt * self.tile_n, self.gather_b, whole, src_b, row0, kt,
                                     stage, full, self.cluster > 1)
                    src_a = self.row_source(gidx_a, self.gather_a, row0, rows, row_in_tile,
                                            kt + 1, rows_a)
                    src_b = self.row_source(gidx_b, self.gather_b, row0, rows, row_in_tile,
                                            kt + 1, rows_b)
                    stage, phase = self.next_stage(stage, phase)
                t += step

        @cute.jit
        def row_source(self, gidx: cute.Pointer, gathered: cutlass.Constexpr, row0: Int32,
                       rows: Int32, row_in_tile: Int32, kt: Int32, oob: Int32) -> Int32:
            """Source row of tile row ``row_in_tile`` of k-tile ``kt``; ``oob`` past the end."""
            r = kt * TILE_K + row_in_tile
            src = oob
            if r < rows:
                src = row0 + r
                if cutlass.const_expr(gathered):
                    src = cute.make_tensor(gidx, cute.make_layout(row0 + rows))[row0 + r]
            return src

        @cute.jit
        def load_k_tile(self, warp: Int32, tma: tuple, swizzle, s_base: cute.Pointer,
                        tile_mn: cutlass.Constexpr, col0: Int32, gathered: cutlass.Constexpr,
                        whole, src: Int32, row0: Int32, kt: Int32, stage: Int32,
                        full: cute.Pointer, split: cutlass.Constexpr):
            """Issue the TMA copies of one operand's k-tile into ``stage``; with ``split`` only
            this CTA's share of the 64-column blocks, multicast to the cluster."""
            atom_box, tma_box, atom_row, tma_row = tma
            stage_base = s_base + stage * (tile_mn * TILE_K)
            blocks = tile_mn // 64 // (self.cluster if split else 1)
            j0 = Int32(0)
            if cutlass.const_expr(split):
                j0 = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) * blocks
            if cutlass.const_expr(gathered):
                self.copy_rows(warp, atom_row, tma_row, swizzle, stage_base, blocks, j0, col0,
                               src, full + stage, split)
            else:
                if whole:
                    if warp == 0:
                        g_box = cute.group_modes(cute.local_tile(
                            cute.domain_offset((0, row0), tma_box), (64, TILE_K), (None, None)),
                            0, 2)
                        for jj in cutlass.range_constexpr(blocks):
                            j = j0 + jj
                            dst = cute.make_tensor(
                                cute.recast_ptr(stage_base + j * (64 * TILE_K), swizzle),
                                cute.make_layout((64, TILE_K), stride=(1, 64)))
                            t_s, t_g = cpasync.tma_partition(
                                atom_box, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                g_box)
                            self.tma_copy(atom_box, t_g[None, col0 // 64 + j, kt], t_s,
                                          full + stage, split)
                else:
                    self.copy_rows(warp, atom_row, tma_row, swizzle, stage_base, blocks, j0,
                                   col0, src, full + stage, split)

        @cute.jit
        def copy_rows(self, warp: Int32, atom_row, tma_row, swizzle, stage_base: cute.Pointer,
                      blocks: cutlass.Constexpr, j0: Int32, col0: Int32, src: Int32,
                      bar: cute.Pointer, multicast: cutlass.Constexpr):
            """This warp's ``TILE_K / 4`` rows of a k-tile, one ``64 x 1`` box per 64 columns of
            blocks ``j0 .. j0 + blocks``."""
            g_row = cute.group_modes(cute.local_tile(tma_row, (64, 1), (None, None)), 0, 2)
            for i in cutlass.range_constexpr(TILE_K // 4):
                row = cute.arch.shuffle_sync(src, i)
                for jj in cutlass.range_constexpr(blocks):
                    j = j0 + jj
                    dst = cute.make_tensor(cute.recast_ptr(
                        stage_base + j * (64 * TILE_K) + (warp * (TILE_K // 4) + i) * 64,
                        swizzle), cute.make_layout((64, 1), stride=(1, 64)))
                    t_s, t_g = cpasync.tma_partition(
                        atom_row, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2), g_row)
                    self.tma_copy(atom_row, t_g[None, col0 // 64 + j, row], t_s, bar, multicast)

        @cute.jit
        def tma_copy(self, atom, src: cute.Tensor, dst: cute.Tensor, bar: cute.Pointer,
                     multicast: cutlass.Constexpr):
            """One TMA load into this CTA, or (``multicast``) into every CTA of the cluster."""
            if cutlass.const_expr(multicast):
                cute.copy(atom, src, dst, tma_bar_ptr=bar,
                          mcast_mask=cutlass.Int16((1 << self.cluster) - 1))
            else:
                cute.copy(atom, src, dst, tma_bar_ptr=bar)

        @cute.jit
        def tile_k_tiles(self, t: Int32, m_off: cute.Tensor, num_experts: Int32) -> Int32:
            """k-tiles of tile ``t``: ``K / TILE_K`` (varlen-M) or the expert's rows (varlen-K)."""
            k_tiles = Int32(self.k_tiles)
            if cutlass.const_expr(self.varlen_k):
                e = t // (self.m_tiles // self.cluster * self.n_tiles)
                k_tiles = (m_off[e + 1] - m_off[e] + TILE_K - 1) // TILE_K
            return k_tiles

        @cute.jit
        def consume(self, ctid: Int32, first: Int32, stride: Int32, total: Int32,
                    tiled_mma: cute.TiledMma, s_a: cute.Tensor, s_b: cute.Tensor,
                    s_c: cute.Pointer, outs: tuple, m_off: cute.Tensor, table: cute.Tensor,
                    num_experts: Int32, full: cute.Pointer, empty: cute.Pointer, h_raw: tuple):
            """WGMMA over the k-tiles of each tile, then the masked store.

            Cooperative: both warpgroups run every tile of the CTA. Ping-pong: warpgroup ``w``
            runs the CTA's tiles ``w, w+2, ...``; two named barriers hand the tensor cores from
            one warpgroup's mainloop to the other's, so one warpgroup's epilogue overlaps the
            other's mainloop (SonicMoE §4.2). A warpgroup skips the stages of the other's tiles.
            """
            wg = cute.arch.make_warp_uniform(ctid // 128)
            wg_tid = ctid - wg * 128
            stage_c = s_c + wg * (self.rows_wg * (SLAB + PAD))
            # First tile row of this warpgroup's accumulator.
            wg_row0 = wg * self.rows_wg
            mma_tid = ctid
            step = stride
            t = first
            if cutlass.const_expr(self.pingpong):
                wg_row0 = Int32(0)
                mma_tid = ctid - wg * 128
                step = 2 * stride
                t = first + wg * stride
            thr_mma = tiled_mma.get_slice(mma_tid)
            t_ca = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
            t_cb = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, self.tile_n)), F32)
            k_blocks = cute.size(t_ca, mode=[2])
            coords = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, self.tile_n)))
            lane = cute.arch.lane_idx()
            stage = Int32(0)
            phase = Int32(0)
            if cutlass.const_expr(self.pingpong):
                if wg == 1:
                    if first < total:
                        stage, phase = self.skip(stage, phase,
                                                 self.tile_k_tiles(first, m_off, num_experts))
            while t < total:
                e, row0, rows, nt, mt, shared = self.decode(t, m_off, table, num_experts)
                k_tiles = self.tile_k_tiles(t, m_off, num_experts)
                if cutlass.const_expr(self.pingpong):
                    if t != first:
                        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=256)
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                prev = Int32(0)
                for kt in cutlass.range(k_tiles, unroll=1):
                    cute.arch.mbarrier_wait(full + stage, phase)
                    for kb in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled_mma, acc, t_ca[None, None, kb, stage],
                                  t_cb[None, None, kb, stage], acc)
                    warpgroup.commit_group()
                    # Keep one WGMMA batch in flight; the previous stage is then free.
                    warpgroup.wait_group(1)
                    if kt > 0:
                        self.release(empty + prev, lane)
                    prev = stage
                    stage, phase = self.next_stage(stage, phase)
                warpgroup.wait_group(0)
                if k_tiles > 0:
                    self.release(empty + prev, lane)
                if cutlass.const_expr(self.pingpong):
                    # The other warpgroup's next tile is t + stride; it may start its mainloop.
                    if t + stride < total:
                        cute.arch.barrier_arrive(barrier_id=2 - wg, number_of_threads=256)
                        stage, phase = self.skip(stage, phase,
                                                 self.tile_k_tiles(t + stride, m_off, num_experts))
                c, act = outs[0], outs[1]
                if cutlass.const_expr(self.dswiglu):
                    stage, phase = self.store_dswiglu(acc, coords, stage_c, wg_tid, wg, wg_row0,
                                                      outs, row0, rows, nt, h_raw, stage, phase,
                                                      full, empty, lane)
                elif cutlass.const_expr(self.swiglu is None):
                    self.store(acc, coords, stage_c, wg_tid, wg, wg_row0, c, e, row0, rows, nt,
                               mt)
                else:
                    self.store_swiglu(acc, coords, stage_c, wg_tid, wg, wg_row0, c, act, row0,
                                      rows, nt)
                t += step

        @cute.jit
        def next_stage(self, stage: Int32, phase: Int32):
            """The ring position after ``stage``: the phase flips when the ring wraps."""
            stage += 1
            if stage == self.stages:
                stage = 0
                phase ^= 1
            return stage, phase

        @cute.jit
        def skip(self, stage: Int32, phase: Int32, k_tiles: Int32):
            """Advance a consumer's ring position past ``k_tiles`` stages."""
            ahead = stage + k_tiles
            wraps = ahead // self.stages
            return ahead - wraps * self.stages, phase ^ (wraps & 1)

        @cute.jit
        def store(self, acc: cute.Tensor, coords: cute.Tensor, stage_c: cute.Pointer,
                  wg_tid: Int32, wg: Int32, wg_row0: Int32, c: cute.Pointer, e: Int32,
                  row0: Int32, rows: Int32, nt: Int32, mt: Int32):
            """bf16 store of this warpgroup's rows of the tile, masked to the expert's rows
            (varlen-M) or to M (varlen-K), and to N.

            Per SLAB of columns: the accumulator's column pairs go to the warpgroup's staging
            buffer, then each thread stores whole 16-byte row chunks (N is a multiple of 8, so a
            chunk is entirely inside or outside); a row of a slab is one 128-byte line. With
            ``transpose_c`` the slab is staged transposed, so the chunks are 8 consecutive rows
            of one column — contiguous in ``C[e]ᵀ``, 8 threads covering a 128-byte line of it.
            """
            cols = self.dim_n - nt * self.tile_n
            if cutlass.const_expr(self.varlen_k):
                rows = self.dim_m - mt * TILE_M
                base = (Int64(e) * self.dim_m + mt * TILE_M) * self.dim_n + nt * self.tile_n
            else:
                base = Int64(row0) * self.dim_n + nt * self.tile_n
            for sl in cutlass.range_constexpr(self.tile_n // SLAB):
                self.stage_slab(acc, coords, stage_c, wg_row0, sl, self.transpose_c)
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)
                if cutlass.const_expr(self.transpose_c):
                    # Staged row r is column nt·tile_n + sl·SLAB + r of C[e]: a row of C[e]ᵀ,
                    # whose warpgroup part starts at M index mt·TILE_M + wg_row0.
                    self.flush(stage_c, wg_tid, Int32(0), self.rows_wg, c,
                               (Int64(e) * self.dim_n + nt * self.tile_n + sl * SLAB) * self.dim_m
                               + mt * TILE_M, self.dim_m, wg_row0, rows, cols - sl * SLAB)
                else:
                    self.flush(stage_c, wg_tid, wg_row0, SLAB, c, base, self.dim_n, sl * SLAB,
                               cols, rows)
                # The next slab overwrites the staging buffer.
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)

        @cute.jit
        def stage_slab(self, acc: cute.Tensor, coords: cute.Tensor, stage_c: cute.Pointer,
                       wg_row0: Int32, sl: int, transposed: cutlass.Constexpr = False):
            """bf16 accumulator columns ``sl·SLAB ..`` of this warpgroup's rows → staging buffer
            (``transposed``: staged row = column, staged column = row; rows_wg == SLAB).

            The WGMMA accumulator holds, per 8-column group j, the column pair (v0 = 0, 1) of two
            rows (v1 = 0, 1) for each 64-row block mm."""
            pair_f32 = cute.make_rmem_tensor((2,), F32)
            pair = cute.make_rmem_tensor((2,), BF16)
            for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for j in cutlass.range_constexpr(SLAB // 8):
                    for v1 in cutlass.range_constexpr(2):
                        first = ((0, v1, sl * (SLAB // 8) + j), mm, 0)
                        second = ((1, v1, sl * (SLAB // 8) + j), mm, 0)
                        m, n = coords[first]
                        pair_f32[0] = acc[first]
                        pair_f32[1] = acc[second]
                        pair.store(pair_f32.load().to(BF16))
                        if cutlass.const_expr(transposed):
                            # A quad's column pairs over 8 rows: 16 distinct banks.
                            for v0 in cutlass.range_constexpr(2):
                                cute.make_tensor(
                                    stage_c + (n + v0 - sl * SLAB) * (SLAB + PAD) + (m - wg_row0),
                                    cute.make_layout(1))[0] = pair[v0]
                        else:
                            offset = (m - wg_row0) * (SLAB + PAD) + (n - sl * SLAB)
                            cute.autovec_copy(pair, cute.make_tensor(
                                stage_c + cute.assume(offset, divby=2), cute.make_layout(2)))

        @cute.jit
        def flush(self, stage_c: cute.Pointer, wg_tid: Int32, wg_row0: Int32, width: int,
                  dst: cute.Pointer, base: Int64, pitch: int, col0: int, col_limit: Int32,
                  rows: Int32):
            """Staged ``rows_wg x width`` block → ``dst[base + m·pitch + col0 + col]`` as 16-byte
            row chunks, masked to tile rows ``< rows`` and to ``col0 + col < col_limit`` (widths
            are multiples of 8, so a chunk is entirely inside or outside)."""
            chunk = cute.make_rmem_tensor((VEC,), BF16)
            chunks_per_row = width // VEC
            for q in cutlass.range_constexpr(self.rows_wg * chunks_per_row // 128):
                index = wg_tid + q * 128
                r = index // chunks_per_row
                col = (index - r * chunks_per_row) * VEC
                m = wg_row0 + r
                if m < rows and col0 + col < col_limit:
                    cute.autovec_copy(cute.make_tensor(
                        stage_c + cute.assume(r * (SLAB + PAD) + col, divby=VEC),
                        cute.make_layout(VEC)), chunk)
                    cute.autovec_copy(chunk, cute.make_tensor(
                        dst + cute.assume(base + (Int64(m) * pitch + col0 + col), divby=VEC),
                        cute.make_layout(VEC)))

        @cute.jit
        def store_swiglu(self, acc: cute.Tensor, coords: cute.Tensor, stage_c: cute.Pointer,
                         wg_tid: Int32, wg: Int32, wg_row0: Int32, h_out: cute.Pointer,
                         act: cute.Pointer, row0: Int32, rows: Int32, nt: Int32):
            """Up-proj epilogue: H ``(P, 2n)`` and ``A = silu(gate) ⊙ up`` ``(P, n)``.

            A is computed from the bf16-rounded H values with the standalone SwiGLU kernel's
            formula, so it equals what the backward recomputes from the saved H bitwise."""
            n = self.dim_n // 2
            slabs = self.tile_n // SLAB
            concat = self.swiglu == "concat"
            h_base = Int64(row0) * self.dim_n
            a_base = Int64(row0) * n
            for sl in cutlass.range_constexpr(slabs):
                # Destination column of the slab's first H column.
                h_col0 = nt * self.tile_n + sl * SLAB
                if cutlass.const_expr(concat):
                    half = slabs // 2
                    h_col0 = (sl // half) * n + nt * (self.tile_n // 2) + (sl % half) * SLAB
                self.stage_slab(acc, coords, stage_c, wg_row0, sl)
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)
                self.flush(stage_c, wg_tid, wg_row0, SLAB, h_out, h_base, self.dim_n, h_col0,
                           self.dim_n, rows)
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)
            # A: per slab of A columns (concat: the gate slab's 64; interleaved: a slab's 32).
            a_width = SLAB if concat else SLAB // 2
            for sl in cutlass.range_constexpr(slabs // 2 if concat else slabs):
                self.stage_swiglu_slab(acc, coords, stage_c, wg_row0, sl, concat, slabs)
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)
                self.flush(stage_c, wg_tid, wg_row0, a_width, act, a_base, n,
                           nt * (self.tile_n // 2) + sl * a_width, n, rows)
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)

        @cute.jit
        def stage_swiglu_slab(self, acc: cute.Tensor, coords: cute.Tensor, stage_c: cute.Pointer,
                              wg_row0: Int32, sl: int, concat: cutlass.Constexpr, slabs: int):
            """A values of slab ``sl`` → staging buffer (column = the A column in the slab)."""
            gate_up = cute.make_rmem_tensor((2,), F32)
            rounded = cute.make_rmem_tensor((2,), BF16)
            for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for j in cutlass.range_constexpr(SLAB // 8):
                    for v1 in cutlass.range_constexpr(2):
                        for v0 in cutlass.range_constexpr(2 if concat else 1):
                            gate = ((v0, v1, sl * (SLAB // 8) + j), mm, 0)
                            up = ((1, v1, sl * (SLAB // 8) + j), mm, 0)
                            if cutlass.const_expr(concat):
                                up = ((v0, v1, (sl + slabs // 2) * (SLAB // 8) + j), mm, 0)
                            m, col = coords[gate]
                            gate_up[0] = acc[gate]
                            gate_up[1] = acc[up]
                            rounded.store(gate_up.load().to(BF16))
                            g = rounded[0].to(F32)
                            sig = cute.arch.rcp_approx(
                                1.0 + cute.math.exp2(g * -LOG2_E, fastmath=True))
                            value = ((g * sig) * rounded[1].to(F32)).to(BF16)
                            a_col = col - sl * SLAB
                            if cutlass.const_expr(not concat):
                                a_col = a_col // 2
                            cute.make_tensor(stage_c + (m - wg_row0) * (SLAB + PAD) + a_col,
                                             cute.make_layout(1))[0] = value

        @cute.jit
        def store_dswiglu(self, acc: cute.Tensor, coords: cute.Tensor, stage_c: cute.Pointer,
                          wg_tid: Int32, wg: Int32, wg_row0: Int32, outs: tuple, row0: Int32,
                          rows: Int32, nt: Int32, h_raw: tuple, stage: Int32, phase: Int32,
                          full: cute.Pointer, empty: cute.Pointer, lane: Int32):
            """dH epilogue: per SLAB of columns, this thread's gate and up values of H are read
            from the slab's ring stage (which is then released to the producer), and dH's
            gate half, dH's up half and A' are staged and stored in turn from fp32 dA', g, u
            and s; the ds partial of each of the thread's rows is reduced over the quad of
            threads holding the row and stored once per tile. Returns the ring position after
            the tile's H stages."""
            dh, a_scaled, scores, ds = outs
            n = self.dim_n
            mms = cute.size(acc, mode=[1])
            # Score of each of this thread's rows (two per 64-row block), zero past the expert.
            s_row = cute.make_rmem_tensor((mms * 2,), F32)
            partial = cute.make_rmem_tensor((mms * 2,), F32)
            partial.fill(0.0)
            for mm in cutlass.range_constexpr(mms):
                for v1 in cutlass.range_constexpr(2):
                    m, _ = coords[((0, v1, 0), mm, 0)]
                    s_row[mm * 2 + v1] = 0.0
                    if m < rows:
                        s_row[mm * 2 + v1] = cute.make_tensor(
                            scores + row0, cute.make_layout(TILE_M))[m]
            silu = cute.make_rmem_tensor((mms * (SLAB // 8) * 4,), F32)
            cols = n - nt * self.tile_n
            for sl in cutlass.range_constexpr(self.tile_n // SLAB):
                cute.arch.mbarrier_wait(full + stage, phase)
                slabs = self.h_slabs(h_raw, stage)
                col0 = nt * self.tile_n + sl * SLAB
                for part in cutlass.range_constexpr(3):
                    self.stage_dswiglu_slab(acc, coords, stage_c, wg_row0, sl, mms, slabs, cols,
                                            silu, s_row, partial, part)
                    cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)
                    if cutlass.const_expr(part == 2):
                        # The warpgroup has read the slab's H: the stage can be refilled.
                        self.release(empty + stage, lane)
                        stage, phase = self.next_stage(stage, phase)
                        self.flush(stage_c, wg_tid, wg_row0, SLAB, a_scaled, Int64(row0) * n, n,
                                   col0, n, rows)
                    else:
                        self.flush(stage_c, wg_tid, wg_row0, SLAB, dh, Int64(row0) * (2 * n),
                                   2 * n, col0 + part * n, (part + 1) * n, rows)
                    cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)
            n_tiles = self.n_tiles
            for i in cutlass.range_constexpr(mms * 2):
                total = partial[i]
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
                total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                m, _ = coords[((0, i % 2, 0), i // 2, 0)]
                if lane % 4 == 0:
                    if m < rows:
                        cute.make_tensor(ds + (Int64(row0 + m) * n_tiles + nt),
                                         cute.make_layout(1))[0] = total
            return stage, phase

        @cute.jit
        def h_pair(self, slab: cute.Pointer, m: Int32, col: Int32, inside, pair: cute.Tensor):
            """The H values at row ``m``, columns ``col, col + 1`` (``col`` even) of a slab in
            a ring stage, one 4-byte load, or zeros when not ``inside``. The slab's rows are
            128-byte lines whose 16-byte chunks TMA's 128-byte swizzle permutes by the row
            (chunk ``c`` at ``c ^ (m mod 8)``; stage bases are 1024-byte aligned)."""
            pair.fill(0.0)
            if inside:
                offset = m * SLAB + ((col // 8) ^ (m % 8)) * 8 + col % 8
                cute.autovec_copy(cute.make_tensor(slab + cute.assume(offset, divby=2),
                                                   cute.make_layout(2)), pair)

        @cute.jit
        def stage_dswiglu_slab(self, acc: cute.Tensor, coords: cute.Tensor,
                               stage_c: cute.Pointer, wg_row0: Int32, sl: int, mms: int,
                               slabs: tuple, cols: Int32, silu: cute.Tensor, s_row: cute.Tensor,
                               partial: cute.Tensor, part: int):
            """Slab ``sl`` of dH's gate half (``part`` 0, which also keeps ``silu(g)``), up half
            (1) or A' (2, also adding ``dA'·A`` to the row partials) → staging buffer. With
            ``dA = s·dA'``: ``d_gate = dA·u·σ(g)(1 + g(1 − σ(g)))``, ``d_up = dA·silu(g)``,
            ``A' = s·silu(g)·u`` (the formulas of :func:`sonic.kernels.swiglu.dswiglu_epilogue`;
            σ is evaluated once per value). g and u are read from the slab's ring stage, as
            zeros on columns past n (a column pair is entirely inside or outside: n is a
            multiple of 8), so no value of the neighbouring columns enters ds."""
            out = cute.make_rmem_tensor((2,), F32)
            pair = cute.make_rmem_tensor((2,), BF16)
            gate = cute.make_rmem_tensor((2,), BF16)
            up = cute.make_rmem_tensor((2,), BF16)
            for mm in cutlass.range_constexpr(mms):
                for j in cutlass.range_constexpr(SLAB // 8):
                    for v1 in cutlass.range_constexpr(2):
                        slot = ((mm * (SLAB // 8) + j) * 2 + v1) * 2
                        s = s_row[mm * 2 + v1]
                        m, col = coords[((0, v1, sl * (SLAB // 8) + j), mm, 0)]
                        if cutlass.const_expr(part != 1):
                            self.h_pair(slabs[1], m, col - sl * SLAB, col < cols, up)
                        if cutlass.const_expr(part == 0):
                            self.h_pair(slabs[0], m, col - sl * SLAB, col < cols, gate)
                        for v0 in cutlass.range_constexpr(2):
                            dap = acc[((v0, v1, sl * (SLAB // 8) + j), mm, 0)]
                            if cutlass.const_expr(part == 0):
                                g = gate[v0].to(F32)
                                u = up[v0].to(F32)
                                sig = cute.arch.rcp_approx(
                                    1.0 + cute.math.exp2(g * -LOG2_E, fastmath=True))
                                silu[slot + v0] = g * sig
                                out[v0] = (s * dap) * u * sig * (1.0 + g * (1.0 - sig))
                            elif cutlass.const_expr(part == 1):
                                out[v0] = (s * dap) * silu[slot + v0]
                            else:
                                act = silu[slot + v0] * up[v0].to(F32)
                                partial[mm * 2 + v1] = partial[mm * 2 + v1] + dap * act
                                out[v0] = act * s
                        pair.store(out.load().to(BF16))
                        offset = (m - wg_row0) * (SLAB + PAD) + (col - sl * SLAB)
                        cute.autovec_copy(pair, cute.make_tensor(
                            stage_c + cute.assume(offset, divby=2), cute.make_layout(2)))

    return GroupedGemmKernel


def _plan(varlen_k: bool, dim_n: int, gathered: bool = False, dim_k: int = 0,
          dim_m: int = 0) -> tuple[int, bool, int]:
    """Tile N, schedule and cluster size: ``(tile_n, pingpong, cluster)``.

    Measured at the ANCHORS shapes on H100 and H200 (tile-plan sweeps; RESULTS.md). On H100
    the kernels are bound by L2→SM bandwidth (~6.5–7 TB/s at 64–85 FLOP per loaded byte), so
    the plan maximises FLOP per loaded byte:

    * cooperative ``128 x 256`` tiles (``128 x 128`` when N is small and not a multiple of 256)
      on 2-CTA clusters that multicast the shared B tile, for gathered varlen-M A (up-proj,
      ``dA'``), contiguous A with K > 512 (down-proj, ``dX̃`` at OLMoE/30B) and varlen-K when M
      has an even number of m-tiles. H100, 30B: up 558 → 651, dA' 571 → 628, down 609 → 633,
      dX 603 → 674, dW1 481 → 577, dW2 531 → 626 TFLOPS (no cluster → cluster); contiguous A
      on ping-pong ``128 x 128`` tiles reached only 443 (down) and 327 (dX) there;
    * contiguous A with K ≤ 512 (the 7B down-proj and dX̃): ping-pong ``128 x 128``, one
      warpgroup's epilogue hidden behind the other's mainloop (SonicMoE §4.2): the mainloop is
      short — H100 7B down 456 vs 444 on a cluster.
    """
    tile_n = 256 if dim_n % 256 == 0 or dim_n >= 1024 else 128
    if varlen_k:
        return tile_n, False, CLUSTER if (dim_m + TILE_M - 1) // TILE_M % CLUSTER == 0 else 1
    if not gathered and dim_k <= 512:
        return 128, True, 1
    return tile_n, False, CLUSTER


def _compile(varlen_k: bool, tile_n: int, pingpong: bool, cluster: int, dim_m: int, dim_n: int,
             dim_k: int, gather_a: bool, gather_b: bool, b_n_major: bool = False,
             transpose_c: bool = False, swiglu: str | None = None, dswiglu: bool = False,
             keep_ptx: bool = False):
    """Compile one static configuration with placeholder arguments."""
    import cutlass

    kernel = _kernels()(varlen_k, tile_n, dim_m, dim_n, dim_k, gather_a, gather_b, pingpong,
                        b_n_major, transpose_c, swiglu, cluster, dswiglu)
    addresses = [runtime.fake_address() for _ in range(10)]
    sizes = [cutlass.Int32(1) for _ in range(4)]
    return runtime.compile_launcher(kernel, *addresses, *sizes, keep_ptx=keep_ptx)


@functools.cache
def _resident(index: int, cluster: int) -> int:
    """CTAs (``cluster == 1``) or clusters of ``cluster`` CTAs that device ``index`` runs at
    once at one CTA per SM: a persistent grid larger than that would run a tail wave."""
    if cluster == 1:
        return torch.cuda.get_device_properties(index).multi_processor_count
    from cutlass.utils import HardwareInfo

    with torch.cuda.device(index):
        return HardwareInfo(index).get_max_active_clusters(cluster)


def _num_ctas(device: torch.device, work_items: int, cluster: int = 1) -> int:
    """Persistent grid size: one CTA (cluster) per resident slot, at most one per work item."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cluster * max(1, min(_resident(index, cluster), work_items))


def _check_offsets(expert_offsets, device) -> int:
    runtime.check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32,), ndim=1,
                         device=device)
    num_experts = expert_offsets.numel() - 1
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"expert_offsets must have E+1 entries with 1 <= E <= {MAX_EXPERTS}, "
                         f"got {expert_offsets.numel()} entries")
    return num_experts


def _check_width(name: str, size: int) -> None:
    if size <= 0 or size % VEC:
        raise ValueError(f"{name} must be a positive multiple of {VEC}, got {size}")


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
                 gather_idx: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """varlen-M grouped GEMM: ``out[r] = A[r] · b[e]ᵀ`` for every row ``r`` of expert ``e``.

    DESIGN §3 (up-proj ``H = gather(X)·W1ᵀ``, down-proj ``Y = A·W2ᵀ``, backward
    ``dX̃ = dH·W1``) and §4; SonicMoE (arXiv 2512.14080) §4.1. One persistent launch for all
    experts, fp32 accumulation, bf16 output, bitwise deterministic; no host synchronisation.

    Args:
        a: bf16, contiguous, CUDA. ``(P, K)`` rows already sorted by expert, or with
            ``gather_idx`` the ``(T, K)`` source rows (``A[r] = a[gather_idx[r]]``, gathered
            while loading, never materialised).
        b: ``(E, N, K)`` bf16, either contiguous (K-major: per expert the ``nn.Linear``
            (out, in) layout) or the ``transpose(1, 2)`` view of a contiguous ``(E, K, N)``
            (N-major, e.g. ``w2.transpose(1, 2)`` for the backward's ``dO·W2``); no copy is made.
        expert_offsets: ``(E+1,)`` int32, contiguous: expert ``e`` owns rows
            ``[expert_offsets[e], expert_offsets[e+1])``; non-decreasing from 0 with
            ``expert_offsets[E] == P`` (as :class:`sonic.RoutingMetadata` builds it). Read on
            the device only; not validated against the data.
        gather_idx: ``(P,)`` int32, contiguous, values in ``[0, T)``, or None.
        out: ``(P, N)`` bf16, contiguous, written in place and returned; allocated if None.

    Returns:
        ``(P, N)`` bf16.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor is not a contiguous CUDA tensor of the right rank, devices differ,
            shapes disagree, ``K`` or ``N`` is not a positive multiple of 8, or ``E`` exceeds
            1024.
    """
    return _varlen_m(a, b, expert_offsets, gather_idx, out, None)[0]


def grouped_gemm_swiglu(x: torch.Tensor, w1: torch.Tensor, expert_offsets: torch.Tensor,
                        gather_idx: torch.Tensor,
                        gate_up: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Up-proj with the SwiGLU epilogue: ``H = gather(X)·W1ᵀ``, ``A = SwiGLU(H)``, one launch.

    DESIGN §3 forward; SonicMoE (arXiv 2512.14080) §4.1.2. The epilogue stores H (kept for the
    backward) and A, computed from H's bf16 values exactly as :func:`sonic.kernels.swiglu.swiglu`
    does, so A equals the backward's recomputation bitwise.

    Args:
        x: ``(T, d)`` bf16, contiguous, CUDA; rows gathered by ``gather_idx`` while loading.
        w1: ``(E, 2n, d)`` bf16, contiguous; rows ``[gate; up]`` (``gate_up="concat"``) or
            alternating (``"interleaved"``).
        expert_offsets: ``(E+1,)`` int32, as for :func:`grouped_gemm`.
        gather_idx: ``(P,)`` int32, values in ``[0, T)``.
        gate_up: ``"concat"`` or ``"interleaved"``.

    Returns:
        ``(H, A)``: ``(P, 2n)`` and ``(P, n)`` bf16.

    Raises:
        TypeError / ValueError: as :func:`grouped_gemm`; also an unknown ``gate_up``, or ``n``
            not a multiple of 8 (of 64 with ``"concat"``).
    """
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
                         gather_idx: torch.Tensor, h: torch.Tensor,
                         row_scores: torch.Tensor, *, dh_out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's dH kernel: ``dA' = gather(dO)·W2`` with the dSwiGLU epilogue, one launch.

    DESIGN §3 backward step 1; SonicMoE (arXiv 2512.14080) §4.1.3 and App. C. dA' never leaves
    the registers: the epilogue reads the saved H ("concat" layout) and the row scores and
    stores ``dH = dSwiGLU(s·dA', H)``, ``A' = s·A`` and ``ds = ⟨dA', A⟩`` — the function of
    :func:`sonic.kernels.swiglu.dswiglu_epilogue`, computed from fp32 dA' instead of its bf16
    copy. ``ds`` is summed over n-tiles in a fixed order (bitwise deterministic).

    Args:
        dout: ``(T, d)`` bf16, contiguous, CUDA: the layer's output gradient, rows gathered
            by ``gather_idx``.
        w2: ``(E, d, n)`` bf16, contiguous (read N-major, no copy).
        expert_offsets: ``(E+1,)`` int32, as for :func:`grouped_gemm`.
        gather_idx: ``(P,)`` int32, values in ``[0, T)``.
        h: ``(P, 2n)`` bf16, contiguous, 16-byte aligned: the forward's up-projection output,
            rows ``[gate | up]``.
        row_scores: ``(P,)`` fp32, contiguous: the score of each row.
        dh_out: ``(P, 2n)`` bf16, contiguous: where dH is written, allocated if None. It may be
            ``h`` itself: dH then overwrites H in place, which is safe because every tile
            reads its H slabs into shared memory before it stores their dH, and no two tiles
            touch the same element (the backward thus needs no second ``P x 2n`` buffer).

    Returns:
        ``(dH (P, 2n) bf16, A' (P, n) bf16, ds (P,) fp32)``; dH is ``dh_out`` when given.

    Raises:
        TypeError / ValueError: as :func:`grouped_gemm`; also ``h``, ``row_scores`` or
            ``dh_out`` of the wrong dtype, shape or device, or ``dh_out`` overlapping ``h``
            without being ``h``.
    """
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
    if dh_out is not None and dh_out.data_ptr() != h.data_ptr() and _overlap(dh_out, h):
        raise ValueError("dh_out must be h itself or a buffer that does not overlap h: a "
                         "shifted overlap would overwrite H rows another tile still reads")
    return _varlen_m(dout, w2.transpose(1, 2), expert_offsets, gather_idx, dh_out, None,
                     (h, row_scores))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of two contiguous tensors intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _varlen_m(a, b, expert_offsets, gather_idx, out, swiglu, dswiglu=None):
    """:func:`grouped_gemm` (``swiglu`` and ``dswiglu`` None): ``(out, None)``;
    :func:`grouped_gemm_swiglu`: ``(H, A)``; :func:`grouped_gemm_dswiglu` (``dswiglu`` =
    ``(h, row_scores)``, validated by the caller; ``out`` receives dH): ``(dH, A', ds)``."""
    runtime.check_tensor("a", a, dtypes=(torch.bfloat16,), ndim=2)
    device = a.device
    b_n_major = b.ndim == 3 and not b.is_contiguous() and b.transpose(1, 2).is_contiguous()
    runtime.check_tensor("b", b.transpose(1, 2) if b_n_major else b, dtypes=(torch.bfloat16,),
                         ndim=3, device=device)
    num_experts = _check_offsets(expert_offsets, device)
    if b.shape[0] != num_experts:
        raise ValueError(f"b must have E = {num_experts} experts (expert_offsets has E+1 "
                         f"entries), got shape {tuple(b.shape)}")
    dim_n, dim_k = b.shape[1], b.shape[2]
    if a.shape[1] != dim_k:
        raise ValueError(f"a must have K = {dim_k} columns (b is (E, N, K)), got shape "
                         f"{tuple(a.shape)}")
    _check_width("K", dim_k)
    _check_width("N", dim_n)
    if gather_idx is not None:
        runtime.check_tensor("gather_idx", gather_idx, dtypes=(torch.int32,), ndim=1,
                             device=device)
        num_pairs = gather_idx.numel()
    else:
        num_pairs = a.shape[0]
    # The dH kernel's C is dH, (P, 2n) with n = N.
    out_name, out_cols = ("dh_out", 2 * dim_n) if dswiglu is not None else ("out", dim_n)
    if out is None:
        out = torch.empty(num_pairs, out_cols, dtype=torch.bfloat16, device=device)
    else:
        runtime.check_tensor(out_name, out, dtypes=(torch.bfloat16,), ndim=2, device=device)
        if tuple(out.shape) != (num_pairs, out_cols):
            raise ValueError(f"{out_name} must have shape ({num_pairs}, {out_cols}), got "
                             f"{tuple(out.shape)}")
    act = None
    if swiglu is not None:
        act = torch.empty(num_pairs, dim_n // 2, dtype=torch.bfloat16, device=device)
    gathered = gather_idx is not None
    tile_n, pingpong, cluster = _plan(False, dim_n, gathered, dim_k)
    if swiglu == "concat" and (dim_n // 2) % (tile_n // 2):
        tile_n = 128    # a tile's gate half must not run past n
    n_tiles = (dim_n + tile_n - 1) // tile_n
    ds_parts = None
    if dswiglu is not None:
        act = torch.empty(num_pairs, dim_n, dtype=torch.bfloat16, device=device)
        ds_parts = torch.zeros(num_pairs, n_tiles, dtype=torch.float32, device=device)
    if num_pairs == 0 or a.shape[0] == 0:
        return (out, act) if dswiglu is None else (out.zero_(), act.zero_(), ds_parts.sum(1))
    key = ("grouped_gemm_varlen_m", tile_n, pingpong, cluster, dim_n, dim_k, gathered, b_n_major,
           swiglu, dswiglu is not None)
    fn = runtime.compiled(key, lambda: _compile(False, tile_n, pingpong, cluster, 0, dim_n, dim_k,
                                                gathered, False, b_n_major, swiglu=swiglu,
                                                dswiglu=dswiglu is not None))
    # Each expert adds at most one partial m-tile; a cluster takes two m-tiles at a time.
    m_tiles_bound = (num_pairs + TILE_M - 1) // TILE_M + num_experts
    work_items = (m_tiles_bound + cluster - 1) // cluster * n_tiles
    addr = runtime.address
    offsets_addr = addr(expert_offsets, 4)
    # Without gather the index addresses are never read; expert_offsets' stands in for them.
    idx = addr(gather_idx, 4) if gathered else offsets_addr
    out_addr = addr(out, 16)
    # Addresses a variant never reads: out's stands in for them.
    h_addr, scores_addr, ds_addr = (
        (addr(dswiglu[0], 16), addr(dswiglu[1], 4), addr(ds_parts, 4)) if dswiglu is not None
        else (out_addr,) * 3)
    fn(addr(a, 16), addr(b, 16), out_addr, addr(act, 16) if act is not None else out_addr,
       h_addr, scores_addr, ds_addr, idx, idx, offsets_addr, a.shape[0],
       num_pairs if dswiglu is not None else 0, num_experts,
       _num_ctas(device, work_items, cluster))
    if dswiglu is not None:
        return out, act, ds_parts.sum(1)
    return out, act


def grouped_gemm_varlen_k(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
                          gather_idx_a: torch.Tensor | None = None,
                          gather_idx_b: torch.Tensor | None = None) -> torch.Tensor:
    """varlen-K grouped GEMM: ``C[e] = A_eᵀ · B_e`` over the rows of expert ``e``.

    DESIGN §3 backward (``dW2[e] = gather(dO)ᵀ_e · A'_e``, ``dW1[e] = dH_eᵀ · gather(X)_e``)
    and §4; SonicMoE (arXiv 2512.14080) §4.1. One persistent launch, fp32 accumulation in row
    order (bitwise deterministic), bf16 output; an expert with no rows gets zeros.

    Args:
        a: bf16, contiguous, CUDA: ``(P, M)``, or the ``(T_a, M)`` source rows when
            ``gather_idx_a`` is given (row ``r`` of ``A`` is ``a[gather_idx_a[r]]``).
        b: bf16, contiguous: ``(P, N)``, or ``(T_b, N)`` with ``gather_idx_b``.
        expert_offsets: ``(E+1,)`` int32, contiguous, non-decreasing from 0, last entry ``P``.
        gather_idx_a, gather_idx_b: ``(P,)`` int32, contiguous, or None.

    Returns:
        ``(E, M, N)`` bf16.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor is not a contiguous CUDA tensor of the right rank, devices differ,
            the row counts disagree, ``M`` or ``N`` is not a positive multiple of 8, or ``E``
            exceeds 1024.
    """
    runtime.check_tensor("a", a, dtypes=(torch.bfloat16,), ndim=2)
    device = a.device
    runtime.check_tensor("b", b, dtypes=(torch.bfloat16,), ndim=2, device=device)
    num_experts = _check_offsets(expert_offsets, device)
    dim_m, dim_n = a.shape[1], b.shape[1]
    _check_width("M (columns of a)", dim_m)
    _check_width("N (columns of b)", dim_n)
    rows = []
    for name, x, idx in (("a", a, gather_idx_a), ("b", b, gather_idx_b)):
        if idx is not None:
            runtime.check_tensor(f"gather_idx_{name}", idx, dtypes=(torch.int32,), ndim=1,
                                 device=device)
            rows.append(idx.numel())
        else:
            rows.append(x.shape[0])
    if rows[0] != rows[1]:
        raise ValueError(f"a and b must have the same number of rows P (after gathering), got "
                         f"{rows[0]} and {rows[1]}")
    out = torch.empty(num_experts, dim_m, dim_n, dtype=torch.bfloat16, device=device)
    if rows[0] == 0:
        return out.zero_()
    ga, gb = gather_idx_a is not None, gather_idx_b is not None
    # Only B gathered (dW1 = dHᵀ·gather(X)): compute C[e]ᵀ = B_eᵀ·A_e, the gathered rows on
    # the 128-wide M side and store it transposed; measured faster at the ANCHORS shapes.
    transpose_c = gb and not ga
    if transpose_c:
        a, b, gather_idx_a, gather_idx_b = b, a, gather_idx_b, None
        dim_m, dim_n, ga, gb = dim_n, dim_m, True, False
    tile_n, pingpong, cluster = _plan(True, dim_n, dim_m=dim_m)
    key = ("grouped_gemm_varlen_k", tile_n, pingpong, cluster, dim_m, dim_n, ga, gb, transpose_c)
    fn = runtime.compiled(key, lambda: _compile(True, tile_n, pingpong, cluster, dim_m, dim_n, 0,
                                                ga, gb, transpose_c=transpose_c))
    work_items = (num_experts * ((dim_m + TILE_M - 1) // TILE_M // cluster)
                  * ((dim_n + tile_n - 1) // tile_n))
    addr = runtime.address
    offsets_addr = addr(expert_offsets, 4)
    # An index address that is not gathered is never read; expert_offsets' stands in for it.
    out_addr = addr(out, 16)
    fn(addr(a, 16), addr(b, 16), out_addr, out_addr, out_addr, out_addr, out_addr,
       addr(gather_idx_a, 4) if ga else offsets_addr,
       addr(gather_idx_b, 4) if gb else offsets_addr, offsets_addr, a.shape[0], b.shape[0],
       num_experts, _num_ctas(device, work_items, cluster))
    return out


_MARKERS_TMA = ("wgmma.mma_async", "cp.async.bulk.tensor")

# The forward's up-proj and down-proj, and the backward's dA' (gathered dO · N-major W2).
for _n, _k, _gather, _n_major in ((512, 1536, True, False), (1536, 256, False, False),
                                  (256, 1536, True, True)):
    register(KernelVariant(
        kernel="grouped_gemm",
        variant=(f"varlen_m_n{_n}_k{_k}_{'gather' if _gather else 'contig'}"
                 f"{'_bn' if _n_major else ''}"),
        compile_fake=lambda n=_n, k=_k, g=_gather, nm=_n_major: _compile(
            False, *_plan(False, n, g, k), 0, n, k, g, False, nm, keep_ptx=True),
        ptx_markers=_MARKERS_TMA))
# The forward's up-proj with the SwiGLU epilogue, both gate/up layouts.
for _n, _gate_up in ((512, "concat"), (2048, "interleaved")):
    register(KernelVariant(
        kernel="grouped_gemm",
        variant=f"varlen_m_n{_n}_k1536_gather_swiglu_{_gate_up}",
        compile_fake=lambda n=_n, gu=_gate_up: _compile(
            False, *_plan(False, n, True, 1536), 0, n, 1536, True, False, swiglu=gu,
            keep_ptx=True),
        ptx_markers=_MARKERS_TMA))

# The backward's dH kernel: dA' with the dSwiGLU epilogue, on 128 x 256 tiles (four H slabs
# per tile) and on 128 x 128 tiles (n not a multiple of 256: two).
for _n in (1024, 192):
    register(KernelVariant(
        kernel="grouped_gemm",
        variant=f"varlen_m_n{_n}_k4096_gather_bn_dswiglu",
        compile_fake=lambda n=_n: _compile(False, *_plan(False, n, True, 4096), 0, n, 4096,
                                           True, False, True, dswiglu=True, keep_ptx=True),
        ptx_markers=_MARKERS_TMA))

# The backward's dW2 (gathered dO on the M side) and dW1 (gathered X, C stored transposed).
for _m, _n, _transpose in ((1536, 256, False), (1536, 512, True)):
    register(KernelVariant(
        kernel="grouped_gemm",
        variant=f"varlen_k_m{_m}_n{_n}_gather_a{'_ct' if _transpose else ''}",
        compile_fake=lambda m=_m, n=_n, tr=_transpose: _compile(
            True, *_plan(True, n, dim_m=m), m, n, 0, True, False, transpose_c=tr,
            keep_ptx=True),
        ptx_markers=_MARKERS_TMA))
