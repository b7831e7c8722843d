"""The grouped-GEMM kernel skeleton: warp roles, shared storage, launch; the mainloop is a hook.

docs/design.md §4; SonicMoE (arXiv 2512.14080) §4.1–4.2. One persistent, warp-specialised launch per
GEMM; the architecture's subclass (:mod:`.sm90`, :mod:`.sm100`) supplies the tiled MMA, its
warp roles (:meth:`GroupedGemmKernel.run_roles`) and the mainloop, and hands finished tiles to
the epilogue (:mod:`.epilogue`). The operand shared-memory layouts are common: the UMMA
canonical 128-byte-swizzled K- and MN-major layouts are byte for byte the WGMMA ones, so one
set of TMA producers (:mod:`.load`) feeds both mainloops.

Pipeline contract (checked while tracing by :meth:`GroupedGemmKernel.check_contract`):

* Warp roles (sm_90; sm_100's are in :mod:`.sm100`). Warpgroup 0 (``PRODUCER_THREADS``)
  produces: the TMA loads of A and B
  (:mod:`.load`) and an epilogue's own loads (dSwiGLU's H). Warpgroups 1..2 consume: the
  MMA mainloop over a tile's k-tiles, then the epilogue — cooperatively on one
  ``128 x tile_n`` tile (64 rows each) or ping-pong, each on its own ``128 x tile_n`` tile.
* ``full[s]`` (producer -> consumers), count ``barrier_contract(cfg).full`` = 1: one elected
  producer thread arrives with expect-tx for the stage's bytes; the stage is full once that
  arrival and all its bytes landed.
* ``empty[s]`` (consumers -> producers), count ``barrier_contract(cfg).empty`` = 4 warps per
  reading warpgroup (ping-pong: 1, cooperative: 2) × cluster CTAs: every MMA warp arrives once
  on the stage's barrier in every CTA of the cluster when done reading it (on a cluster both
  CTAs' producers write into the stage of both); with ``store_in_stage`` the stage of a
  tile's last k-tile is released by the epilogue, once TMA has read the C boxes staged in it.
* Named barriers (:class:`~.config.NamedBarrier`): ``MMA_TURN + wg`` hand the tensor cores
  between the consumer warpgroups (256 threads); ``EPILOGUE + wg`` orders a warpgroup's
  epilogue staging (128 threads) where its warps share staged rows (transposed varlen-K
  blocks, sm_100, C stored from the ring stage); otherwise each warp stages its own rows and
  synchronises with itself; ``CONSUMERS`` (256 threads): both warpgroups are done with a
  tile's last stage before C is staged in it.
* Cluster sync after barrier init and tile-table build, and before exit (no CTA leaves while
  its peer can still arrive on its barriers).

Imports ``cutlass``: only the kernel modules import this one.
"""

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cuda.bindings import driver as cuda
from cutlass import BFloat16 as BF16, Float8E4M3FN, Float32 as F32, Int32, Int64, cute
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from sonic.kernels import runtime
from sonic.kernels.grouped_gemm.args import (BlockScales, EpilogueOutputs, KernelPointers,
                                             OperandTmas, RowSources, SchedulerArgs,
                                             StageMemory, WorkItems)
from sonic.kernels.grouped_gemm.config import (MAX_EXPERTS, THREADS, GroupedGemmConfig,
                                               barrier_contract)
from sonic.kernels.grouped_gemm.epilogue import make_epilogue
from sonic.kernels.grouped_gemm.load import FULL_ARRIVALS, TmaProducers
from sonic.kernels.grouped_gemm.pipeline import OperandRing
from sonic.kernels.grouped_gemm.protocols import TileScheduler
from sonic.kernels.grouped_gemm.tile_scheduler import make_scheduler


