"""Static persistent tile schedulers over the device-side ``expert_offsets`` (varlen-M, varlen-K).

CTA ``b`` of a grid of ``G`` takes work items ``b, b + G, ...`` (on a cluster: cluster ``b`` of
``G / cluster`` takes pairs of m-tiles). A work item decodes to (expert, first row, rows, n-tile,
m-tile, shared) with no host synchronisation: experts with no rows own no tile, and ragged last
tiles are masked by the epilogue. Producer and consumer warps decode the same sequence.
Imports ``cutlass``: only the kernel modules import this one.
"""

import cutlass
from cutlass import Int32, cute

from sonic.kernels.grouped_gemm.args import SchedulerArgs, TileCoord
from sonic.kernels.grouped_gemm.config import GroupedGemmConfig
from sonic.kernels.grouped_gemm.protocols import TileScheduler


@cute.jit
def last_at_most(starts: cute.Tensor, value: Int32, count: Int32) -> Int32:
    """The largest ``e < count`` with ``starts[e] <= value``, by binary search over the
    non-decreasing ``starts`` (``starts[0] <= value``): which expert of a table of expert
    starts (rows, tiles, padded rows) holds ``value``."""
    lo = Int32(0)
    hi = count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= value:
            lo = mid
        else:
            hi = mid - 1
    return lo


class VarlenMScheduler:
    """A :class:`~.protocols.TileScheduler`.

    varlen-M: linear m-tiles of all experts × n-tiles, via a per-CTA table in shared memory.

    ``table[e]`` is expert ``e``'s first linear m-tile (built from ``expert_offsets`` by one warp
    scan) and a binary search maps a linear m-tile back to its expert. On a 2-CTA cluster the
    CTAs take consecutive m-tiles of one n-tile; ``shared`` says both are the same expert's, so
    the B tile can be multicast. With ``multicast_a`` they take consecutive n-tiles of one
    m-tile instead, and always share its A tile (``shared``, which is about B, stays False).
    """

    def __init__(self, cfg: GroupedGemmConfig):
        self.cfg = cfg
        self.cluster = cfg.cluster
        self.n_tiles = cfg.n_tiles
        self.k_tiles = cfg.k_tiles
        self.tile_m = cfg.tile_m

    @cute.jit
    def prepare(self, sched: SchedulerArgs):
        """``table[e]`` = first linear m-tile of expert ``e``; ``table[E]`` = all m-tiles.

        One warp: each lane sums the m-tile counts of a contiguous chunk of experts, a
        shuffle scan turns the sums into chunk starts, then each lane writes its chunk.
        """
        mOffsets, table, num_experts = sched
        lane = cute.arch.lane_idx()
        chunk = (num_experts + 31) // 32
        lo = lane * chunk
        hi = lo + chunk
        if hi > num_experts:
            hi = num_experts
        local = Int32(0)
        for e in cutlass.range(lo, hi, unroll=1):
            local += (mOffsets[e + 1] - mOffsets[e] + self.tile_m - 1) // self.tile_m
        inclusive = local
        for i in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(inclusive, 1 << i)
            if lane >= (1 << i):
                inclusive += other
        run = inclusive - local
        for e in cutlass.range(lo, hi, unroll=1):
            table[e] = run
            run += (mOffsets[e + 1] - mOffsets[e] + self.tile_m - 1) // self.tile_m
        if lane == 31:
            table[num_experts] = inclusive

    def total(self, sched: SchedulerArgs):
        """Work items: :meth:`GroupedGemmConfig.varlen_m_work_items` of all m-tiles."""
        return self.cfg.varlen_m_work_items(sched.table[sched.num_experts])

    @cute.jit
    def decode(self, t: Int32, sched: SchedulerArgs) -> TileCoord:
        """Work item ``t`` → its :class:`~.args.TileCoord`.

        The first row is a row of ``P`` and ``rows`` the rows of the expert left from it. On a
        cluster, ``t`` is a pair of linear m-tiles and this CTA takes the one of its rank. With
        an odd m-tile count the last pair's second CTA repeats the first one's tile with no
        rows (it loads its half of B and stores nothing). With ``multicast_a``, ``t`` is a pair
        of n-tiles of one m-tile, and with an odd n-tile count the last pair's second CTA
        takes the last n-tile with no rows (it loads its half of A and stores nothing).
        """
        mOffsets, table, num_experts = sched
        shared = False
        mg, nt = self.m_group_and_n_group(t, sched)
        phantom = False
        e_peer = Int32(0)
        if cutlass.const_expr(self.cfg.multicast_a):
            nt = nt * self.cluster + cute.arch.make_warp_uniform(
                cute.arch.block_idx_in_cluster())
            if nt >= self.n_tiles:
                phantom = True
                nt = Int32(self.n_tiles - 1)
        elif cutlass.const_expr(self.cluster > 1):
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
        row0 = mOffsets[e] + mt * self.tile_m
        rows = mOffsets[e + 1] - row0
        if cutlass.const_expr(self.cluster > 1 and not self.cfg.multicast_a):
            shared = e == e_peer
        if cutlass.const_expr(self.cluster > 1):
            if phantom:
                rows = Int32(0)
        return TileCoord(e, row0, rows, nt, mt, shared)

    @cute.jit
    def m_group_and_n_group(self, t: Int32, sched: SchedulerArgs):
        """Work item ``t`` → (linear m-group, n-group) in the configuration's tile order
        (:attr:`GroupedGemmConfig.n_band`)."""
        n_groups = self.cfg.n_groups
        if cutlass.const_expr(self.cfg.n_band == 0):
            mg = t // n_groups
            nt = t - mg * n_groups
        else:
            band = self.cfg.n_band
            m_tiles = sched.table[sched.num_experts]
            m_groups = m_tiles
            if cutlass.const_expr(self.cluster > 1 and not self.cfg.multicast_a):
                m_groups = (m_tiles + self.cluster - 1) // self.cluster
            first = t // (m_groups * band) * band
            width = n_groups - first
            if width > band:  # every band but the last, which holds what is left of N
                width = Int32(band)
            rest = t - first * m_groups
            mg = rest // width
            nt = first + rest - mg * width
        return mg, nt

    @cute.jit
    def expert_of(self, mg: Int32, table: cute.Tensor, num_experts: Int32) -> Int32:
        """The expert owning linear m-tile ``mg``: :func:`last_at_most` of the tile table
        (empty experts share their start with the next expert, so the search lands on the
        one that owns the tile)."""
        return last_at_most(table, mg, num_experts)

    @cute.jit
    def tile_k_tiles(self, t: Int32, sched: SchedulerArgs) -> Int32:
        """k-tiles of every tile: ``K / TILE_K``."""
        return Int32(self.k_tiles)


