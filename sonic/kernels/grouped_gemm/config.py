"""Static configuration of one grouped-GEMM kernel: tile sizes, the frozen config, its cache key.

Pure Python (no ``cutlass``): the torch-facing dispatcher, the tile-plan heuristic and the CPU
tests use it without the CuTe DSL installed. A :class:`GroupedGemmConfig` holds every
compile-time choice and nothing batch-dependent, so it *is* the compile-cache key.
"""

from __future__ import annotations

from dataclasses import dataclass

from sonic.types import FP8_BLOCK, GATE_UP_LAYOUTS, GATED_ACTIVATIONS, GROUPED_GEMM_MAX_EXPERTS

TILE_M = 128
# M tiles: 256 rows (128 per consumer warpgroup) serve the cooperative bf16 sm_90a store
# kernels only (see GroupedGemmConfig).
TILE_MS = (TILE_M, 256)
TILE_K = 64
# FP8 k-tile: one 128-wide scale block per k-tile, so the mainloop promotes every k-tile; 128
# e4m3 values are one 128-byte swizzle line, the bytes of a bf16 TILE_K row.
TILE_K_FP8 = FP8_BLOCK
# Operand element types: bf16, or e4m3 with DeepSeek-V3 block scales (1x128 A, 128x128 B).
AB_DTYPES = ("bf16", "e4m3")
# Elements per 16-byte bf16 vector (epilogue stores, width checks).
VEC = 8
# Largest E: the varlen-M tile table lives in shared memory (4 bytes per expert).
MAX_EXPERTS = GROUPED_GEMM_MAX_EXPERTS
PRODUCER_THREADS = 128
CONSUMER_WARPGROUPS = 2
# CTAs per cluster of the multicast kernels.
CLUSTER = 2
THREADS = PRODUCER_THREADS + 128 * CONSUMER_WARPGROUPS


class NamedBarrier:
    """The hardware named barriers (``bar.sync`` / ``bar.arrive`` ids) of the grouped GEMM,
    all in one place (id 0 is the CTA-wide barrier). A role with one barrier per consumer
    warpgroup ``wg`` (0 or 1) uses ids ``BASE + wg``; plain ints, since the kernels add a
    traced warpgroup index to them.

    Attributes:
        MMA_TURN: turns at the tensor cores between the two consumer warpgroups (256
            threads): ping-pong hands the mainloop over (warpgroup ``wg`` waits at
            ``MMA_TURN + wg``, arrives at the other's), and the FP8 mainloop with one partial
            accumulator queues its WGMMAs in turn the same way (it never runs ping-pong).
        EPILOGUE: a warpgroup's epilogue staging (128 threads), ``EPILOGUE + wg``, where its
            warps share staged rows (transposed varlen-K blocks, sm_100's one epilogue
            warpgroup).
        CONSUMERS: both consumer warpgroups (256 threads): with ``store_in_stage`` both have
            read the tile's last ring stage before either stages C in it.
    """

    MMA_TURN = 1
    EPILOGUE = MMA_TURN + CONSUMER_WARPGROUPS
    CONSUMERS = EPILOGUE + CONSUMER_WARPGROUPS
# Epilogue: a warpgroup stages SLAB columns of its rows in shared memory, then stores them as
# 16-byte row chunks; PAD elements per staged row keep the accumulator writes free of bank
# conflicts.
SLAB = 64
PAD = 8
# Shared memory per CTA on sm_90 (227 KiB) less room for barriers and the tile table.
SMEM_BYTES = 227 * 1024 - (MAX_EXPERTS + 1) * 4 - 1024
MAX_STAGES = 8
# N tiles of the grouped GEMM (192: contiguous-A bf16 varlen-M only, see GroupedGemmConfig).
TILE_NS = (128, 192, 256)

EPILOGUES = ("store", "swiglu", "dswiglu")
# The kernel class of each architecture, "module:class", imported lazily by the dispatcher
# (interface.kernel_class): with FP8_MAINLOOPS, the one place a mainloop is registered.
MAINLOOPS = {"sm_90a": "sonic.kernels.grouped_gemm.sm90:Sm90GroupedGemm",
             "sm_100a": "sonic.kernels.grouped_gemm.sm100:Sm100GroupedGemm"}
