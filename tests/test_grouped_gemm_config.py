"""CPU tests of the grouped-GEMM package's pure-Python parts: the frozen config (validation,
derived sizes, cache key), the barrier contract, the tile-plan heuristic; and that a wrong
barrier count fails compilation (needs the CuTe DSL, no GPU)."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest

from sonic.kernels.grouped_gemm import config, heuristic
from sonic.kernels.grouped_gemm.config import (CLUSTER, GroupedGemmConfig, barrier_contract)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None


def _m(**kw):
    base = dict(varlen_k=False, tile_n=256, pingpong=False, cluster=CLUSTER, dim_m=0,
                dim_n=1024, dim_k=1536, gather_a=True)
    return GroupedGemmConfig(**{**base, **kw})


@pytest.mark.parametrize("kw,match", [
    (dict(tile_n=64), r"tile_n must be one of \(128, 192, 256\)"),
    (dict(tile_n=192), "tile_n=192 serves the contiguous-A"),                 # gathered A
    (dict(tile_n=192, gather_a=False, epilogue="dswiglu"), "tile_n=192 serves"),
    (dict(tile_n=192, gather_a=False, ab_dtype="e4m3"), "tile_n=192 serves"),
    (dict(pingpong=True, cluster=1), "ping-pong schedule holds a 128 x 128 or 128 x 192"),
    (dict(cluster=4), "cluster must be 1 or 2"),
    (dict(gather_b=True), "gather_b serves the varlen-K"),
    (dict(transpose_c=True), "transposed C serves the cooperative varlen-K"),
    (dict(epilogue="gelu"), "epilogue must be one of"),
    (dict(epilogue="swiglu"), "gate_up is given exactly with the 'swiglu' epilogue"),
    (dict(gate_up="concat"), "gate_up is given exactly"),
    (dict(epilogue="swiglu", gate_up="halves"), "gate_up must be one of"),
    (dict(epilogue="swiglu", gate_up="concat", gather_a=False), "SwiGLU epilogue serves"),
    (dict(epilogue="dswiglu"), "dSwiGLU epilogue serves"),     # K-major B
    (dict(arch="sm_120a"), "no grouped-GEMM mainloop for arch 'sm_120a'"),
    (dict(arch="sm_100a"), "sm_100a mainloop runs cooperative tiles on one CTA"),
    (dict(arch="sm_100a", cluster=1, tile_n=128, pingpong=True), "sm_100a mainloop"),
    (dict(tile_m=192), r"tile_m must be one of \(128, 256\)"),
    # 256-row tiles: cooperative bf16 sm_90a store kernels on tile_n=128, A not gathered
    # (varlen-M), C not transposed.
    (dict(tile_m=256, tile_n=128), "tile_m=256 serves the cooperative"),       # gathered A
    (dict(tile_m=256, gather_a=False), "tile_m=256 serves"),                    # tile_n=256
    (dict(tile_m=256, tile_n=128, gather_a=False, pingpong=True), "tile_m=256 serves"),
    (dict(tile_m=256, tile_n=128, gather_a=False, ab_dtype="e4m3"), "tile_m=256 serves"),
    (dict(tile_m=256, tile_n=128, epilogue="dswiglu", b_n_major=True), "tile_m=256 serves"),
    (dict(tile_m=256, tile_n=128, gather_a=False, arch="sm_100a", cluster=1),
     "tile_m=256 serves"),
    (dict(multicast_a=True, gather_a=False, cluster=1), "multicast_a serves"),
    (dict(multicast_a=True, gather_a=False, ab_dtype="e4m3"), "multicast_a serves"),
    (dict(multicast_a=True, tile_n=128, pingpong=True), "multicast_a serves"),  # gathered
    (dict(n_band=-1), "n_band orders the sm_90a varlen-M tiles"),
    (dict(n_band=2, varlen_k=True), "n_band orders"),
    (dict(n_band=2, arch="sm_100a", cluster=1), "n_band orders"),
])
def test_config_rejects_unsupported_combinations(kw, match):
    with pytest.raises(ValueError, match=match):
        _m(**kw)


def test_config_varlen_k_cluster_needs_even_m_tiles():
    with pytest.raises(ValueError, match="pairs the m-tiles of M"):
        GroupedGemmConfig(varlen_k=True, tile_n=256, pingpong=False, cluster=CLUSTER,
                          dim_m=384, dim_n=256, dim_k=0, gather_a=True)
    # 768 rows: an even count of 128-row m-tiles, an odd one of 256-row m-tiles.
    with pytest.raises(ValueError, match="pairs the m-tiles of M"):
        GroupedGemmConfig(varlen_k=True, tile_n=128, pingpong=False, cluster=CLUSTER,
                          dim_m=768, dim_n=256, dim_k=0, gather_a=False, tile_m=256)
    # Sharing A pairs n-tiles instead (M's m-tile count is then free).
    shared_a = GroupedGemmConfig(varlen_k=True, tile_n=128, pingpong=False, cluster=CLUSTER,
                                 dim_m=384, dim_n=256, dim_k=0, gather_a=True,
                                 multicast_a=True)
    assert shared_a.varlen_k_items_per_expert == 3
    for kw in (dict(dim_n=384), dict(tile_m=256, dim_m=512)):
        with pytest.raises(ValueError, match="varlen-K sharing A pairs the n-tiles"):
            GroupedGemmConfig(**{**dict(varlen_k=True, tile_n=128, pingpong=False,
                                        cluster=CLUSTER, dim_m=384, dim_n=256, dim_k=0,
                                        gather_a=False, multicast_a=True), **kw})
    # 256-row varlen-K tiles store C transposed too (the swapped dW2).
    assert GroupedGemmConfig(varlen_k=True, tile_n=128, pingpong=False, cluster=CLUSTER,
                             dim_m=512, dim_n=256, dim_k=0, gather_a=False, gather_b=True,
                             transpose_c=True, tile_m=256).staged_rows == 64
    with pytest.raises(ValueError, match="ping-pong kernel on a 2-CTA cluster serves varlen-M"):
        GroupedGemmConfig(varlen_k=True, tile_n=128, pingpong=True, cluster=CLUSTER,
                          dim_m=256, dim_n=256, dim_k=0, gather_a=True)


def test_config_derived_sizes():
    coop = _m()
    # 227 KiB less table and barriers, less a 2 x 64 x 72 bf16 staging buffer, over
    # (128 + 256) x 64 bf16 stages.
    assert (coop.stages, coop.rows_wg, coop.n_tiles, coop.k_tiles) == (4, 64, 4, 24)
    assert coop.tma_bytes == (128 + 256) * 64 * 2
    pp = _m(tile_n=128, pingpong=True, cluster=1, gather_a=False, dim_k=256)
    assert (pp.stages, pp.rows_wg, pp.producer_regs, pp.consumer_regs) == (5, 128, 40, 232)
    # (128 + 192) x 64 bf16 stages beside two 128 x 72 staging blocks; 1536 = 8 tiles of 192.
    wide = _m(tile_n=192, pingpong=True, cluster=CLUSTER, gather_a=False, dim_n=1536)
    assert (wide.stages, wide.rows_wg, wide.n_tiles) == (4, 128, 8)
    # 256 x 128: 128 rows per warpgroup, staged 64 at a time (2 x 64 x 72), so four
    # (256 + 128) x 64 stages fit.
    tall = _m(tile_n=128, gather_a=False, dim_n=640, tile_m=256, multicast_a=True)
    assert (tall.rows_wg, tall.staged_rows, tall.stages) == (128, 64, 4)
    assert tall.staging_elems == 2 * 64 * 72 and tall.tma_bytes == (256 + 128) * 64 * 2
    # Work items: m-tiles x pairs of n-tiles (5 n-tiles: the third pair's second is phantom).
    assert (tall.n_groups, tall.varlen_m_work_items(7)) == (3, 21)
    # Gathered A shared by the cluster: each CTA copies half of the rows, but receives all.
    shared_rows = _m(multicast_a=True)
    assert shared_rows.tma_bytes == coop.tma_bytes
    assert (shared_rows.n_groups, shared_rows.varlen_m_work_items(7)) == (2, 14)
    assert (coop.n_groups, coop.varlen_m_work_items(7)) == (4, 16)
    assert _m(epilogue="swiglu", gate_up="concat").b_halves
    assert not _m(epilogue="swiglu", gate_up="interleaved").b_halves


def test_cache_key_is_the_config():
    a, b = _m(), _m()
    assert a.cache_key == b.cache_key and hash(a.cache_key) == hash(b.cache_key)
    keys = {a.cache_key, _m(dim_n=512).cache_key, _m(b_n_major=True).cache_key,
            _m(epilogue="swiglu", gate_up="concat").cache_key,
            _m(epilogue="swiglu", gate_up="interleaved").cache_key}
    assert len(keys) == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tile_n = 128


@pytest.mark.parametrize("pingpong,cluster,expected", [(False, 1, 8), (False, CLUSTER, 16),
                                                       (True, 1, 4), (True, CLUSTER, 8)])
def test_barrier_contract(pingpong, cluster, expected):
    cfg = _m(tile_n=128 if pingpong else 256, pingpong=pingpong, cluster=cluster)
    assert barrier_contract(cfg).full == 1
    assert barrier_contract(cfg).empty == expected


@pytest.mark.parametrize("args,expected", [
    # gathered varlen-M (up-proj, dA'): cooperative 128 x 256 on a 2-CTA cluster sharing A
    # when N has an even number of n-tiles, else B (no phantom half)
    ((False, 1024, True, 1536), (256, False, CLUSTER, 128, True)),
    ((False, 256, True, 1536), (256, False, CLUSTER)),
    ((False, 1280, True, 1536), (256, False, CLUSTER)),
    # N small and not a multiple of 256: 128-wide tiles
    ((False, 192, True, 4096), (128, False, CLUSTER, 128, True)),
    ((False, 640, True, 4096), (128, False, CLUSTER)),
    # FP8 gathered: sharing B
    ((False, 1024, True, 1536, 0, "sm_90a", "e4m3"), (256, False, CLUSTER)),
    # contiguous A, K > 512 (down-proj / dX at OLMoE, 30B): cooperative 128 x 256 on a
    # cluster (stores deferred into the next tile's mainloop)
    ((False, 2048, False, 1024), (256, False, CLUSTER)),
    ((False, 4096, False, 2048), (256, False, CLUSTER)),
    # contiguous A, K <= 512 (7B down-proj / dX): ping-pong 128 x 192, one CTA
    ((False, 1536, False, 256), (192, True, 1)),
    ((False, 1536, False, 512), (192, True, 1)),
    # contiguous A where 192-wide tiles would mask more than 5% of N: the 128 / 256 plan
    ((False, 1024, False, 1024), (256, False, CLUSTER)),
    ((False, 512, False, 256), (128, True, 1)),
])
def test_plan_varlen_m(args, expected):
    assert heuristic.plan(*args) == heuristic.TilePlan(*expected)


H100 = heuristic.DeviceMemory(sms=132, l2_bytes=50 << 20, dram_bytes_per_s=3.35e12)
H200 = heuristic.DeviceMemory(sms=132, l2_bytes=60 << 20, dram_bytes_per_s=4.8e12)


# (N, K, P / E): the gathered up-proj (N = 2n, K = d) and dA' (N = n, K = d) of DeepSeek-V3,
# GLM-4.5 and Qwen3-235B (a wave's B panels over an expert's m-tiles past half the L2), and
# of 30B, OLMoE and 7B (within it).
@pytest.mark.parametrize("dim_n,dim_k,rows,outgrows", [
    (4096, 7168, 512, True), (2048, 7168, 512, True), (3072, 5120, 819, True),
    (1536, 5120, 819, True), (3072, 4096, 1024, True),
    (2048, 4096, 2048, False), (2048, 2048, 4096, False), (512, 1536, 1536, False),
])
def test_gathered_cluster_shares_b_where_weights_outgrow_l2(dim_n, dim_k, rows, outgrows):
    def shares_a(memory, per_expert=rows):
        return heuristic.plan(False, dim_n, True, dim_k, rows_per_expert=per_expert,
                              memory=memory).multicast_a

    assert shares_a(H100) is not outgrows
    # H200-class bandwidth, unknown rows or an unknown GPU: sharing A as before.
    assert shares_a(H200) and shares_a(None) and shares_a(H100, 0)
    # Unknown bandwidth counts as low.
    assert shares_a(H100._replace(dram_bytes_per_s=None)) is not outgrows
    # The FP8 plans share B anyway; contiguous A is untouched.
    assert heuristic.plan(False, dim_n, False, dim_k, rows_per_expert=rows,
                          memory=H100) == heuristic.plan(False, dim_n, False, dim_k)


def test_varlen_m_config_passes_rows_and_memory():
    cfg = heuristic.varlen_m_config(4096, 7168, True, epilogue="swiglu", gate_up="concat",
                                    rows_per_expert=512, memory=H100)
    assert (cfg.cluster, cfg.multicast_a) == (CLUSTER, False)
    assert heuristic.varlen_m_config(4096, 7168, True, rows_per_expert=512,
                                     memory=H200).multicast_a


# (N, K, P / E) of the gathered up-proj (N = 2n, K = d) and dH kernel (N = n): Mixtral-8x7B's
# experts hold 4096 rows each against 235 / 117 MB of B; the other named shapes' experts
# read their B about once per wave (few m-tiles each, or B within the L2).
@pytest.mark.parametrize("dim_n,dim_k,rows,band", [
    (28672, 4096, 4096, {"H100": 4, "H200": 5}), (14336, 4096, 4096, {"H100": 4, "H200": 5}),
    (4096, 7168, 512, None), (2048, 7168, 512, None), (3072, 5120, 819, None),
    (3072, 4096, 1024, None), (2048, 4096, 2048, None), (512, 1536, 1536, None),
    (28672, 4096, 256, None),            # two m-tiles an expert: one wave holds them
])
def test_gathered_tile_order_bands_where_b_is_read_per_m_tile(dim_n, dim_k, rows, band):
    for name, memory in (("H100", H100), ("H200", H200)):
        tiles = heuristic.plan(False, dim_n, True, dim_k, rows_per_expert=rows, memory=memory)
        assert tiles.n_band == (band[name] if band else 0)
        cfg = heuristic.varlen_m_config(dim_n, dim_k, True, epilogue="swiglu",
                                        gate_up="concat", rows_per_expert=rows, memory=memory)
        assert cfg.n_band == tiles.n_band
    # Unknown rows or GPU: no bands.
    assert heuristic.plan(False, dim_n, True, dim_k).n_band == 0
    assert heuristic.plan(False, dim_n, True, dim_k, rows_per_expert=rows).n_band == 0


# FP8 (one byte per element, :func:`heuristic.band_width`'s ab_bytes): Mixtral-8x7B's up-proj B
# (117 MB of e4m3) outgrows both GPUs' L2, its dH kernel's (59 MB) only the H100's; the other
# named shapes' experts read their B about once per wave; varlen-K never bands.
@pytest.mark.parametrize("dim_n,dim_k,rows,band", [
    (28672, 4096, 4096, {"H100": 16, "H200": 20}), (14336, 4096, 4096, {"H100": 16, "H200": 0}),
    (4096, 7168, 512, None), (3072, 5120, 819, None), (2048, 4096, 2048, None),
    (4096, 14336, 4096, None),           # Mixtral's down-proj: bands would reread A
])
def test_fp8_tile_order_bands_on_one_byte_operands(dim_n, dim_k, rows, band):
    for name, memory in (("H100", H100), ("H200", H200)):
        for gathered in (True, False):
            tiles = heuristic.plan(False, dim_n, gathered, dim_k, ab_dtype="e4m3",
                                   rows_per_expert=rows, memory=memory)
            assert tiles.n_band == (band[name] if band else 0), (name, gathered)
        cfg = heuristic.varlen_m_config(dim_n, dim_k, True, epilogue="swiglu", gate_up="concat",
                                        ab_dtype="e4m3", rows_per_expert=rows, memory=memory)
        assert cfg.n_band == (band[name] if band else 0)
        assert heuristic.plan(True, dim_n, dim_m=dim_k, ab_dtype="e4m3").n_band == 0
    # Half the bytes of bf16's bands: twice the n-groups a band holds.
    bf16 = heuristic.band_width(28672, 4096, 256, CLUSTER, False, 4096, H100)
    assert heuristic.band_width(28672, 4096, 256, CLUSTER, False, 4096, H100, ab_bytes=1) \
        == 2 * bf16


def test_band_width_counts_the_bytes_both_ways():
    """Mixtral's contiguous down-proj (K = n = 14336) reads its 7 MB B panels about four
    times unbanded, but bands of two panels would read its A eight times: no bands. A band
    never covers the whole of N."""
    assert heuristic.band_width(4096, 14336, 256, CLUSTER, False, 4096, H100) == 0
    width = heuristic.band_width(28672, 4096, 256, CLUSTER, True, 4096, H100)
    assert 0 < width < 28672 // 256 // CLUSTER
    assert width * 256 * CLUSTER * 4096 * 2 <= H100.l2_bytes // 3


def test_plan_varlen_k_cluster_needs_even_m_tiles():
    assert heuristic.plan(True, 256, dim_m=1536) == heuristic.TilePlan(256, False, CLUSTER)
    assert heuristic.plan(True, 256, dim_m=384) == heuristic.TilePlan(256, False, 1)
    assert heuristic.varlen_k_config(384, 256, True, False).cluster == 1


# expected: tile M, swapped, the cluster shares the gathered A (multicast_a).
@pytest.mark.parametrize("dim_m,dim_n,gather_a,gather_b,expected", [
    (512, 1536, False, True, (256, False, False)),   # 7B dW1: 256 x 128, B gathered on N
    (2048, 2048, False, True, (256, False, False)),  # OLMoE dW1
    # 30B dW1 (N > 2048): transposed 128-row tiles, the cluster sharing the gathered X
    (2048, 4096, False, True, (128, True, True)),
    (768, 1536, False, True, (128, True, False)),    # 3 m-tiles of 256 rows; 3 n-tiles
    (2048, 2048, True, True, (128, False, False)),   # both gathered: neither
    (2048, 1024, True, False, (256, True, False)),   # OLMoE dW2: swapped, dO gathered on N
    (4096, 1024, True, False, (128, False, True)),   # 30B dW2 (d > 2048): dO gathered on M
    (1536, 256, True, False, (128, False, False)),   # 7B dW2: one n-tile, one 256-row m-tile
])
def test_plan_varlen_k_orientation(dim_m, dim_n, gather_a, gather_b, expected):
    """dW1 / dW2 (one operand gathered): which side the gathered rows go on, the tile M of
    the GEMM that runs (swapped: M and N, and the gathers, trade places) and which operand
    the cluster shares."""
    transposed = heuristic.transpose_varlen_k(gather_a, gather_b, "sm_90a", dim_m, dim_n)
    if transposed:
        dim_m, dim_n, gather_a, gather_b = dim_n, dim_m, gather_b, gather_a
    cfg = heuristic.varlen_k_config(dim_m, dim_n, gather_a, gather_b, transposed)
    assert (cfg.tile_m, transposed, cfg.multicast_a) == expected
    if expected[0] == 256:
        assert (cfg.tile_n, cfg.cluster, cfg.gather_a, cfg.gather_b) == (128, CLUSTER, False,
                                                                         True)


@pytest.mark.parametrize("rows_per_expert,memory,shares_a", [
    (2048, H100, True),     # 30B: an expert's dH, 2048 x 2048 bf16, is 8 MiB
    (4096, H100, False),    # Mixtral-8x7B: 4096 x 28672, 224 MiB, past half the L2
    (4096, None, True),     # the GPU unknown
    (0, H100, True),        # the rows per expert unknown
])
def test_plan_varlen_k_shares_a_while_panel_fits_l2(rows_per_expert, memory, shares_a):
    """The transposed dW1 (X gathered on M) shares the gathered rows unless an expert's
    contiguous dH panel outgrows half the L2."""
    dim_n = 28672 if rows_per_expert == 4096 else 2048
    cfg = heuristic.varlen_k_config(4096, dim_n, True, False, True,
                                    rows_per_expert=rows_per_expert, memory=memory)
    assert cfg.multicast_a is shares_a and cfg.cluster == CLUSTER and cfg.transpose_c
    assert heuristic.panel_outgrows_l2(rows_per_expert, dim_n, memory) is (not shares_a)
    # dW2 (C not transposed) shares the gathered dO whatever the panel.
    assert heuristic.varlen_k_config(4096, dim_n, True, False, rows_per_expert=rows_per_expert,
                                     memory=memory).multicast_a


@pytest.mark.parametrize("dim_m,rows_per_expert,memory,expected", [
    (28672, 4096, H100, (False, 256, True)),    # Mixtral-8x7B: a 4096 x 28672 dH panel
    (28672, 4096, H200, (False, 256, True)),
    (28672, 4096, None, (True, 128, True)),     # the GPU unknown: the N > 2048 rule
    (2048, 2048, H200, (True, 128, True)),      # 30B: an 8 MiB panel fits
    (28928, 4096, H200, (True, 128, False)),    # 113 tiles of 256 rows: transposed, sharing dH
])
def test_plan_dw1_untransposed_where_dh_panel_outgrows_l2(dim_m, rows_per_expert, memory,
                                                          expected):
    """dW1 (X gathered, d = 4096 > 2048) runs untransposed on 256 x 128 tiles sharing the
    gathered X where an expert's dH panel outgrows half the L2 and 2n has an even number of
    256-row tiles; otherwise transposed. Expected: (transposed, tile M, sharing X)."""
    plan_inputs = dict(rows_per_expert=rows_per_expert, memory=memory)
    dim_n = 4096
    transposed = heuristic.transpose_varlen_k(False, True, "sm_90a", dim_m, dim_n, **plan_inputs)
    if transposed:
        cfg = heuristic.varlen_k_config(dim_n, dim_m, True, False, True, **plan_inputs)
        shares_x = cfg.multicast_a
    else:
        cfg = heuristic.varlen_k_config(dim_m, dim_n, False, True, **plan_inputs)
        # Untransposed, the cluster pairs m-tiles and shares B: the gathered X.
        shares_x = cfg.gather_b and cfg.cluster == CLUSTER and not cfg.multicast_a
        assert (cfg.tile_n, cfg.store_in_stage) == (128, False)
    assert (transposed, cfg.tile_m, shares_x) == expected
    # dW2 is swapped on the N <= 2048 terms only, whatever the panel.
    assert not heuristic.transpose_varlen_k(True, False, "sm_90a", dim_n, dim_m // 2,
                                            **plan_inputs)


# The weight gradients' configurations of the named layers: 128 x 256 tiles store C from the
# ring stage, 256 x 128 tiles and C with rows per expert not a multiple of 64 by threads.
@pytest.mark.parametrize("args,in_stage", [
    ((7168, 4096, True, False, True), True),     # DeepSeek-V3 dW1ᵀ
    ((2048, 7168, True, False), True),           # DeepSeek-V3 dW2
    ((1024, 2048, False, True, True), False),    # OLMoE-like dW2, swapped, 256-row tiles
    ((512, 1536, False, True), False),           # 7B dW1, 256 x 128 tiles
    ((256, 1536, True, False), True),            # 7B dW2, 128 x 256 tiles
    ((64, 64, False, False), False),             # 128 x 128 tiles
    ((1000, 512, True, False), False),           # M = 1000
    ((512, 1000, True, False, True), False),     # C[e]ᵀ with N = 1000 rows
    ((4096, 7168, False, False, False, "sm_90a", "e4m3"), True),   # FP8 DeepSeek-V3 dW1
    ((1536, 2048, False, False, False, "sm_90a", "e4m3"), True),   # FP8, even m-tiles
    ((384, 384, False, False, False, "sm_90a", "e4m3"), False),    # FP8 128 x 128 tiles
])
def test_varlen_k_stores_c_from_the_ring_stage(args, in_stage):
    """sm_90a varlen-K on 128 x 256 tiles (bf16, and e4m3 on K-major copies) stores C by TMA
    from the last k-tile's ring stage where C's rows per expert are a multiple of 64; the ring
    keeps four stages beside the warpgroups' own ``64 x 64`` boxes, and each warpgroup's
    boxes but one fit in a stage."""
    cfg = heuristic.varlen_k_config(*args)
    assert cfg.store_in_stage is in_stage
    assert cfg.tma_stored == (("c",) if in_stage else ())
    if in_stage:
        assert cfg.staging_elems == 2 * 64 * config.SLAB
        assert cfg.stages == 4
        assert 2 * (cfg.tile_boxes - 1) * 64 <= cfg.tile_m + cfg.tile_n
    assert not heuristic.varlen_k_config(*args[:4], arch="sm_100a").store_in_stage


@pytest.mark.parametrize("kw,match", [
    (dict(varlen_k=False, dim_k=1536), "store_in_stage serves the cooperative sm_90a"),
    (dict(tile_n=128, pingpong=True, cluster=1), "store_in_stage serves"),
    (dict(dim_m=1000), "rows per expert a multiple of 64"),
    (dict(dim_n=1000, transpose_c=True), "rows per expert a multiple of 64"),
])
def test_store_in_stage_rejects_what_the_kernel_cannot_store(kw, match):
    base = dict(varlen_k=True, tile_n=256, pingpong=False, cluster=CLUSTER, dim_m=1536,
                dim_n=2048, dim_k=0, gather_a=True, store_in_stage=True)
    with pytest.raises(ValueError, match=match):
        GroupedGemmConfig(**{**base, **kw})


@pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl) is not importable")
@pytest.mark.parametrize("args", [(7168, 4096, True, False, True), (512, 1536, False, True),
                                  (512, 512, True, False),
                                  (4096, 7168, False, False, False, "sm_90a", "e4m3")])
def test_c_boxes_in_the_ring_stage_are_disjoint(args):
    """The boxes both warpgroups stage C in (all but each one's last) are distinct, 1024-byte
    aligned ``64 x 64`` bf16 blocks inside the stage's A and B k-tiles (bf16, or e4m3 k-tiles
    of twice the columns: the same bytes)."""
    from sonic.kernels.grouped_gemm.epilogue import make_epilogue

    # 256 x 128 tiles (the second) are not planned with it, but the kernel takes them.
    cfg = dataclasses.replace(heuristic.varlen_k_config(*args), store_in_stage=True)
    epilogue = make_epilogue(cfg, ring=None)
    a_base, b_base, stage = 0, 1 << 30, 2
    # Stage sizes in bf16 elements.
    a_elems, b_elems = (rows * cfg.tile_k * cfg.ab_bytes // 2 for rows in (cfg.tile_m,
                                                                           cfg.tile_n))
    box = 64 * config.SLAB
    starts = [epilogue.stage_box(a_base, b_base, stage, wg, i)
              for wg in range(2) for i in range(cfg.tile_boxes - 1)]
    assert len(set(starts)) == len(starts) == 2 * (cfg.tile_boxes - 1)
    for start in starts:
        region, size = (a_base, a_elems) if start < b_base else (b_base, b_elems)
        assert region + stage * size <= start <= region + (stage + 1) * size - box
        assert (start - region) % box == 0


def test_ping_pong_varlen_k_is_never_transposed(monkeypatch):
    """A ping-pong varlen-K plan (``bench_grouped_gemm.py --plans`` forces one) keeps C
    untransposed, which the ping-pong kernel needs, where the cooperative plan would swap."""
    assert heuristic.transpose_varlen_k(False, True, "sm_90a", 4096, 7168)
    original = heuristic.plan
    monkeypatch.setattr(heuristic, "plan", lambda varlen_k, *args, **kwargs: (
        heuristic.TilePlan(128, True, 1) if varlen_k else original(varlen_k, *args, **kwargs)))
    for gather_a, gather_b in ((False, True), (True, False)):
        assert not heuristic.transpose_varlen_k(gather_a, gather_b, "sm_90a", 4096, 7168)
        cfg = heuristic.varlen_k_config(4096, 7168, gather_a, gather_b)
        assert (cfg.pingpong, cfg.transpose_c, cfg.tile_n) == (True, False, 128)


def test_sm100_config_plan_and_contract():
    # One epilogue warpgroup holds all 128 rows: a 128 x 72 staging block, still 4 stages.
    cfg = heuristic.varlen_m_config(1024, 1536, True, arch="sm_100a")
    assert (cfg.tile_n, cfg.pingpong, cfg.cluster) == (256, False, 1)
    assert (cfg.rows_wg, cfg.staging_elems, cfg.stages) == (128, 128 * 72, 4)
    assert barrier_contract(cfg) == config.BarrierContract(full=1, empty=1)
    assert heuristic.varlen_m_config(1536, 256, False, arch="sm_100a").pingpong is False
    # dW1 gathers B directly on sm_100a (its epilogue cannot stage C transposed).
    assert heuristic.transpose_varlen_k(False, True, "sm_90a", 2048, 4096)
    assert not heuristic.transpose_varlen_k(False, True, "sm_100a", 2048, 4096)
    assert not heuristic.transpose_varlen_k(True, False, "sm_90a", 4096, 1024)
    assert heuristic.transpose_varlen_k(True, False, "sm_90a", 2048, 1024)
    assert not heuristic.transpose_varlen_k(True, False, "sm_100a", 2048, 1024)
    assert heuristic.varlen_k_config(512, 1536, False, True, arch="sm_100a").tile_m == 128


def test_swiglu_concat_tile_keeps_gate_half_inside_n():
    # n = 320: a 256 tile's gate half (128) does not divide n, so the tile drops to 128.
    assert heuristic.varlen_m_config(640, 1536, True, epilogue="swiglu",
                                     gate_up="concat").tile_n == 128
    assert heuristic.varlen_m_config(640, 1536, True, epilogue="swiglu",
                                     gate_up="interleaved").tile_n == 128
    assert heuristic.varlen_m_config(1024, 1536, True, epilogue="swiglu",
                                     gate_up="concat").tile_n == 256


@pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl) is not importable")
def test_wrong_barrier_count_fails_compilation():
    code = """