class GroupedGemmKernel(TmaProducers):
    """One static configuration of the grouped GEMM (architecture-independent part).

    Subclasses implement :meth:`make_tiled_mma` and :meth:`run_roles`, and may extend the
    shared storage (:meth:`extra_storage`) and warp 0's setup (:meth:`setup_warp0`). The
    launcher takes the addresses of :class:`~.args.Operands` and the :class:`~.args.Sizes`
    (:meth:`__call__`); inside, the arguments travel as the bundles of :mod:`.args`.
    """

    def __init__(self, cfg: GroupedGemmConfig):
        self.cfg = cfg
        self.ring = OperandRing(cfg)
        self.scheduler: TileScheduler = make_scheduler(cfg)
        self.epilogue = make_epilogue(cfg, self.ring)
        self.contract = barrier_contract(cfg)
        self.threads = THREADS
        self.ab_type = Float8E4M3FN if cfg.fp8 else BF16
        # Operand majorness: varlen-M reads K-major A rows, bf16 varlen-K MN-major rows (FP8
        # varlen-K K-major copies); varlen-M B is K-major or (b_n_major) N-major.
        self.a_layout = LayoutEnum.COL_MAJOR if cfg.mn_major_k else LayoutEnum.ROW_MAJOR
        self.b_layout = (LayoutEnum.COL_MAJOR if cfg.mn_major_k or cfg.b_n_major
                         else LayoutEnum.ROW_MAJOR)

    # Architecture hooks.
    def make_tiled_mma(self):
        """The tiled MMA of the mainloop."""
        raise NotImplementedError

    def run_roles(self, tidx, warp_idx, work: WorkItems, tiled_mma, storage, tmas: OperandTmas,
                  epi_tmas: tuple, stages: StageMemory, pointers: KernelPointers,
                  rows: RowSources, sched: SchedulerArgs):
        """Every thread after setup: its warp's role (producer, MMA, epilogue) over the CTA's
        ``work`` items."""
        raise NotImplementedError

    def setup_warp0(self, storage):
        """Warp 0, after the ring's barriers and the tile table: an architecture's own setup
        (barriers, tensor memory); made visible by the CTA barrier that follows."""

    def make_smem_layouts(self):
        """``(a_smem, b_smem)``: staged, 128-byte-swizzled operand layouts of the ring (the
        WGMMA helpers' layouts, which UMMA reads unchanged)."""
        cfg = self.cfg
        tile_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        return (sm90_utils.make_smem_layout_a(self.a_layout, tile_mnk, self.ab_type, cfg.stages),
                sm90_utils.make_smem_layout_b(self.b_layout, tile_mnk, self.ab_type, cfg.stages))

    def extra_storage(self) -> dict:
        """An architecture's own shared-memory fields (name -> type), placed after the ring's
        barriers."""
        return {}

    def col_scale_stages(self, storage):
        """Shared memory of the ring stages' B column scales (an :meth:`extra_storage`
        field of the FP8 varlen-K mainloop), or None."""
        return None

    def shared_storage(self, a_smem, b_smem):
        """The CTA's shared-memory struct: ring barriers, :meth:`extra_storage`, tile table,
        operand stages, the epilogue's staging buffer."""
        cfg = self.cfg
        fields = {
            "full": cute.struct.MemRange[Int64, cfg.stages],
            "empty": cute.struct.MemRange[Int64, cfg.stages],
            **self.extra_storage(),
            "tile_start": cute.struct.MemRange[Int32, MAX_EXPERTS + 1],
            "sA": cute.struct.Align[cute.struct.MemRange[self.ab_type, cute.cosize(a_smem)],
                                    1024],
            "sB": cute.struct.Align[cute.struct.MemRange[self.ab_type, cute.cosize(b_smem)],
                                    1024],
            # 1024-byte aligned: a staging block may be a TMA store's swizzled source.
            "sC": cute.struct.Align[cute.struct.MemRange[
                BF16, self.epilogue.staging_elems()], 1024],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def check_contract(self, tiled_mma) -> None:
        """Trace-time check of the pipeline contract: the barrier counts the kernel initialises
        (:func:`barrier_contract`, from the configuration) must equal the arrivals its code
        paths make — one expect-tx per fill, and one release per MMA warp (the tiled MMA's
        threads / 32) on each CTA of the cluster. A mismatch would hang the GPU; here it
        fails compilation.

        Raises:
            AssertionError: the counts differ (names both).
        """
        mma_warps = tiled_mma.size // 32
        empty = mma_warps * self.ring.cluster
        assert self.contract.full == FULL_ARRIVALS, (
            f"full barrier initialised for {self.contract.full} arrivals, the producer makes "
            f"{FULL_ARRIVALS}")
        assert self.contract.empty == empty, (
            f"empty barrier initialised for {self.contract.empty} arrivals, {mma_warps} MMA "
            f"warps releasing on {self.ring.cluster} CTA(s) make {empty}")

    @cute.jit
    def __call__(self, a_addr: Int64, b_addr: Int64, c_addr: Int64, act_addr: Int64,
                 h_addr: Int64, scores_addr: Int64, ds_addr: Int64,
                 gather_a_addr: Int64, gather_b_addr: Int64, offsets_addr: Int64,
                 a_scales_addr: Int64, b_scales_addr: Int64, rows_a: Int32,
                 rows_b: Int32, num_experts: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):
        """The compiled launcher's entry, the one flat signature: the addresses of
        :class:`~.args.Operands` in field order, then :class:`~.args.Sizes`, then the
        stream; everything past here travels in bundles."""
        cfg = self.cfg
        gmem = runtime.gmem_ptr
        a, b = gmem(self.ab_type, a_addr, 16), gmem(self.ab_type, b_addr, 16)
        c = gmem(BF16, c_addr, 16)
        act = gmem(BF16, act_addr, 16)
        h, scores, ds = gmem(BF16, h_addr, 16), gmem(F32, scores_addr, 4), gmem(F32, ds_addr, 4)
        gather_a, gather_b = gmem(Int32, gather_a_addr, 4), gmem(Int32, gather_b_addr, 4)
        offsets = gmem(Int32, offsets_addr, 4)
        scales = None
        if cutlass.const_expr(cfg.fp8):
            scales = BlockScales(gmem(F32, a_scales_addr, 4),
                                 gmem(F32, b_scales_addr, cfg.b_scales_align))
        pointers = KernelPointers(EpilogueOutputs(c, act, scores, ds), scales)
        tiled_mma = self.make_tiled_mma()
        self.check_contract(tiled_mma)
        a_smem, b_smem = self.make_smem_layouts()
        tmas = self.make_operand_tmas(a, b, rows_a, rows_b, num_experts, a_smem, b_smem)
        # dSwiGLU reads H (P, 2n) and writes dH and A' (P rows), with P passed as rows_b.
        epi_tmas = self.epilogue.make_tma(h, c, act, rows_b, num_experts, a_smem)
        self.storage_type = self.shared_storage(a_smem, b_smem)
        self.kernel(tiled_mma, tmas, epi_tmas, a_smem, b_smem, pointers, gather_a, gather_b,
                    offsets, rows_a, rows_b, num_experts).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], cluster=[cfg.cluster, 1, 1],
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tmas, epi_tmas: tuple,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, pointers: tuple,
               gather_a: cute.Pointer, gather_b: cute.Pointer, offsets: cute.Pointer,
               rows_a: Int32, rows_b: Int32, num_experts: Int32):
        """Setup (barrier init, tile table, :meth:`setup_warp0`), then :meth:`run_roles`.

        ``tmas``: :class:`~.args.OperandTmas`; ``epi_tmas``: the epilogue's
        (:meth:`.epilogue.base.Epilogue.make_tma`); ``pointers``:
        :class:`~.args.KernelPointers`. The parameters keep the order of the kernel's
        PTX parameters."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = SmemAllocator()
        storage = smem.allocate(self.storage_type)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        table = storage.tile_start.get_tensor(cute.make_layout(MAX_EXPERTS + 1))
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        # Raw stage memory (A space, B space, swizzle) for an epilogue's own loads, and the
        # stages' B column scales (FP8 varlen-K; :meth:`col_scale_stages`).
        a_base, b_base = storage.sA.data_ptr(), storage.sB.data_ptr()
        col_scales = self.col_scale_stages(storage)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        stages = StageMemory(sA, sB, a_base, b_base, a_smem.inner, b_smem.inner, col_scales,
                             full, empty)
        mOffsets = cute.make_tensor(offsets, cute.make_layout(num_experts + 1))
        sched = SchedulerArgs(mOffsets, table, num_experts)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tmas.a.atom)
            cpasync.prefetch_descriptor(tmas.b.atom)
            if cutlass.const_expr(cfg.mn_major_k):
                cpasync.prefetch_descriptor(tmas.a_row.atom)
                cpasync.prefetch_descriptor(tmas.b_row.atom)
            if cutlass.const_expr(self.epilogue.has_producer_loads):
                self.epilogue.prefetch(epi_tmas)
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(cfg.stages):
                    cute.arch.mbarrier_init(full + s, self.contract.full)
                    cute.arch.mbarrier_init(empty + s, self.contract.empty)
            cute.arch.mbarrier_init_fence()
            self.scheduler.prepare(sched)
            self.setup_warp0(storage)
        self.ring.sync_cluster()

        # Work items: tiles, or on a cluster pairs of m-tiles (one per CTA) of an n-tile
        # (multicast_a: pairs of n-tiles of an m-tile).
        first, step = bidx, grid
        if cutlass.const_expr(cfg.cluster > 1):
            first, step = bidx // cfg.cluster, grid // cfg.cluster
        work = WorkItems(first, step, self.scheduler.total(sched))

        self.run_roles(tidx, warp_idx, work, tiled_mma, storage, tmas, epi_tmas, stages, pointers,
                       RowSources(gather_a, gather_b, rows_a, rows_b), sched)
        # On a cluster no CTA may exit while the other can still arrive on its barriers.
        if cutlass.const_expr(cfg.cluster > 1):
            self.ring.sync_cluster()
