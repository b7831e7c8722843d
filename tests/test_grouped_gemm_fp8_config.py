"""CPU tests of the block-scaled FP8 grouped GEMM: its configuration (validation,
derived sizes, the bf16 configurations' cache keys left alone), its tile plan, the argument
validation of ``grouped_gemm_fp8`` (errors name the argument), and its compile-check variants.
The numerics run on the GPU (tests/gpu/test_grouped_gemm_fp8.py)."""

import dataclasses

import pytest
import torch

from sonic.kernels.grouped_gemm import config, heuristic
from sonic.kernels.grouped_gemm.config import CLUSTER, GroupedGemmConfig


def _fp8(**kw):
    base = dict(varlen_k=False, tile_n=128, pingpong=False, cluster=CLUSTER, dim_m=0,
                dim_n=1024, dim_k=1536, gather_a=True, ab_dtype="e4m3")
    return GroupedGemmConfig(**{**base, **kw})


@pytest.mark.parametrize("kw,match", [
    (dict(ab_dtype="e5m2"), "ab_dtype must be one of"),
    (dict(arch="sm_100a", cluster=1), "no FP8 grouped-GEMM mainloop for arch 'sm_100a'"),
    (dict(varlen_k=True, dim_m=512, dim_k=0), "reads K-major copies \\(no gather"),
    (dict(varlen_k=True, dim_m=512, dim_k=0, gather_a=False, transpose_c=True),
     "reads K-major copies"),
    (dict(varlen_k=True, dim_m=512, dim_k=0, gather_a=False, tile_n=256, dim_n=384),
     "runs 128 x 128 or 128 x 256 tiles"),
    (dict(varlen_k=True, dim_m=200, dim_k=0, gather_a=False, cluster=1),
     "runs 128 x 128 or 128 x 256 tiles"),
    (dict(b_n_major=True), "K-major B"),
    (dict(epilogue="dswiglu", gather_a=False), "serves the gathered dA' GEMM"),
    (dict(tile_n=256, dim_n=384), "256-wide tiles need N a multiple of 256"),
    (dict(pingpong=True, cluster=1), "the FP8 mainloop runs cooperative tiles"),
    (dict(dim_k=1600), "K and N multiples of 128"),
    (dict(dim_n=200), "K and N multiples of 128"),
])
def test_fp8_config_rejects_unsupported_combinations(kw, match):
    with pytest.raises(ValueError, match=match):
        _fp8(**kw)


def test_fp8_config_derived_sizes():
    cfg = _fp8()
    assert cfg.fp8 and cfg.tile_k == config.TILE_K_FP8 == 128 and cfg.ab_bytes == 1
    assert cfg.k_tiles == 1536 // 128
    # 128 e4m3 values per row are the bytes of 64 bf16: a stage is as large as a bf16 one.
    bf16 = dataclasses.replace(cfg, ab_dtype="bf16")
    assert cfg.tma_bytes == bf16.tma_bytes == (128 + 128) * 128
    assert cfg.stages == bf16.stages
    assert cfg.mainloop == config.FP8_MAINLOOPS["sm_90a"]
    assert bf16.mainloop == config.MAINLOOPS["sm_90a"]
    assert config.barrier_contract(cfg) == config.barrier_contract(bf16)


def test_bf16_configs_keep_their_cache_key():
    """The new field defaults to bf16, so every existing configuration (built without it) is
    the same key; the FP8 one is a different key."""
    planned = heuristic.varlen_m_config(512, 1536, True)
    assert planned.ab_dtype == "bf16" and planned.tile_k == config.TILE_K
    assert planned.cache_key == dataclasses.replace(planned, ab_dtype="bf16").cache_key
    fp8 = heuristic.varlen_m_config(512, 1536, True, ab_dtype="e4m3")
    assert fp8.cache_key != heuristic.varlen_m_config(512, 1536, True, ab_dtype="bf16").cache_key


@pytest.mark.parametrize("gathered,dim_k", [(True, 2048), (False, 768), (False, 256)])
def test_fp8_plan(gathered, dim_k):
    """256-wide tiles where N allows (two 128-column sub-tiles, one partial accumulator),
    else 128-wide; cooperative on a 2-CTA cluster either way."""
    cfg = heuristic.varlen_m_config(2048, dim_k, gathered, ab_dtype="e4m3")
    assert (cfg.tile_n, cfg.pingpong, cfg.cluster) == (256, False, CLUSTER)
    assert cfg.gather_a == gathered and cfg.dim_k == dim_k
    assert not cfg.overlapped_promotion
    narrow = heuristic.varlen_m_config(384, dim_k, gathered, ab_dtype="e4m3")
    assert narrow.tile_n == 128 and narrow.overlapped_promotion == (not gathered)