class VarlenKScheduler:
    """A :class:`~.protocols.TileScheduler`.

    varlen-K: experts × m-tiles of M × n-tiles of N, each reducing over its expert's rows.

    On a 2-CTA cluster both CTAs take the same expert and n-tile and consecutive m-tiles, so
    the B rows are always shared (multicast); with ``multicast_a`` the same m-tile and
    consecutive n-tiles, sharing the A rows.
    """

    def __init__(self, cfg: GroupedGemmConfig):
        self.cluster = cfg.cluster
        self.multicast_a = cfg.multicast_a
        self.n_tiles = cfg.n_tiles
        self.n_groups = cfg.n_tiles // cfg.cluster if cfg.multicast_a else cfg.n_tiles
        self.per_expert = cfg.varlen_k_items_per_expert
        self.tile_k = cfg.tile_k

    @cute.jit
    def prepare(self, sched: SchedulerArgs):
        """``table`` = ``expert_offsets`` (one warp): work items map to experts
        arithmetically, but every tile reads its expert's rows, and from shared memory that
        read does not hold up the start of the tile's mainloop as a global load would."""
        mOffsets, table, num_experts = sched
        for e in cutlass.range(cute.arch.lane_idx(), num_experts + 1, 32, unroll=1):
            table[e] = mOffsets[e]

    def total(self, sched: SchedulerArgs):
        """Work items: experts × (m-tiles / cluster) × n-tiles."""
        return sched.num_experts * self.per_expert

    @cute.jit
    def decode(self, t: Int32, sched: SchedulerArgs) -> TileCoord:
        """Work item ``t`` → its :class:`~.args.TileCoord` (the expert's first row of ``P``
        and its row count, the n-tile, the m-tile of ``M``)."""
        table = sched.table
        shared = False
        e = t // self.per_expert
        rest = t - e * self.per_expert
        mt = rest // self.n_groups
        nt = rest - mt * self.n_groups
        row0 = table[e]
        rows = table[e + 1] - row0
        if cutlass.const_expr(self.cluster > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            if cutlass.const_expr(self.multicast_a):
                nt = nt * self.cluster + rank
            else:
                shared = True
                mt = mt * self.cluster + rank
        return TileCoord(e, row0, rows, nt, mt, shared)

    @cute.jit
    def tile_k_tiles(self, t: Int32, sched: SchedulerArgs) -> Int32:
        """k-tiles of tile ``t``: its expert's rows over the k-tile."""
        table = sched.table
        e = t // self.per_expert
        return (table[e + 1] - table[e] + self.tile_k - 1) // self.tile_k


def make_scheduler(cfg: GroupedGemmConfig) -> TileScheduler:
    """The scheduler of ``cfg``'s mode."""
    return VarlenKScheduler(cfg) if cfg.varlen_k else VarlenMScheduler(cfg)