import sys
from sonic.kernels import runtime
runtime.set_compile_arch("sm_90a")
from sonic.kernels.grouped_gemm import config, heuristic, interface
from sonic.kernels.grouped_gemm.sm90 import Sm90GroupedGemm
cfg = heuristic.varlen_m_config(512, 256, True)

class Miscounted(Sm90GroupedGemm):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.contract = config.BarrierContract(full=1, empty=self.contract.empty // 2)

try:
    interface.compile_kernel(Miscounted(cfg))
except Exception as err:
    print("FAILED:", err)
    sys.exit(0)
sys.exit(1)
"""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "empty barrier initialised for 8 arrivals" in out.stdout, out.stdout


def test_sm_margin_shrinks_the_persistent_grid(monkeypatch):
    """The grid leaves sm_margin SMs (whole clusters) free, keeps at least one CTA (cluster),
    never exceeds the work items, and is restored when the context ends."""
    import torch

    from sonic.backend import sm_margin
    from sonic.kernels.grouped_gemm import interface

    # 132 SMs; 66 resident 2-CTA clusters. No GPU is touched: the device index is given.
    monkeypatch.setattr(interface, "_resident", lambda index, cluster: 132 // cluster)
    device = torch.device("cuda", 0)
    assert interface._num_ctas(device, 1000) == 132
    with sm_margin(16):
        assert interface._num_ctas(device, 1000) == 116
        assert interface._num_ctas(device, 1000, cluster=2) == 2 * 58
        assert interface._num_ctas(device, 10) == 10
        with sm_margin(15):
            assert interface._num_ctas(device, 1000, cluster=2) == 2 * 58   # ceil(15 / 2)
        with sm_margin(500):
            assert interface._num_ctas(device, 1000, cluster=2) == 2
    assert interface._num_ctas(device, 1000) == 132
    with pytest.raises(ValueError, match="num_sms"):
        with sm_margin(-1):
            pass


def test_operands_pass_a_stand_in_for_absent_addresses():
    """An operand a configuration never reads (None) passes C's address; the others pass
    their own, in the launcher's order."""
    import random

    from sonic.kernels.grouped_gemm.args import Operands

    rng = random.Random(7)
    fields = Operands._fields
    for _ in range(20):
        values = {f: rng.randrange(1, 1 << 40) * 16 for f in fields}
        absent = {f for f in fields if f not in ("a", "b", "c") and rng.random() < 0.5}
        operands = Operands(**{f: None if f in absent else values[f] for f in fields})
        assert operands.addresses() == tuple(
            values["c"] if f in absent else values[f] for f in fields)


@pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl) is not importable")
def test_launcher_signature_follows_the_bundles():
    """The compiled launcher's flat parameters are Operands' addresses, then Sizes, then the
    stream: adding an operand is a field of Operands and a parameter of the launcher."""
    import inspect

    from sonic.kernels.grouped_gemm.args import Operands, Sizes
    from sonic.kernels.grouped_gemm.base import GroupedGemmKernel

    call = inspect.unwrap(GroupedGemmKernel.__call__)
    names = list(inspect.signature(call).parameters)[1:]
    assert names == ([f"{f}_addr" for f in Operands._fields] + list(Sizes._fields)
                     + ["stream"])