def test_fp8_plan_on_sm100_names_the_missing_mainloop():
    with pytest.raises(ValueError, match="no FP8 grouped-GEMM mainloop for arch 'sm_100a'"):
        heuristic.varlen_m_config(2048, 2048, True, ab_dtype="e4m3", arch="sm_100a")


def _args(num_rows=16, dim_k=256, dim_n=128, experts=2):
    a_q = torch.zeros(num_rows, dim_k, dtype=torch.float8_e4m3fn)
    a_s = torch.ones(dim_k // 128, num_rows)
    b_q = torch.zeros(experts, dim_n, dim_k, dtype=torch.float8_e4m3fn)
    b_s = torch.ones(experts, dim_n // 128, dim_k // 128)
    off = torch.tensor([0, 8, 16], dtype=torch.int32)
    return [a_q, a_s, b_q, b_s, off]


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.__setitem__(0, a[0].to(torch.bfloat16)), TypeError,
     "a_q must be a torch.float8_e4m3fn tensor"),
    (lambda a: a.__setitem__(1, a[1].double()), TypeError,
     "a_scales must be a torch.float32 tensor"),
    (lambda a: a.__setitem__(2, a[2].float()), TypeError,
     "b_q must be a torch.float8_e4m3fn tensor"),
    (lambda a: a.__setitem__(3, a[3][0]), ValueError, "b_scales must have 3 dimensions"),
    (lambda a: a.__setitem__(2, a[2][:, :, :200]), ValueError,
     r"K \(columns of a_q, last dim of b_q\) must be a positive multiple of 128"),
    (lambda a: a.__setitem__(2, a[2][:, :64]), ValueError,
     r"N \(rows of b_q per expert\) must be a positive multiple of 128"),
    (lambda a: a.__setitem__(0, a[0][:, :128]), ValueError, "a_q must have K = 256 columns"),
    (lambda a: a.__setitem__(1, a[1].t()), ValueError,
     r"a_scales must have shape \(K/128, rows of a_q\) = \(2, 16\)"),
    (lambda a: a.__setitem__(3, a[3][:, :, :1]), ValueError,
     r"b_scales must have shape \(E, N/128, K/128\) = \(2, 1, 2\)"),
    (lambda a: None, ValueError, "a_q must be on a CUDA device"),
])
def test_fp8_validation(change, error, match):
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8

    args = _args()
    change(args)
    with pytest.raises(error, match=match):
        grouped_gemm_fp8(*args)


def test_fp8_variants_registered_for_sm90_only():
    from sonic.kernels import registry
    from sonic.kernels.grouped_gemm import interface

    fp8 = [v for v in registry.variants() if v.kernel == "grouped_gemm" and "fp8" in v.variant]
    assert {v.variant for v in fp8} == {"varlen_m_fp8_n512_k1536_gather",
                                         "varlen_m_fp8_n1408_k2048_gather",
                                         "varlen_m_fp8_n1536_k256_contig",
                                         "varlen_m_fp8_n384_k256_contig",
                                         "varlen_m_fp8_n384_k1536_gather_swiglu_concat",
                                         "varlen_m_fp8_n1024_k1536_gather_swiglu_concat",
                                         "varlen_m_fp8_n1024_k1536_gather_swiglu_interleaved",
                                         "varlen_m_fp8_n28672_k4096_gather_swiglu_interleaved_banded",
                                         "varlen_m_fp8_n1024_k2048_gather_dswiglu",
                                         "varlen_m_fp8_n1408_k2048_gather_dswiglu",
                                         "varlen_m_fp8_n14336_k4096_gather_dswiglu_banded",
                                         "varlen_k_fp8_m1536_n2048", "varlen_k_fp8_m384_n384"}
    for v in fp8:
        assert v.archs == ("sm_90a",)
        assert v.ptx_markers == interface._FP8_MARKERS
        assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in v.ptx_markers