# The block-scaled e4m3 mainloops, same form.
FP8_MAINLOOPS = {"sm_90a": "sonic.kernels.grouped_gemm.sm90_fp8:Sm90Fp8GroupedGemm"}
# Warpgroups running the epilogue: sm_90's two consumer warpgroups; sm_100's four epilogue
# warps (one TMEM lane quarter each) form one warpgroup holding all TILE_M rows of a tile.
EPILOGUE_WARPGROUPS = {"sm_90a": CONSUMER_WARPGROUPS, "sm_100a": 1}


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Every compile-time choice of one grouped-GEMM kernel (hashable: the compile-cache key).

    Attributes:
        varlen_k: varlen-K (``C[e] = A_eᵀ·B_e``, weight gradients) instead of varlen-M.
        tile_n: N tile, one of :data:`TILE_NS`; the K tile is :attr:`tile_k`.
        pingpong: ping-pong schedule (each consumer warpgroup owns a ``128 x tile_n`` tile,
            tile_n <= 192) instead of cooperative (both share one ``tile_m x tile_n`` tile,
            ``tile_m / 2`` rows each).
        cluster: CTAs per cluster, 1 or :data:`CLUSTER` (B tile multicast between CTAs
            taking consecutive m-tiles, or with ``multicast_a`` A between CTAs taking
            consecutive n-tiles).
        dim_m: M (varlen-K only; 0 for varlen-M, where M is the runtime ``P``).
        dim_n: N.
        dim_k: K (varlen-M only; 0 for varlen-K, where K is each expert's row count).
        gather_a, gather_b: rows of A / B gathered by index while loading (``gather_b``:
            varlen-K only).
        b_n_major: varlen-M B is the N-major view of a contiguous ``(E, K, N)``.
        transpose_c: varlen-K stores ``C[e]ᵀ`` ``(E, N, M)``.
        epilogue: ``"store"`` (C), ``"swiglu"`` (H and A = SwiGLU(H)) or ``"dswiglu"`` (dH, A',
            ds partials from dA', H and the row scores).
        gate_up: gate/up layout of the ``"swiglu"`` epilogue (``"concat"`` or
            ``"interleaved"``), else None.
        activation: the GLU variant the ``"swiglu"`` and ``"dswiglu"`` epilogues compute, one
            of :data:`sonic.types.GATED_ACTIVATIONS` (``"swiglu"`` with every other
            epilogue); bf16 only.
        arch: target architecture, a key of :data:`MAINLOOPS`.
        tile_m: M tile, one of :data:`TILE_MS`; 256 (two 128-row warpgroup halves, ``128 x
            128`` accumulators) only for the cooperative bf16 sm_90a store kernel on
            ``tile_n=128``, varlen-M with contiguous A or varlen-K.
        multicast_a: on a 2-CTA cluster, the CTAs take consecutive n-tiles of one m-tile and
            each loads half of the shared A tile (gathered: half of its rows; varlen-K: half
            of its 64-column blocks) for both (CUTLASS cluster shape 1 x 2); bf16, sm_90a;
            cooperative tiles with gathered A; varlen-K on 128-row tiles and an even n-tile
            count.
        n_band: varlen-M tile order. 0: each m-group (an m-tile, or a cluster's pair of
            them) walks all of N's :attr:`n_groups` before the next, expert after expert.
            ``w > 0``: N is cut into bands of ``w`` n-groups, and every m-group of every
            expert walks one band before any walks the next, so the m-tiles reading one
            band's B panels run together and share them through L2
            (:func:`.heuristic.band_width`); sm_90a varlen-M only (bf16 or e4m3).
        ab_dtype: operand type, ``"bf16"`` or ``"e4m3"`` (block-scaled FP8 on sm_90a,
            :data:`FP8_MAINLOOPS`: varlen-M with the store, SwiGLU or dSwiGLU epilogue, or
            varlen-K on K-major copies with the store epilogue).
        store_in_stage: sm_90a cooperative varlen-K (bf16, or e4m3 on K-major copies, whose
            ring stages have the same bytes per row): C is written by TMA from swizzled
            ``64 x SLAB`` boxes (``C[e]ᵀ``'s with ``transpose_c``), all but the last of a
            warpgroup's :attr:`tile_boxes` staged in the ring stage of the tile's last k-tile,
            which the consumers release once TMA has read them, the last in the warpgroup's
            own box; so a tile is staged without waiting for a store. False: the threads
            store C. Needs C's rows per expert (N if ``transpose_c``, else M) a multiple of
            64, so that no box reaches into the next expert's rows.

    Raises:
        ValueError: a combination no kernel implements (the message names it).
    """

    varlen_k: bool
    tile_n: int
    pingpong: bool
    cluster: int
    dim_m: int
    dim_n: int
    dim_k: int
    gather_a: bool
    gather_b: bool = False
    b_n_major: bool = False
    transpose_c: bool = False
    epilogue: str = "store"
    gate_up: str | None = None
    arch: str = "sm_90a"
    ab_dtype: str = "bf16"
    tile_m: int = TILE_M
    multicast_a: bool = False
    activation: str = "swiglu"
    n_band: int = 0
    store_in_stage: bool = False

    def __post_init__(self):
        if self.arch not in MAINLOOPS:
            raise ValueError(f"no grouped-GEMM mainloop for arch {self.arch!r}; registered: "
                             f"{sorted(MAINLOOPS)}")
        # FP8 first: its limits name the FP8 mainloop, not a bf16 schedule it never runs.
        if self.ab_dtype not in AB_DTYPES:
            raise ValueError(f"ab_dtype must be one of {AB_DTYPES}, got {self.ab_dtype!r}")
        if self.fp8:
            self._check_fp8()
        if self.tile_n not in TILE_NS:
            raise ValueError(f"tile_n must be one of {TILE_NS}, got {self.tile_n}")
        # 192-wide tiles: the contiguous-A bf16 sm_90 varlen-M kernel with the store
        # epilogue only, the one the plan runs them on and the GPU tests check (the fused
        # epilogues and the FP8 scale blocks are laid out in 128-column halves).
        if self.tile_n == 192 and (self.varlen_k or self.gather_a or self.epilogue != "store"
                                   or self.fp8 or self.arch != "sm_90a"):
            raise ValueError("tile_n=192 serves the contiguous-A bf16 sm_90a varlen-M kernel "
                             "with the store epilogue")
        if self.pingpong and self.tile_n > 192:
            raise ValueError("the ping-pong schedule holds a 128 x 128 or 128 x 192 tile per "
                             "warpgroup (its accumulator's registers)")
        if self.cluster not in (1, CLUSTER):
            raise ValueError(f"cluster must be 1 or {CLUSTER}, got {self.cluster}")
        self._check_tile_m()
        if self.multicast_a and (self.cluster == 1 or self.fp8 or self.arch != "sm_90a"
                                 or (self.gather_a and self.pingpong)):
            raise ValueError("multicast_a serves the bf16 sm_90a kernel on a "
                             f"{CLUSTER}-CTA cluster (cooperative tiles with gathered A)")
        if self.pingpong and self.cluster > 1 and self.varlen_k:
            raise ValueError("a ping-pong kernel on a 2-CTA cluster serves varlen-M")
        if self.n_band < 0 or (self.n_band and (self.varlen_k or self.arch != "sm_90a")):
            raise ValueError(f"n_band orders the sm_90a varlen-M tiles: 0 or a positive "
                             f"count of n-groups, got {self.n_band}")
        if self.varlen_k and self.multicast_a:
            if self.tile_m != TILE_M or self.n_tiles % self.cluster:
                raise ValueError(f"varlen-K sharing A pairs the n-tiles of N on {TILE_M}-row "
                                 f"tiles, got tile_m={self.tile_m}, {self.n_tiles} n-tiles")
        elif self.varlen_k and self.cluster > 1 and self.m_tiles % self.cluster:
            raise ValueError("varlen-K on a cluster pairs the m-tiles of M")
        if self.gather_b and not self.varlen_k:
            raise ValueError("gather_b serves the varlen-K kernel (varlen-M B is a weight)")
        if self.transpose_c and (not self.varlen_k or self.pingpong):
            raise ValueError("a transposed C serves the cooperative varlen-K kernel")
        self._check_store_in_stage()
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if (self.epilogue == "swiglu") != (self.gate_up is not None):
            raise ValueError("gate_up is given exactly with the 'swiglu' epilogue")
        if self.arch == "sm_100a" and (self.pingpong or self.cluster > 1 or self.transpose_c):
            raise ValueError("the sm_100a mainloop runs cooperative tiles on one CTA (no "
                             "ping-pong, no 2-CTA cluster, no transposed C)")
        if self.gate_up is not None and self.gate_up not in GATE_UP_LAYOUTS:
            raise ValueError(f"gate_up must be one of {GATE_UP_LAYOUTS}, got {self.gate_up!r}")
        if self.epilogue == "swiglu" and (self.varlen_k or not self.gather_a or self.b_n_major
                                          or self.pingpong):
            raise ValueError("the SwiGLU epilogue serves the gathered up-proj (cooperative)")
        # bf16 reads W2 N-major; FP8 reads a K-major e4m3 copy of W2ᵀ (checked above).
        if self.epilogue == "dswiglu" and (self.varlen_k or not self.gather_a
                                           or not (self.b_n_major or self.fp8)
                                           or self.pingpong or self.tile_n < TILE_M):
            raise ValueError("the dSwiGLU epilogue serves the gathered dA' GEMM "
                             "(cooperative, tile_n >= 128)")

        self._check_activation()

    def _check_activation(self):
        if self.activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got "
                             f"{self.activation!r}")
        if self.activation != "swiglu" and (self.epilogue == "store" or self.fp8):
            raise ValueError(f"activation={self.activation!r} serves the bf16 SwiGLU and "
                             "dSwiGLU epilogues (a GLU variant's gate function)")

    def _check_store_in_stage(self):
        if not self.store_in_stage:
            return
        if (not self.varlen_k or self.pingpong or self.arch != "sm_90a"
                or self.epilogue != "store"):
            raise ValueError("store_in_stage serves the cooperative sm_90a varlen-K kernel")
        rows, width = self.c_per_expert
        if rows % 64 or width % VEC:
            raise ValueError(f"store_in_stage needs C's rows per expert a multiple of 64 and "
                             f"its rows whole 16-byte lines, got M={self.dim_m}, "
                             f"N={self.dim_n}, transpose_c={self.transpose_c}")
        # Each warpgroup's boxes but one in the stage: 64 of its rows (of A's and B's k-tile)
        # per box.
        if 2 * (self.tile_boxes - 1) * 64 > self.tile_m + self.tile_n:
            raise ValueError(f"store_in_stage: a {self.tile_m} x {self.tile_n} tile's boxes do "
                             "not fit in its ring stage")

    def _check_tile_m(self):
        if self.tile_m not in TILE_MS:
            raise ValueError(f"tile_m must be one of {TILE_MS}, got {self.tile_m}")
        # 256 rows: each consumer warpgroup accumulates a 128 x 128 half (128 registers per
        # thread); the fused epilogues, the row gathers of varlen-M A (four producer warps of
        # 32 rows) and the FP8 / sm_100 mainloops are built around 128-row tiles.
        if self.tile_m != TILE_M and (
                self.pingpong or self.tile_n != 128 or self.epilogue != "store"
                or self.fp8 or self.arch != "sm_90a"
                or (self.gather_a and not self.varlen_k)):
            raise ValueError(f"tile_m={self.tile_m} serves the cooperative bf16 sm_90a store "
                             "kernel on tile_n=128 (varlen-M with contiguous A, or varlen-K)")

    def _check_fp8(self):
        if self.arch not in FP8_MAINLOOPS:
            raise ValueError(f"no FP8 grouped-GEMM mainloop for arch {self.arch!r}; registered: "
                             f"{sorted(FP8_MAINLOOPS)}")
        if self.b_n_major:
            raise ValueError("the FP8 mainloop reads K-major B (FP8 WGMMA reads both operands "
                             "K-major)")
        if self.pingpong:
            raise ValueError("the FP8 mainloop runs cooperative tiles")
        if self.varlen_k:
            # The operands are the K-major copies of fp8_quant.quantize_cols_grouped: the
            # gather happened there, and each expert's rows are padded to whole k-tiles.
            if self.gather_a or self.gather_b or self.transpose_c:
                raise ValueError("the FP8 varlen-K mainloop reads K-major copies (no gather, "
                                 "no transposed C)")
            if (self.tile_n == 192 or self.dim_m % TILE_M or self.dim_n % TILE_K_FP8
                    or self.dim_n % self.tile_n):
                raise ValueError(f"the FP8 varlen-K mainloop runs 128 x 128 or 128 x 256 tiles "
                                 f"on M and N multiples of 128 and of the tile, got "
                                 f"tile_n={self.tile_n}, M={self.dim_m}, N={self.dim_n}")
            return
        # A 256-wide tile's second 128-column sub-tile must lie inside N: its B scale block
        # is read whether or not its columns are stored.
        if self.tile_n == 256 and self.dim_n % 256:
            raise ValueError(f"FP8 256-wide tiles need N a multiple of 256, got N={self.dim_n}")
        if self.dim_k % TILE_K_FP8 or self.dim_n % TILE_K_FP8:
            raise ValueError(f"the FP8 mainloop needs K and N multiples of {TILE_K_FP8} (one "
                             f"scale block per k-tile and n-tile), got K={self.dim_k}, "
                             f"N={self.dim_n}")

    @property
    def fp8(self) -> bool:
        return self.ab_dtype == "e4m3"

    @property
    def mainloop(self) -> str:
        """``"module:class"`` of this configuration's kernel."""
        return (FP8_MAINLOOPS if self.fp8 else MAINLOOPS)[self.arch]

    # Tiles and the operand ring.
    @property
    def tile_k(self) -> int:
        return TILE_K_FP8 if self.fp8 else TILE_K

    @property
    def ab_bytes(self) -> int:
        """Bytes per operand element."""
        return 1 if self.fp8 else 2

    @property
    def n_tiles(self) -> int:
        return (self.dim_n + self.tile_n - 1) // self.tile_n

    @property
    def m_tiles(self) -> int:
        return (self.dim_m + self.tile_m - 1) // self.tile_m

    @property
    def n_groups(self) -> int:
        """varlen-M n-tile groups of a work item: n-tiles, or with ``multicast_a`` pairs of
        them (the last one half phantom when the n-tile count is odd)."""
        if self.multicast_a:
            return (self.n_tiles + self.cluster - 1) // self.cluster
        return self.n_tiles

    def varlen_m_work_items(self, m_tiles):
        """varlen-M work items over ``m_tiles`` linear m-tiles (a Python or a traced int):
        m-tiles × n-tiles, in pairs of m-tiles on a cluster sharing B, of n-tiles on one
        sharing A (``multicast_a``)."""
        if self.multicast_a:
            return m_tiles * self.n_groups
        return (m_tiles + self.cluster - 1) // self.cluster * self.n_tiles

    @property
    def varlen_k_items_per_expert(self) -> int:
        """varlen-K work items of one expert: m-tiles × n-tiles, on a cluster in pairs of
        m-tiles (sharing B) or of n-tiles (``multicast_a``)."""
        return self.m_tiles * self.n_tiles // self.cluster

    @property
    def k_tiles(self) -> int:
        return (self.dim_k + self.tile_k - 1) // self.tile_k

    @property
    def rows_wg(self) -> int:
        """Tile rows of one epilogue warpgroup's accumulator."""
        if self.pingpong:
            return self.tile_m
        return self.tile_m // EPILOGUE_WARPGROUPS[self.arch]

    @property
    def staged_rows(self) -> int:
        """Rows of a warpgroup's accumulator the epilogue stages at a time: all ``rows_wg``,
        or on 256-row tiles one 64-row WGMMA block, so that the ring keeps four stages."""
        return 64 if self.tile_m == 256 else self.rows_wg

    @property
    def stages(self) -> int:
        """Ring stages: as many ``A + B`` k-tiles as fit beside the epilogue's staging buffer."""
        return min(MAX_STAGES, (SMEM_BYTES - self.staging_elems * 2) // self.tma_bytes)

    @property
    def staging_elems(self) -> int:
        """bf16 elements of the epilogue staging buffer (one :attr:`staged_block_elems` block
        per epilogue warpgroup)."""
        return EPILOGUE_WARPGROUPS[self.arch] * self.staged_block_elems

    @property
    def staged_block_elems(self) -> int:
        """bf16 elements of one warpgroup's staging block: ``staged_rows x SLAB``, padded, or
        with :attr:`store_in_stage` one swizzled ``64 x SLAB`` box."""
        if self.store_in_stage:
            return 64 * SLAB
        return self.staged_rows * (SLAB + PAD)

    @property
    def c_per_expert(self) -> tuple[int, int]:
        """varlen-K: ``(rows, width)`` of one expert's C as stored, ``C[e]`` ``(M, N)`` or
        with :attr:`transpose_c` ``C[e]ᵀ`` ``(N, M)``."""
        return (self.dim_n, self.dim_m) if self.transpose_c else (self.dim_m, self.dim_n)

    @property
    def tile_boxes(self) -> int:
        """``64 x SLAB`` boxes of C one consumer warpgroup holds per tile (its 64-row blocks ×
        SLAB-column slabs)."""
        return self.rows_wg // 64 * (self.tile_n // SLAB)

    @property
    def tma_bytes(self) -> int:
        """Bytes of one operand stage: every operand arrives by TMA (out-of-bounds boxes are
        zero-filled and counted), so a stage is complete at one expect-tx and these bytes."""
        return (self.tile_n + self.tile_m) * self.tile_k * self.ab_bytes + self.col_scale_bytes

    @property
    def col_scale_bytes(self) -> int:
        """FP8 varlen-K: bytes of a stage's B column scales (the k-tile's fp32 scale of each
        of the tile's ``tile_n`` columns), loaded by the producer with the operands."""
        return self.tile_n * 4 if self.fp8 and self.varlen_k else 0

    @property
    def b_scales_align(self) -> int:
        """Byte alignment the kernel assumes of B's FP8 scales: 16 where they are bulk-copied
        (:attr:`col_scale_bytes`), else 4."""
        return 16 if self.col_scale_bytes else 4

    @property
    def b_halves(self) -> bool:
        """varlen-M B n-tile loaded as two half boxes, rows ``nt·tile_n/2 ..`` and
        ``N/2 + nt·tile_n/2 ..``: the SwiGLU "concat" epilogue asks for it so that gate and up
        of one output column land in the same thread's accumulator."""
        return self.epilogue == "swiglu" and self.gate_up == "concat"

    @property
    def mn_major_k(self) -> bool:
        """varlen-K on MN-major operand rows (bf16: the rows as the forward wrote them); FP8
        varlen-K reads K-major copies instead, as tiles."""
        return self.varlen_k and not self.fp8

    @property
    def row_copies(self) -> bool:
        """Producers spread row copies over four warps (and keep row indices in registers)."""
        return self.mn_major_k or self.gather_a

    @property
    def overlapped_promotion(self) -> bool:
        """FP8: promote each k-tile while the next one's WGMMAs run (two partial
        accumulators, :mod:`.sm90_fp8`). Not with gathered rows: the third accumulator needs
        the 232 registers per consumer thread that the row-copy producers' 56 leave short
        (224 spills; producers cut to 40 starve the row copies: slower either way). Not on
        256-wide tiles: their promoted accumulator alone takes 128 registers per thread. Not
        varlen-K: its k-tile count is the expert's, so the k-loop cannot be unrolled."""
        return self.fp8 and not self.row_copies and self.tile_n == 128 and not self.varlen_k

    @property
    def wgmma_turns(self) -> bool:
        """FP8 with one partial accumulator: the two consumer warpgroups queue their WGMMAs in
        turn (named barriers), so one warpgroup's promotion runs while the tensor cores
        work through the other's WGMMAs instead of both waiting at once. Faster or level for
        every FP8 GEMM but the fused SwiGLU up-proj, which it slows, and the gathered GEMMs on
        128-wide tiles: there, beside the row-copy producers' 56 registers, ptxas put the
        producers' TMA loads in waterfall loops and the GEMM ran 3x slower (benchmarks/
        RESULTS.md; the compile check now fails such loops)."""
        return (self.fp8 and not self.overlapped_promotion and self.epilogue != "swiglu"
                and not (self.gather_a and self.tile_n == 128))

    @property
    def scale_prefetch(self) -> bool:
        """FP8 with one partial accumulator: each k-tile's scales are loaded a k-tile ahead of
        their promotion (:mod:`.sm90_fp8`), so that their L2 round trip does not hold up the
        WGMMA turn. Where measured faster or level: the contiguous varlen-M GEMMs (down-proj,
        dX) and the fused SwiGLU and dSwiGLU ones; not the gathered GEMMs with the store
        epilogue nor varlen-K, measured slower (benchmarks/RESULTS.md)."""
        return (self.fp8 and not self.overlapped_promotion and not self.varlen_k
                and not (self.gather_a and self.epilogue == "store"))

    @property
    def tma_stored(self) -> tuple[str, ...]:
        """The outputs (:class:`~sonic.kernels.grouped_gemm.args.Operands` fields) written by
        TMA box stores (``cp.async.bulk.tensor``) instead of thread stores, on sm_90: C of
        the bf16 plain store on cooperative varlen-M tiles (deferred,
        :meth:`~.epilogue.base.Epilogue.defers`) and of varlen-K tiles with
        :attr:`store_in_stage` (bf16 or e4m3 operands), and dH and A' of the dSwiGLU epilogue
        (:attr:`~.epilogue.dswiglu.DswigluEpilogue.tma_store`). Tools that track writes per
        thread do not see them: compute-sanitizer's initcheck reports later reads of these rows
        as uninitialised."""
        if self.store_in_stage:
            return ("c",)
        if self.arch != "sm_90a" or self.fp8:
            return ()
        if self.epilogue == "dswiglu":
            return ("c", "act")
        if self.epilogue == "store" and not self.pingpong and not self.varlen_k:
            return ("c",)
        return ()

    @property
    def consumer_heavy(self) -> bool:
        """Row-copy kernels whose consumers take 232 registers (producers 40) instead of 224
        (56), where a same-run A/B showed it faster (benchmarks/RESULTS.md): FP8 on 256-wide
        tiles (the promoted and partial accumulators spill at 224) and the bf16 up-proj with
        the SwiGLU epilogue on 256-wide tiles. Not the bf16 dH kernel: its producers also
        load H, and with 40 registers it runs much slower."""
        return self.tile_n == 256 and (self.fp8 or self.epilogue == "swiglu")

    @property
    def producer_regs(self) -> int:
        # setmaxnreg moves registers within the CTA's launch allocation (168 per thread of
        # 384): 128 x producer + 256 x consumer must fit, or the consumers' increase waits
        # forever.
        return 56 if self.row_copies and not self.consumer_heavy else 40

    @property
    def consumer_regs(self) -> int:
        return 224 if self.row_copies and not self.consumer_heavy else 232

    @property
    def cache_key(self) -> tuple:
        """Key of :func:`sonic.kernels.runtime.compiled`: the kernel family and this config."""
        return ("grouped_gemm", self)


@dataclass(frozen=True)
class BarrierContract:
    """Arrival counts of the operand ring's mbarriers, derived from the warp roles.

    Attributes:
        full: arrivals completing a *full* barrier phase (besides the transaction bytes).
        empty: arrivals completing an *empty* barrier phase.
    """

    full: int
    empty: int


def barrier_contract(cfg: GroupedGemmConfig) -> BarrierContract:
    """Re-derive the ring's arrival counts from the role configuration.

    * full[s]: producer -> consumers. One elected producer thread arrives with expect-tx for
      the stage's bytes (one arrival), whatever the number of producer warps issuing copies.
    * empty[s]: consumers -> producers. sm_90: every consumer warp reading the stage arrives
      once when done: 4 warps of one warpgroup (ping-pong: one warpgroup reads a stage) or of
      both (cooperative), and on a cluster on the barrier of every CTA, because every CTA's
      producer writes (multicasts) into the stage of both. sm_100: one arrival, the MMA
      warp's ``tcgen05.commit`` (or, for a dSwiGLU H stage, one epilogue thread after the
      epilogue warps' named barrier).

    The base kernel initialises its barriers with these counts and asserts, while tracing,
    that they equal what the consumer and producer code paths issue, so a wrong count fails
    compilation instead of hanging the GPU.
    """
    if cfg.arch == "sm_100a":
        return BarrierContract(full=1, empty=1)
    readers_per_cta = 1 if cfg.pingpong else CONSUMER_WARPGROUPS
    return BarrierContract(full=1, empty=4 * readers_per_cta * cfg.cluster)