def test_named_barriers_do_not_collide():
    """Every role's per-warpgroup named barrier ids are distinct, none is the CTA barrier (0),
    and all fit the 16 hardware barriers."""
    from sonic.kernels.grouped_gemm.config import CONSUMER_WARPGROUPS, NamedBarrier

    bases = [NamedBarrier.MMA_TURN, NamedBarrier.EPILOGUE]
    ids = ([base + wg for base in bases for wg in range(CONSUMER_WARPGROUPS)]
           + [NamedBarrier.CONSUMERS])
    assert len(set(ids)) == len(ids)
    assert all(0 < i < 16 for i in ids)
    assert all(type(base) is int for base in bases)


@pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl) is not importable")
def test_schedulers_and_accumulator_views_meet_their_protocols():
    """Both tile schedulers are TileSchedulers and both accumulator views carry every member
    of AccumulatorView (what the warp roles and the epilogues call)."""
    from sonic.kernels.grouped_gemm import protocols
    from sonic.kernels.grouped_gemm.sm90 import WgmmaAccumulator
    from sonic.kernels.grouped_gemm.sm100 import TmemAccumulator
    from sonic.kernels.grouped_gemm.tile_scheduler import make_scheduler

    for cfg in (heuristic.varlen_m_config(512, 1536, True),
                heuristic.varlen_k_config(1536, 512, True, False)):
        assert isinstance(make_scheduler(cfg), protocols.TileScheduler)
    members = [m for m in dir(protocols.AccumulatorView) if not m.startswith("_")]
    members += list(protocols.AccumulatorView.__annotations__)
    assert {"pairs", "coord", "value", "warp_private"} <= set(members)
    for view in (WgmmaAccumulator, TmemAccumulator):
        missing = [m for m in members if not hasattr(view, m)
                   and m not in getattr(view, "__init__").__code__.co_names]
        assert not missing, (view.__name__, missing)


def test_no_long_host_functions_in_the_package():
    """Host-side (not ``@cute.jit`` / ``@cute.kernel``) functions of the grouped-GEMM package
    stay within 150 lines, so each can be read whole."""
    import ast
    import pathlib

    package = pathlib.Path(ROOT, "sonic", "kernels", "grouped_gemm")
    long = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any(ast.unparse(d).startswith("cute.") for d in node.decorator_list):
                continue
            if node.end_lineno - node.lineno + 1 > 150:
                long.append(f"{path.name}:{node.name}")
    assert not long, long