@pytest.mark.parametrize("ab_dtype", ["bf16", "e4m3"])
@pytest.mark.parametrize("gathered", [False, True])
def test_register_split_fits_the_launch_allocation(ab_dtype, gathered):
    """setmaxnreg only moves registers within the CTA's launch allocation (168 per thread of
    384): a split beyond it makes the consumers' increase wait forever (a hang, not an error).
    The overlapped FP8 promotion needs 232 per consumer for its three accumulators."""
    for dim_n in (2048, 384):
        cfg = heuristic.varlen_m_config(dim_n, 4096, gathered, ab_dtype=ab_dtype)
        consumers = config.THREADS - config.PRODUCER_THREADS
        assert (config.PRODUCER_THREADS * cfg.producer_regs + consumers * cfg.consumer_regs
                <= config.THREADS * 168)
        assert cfg.producer_regs % 8 == 0 and cfg.consumer_regs % 8 == 0
        assert cfg.overlapped_promotion == (cfg.fp8 and not gathered and cfg.tile_n == 128)
        if cfg.overlapped_promotion:
            assert cfg.consumer_regs == 232


def test_consumer_heavy_split_follows_the_measurements():
    """40/232 where the H200 A/Bs measured it faster (FP8 256-wide tiles, the bf16 SwiGLU
    up-proj), 56/224 for the bf16 dH kernel (its producers also load H: 1.6x slower at 40)."""
    limit = config.THREADS * 168
    consumers = config.THREADS - config.PRODUCER_THREADS
    swiglu = heuristic.varlen_m_config(2048, 4096, True, epilogue="swiglu", gate_up="concat")
    dswiglu = heuristic.varlen_m_config(1024, 4096, True, True, epilogue="dswiglu")
    fp8 = heuristic.varlen_m_config(2048, 4096, True, ab_dtype="e4m3")
    for cfg, heavy in ((swiglu, True), (fp8, True), (dswiglu, False)):
        assert cfg.consumer_heavy == heavy
        assert (cfg.producer_regs, cfg.consumer_regs) == ((40, 232) if heavy else (56, 224))
        assert config.PRODUCER_THREADS * cfg.producer_regs + consumers * cfg.consumer_regs <= limit

# The FP8 up-proj with the SwiGLU epilogue (grouped_gemm_fp8_swiglu).
@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_fp8_swiglu_config_and_plan(gate_up):
    cfg = heuristic.varlen_m_config(384, 1536, True, epilogue="swiglu", gate_up=gate_up,
                                    ab_dtype="e4m3")
    assert (cfg.tile_n, cfg.pingpong, cfg.cluster) == (128, False, CLUSTER)
    assert cfg.fp8 and cfg.epilogue == "swiglu" and cfg.mainloop == config.FP8_MAINLOOPS["sm_90a"]
    # concat loads B as gate and up halves of 64 rows (each inside one 128-row scale block).
    assert cfg.b_halves == (gate_up == "concat")
    keys = {cfg.cache_key, dataclasses.replace(cfg, ab_dtype="bf16").cache_key,
            dataclasses.replace(cfg, epilogue="store", gate_up=None).cache_key,
            dataclasses.replace(cfg, gate_up="interleaved" if gate_up == "concat"
                                else "concat").cache_key}
    assert len(keys) == 4


@pytest.mark.parametrize("kw,match", [
    (dict(gather_a=False), "the SwiGLU epilogue serves the gathered up-proj"),
    (dict(dim_n=192), "K and N multiples of 128"),
    (dict(pingpong=True, cluster=1), "the FP8 mainloop runs cooperative tiles"),
    (dict(gate_up=None), "gate_up is given exactly with the 'swiglu' epilogue"),
])
def test_fp8_swiglu_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        _fp8(**{**dict(epilogue="swiglu", gate_up="concat"), **kw})


def _swiglu_args(num_tokens=16, dim_k=256, two_n=256, experts=2):
    x_q, x_s, w_q, w_s, off = _args(num_tokens, dim_k, two_n, experts)
    return [x_q, x_s, w_q, w_s, off, torch.arange(num_tokens, dtype=torch.int32)]


@pytest.mark.parametrize("change,kw,error,match", [
    (lambda a: None, dict(gate_up="halves"), ValueError, "gate_up must be one of"),
    (lambda a: a.__setitem__(5, None), {}, ValueError, "gather_idx is required"),
    (lambda a: a.__setitem__(0, a[0].to(torch.bfloat16)), {}, TypeError,
     "x_q must be a torch.float8_e4m3fn tensor"),
    (lambda a: a.__setitem__(3, a[3].double()), {}, TypeError,
     "w1_scales must be a torch.float32 tensor"),
    (lambda a: a.__setitem__(2, a[2][:, :192]), {}, ValueError,
     r"N \(rows of w1_q per expert\) must be a positive multiple of 128"),
    (lambda a: a.__setitem__(1, a[1][:1]), {}, ValueError,
     r"x_scales must have shape \(K/128, rows of x_q\) = \(2, 16\)"),
    (lambda a: a.__setitem__(3, a[3][:, :1]), {}, ValueError,
     r"w1_scales must have shape \(E, N/128, K/128\) = \(2, 2, 2\)"),
    (lambda a: None, {}, ValueError, "x_q must be on a CUDA device"),
])
def test_fp8_swiglu_validation(change, kw, error, match):
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8_swiglu

    args = _swiglu_args()
    change(args)
    with pytest.raises(error, match=match):
        grouped_gemm_fp8_swiglu(*args, **kw)


