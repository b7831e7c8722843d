"""Tile plan: which configuration each grouped GEMM of an MoE layer runs with.

Chosen by same-run comparisons of the candidate plans at the paper's configurations (7B,
OLMoE, 30B; docs/design.md §5) and larger ones on H100 and H200 with
``benchmarks/bench_grouped_gemm.py`` (:func:`plan` names the run behind each rule). On H100
the kernels are bound by L2→SM bandwidth, so the plan maximises FLOP per loaded byte. Pure
Python: no ``cutlass``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from sonic.kernels.grouped_gemm.config import CLUSTER, TILE_M, VEC, GroupedGemmConfig


class DeviceMemory(NamedTuple):
    """What the plan reads of a GPU's memory system (:func:`device_memory`).

    Attributes:
        sms: streaming multiprocessors (one persistent CTA each).
        l2_bytes: L2 cache size in bytes.
        dram_bytes_per_s: DRAM bandwidth in bytes/s, or None where the driver does not say.
    """

    sms: int
    l2_bytes: int
    dram_bytes_per_s: float | None


# Where a gathered GEMM's weights outgrow L2, the DRAM bandwidth below which the 2-CTA
# cluster shares B (each B tile read once for two m-tiles) rather than A (half the row
# copies each): H100 (3.35 TB/s) shares B, H200 (4.8 TB/s) keeps sharing A. See plan().
SHARE_B_BELOW_BYTES_PER_S = 4e12


class TilePlan(NamedTuple):
    """The tile choices of one grouped GEMM (fields as in :class:`GroupedGemmConfig`)."""

    tile_n: int
    pingpong: bool
    cluster: int
    tile_m: int = TILE_M
    multicast_a: bool = False
    n_band: int = 0


def plan(varlen_k: bool, dim_n: int, gathered: bool = False, dim_k: int = 0,
         dim_m: int = 0, arch: str = "sm_90a", ab_dtype: str = "bf16",
         gather_b: bool = False, transpose_c: bool = False, rows_per_expert: int = 0,
         memory: DeviceMemory | None = None) -> TilePlan:
    """Tile N, schedule, cluster size, tile M and the cluster's shared operand (``gathered``:
    A's rows are gathered; ``gather_b``: varlen-K B's are; ``transpose_c``: varlen-K stores
    C transposed; ``rows_per_expert``: ``P / E``, 0 if unknown; ``memory``: the
    GPU's, None if unknown).

    The rules, in the order they are applied; each names the ``benchmarks/bench_grouped_gemm.py``
    run that shows the choice against its alternatives in the same run (the measurements are
    in ``benchmarks/RESULTS.md``, "Grouped GEMM"):

    * FP8 (``ab_dtype="e4m3"``): cooperative ``128 x 256`` tiles when N is a multiple of 256,
      else ``128 x 128`` (:mod:`.sm90_fp8`), on 2-CTA clusters sharing B; varlen-K only when
      M has an even number of m-tiles. The wider tile reads half the A bytes per FLOP.
      ``--plans --fp8`` times every FP8 candidate: at DeepSeek-V3 and 30B this plan is the
      fastest or level with the best; gathered A on ``128 x 128`` tiles (planned only where N
      is not a multiple of 256) reached 682 TFLOPS on dA' at n = 1408, where the up-proj on
      ``128 x 256`` tiles reached 760 (an H200; without WGMMA turns there:
      :attr:`~.config.GroupedGemmConfig.wgmma_turns`). varlen-M walks N in
      bands as bf16 does (below), on e4m3's one byte per element.
    * bf16 ``tile_n``: 256, or 128 when N is below 1024 and not a multiple of 256 (a 256-wide
      tile would be mostly masked).
    * sm_100a: cooperative ``128 x tile_n`` tiles on one CTA, the only schedule its mainloop
      has (no 2-CTA UMMA yet); untuned, no sm_100 measurement exists.
    * varlen-K with only B gathered (dW1 = dHᵀ·gather(X)) and an even number of 256-row
      m-tiles, where N ≤ 2048 or an expert's contiguous A (``P/E x M``, dH) outgrows half the
      L2 (:func:`panel_outgrows_l2`, Mixtral-8x7B's 4096 x 28672 panel): cooperative ``256 x
      128`` tiles on 2-CTA clusters sharing the gathered B, which halves the row copies per
      CTA; otherwise :func:`transpose_varlen_k` stores C transposed (dW2 runs swapped on the
      N ≤ 2048 terms only). ``--plans --gemm dW1 --gemm dW2``; for the panel rule, dW1 alone
      and the layer's step with dW1 forced onto each plan (Mixtral-8x7B, an H200).
    * varlen-K with only A gathered and an even number of n-tiles (dW2, and dW1 stored
      transposed): the cluster shares A (pairs of n-tiles, each CTA copying half of the
      gathered rows' columns), as for the gathered varlen-M GEMMs below. ``--plans --config
      30B --gemm dW2``; for dW1, the layer's step on each plan (DeepSeek-V3, Qwen3-235B,
      GLM-4.5, 30B). Except the transposed dW1 whose expert's contiguous B outgrows L2
      (:func:`panel_outgrows_l2`; planned only where 2n has an odd number of 256-row tiles,
      since such a dW1 otherwise runs untransposed, above): it shares B, as sharing A made
      Mixtral-8x7B's step slower on transposed tiles. dW2 keeps sharing A there: on B,
      Mixtral-8x7B's step (its A' panel ``4096 x 14336``) was slower too.
    * Other varlen-K: cooperative tiles, on 2-CTA clusters sharing B when M has an even number
      of m-tiles. ``--plans --gemm dW1 --gemm dW2``.
    * Contiguous varlen-M A (down-proj, dX̃) with K ≤ 512: ping-pong, each warpgroup on its
      own ``128 x 192`` tile when that masks at most 5% of N's columns, else ``128 x 128``,
      on one CTA: one warpgroup's epilogue hides behind the other's mainloop (SonicMoE
      §4.2), and on such short mainloops a cluster's lockstep costs more than its multicast
      saves. ``--plans --config 7B``.
    * Contiguous varlen-M A with K > 512 (down-proj, dX̃ at OLMoE and 30B): cooperative
      ``128 x tile_n`` tiles on 2-CTA clusters sharing B, with the stores deferred into the
      next tile's mainloop (:class:`.epilogue.base.StoreEpilogue`), which beat the ping-pong
      cluster plans. ``--plans --config OLMoE --config 30B``.
    * Gathered varlen-M A (up-proj, dA'): cooperative ``128 x tile_n`` tiles on 2-CTA
      clusters. They share A (``multicast_a``: consecutive n-tiles of one m-tile, each CTA
      issuing half of the tile's row copies, which bound the gathered bf16 GEMMs) when N has
      an even number of n-tiles; with an odd count a phantom CTA would only copy rows for
      its peer, so the cluster shares B. ``--share both --config OLMoE --config 30B``.
    * ... except where B outgrows L2 (:func:`b_outgrows_l2`: the B panels one wave of CTAs
      reads, over the m-tiles of an expert sharing each, exceed half the L2) on a GPU below
      :data:`SHARE_B_BELOW_BYTES_PER_S` of DRAM bandwidth (H100): the cluster shares B, read
      from DRAM once for two m-tiles instead of once per m-tile.
      ``--share both --config DeepSeek-V3`` (also GLM-4.5, Qwen3-235B; on an H200 sharing A
      stays faster).
    * varlen-M tile order (``n_band``, :func:`band_width`): where an expert's B outgrows
      L2 and one wave of CTAs holds fewer of its m-tiles than it has (few experts with
      thousands of rows each: Mixtral-8x7B's up-proj and dH kernel), N is walked in bands
      whose B panels the expert's m-tiles read together. ``--config Mixtral-8x7B``.
    """
    paired = CLUSTER if (dim_m + TILE_M - 1) // TILE_M % CLUSTER == 0 else 1
    if ab_dtype == "e4m3":
        tile_n = 256 if dim_n % 256 == 0 else 128
        if varlen_k:
            return TilePlan(tile_n, False, paired)
        return TilePlan(tile_n, False, CLUSTER,
                        n_band=band_width(dim_n, dim_k, tile_n, CLUSTER, False, rows_per_expert,
                                          memory, ab_bytes=1))
    tile_n = 256 if dim_n % 256 == 0 or dim_n >= 1024 else 128
    if arch == "sm_100a":
        return TilePlan(tile_n, False, 1)
    if varlen_k:
        if (gather_b and not gathered and (dim_m + 255) // 256 % CLUSTER == 0
                and (dim_n <= 2048 or panel_outgrows_l2(rows_per_expert, dim_m, memory))):
            return TilePlan(128, False, CLUSTER, tile_m=256)
        if (gathered and not gather_b and -(-dim_n // tile_n) % CLUSTER == 0
                and not (transpose_c and panel_outgrows_l2(rows_per_expert, dim_n, memory))):
            return TilePlan(tile_n, False, CLUSTER, multicast_a=True)
        return TilePlan(tile_n, False, paired)
    if not gathered and dim_k <= 512:
        masked = -dim_n % 192          # columns of the last 192-wide tile past N
        return TilePlan(192 if masked * 20 <= dim_n else 128, True, 1)
    share_a = (gathered and -(-dim_n // tile_n) % CLUSTER == 0
               and not b_outgrows_l2(dim_k, tile_n, rows_per_expert, memory))
    return TilePlan(tile_n, False, CLUSTER, multicast_a=share_a,
                    n_band=band_width(dim_n, dim_k, tile_n, CLUSTER, share_a, rows_per_expert,
                                      memory))


def band_width(dim_n: int, dim_k: int, tile_n: int, cluster: int, multicast_a: bool,
               rows_per_expert: int, memory: DeviceMemory | None, ab_bytes: int = 2) -> int:
    """n-groups per band of a varlen-M GEMM's tile order
    (:attr:`GroupedGemmConfig.n_band`) on operands of ``ab_bytes`` bytes (2: bf16, 1:
    e4m3, whose scales the model leaves out: 1/128 of the bytes), 0 for none.

    A model of each expert's DRAM bytes. In the unbanded order one wave of persistent CTAs
    holds ``max(1, wave / n_groups)`` of an expert's m-groups, so where the expert's B
    (``N x K``) outgrows the L2, B is read once per wave's worth of m-groups while A is read
    once. Banded, the band's B panels (``w`` n-groups, at most a third of the L2) stay in L2
    while every m-group reads them: B is read once and A once per band. Bands are chosen
    where they at least halve the bytes. 0 where the rows per expert or the GPU are
    unknown.
    """
    if memory is None or rows_per_expert <= 0 or dim_n * dim_k * ab_bytes <= memory.l2_bytes:
        return 0
    n_tiles = -(-dim_n // tile_n)
    n_groups = -(-n_tiles // cluster) if multicast_a else n_tiles
    m_tiles = -(-rows_per_expert // TILE_M)
    m_groups = m_tiles if multicast_a or cluster == 1 else -(-m_tiles // cluster)
    wave = max(1, memory.sms // cluster)
    b_reads = -(-m_groups // max(1, wave // n_groups))
    panel = tile_n * dim_k * ab_bytes * (cluster if multicast_a else 1)
    width = max(1, memory.l2_bytes // 3 // panel)
    if width >= n_groups:
        return 0
    a_bytes, b_bytes = rows_per_expert * dim_k * ab_bytes, dim_n * dim_k * ab_bytes
    unbanded = a_bytes + b_bytes * b_reads
    banded = a_bytes * -(-n_groups // width) + b_bytes
    return width if 2 * banded <= unbanded else 0


def b_outgrows_l2(dim_k: int, tile_n: int, rows_per_expert: int,
                  memory: DeviceMemory | None) -> bool:
    """Whether a varlen-M GEMM's B tiles are read from DRAM about once per m-tile: the B
    panels (``tile_n x K``) one wave of persistent CTAs works on, divided by the m-tiles of
    an expert that share each, exceed half the L2, on a GPU below
    :data:`SHARE_B_BELOW_BYTES_PER_S` (or of unknown bandwidth). False when the rows per
    expert or the GPU are unknown."""
    if memory is None or rows_per_expert <= 0:
        return False
    if (memory.dram_bytes_per_s is not None
            and memory.dram_bytes_per_s >= SHARE_B_BELOW_BYTES_PER_S):
        return False
    m_tiles = -(-rows_per_expert // TILE_M)
    return memory.sms * tile_n * dim_k * 2 // m_tiles > memory.l2_bytes // 2


def panel_outgrows_l2(rows_per_expert: int, width: int, memory: DeviceMemory | None) -> bool:
    """Whether a varlen-K expert's contiguous operand, ``rows_per_expert x width`` bf16,
    exceeds half the L2. Where dW1's dH panel does, :func:`plan` runs dW1 untransposed on
    256-row tiles (dW1 alone and the step measured faster at Mixtral-8x7B), and a transposed
    dW1 shares dH rather than the gathered X: a cluster sharing the gathered operand pairs
    n-tiles of one m-tile, so a wave of CTAs spans fewer m-tiles, and such a panel likely
    leaves L2 between the m-tiles that read it (an inference; the step was measured). False
    when the rows per expert or the GPU are unknown."""
    if memory is None or rows_per_expert <= 0:
        return False
    return rows_per_expert * width * 2 > memory.l2_bytes // 2


def varlen_m_config(dim_n: int, dim_k: int, gathered: bool, b_n_major: bool = False,
                    epilogue: str = "store", gate_up: str | None = None,
                    arch: str = "sm_90a", ab_dtype: str = "bf16", rows_per_expert: int = 0,
                    memory: DeviceMemory | None = None,
                    activation: str = "swiglu") -> GroupedGemmConfig:
    """The planned varlen-M configuration (:func:`plan`, then the epilogue's constraints);
    ``activation``: the GLU variant of the fused epilogues.

    With the SwiGLU "concat" epilogue a tile's gate half must not run past ``n = N/2``: when
    ``n`` is not a multiple of half the planned tile, the tile drops to ``128 x 128``.

    Raises:
        ValueError: as :class:`GroupedGemmConfig`.
    """
    tiles = plan(False, dim_n, gathered, dim_k, arch=arch, ab_dtype=ab_dtype,
                 rows_per_expert=rows_per_expert, memory=memory)
    tile_n, n_band = tiles.tile_n, tiles.n_band
    if epilogue == "swiglu" and gate_up == "concat" and (dim_n // 2) % (tile_n // 2):
        tile_n = 128
        if n_band:
            n_band = band_width(dim_n, dim_k, tile_n, tiles.cluster, tiles.multicast_a,
                                rows_per_expert, memory, ab_bytes=1 if ab_dtype == "e4m3" else 2)
    return GroupedGemmConfig(varlen_k=False, tile_n=tile_n, pingpong=tiles.pingpong,
                             cluster=tiles.cluster, dim_m=0, dim_n=dim_n, dim_k=dim_k,
                             gather_a=gathered, b_n_major=b_n_major, epilogue=epilogue,
                             gate_up=gate_up, arch=arch, ab_dtype=ab_dtype,
                             tile_m=tiles.tile_m, multicast_a=tiles.multicast_a,
                             activation=activation, n_band=n_band)


def varlen_k_config(dim_m: int, dim_n: int, gather_a: bool, gather_b: bool,
                    transpose_c: bool = False, arch: str = "sm_90a",
                    ab_dtype: str = "bf16", rows_per_expert: int = 0,
                    memory: DeviceMemory | None = None) -> GroupedGemmConfig:
    """The planned varlen-K configuration (:func:`plan`; ``rows_per_expert``: ``P / E``, 0
    if unknown; ``memory``: the GPU's, None if unknown), with C stored by TMA from the last
    k-tile's ring stage (``store_in_stage``) on sm_90a cooperative ``128 x 256`` tiles (bf16,
    and e4m3 on K-major copies) whose C has a multiple of 64 rows per expert
    (``bench_grouped_gemm.py [--fp8] --gemm dW1 --gemm dW2`` at the named layers against thread
    stores: faster on ``128 x 256`` tiles, level to slower on ``256 x 128`` ones;
    benchmarks/RESULTS.md).

    Raises:
        ValueError: as :class:`GroupedGemmConfig`.
    """
    tiles = plan(True, dim_n, gather_a, dim_m=dim_m, arch=arch, ab_dtype=ab_dtype,
                 gather_b=gather_b, transpose_c=transpose_c, rows_per_expert=rows_per_expert,
                 memory=memory)
    cfg = GroupedGemmConfig(varlen_k=True, tile_n=tiles.tile_n, pingpong=tiles.pingpong,
                            cluster=tiles.cluster, dim_m=dim_m, dim_n=dim_n, dim_k=0,
                            gather_a=gather_a, gather_b=gather_b, transpose_c=transpose_c,
                            arch=arch, ab_dtype=ab_dtype, tile_m=tiles.tile_m,
                            multicast_a=tiles.multicast_a)
    # Only where it was measured faster: level to 0.5% slower on 256 x 128 tiles (7B's dW1,
    # OLMoE's); 128 x 128 tiles (small M or N) were not timed.
    rows, width = cfg.c_per_expert
    if (arch == "sm_90a" and not tiles.pingpong
            and (tiles.tile_m, tiles.tile_n) == (TILE_M, 256) and rows % 64 == 0
            and width % VEC == 0):
        return dataclasses.replace(cfg, store_in_stage=True)
    return cfg


def transpose_varlen_k(gather_a: bool, gather_b: bool, arch: str, dim_m: int,
                       dim_n: int, rows_per_expert: int = 0,
                       memory: DeviceMemory | None = None) -> bool:
    """Whether varlen-K ``(M, N)`` with one operand gathered computes ``C[e]ᵀ = B_eᵀ·A_e``
    instead (operands swapped) and stores it transposed, so that the gathered rows sit on the
    side where :func:`plan` loads them best (``rows_per_expert``, ``memory``: as
    :func:`plan`'s, read for dW1 only).

    * Only B gathered (dW1 = dHᵀ·gather(X)): swapped, the gathered rows on the 128-row M side,
      unless the plan gives the untransposed GEMM 256-row tiles (B gathered on N, shared by
      the cluster): measured faster than ``128 x 256`` tiles gathering B at the docs/design.md §5
      shapes on sm_90 where 256-row tiles are not planned (30B).
    * Only A gathered (dW2 = gather(dO)ᵀ·A'): swapped when the plan gives the swapped GEMM
      256-row tiles, i.e. on the same terms as dW1 (the gathered dO then on N, shared by
      the cluster, instead of 128 unshared row copies per k-tile on M).

    Not on sm_100a: its one epilogue warpgroup holds all TILE_M rows of a tile, more than the
    transposed staging block (SLAB rows) takes, so its producers gather B directly. Nor on
    ping-pong tiles (which :func:`plan` does not give varlen-K; ``bench_grouped_gemm.py
    --plans`` forces them): the transposed store is the cooperative kernel's."""
    if gather_a == gather_b or arch != "sm_90a":
        return False
    if gather_b:
        tiles = plan(True, dim_n, False, dim_m=dim_m, arch=arch, gather_b=True,
                     rows_per_expert=rows_per_expert, memory=memory)
        return tiles.tile_m == TILE_M and not tiles.pingpong
    return plan(True, dim_m, False, dim_m=dim_n, arch=arch, gather_b=True).tile_m != TILE_M
