"""Tile plan: which configuration each grouped GEMM of an MoE layer runs with.

Measured at the paper's configurations (7B, OLMoE, 30B; docs/design.md §5) on H100 and H200 by tile-plan sweeps with
``benchmarks/bench_grouped_gemm.py`` (benchmarks/RESULTS.md, "Grouped GEMM"). On H100 the
kernels are bound by L2→SM bandwidth (~6.5–7 TB/s at 64–85 FLOP per loaded byte), so the plan
maximises FLOP per loaded byte. Pure Python: no ``cutlass``.
"""

from __future__ import annotations

from typing import NamedTuple

from sonic.kernels.grouped_gemm.config import CLUSTER, TILE_M, GroupedGemmConfig


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


def plan(varlen_k: bool, dim_n: int, gathered: bool = False, dim_k: int = 0,
         dim_m: int = 0, arch: str = "sm_90a", ab_dtype: str = "bf16",
         gather_b: bool = False, transpose_c: bool = False, rows_per_expert: int = 0,
         memory: DeviceMemory | None = None) -> TilePlan:
    """Tile N, schedule, cluster size, tile M and the cluster's shared operand (``gathered``:
    A's rows are gathered; ``gather_b``: varlen-K B's are; ``transpose_c``: varlen-K stores
    C transposed; ``rows_per_expert``: varlen-M ``P / E``, 0 if unknown; ``memory``: the
    GPU's, None if unknown).

    * ``tile_n`` 256, or 128 when N is small and not a multiple of 256 (a 256 tile would be
      mostly masked); 192 for contiguous A (below).
    * Cooperative ``128 x tile_n`` tiles on 2-CTA clusters that multicast the shared B tile,
      for gathered varlen-M A (up-proj, ``dA'``), contiguous A with K > 512 (down-proj, ``dX̃``
      at OLMoE/30B; their stores deferred into the next tile's mainloop, see below) and
      varlen-K when M has an even number of m-tiles. H100, 30B: up 558 →
      651, dA' 571 → 628, down 609 → 633, dX 603 → 674, dW1 481 → 577, dW2 531 → 626 TFLOPS
      (no cluster → cluster); contiguous A on ping-pong ``128 x 128`` tiles reached only 443
      (down) and 327 (dX) there. The fused SwiGLU / dSwiGLU GEMMs on ping-pong tiles (H200,
      with and without a 2-CTA cluster): 1.4–1.7× / 2.0–2.7× slower; the gathered GEMMs with
      the plain store epilogue on ping-pong ``128 x 128`` tiles are already 1.0–1.4× slower
      than the fused kernels on this plan.
    * Gathered varlen-M A (bf16) when N has an even number of n-tiles: the cluster shares A
      instead (``multicast_a``, consecutive n-tiles of one m-tile), so each CTA issues half
      of the tile's 128 row copies per k-tile. Those copies bound the gathered GEMMs: the
      same kernel on an identity index ran as slowly as on the routing's, 4–7% behind the
      rows gathered beforehand. H200, same run, two rounds, µs (sharing B → sharing A; every
      output bitwise the same): OLMoE up 3513/3613 → 3384/3426, dA' 1797/1846 → 1736/1777,
      dA' + dSwiGLU (each call with a copy of H) 3024/2868 → 2770/2777; 30B up 7163/7412 →
      6765/6917, dA' 3686/3797 → 3678/3476, dA' + dSwiGLU 4912/4874 → 4474/4571; 7B up
      553/613 → 535/546; the layer's step 2.2% (OLMoE) and 2.7% (30B) faster over three
      rounds. With an odd count the last pair's second CTA is a phantom that only copies rows
      for its peer: 7B's dA' (N = 256, one n-tile) ran 1.6× slower, so odd counts keep
      sharing B (on ``128 x 128`` tiles sharing A it was 4–11% slower). The FP8 gathered
      GEMMs are not bound by their row copies (as fast on the routing's index as on rows
      gathered beforehand) and keep sharing B.
    * Gathered varlen-M A (bf16) whose weights outgrow L2 (:func:`b_outgrows_l2`: the B
      panels one wave of CTAs reads, divided by the m-tiles of an expert that share each,
      exceed half the L2) on a GPU with less than :data:`SHARE_B_BELOW_BYTES_PER_S` of DRAM
      bandwidth: the cluster shares B. A persistent CTA re-reads a B tile from DRAM whenever
      the other m-tiles' CTAs read it too far apart in time for L2 to keep it; the
      multicast reads it once for two. Measured with ``benchmarks/bench_grouped_gemm.py
      --config NAME --share both`` (same run, sharing A → B): on an H100 the gathered GEMMs
      at DeepSeek-V3 (T, d, n, E, K = 16384, 7168, 2048, 256, 8) read 74 → 34 GB of DRAM
      (up-proj) and ran 1.6–1.8× faster, at GLM-4.5 1.4–1.6×, at Qwen3-235B the up-proj
      10–20%; on an H200 DeepSeek-V3's up-proj ran 7% slower sharing B, so the rule asks
      for H100-class bandwidth too.
    * Contiguous A (down-proj, dX̃) with K > 512: cooperative ``128 x tile_n`` on a cluster,
      its varlen-M stores deferred (:class:`.epilogue.base.StoreEpilogue`: each warp
      TMA-stores the previous tile one box per k-tile behind the WGMMAs), which beat the
      ping-pong ``128 x 192`` cluster plan before it. H200, same run, two rounds, µs
      (ping-pong 192 cluster → cooperative 256 deferred; the same tile with its stores after
      the mainloop in brackets): OLMoE down 1716/1718 → 1678/1856 (1765/1799), dX̃
      3306/3449 → 3263/3289 (3376/3491); 30B down 3597/3523 → 3427/3475 (3642/3638), dX̃
      6975/7380 → 6727/6729 (6858/7012); 7B down 330/337 → 314/332 (K ≤ 512: not taken).
    * Contiguous A with K ≤ 512, when 192-wide tiles mask at most 5% of N's columns
      (N = 1536, 2048, 4096 at the docs/design.md §5 shapes; not 1024: 12.5%): ping-pong, each
      warpgroup on its own ``128 x 192`` tile, one warpgroup's epilogue hidden behind the
      other's mainloop (SonicMoE §4.2), on one CTA (short mainloops: a cluster's lockstep
      costs more than the multicast saves). Before the deferred stores, H200,
      same run, two rounds, µs (cooperative ``128 x 256`` on a cluster before at K > 512,
      ping-pong ``128 x 128`` on one CTA at K ≤ 512): 7B down 358/366 → 335/341, dX̃ 607/636
      → 546/570; OLMoE down 1840/1832 → 1711/1761, dX̃ 3440/3427 → 3296/3384; 30B down
      3751/3745 → 3525/3527, dX̃ 6985/7853 → 6908/7309. Ping-pong ``128 x 128`` tiles on a
      cluster and cooperative ``128 x 192`` ones were slower than these at every shape
      (benchmarks/RESULTS.md, twelfth session). Other N: ping-pong ``128 x 128`` on one CTA.
    * varlen-K with only A gathered and C not transposed (dW2 = gather(dO)ᵀ·A' at 30B) when
      N has an even number of n-tiles: the cluster shares A (pairs of n-tiles; each CTA copies
      one of the gathered rows' two 64-column blocks), as for the gathered varlen-M GEMMs.
      H200, same run, six rounds, µs (sharing B → sharing A, bitwise the same): 30B dW2
      3713/3855/3731/3712/3818/3842 → 3666/3676/3678/3811/3780/3662. The transposed 30B dW1
      (X gathered on M, C stored transposed) was not faster: 7243/7273/7287/7610/7459/7350
      → 7281/7402/7637/7434/7242/7453, so it keeps sharing B.
    * varlen-K with only B gathered (dW1 = dHᵀ·gather(X)) when N ≤ 2048 and M has an even
      number of 256-row m-tiles: cooperative ``256 x 128`` tiles (128 rows per warpgroup,
      staged one 64-row block at a time so the ring keeps four stages) on 2-CTA clusters
      sharing B, B gathered on N; otherwise the transposed form
      (:func:`transpose_varlen_k`). H200, same run, three rounds, µs (transposed ``128 x
      256`` on a cluster → ``256 x 128``): 7B 568/578/645 → 550/552/562, OLMoE
      3712/3729/3730 → 3486/3529/3783; 30B (N = 4096) 7333/7318/7614 → 7326/7697/7380, not
      taken. ``256 x 128`` for the down-proj and dX̃ (also sharing A on a cluster along N,
      CUTLASS 1 x 2) ran 5–10% slower than the ping-pong plan (benchmarks/RESULTS.md).
    * dW2 (only A gathered) runs swapped on the same terms (:func:`transpose_varlen_k`):
      ``256 x 128`` tiles with A gathered on M ran 1.3–1.4× slower (256 unshared row copies
      per k-tile), but swapped, dO gathered on N and shared by the cluster: H200, same run,
      two rounds, µs (``128 x 256`` on a cluster → swapped ``256 x 128``): OLMoE 1833/1929
      → 1739/1785; 30B 3580–4091 against 3619–3893 over two runs (level: not taken, as for
      dW1).
    * sm_100a: cooperative ``128 x tile_n`` tiles on one CTA, the only schedule its mainloop
      has (no 2-CTA UMMA yet); untuned, no sm_100 measurement exists.
    * FP8 (``ab_dtype="e4m3"``, varlen-M): cooperative ``128 x 256`` tiles when N is a
      multiple of 256, else ``128 x 128``, on 2-CTA clusters multicasting B as for bf16
      (:mod:`.sm90_fp8`). H200, same run, 256 vs 128: OLMoE up 688 → 835, dA' 684 → 836, down
      802 → 815; 30B up 696 → 806, dA' 685 → 802, dX 874 → 927 TFLOPS; the layer's step 8%
      faster. Not measured against one CTA.
    * FP8 varlen-K (the weight gradients on K-major copies): ``128 x 256`` tiles when N is a
      multiple of 256, else ``128 x 128``, on 2-CTA clusters sharing B when M has an even
      number of m-tiles. H200, same run, three rounds, µs (``128 x 128`` with the column
      scales held in registers → ``128 x 256`` reading them from the stage during the
      promotion; results bitwise the same): OLMoE dW1 2773/2763/2782 → 2637/2734/2652, dW2
      1489/1502/1507 → 1343/1432/1383; 30B dW1 5552/5561/5800 → 5377/5471/5513, dW2
      3077/3080/3086 → 2757/2849/2789; 7B dW2 269/272/272 → 216/218/217.
    """
    paired = CLUSTER if (dim_m + TILE_M - 1) // TILE_M % CLUSTER == 0 else 1
    if ab_dtype == "e4m3":
        return TilePlan(256 if dim_n % 256 == 0 else 128, False, paired if varlen_k else CLUSTER)
    tile_n = 256 if dim_n % 256 == 0 or dim_n >= 1024 else 128
    if arch == "sm_100a":
        return TilePlan(tile_n, False, 1)
    if varlen_k:
        if gather_b and not gathered and dim_n <= 2048 and (dim_m + 255) // 256 % CLUSTER == 0:
            return TilePlan(128, False, CLUSTER, tile_m=256)
        if gathered and not gather_b and not transpose_c and -(-dim_n // tile_n) % CLUSTER == 0:
            return TilePlan(tile_n, False, CLUSTER, multicast_a=True)
        return TilePlan(tile_n, False, paired)
    if not gathered and dim_k <= 512:
        masked = -dim_n % 192          # columns of the last 192-wide tile past N
        return TilePlan(192 if masked * 20 <= dim_n else 128, True, 1)
    share_a = (gathered and -(-dim_n // tile_n) % CLUSTER == 0
               and not b_outgrows_l2(dim_k, tile_n, rows_per_expert, memory))
    return TilePlan(tile_n, False, CLUSTER, multicast_a=share_a)


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


def varlen_m_config(dim_n: int, dim_k: int, gathered: bool, b_n_major: bool = False,
                    epilogue: str = "store", gate_up: str | None = None,
                    arch: str = "sm_90a", ab_dtype: str = "bf16", rows_per_expert: int = 0,
                    memory: DeviceMemory | None = None) -> GroupedGemmConfig:
    """The planned varlen-M configuration (:func:`plan`, then the epilogue's constraints).

    With the SwiGLU "concat" epilogue a tile's gate half must not run past ``n = N/2``: when
    ``n`` is not a multiple of half the planned tile, the tile drops to ``128 x 128``.

    Raises:
        ValueError: as :class:`GroupedGemmConfig`.
    """
    tiles = plan(False, dim_n, gathered, dim_k, arch=arch, ab_dtype=ab_dtype,
                 rows_per_expert=rows_per_expert, memory=memory)
    tile_n = tiles.tile_n
    if epilogue == "swiglu" and gate_up == "concat" and (dim_n // 2) % (tile_n // 2):
        tile_n = 128
    return GroupedGemmConfig(varlen_k=False, tile_n=tile_n, pingpong=tiles.pingpong,
                             cluster=tiles.cluster, dim_m=0, dim_n=dim_n, dim_k=dim_k,
                             gather_a=gathered, b_n_major=b_n_major, epilogue=epilogue,
                             gate_up=gate_up, arch=arch, ab_dtype=ab_dtype,
                             tile_m=tiles.tile_m, multicast_a=tiles.multicast_a)


def varlen_k_config(dim_m: int, dim_n: int, gather_a: bool, gather_b: bool,
                    transpose_c: bool = False, arch: str = "sm_90a",
                    ab_dtype: str = "bf16") -> GroupedGemmConfig:
    """The planned varlen-K configuration (:func:`plan`).

    Raises:
        ValueError: as :class:`GroupedGemmConfig`.
    """
    tiles = plan(True, dim_n, gather_a, dim_m=dim_m, arch=arch, ab_dtype=ab_dtype,
                 gather_b=gather_b, transpose_c=transpose_c)
    return GroupedGemmConfig(varlen_k=True, tile_n=tiles.tile_n, pingpong=tiles.pingpong,
                             cluster=tiles.cluster, dim_m=dim_m, dim_n=dim_n, dim_k=0,
                             gather_a=gather_a, gather_b=gather_b, transpose_c=transpose_c,
                             arch=arch, ab_dtype=ab_dtype, tile_m=tiles.tile_m,
                             multicast_a=tiles.multicast_a)


def transpose_varlen_k(gather_a: bool, gather_b: bool, arch: str, dim_m: int,
                       dim_n: int) -> bool:
    """Whether varlen-K ``(M, N)`` with one operand gathered computes ``C[e]ᵀ = B_eᵀ·A_e``
    instead (operands swapped) and stores it transposed, so that the gathered rows sit on the
    side where :func:`plan` loads them best.

    * Only B gathered (dW1 = dHᵀ·gather(X)): swapped, the gathered rows on the 128-row M side,
      unless the plan gives the untransposed GEMM 256-row tiles (B gathered on N, shared by
      the cluster): measured faster than ``128 x 256`` tiles gathering B at the docs/design.md §5
      shapes on sm_90 where 256-row tiles are not planned (30B).
    * Only A gathered (dW2 = gather(dO)ᵀ·A'): swapped when the plan gives the swapped GEMM
      256-row tiles, i.e. on the same terms as dW1 (the gathered dO then on N, shared by
      the cluster, instead of 128 unshared row copies per k-tile on M).

    Not on sm_100a: its one epilogue warpgroup holds all TILE_M rows of a tile, more than the
    transposed staging block (SLAB rows) takes, so its producers gather B directly."""
    if gather_a == gather_b or arch != "sm_90a":
        return False
    if gather_b:
        return plan(True, dim_n, False, dim_m=dim_m, arch=arch, gather_b=True).tile_m == TILE_M
    return plan(True, dim_m, False, dim_m=dim_n, arch=arch, gather_b=True).tile_m != TILE_M