# The FP8 dH kernel (grouped_gemm_fp8_dswiglu): K-major W2ᵀ, where bf16 reads W2 N-major.
def test_fp8_dswiglu_config():
    cfg = heuristic.varlen_m_config(1024, 2048, True, epilogue="dswiglu", ab_dtype="e4m3")
    assert (cfg.tile_n, cfg.pingpong, cfg.cluster, cfg.b_n_major) == (256, False, CLUSTER, False)
    assert cfg.mainloop == config.FP8_MAINLOOPS["sm_90a"] and cfg.n_tiles == 4
    with pytest.raises(ValueError, match="serves the gathered dA' GEMM"):
        dataclasses.replace(cfg, ab_dtype="bf16")   # bf16 dSwiGLU reads W2 N-major
    with pytest.raises(ValueError, match="K-major B"):
        dataclasses.replace(cfg, b_n_major=True)


def _dswiglu_args(num_tokens=16, dim_k=256, n=128, experts=2, num_pairs=16):
    x_q, x_s, w_q, w_s, off = _args(num_tokens, dim_k, n, experts)
    idx = torch.arange(num_pairs, dtype=torch.int32)
    h = torch.zeros(num_pairs, 2 * n, dtype=torch.bfloat16)
    return [x_q, x_s, w_q, w_s, off, idx, h, torch.ones(num_pairs)]


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.__setitem__(5, None), ValueError, "gather_idx is required"),
    (lambda a: a.__setitem__(0, a[0].float()), TypeError,
     "dout_q must be a torch.float8_e4m3fn tensor"),
    (lambda a: a.__setitem__(2, a[2][:, :64]), ValueError,
     r"N \(rows of w2t_q per expert\) must be a positive multiple of 128"),
    (lambda a: a.__setitem__(3, a[3][:1]), ValueError,
     r"w2t_scales must have shape \(E, N/128, K/128\)"),
    (lambda a: a.__setitem__(1, a[1][:1]), ValueError,
     r"dout_scales must have shape \(K/128, rows of dout_q\)"),
    (lambda a: None, ValueError, "dout_q must be on a CUDA device"),
])
def test_fp8_dswiglu_validation(change, error, match):
    from sonic.kernels.grouped_gemm import grouped_gemm_fp8_dswiglu

    args = _dswiglu_args()
    change(args)
    with pytest.raises(error, match=match):
        grouped_gemm_fp8_dswiglu(*args)


def test_fp8_varlen_k_config_and_plan():
    """FP8 varlen-K (the weight gradients on K-major copies): TMA tiles, not row copies, so
    the 40/232 register split; no overlapped promotion (the k-loop is the expert's, not
    unrollable); 128 x 256 tiles where N is a multiple of 256, else 128 x 128; a 2-CTA
    cluster exactly when M has an even m-tile count."""
    cfg = heuristic.varlen_k_config(1536, 2048, False, False, ab_dtype="e4m3")
    assert (cfg.varlen_k, cfg.fp8, cfg.tile_n, cfg.cluster) == (True, True, 256, CLUSTER)
    assert heuristic.varlen_k_config(1536, 384, False, False, ab_dtype="e4m3").tile_n == 128
    assert not cfg.mn_major_k and not cfg.row_copies and not cfg.overlapped_promotion
    assert (cfg.producer_regs, cfg.consumer_regs) == (40, 232)
    assert cfg.mainloop == config.FP8_MAINLOOPS["sm_90a"]
    assert heuristic.varlen_k_config(384, 256, False, False, ab_dtype="e4m3").cluster == 1
    bf16 = heuristic.varlen_k_config(1536, 2048, False, True)
    assert bf16.mn_major_k and bf16.row_copies and not bf16.fp8


def test_fp8_varlen_k_stages_carry_the_column_scales():
    """FP8 varlen-K stages carry the k-tile's fp32 B scale of each of the tile's columns
    (bulk-copied, so B's scales are 16-byte aligned); no other configuration has them."""
    for n, tile_n in ((384, 128), (2048, 256)):
        cfg = heuristic.varlen_k_config(1536, n, False, False, ab_dtype="e4m3")
        assert cfg.tile_n == tile_n and cfg.b_scales_align == 16
        assert cfg.col_scale_bytes == tile_n * 4
        assert cfg.tma_bytes == (128 + tile_n) * 128 + tile_n * 4
        assert cfg.stages >= 4
        assert cfg.stages * cfg.tma_bytes + cfg.staging_elems * 2 <= config.SMEM_BYTES
    for other in (_fp8(), heuristic.varlen_k_config(1536, 2048, False, True)):
        assert other.col_scale_bytes == 0 and other.b_scales_align == 4


def test_fp8_varlen_k_entry_points_validate_on_cpu():
    from sonic.kernels.fp8_quant import quantize_cols_grouped
    from sonic.kernels.grouped_gemm import grouped_gemm_varlen_k_fp8

    off = torch.tensor([0, 3, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        quantize_cols_grouped(torch.randn(10, 128, dtype=torch.bfloat16), off, off)
    q = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(2, 128)
    with pytest.raises(ValueError, match="a_t_q must be on a CUDA device"):
        grouped_gemm_varlen_k_fp8(q, s, q, s, off)
    with pytest.raises(TypeError, match="a_t_q must have dtype"):
        grouped_gemm_varlen_k_fp8(q.float(), s, q, s, off)


def test_quantize_cols_strips_cover_the_columns():
    """Each CTA of quantize_cols_grouped takes at most MAX_COLS_CHUNKS 64-column chunks, as
    many as divide the columns' chunks, and its strips tile the columns."""
    from sonic.kernels import fp8_quant

    seen = set()
    for cols in range(128, 16384 + 1, 128):
        chunks = fp8_quant.cols_chunks(cols)
        seen.add(chunks)
        assert 2 <= chunks <= fp8_quant.MAX_COLS_CHUNKS
        assert (cols // fp8_quant.COLS_PER_CTA) % chunks == 0
    assert fp8_quant.cols_chunks(7168) == 8 and fp8_quant.cols_chunks(768) == 6
    assert fp8_quant.cols_chunks(640) == 5 and fp8_quant.cols_chunks(128) == 2


def test_wgmma_turns_follow_the_measurements():
    """The warpgroups queue their WGMMAs in turn on FP8 tiles with one partial accumulator
    (measured faster or level), not with the fused SwiGLU epilogue nor on gathered 128-wide
    tiles (measured slower), not where two partials already overlap the promotion, never on
    bf16."""
    def plan(dim_n, gathered, **kw):
        return heuristic.varlen_m_config(dim_n, 2048, gathered, **kw)

    assert plan(2048, True, ab_dtype="e4m3").wgmma_turns
    assert plan(2048, False, ab_dtype="e4m3").wgmma_turns
    assert plan(1024, True, epilogue="dswiglu", ab_dtype="e4m3").wgmma_turns
    assert not plan(2048, True, epilogue="swiglu", gate_up="concat",
                    ab_dtype="e4m3").wgmma_turns
    assert not plan(384, False, ab_dtype="e4m3").wgmma_turns    # overlapped promotion
    assert not plan(1408, True, ab_dtype="e4m3").wgmma_turns     # gathered, 128-wide
    assert not plan(1408, True, epilogue="dswiglu", ab_dtype="e4m3").wgmma_turns
    assert heuristic.varlen_k_config(2048, 1024, False, False, ab_dtype="e4m3").wgmma_turns
    assert not plan(2048, True).wgmma_turns


def test_scale_prefetch_follows_the_measurements():
    """Scales a k-tile ahead on the FP8 tiles with one partial accumulator where that was
    measured faster (contiguous varlen-M, fused SwiGLU and dSwiGLU), not on the gathered store
    GEMM or varlen-K (measured slower), not with overlapped promotion, never on bf16."""
    def plan(dim_n, gathered, **kw):
        return heuristic.varlen_m_config(dim_n, 2048, gathered, **kw)

    assert plan(2048, False, ab_dtype="e4m3").scale_prefetch
    assert plan(2048, True, epilogue="swiglu", gate_up="concat",
                ab_dtype="e4m3").scale_prefetch
    assert plan(1024, True, epilogue="dswiglu", ab_dtype="e4m3").scale_prefetch
    assert not plan(2048, True, ab_dtype="e4m3").scale_prefetch
    assert not plan(384, False, ab_dtype="e4m3").scale_prefetch    # overlapped promotion
    assert not heuristic.varlen_k_config(2048, 1024, False, False,
                                         ab_dtype="e4m3").scale_prefetch
    assert not plan(2048, False).scale_prefetch
