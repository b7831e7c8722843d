"""GPU grouped GEMMs (varlen-M, varlen-K, gathered or not) against per-expert fp32 matmuls."""

import functools

import pytest
import torch


from kernel_checks import (bf16_rand as _rand, dh_problem, expert_counts as _counts,
                           expert_offsets as _offsets, force_n_band, poison_allocator,
                           ref_varlen_m as _ref_varlen_m, require_kernels, up_proj_problem)
from sonic.kernels.grouped_gemm import heuristic
from sonic.kernels.grouped_gemm.config import CLUSTER
from sonic.kernels.grouped_gemm.heuristic import TilePlan

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_kernels():
    require_kernels()


def _rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _ref_varlen_k(a_rows, b_rows, offsets):
    off = offsets.tolist()
    out = torch.empty(len(off) - 1, a_rows.shape[1], b_rows.shape[1], device="cuda")
    for e in range(len(off) - 1):
        out[e] = a_rows[off[e]:off[e + 1]].float().t() @ b_rows[off[e]:off[e + 1]].float()
    return out


@pytest.mark.parametrize("b_n_major", [False, True])
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("num_pairs,num_experts,dim_n,dim_k,mode", [
    (1, 1, 64, 64, "ragged"),
    (1000, 8, 1536, 256, "ragged"),
    (3001, 16, 512, 1536, "empty"),
    (777, 4, 200, 136, "one"),
    (20000, 512, 256, 128, "ragged"),
    (4097, 128, 3072, 64, "empty"),
    (2500, 32, 200, 2048, "ragged"),
    (1500, 64, 1024, 1096, "empty"),
    (2000, 8, 256, 4104, "ragged"),
    (300, 4, 8, 24, "ragged"),
    # Contiguous A on ping-pong 128 x 192 tiles on a 2-CTA cluster (K > 512): a partial last
    # n-tile (2048 = 10 x 192 + 128), whole n-tiles (384), and an odd m-tile count.
    (2900, 16, 2048, 1024, "one"),
    (1100, 8, 384, 1536, "empty"),
    (129, 3, 4096, 576, "ragged"),
])
def test_varlen_m(num_pairs, num_experts, dim_n, dim_k, mode, gathered, b_n_major):
    from sonic.kernels.grouped_gemm import grouped_gemm

    gen = torch.Generator().manual_seed(num_pairs + dim_n + dim_k)
    offsets = _offsets(_counts(mode, num_experts, num_pairs, gen))
    # N-major B: the (E, N, K) transposed view of a contiguous (E, K, N), as the backward passes W2.
    b = (_rand(num_experts, dim_k, dim_n, gen=gen).transpose(1, 2) if b_n_major
         else _rand(num_experts, dim_n, dim_k, gen=gen))
    if gathered:
        num_tokens = max(num_pairs // 3, 1)
        x = _rand(num_tokens, dim_k, gen=gen)
        idx = torch.randint(0, num_tokens, (num_pairs,), generator=gen, dtype=torch.int32).cuda()
        a_rows = x[idx.long()]
        args, kwargs = (x, b, offsets), {"gather_idx": idx}
    else:
        a_rows = _rand(num_pairs, dim_k, gen=gen)
        args, kwargs = (a_rows, b, offsets), {}
    inputs = [t.clone() for t in args]
    ref = _ref_varlen_m(a_rows, b, offsets)
    poison_allocator(512 << 20)
    out = grouped_gemm(*args, **kwargs)
    assert out.shape == (num_pairs, dim_n) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    assert _rel_err(out, ref) < 1e-2
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    preset = torch.full_like(out, float("nan"))
    again = grouped_gemm(*args, **kwargs, out=preset)
    assert again is preset and torch.equal(out, again)
    for before, after in zip(inputs, args):
        assert torch.equal(before, after)


# Tile plans beside heuristic.plan's own: 256-row cooperative tiles, clusters sharing A
# (multicast_a) and banded tile orders (n_band, the last band narrower where the band does not
# divide N's n-groups), so each stays correct whether or not the plan picks it today.
VARLEN_M_PLANS = [
    TilePlan(128, False, 1, tile_m=256), TilePlan(128, False, CLUSTER, tile_m=256),
    TilePlan(128, False, CLUSTER, tile_m=256, multicast_a=True),
    TilePlan(192, True, CLUSTER, multicast_a=True), TilePlan(128, True, CLUSTER, multicast_a=True),
    TilePlan(256, False, CLUSTER, multicast_a=True),
    TilePlan(256, False, CLUSTER, n_band=1), TilePlan(128, False, 1, n_band=3),
    TilePlan(128, False, CLUSTER, multicast_a=True, n_band=2),
    TilePlan(192, True, 1, n_band=2),
]
VARLEN_K_PLANS = [TilePlan(128, False, 1, tile_m=256), TilePlan(128, False, CLUSTER, tile_m=256),
                  TilePlan(256, False, CLUSTER, multicast_a=True), TilePlan(128, True, 1)]


@pytest.fixture
def forced_plan(monkeypatch):
    """Make ``heuristic.plan`` answer a given :class:`TilePlan` for bf16 GEMMs of one mode."""
    def force(tiles, varlen_k):
        original = heuristic.plan

        def plan(is_varlen_k, *args, **kwargs):
            if is_varlen_k == varlen_k and kwargs.get("ab_dtype", "bf16") == "bf16":
                return tiles
            return original(is_varlen_k, *args, **kwargs)
        monkeypatch.setattr(heuristic, "plan", plan)
    return force


@pytest.mark.parametrize("tiles", VARLEN_M_PLANS, ids=str)
@pytest.mark.parametrize("num_pairs,num_experts,dim_n,dim_k,mode", [
    (1, 1, 64, 64, "ragged"),
    (2900, 16, 2048, 1024, "one"),      # whole n-tile pairs
    (3001, 16, 640, 576, "empty"),      # an odd n-tile count: the last pair's phantom half
    (1100, 8, 200, 136, "ragged"),      # partial n-tile and k-tile
    (20000, 512, 384, 128, "ragged"),
])
def test_varlen_m_tile_plans(forced_plan, tiles, num_pairs, num_experts, dim_n, dim_k, mode):
    """Contiguous-A varlen-M under every candidate tile plan, against the fp32 reference."""
    from sonic.kernels.grouped_gemm import grouped_gemm

    forced_plan(tiles, varlen_k=False)
    gen = torch.Generator().manual_seed(num_pairs + dim_n)
    offsets = _offsets(_counts(mode, num_experts, num_pairs, gen))
    a, b = _rand(num_pairs, dim_k, gen=gen), _rand(num_experts, dim_n, dim_k, gen=gen)
    ref = _ref_varlen_m(a, b, offsets)
    poison_allocator(512 << 20)
    out = grouped_gemm(a, b, offsets)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.fixture
def gathered_cluster_shares(monkeypatch):
    """Make the gathered bf16 varlen-M plans on a cluster share A (``multicast_a``: each CTA
    copies half of the rows) or B (consecutive m-tiles), whatever ``heuristic.plan`` picks
    (A on even n-tile counts)."""
    def force(share_a):
        original = heuristic.plan

        def plan(is_varlen_k, dim_n, gathered=False, *args, **kwargs):
            tiles = original(is_varlen_k, dim_n, gathered, *args, **kwargs)
            if (gathered and not is_varlen_k and tiles.cluster > 1
                    and kwargs.get("ab_dtype", "bf16") == "bf16"):
                return tiles._replace(multicast_a=share_a)
            return tiles
        monkeypatch.setattr(heuristic, "plan", plan)
    return force


# Odd n-tile counts among them (N = 640: 5 x 128; the SwiGLU GEMM's 2n = 384: 3 x 128; the dH
# kernel's n = 1096: 5 x 256), so the last pair of a cluster sharing A has a phantom half
# that still copies its rows for its peer.
@pytest.mark.parametrize("share_a", [False, True], ids=["share_b", "share_a"])
@pytest.mark.parametrize("case", [
    ("gemm", (1000, 8, 1536, 256, "ragged")), ("gemm", (3001, 16, 640, 1536, "empty")),
    ("gemm", (777, 4, 200, 136, "one")), ("gemm", (1500, 64, 1024, 1096, "empty")),
    ("swiglu", (3001, 16, 256, 1536, "empty")), ("swiglu", (2000, 4, 1024, 512, "one")),
    ("swiglu", (4097, 128, 192, 256, "ragged")),
    ("dswiglu", (3001, 16, 256, 1536, "empty")), ("dswiglu", (4097, 128, 1096, 256, "ragged")),
    ("dswiglu", (1000, 8, 200, 136, "ragged")),
], ids=str)
def test_gathered_cluster_shares(gathered_cluster_shares, share_a, case):
    """The gathered GEMMs (plain, SwiGLU, dSwiGLU epilogues) with the cluster sharing A or B."""
    gathered_cluster_shares(share_a)
    kind, sizes = case
    if kind == "gemm":
        test_varlen_m(*sizes, gathered=True, b_n_major=False)
    elif kind == "swiglu":
        test_up_proj_swiglu_epilogue(*sizes, gate_up="concat")
    else:
        test_dh_dswiglu_epilogue(*sizes)


@pytest.mark.parametrize("tiles", VARLEN_K_PLANS, ids=str)
@pytest.mark.parametrize("gather_a,gather_b", [(False, False), (True, False), (False, True)])
# M and N both take an even number of 256-row tiles: with A gathered the GEMM runs swapped
# (N on the 256-row side, C stored transposed), 264 and 776 with an 8-row last tile.
@pytest.mark.parametrize("num_pairs,num_experts,dim_m,dim_n,mode", [
    (1, 2, 512, 264, "ragged"),
    (3001, 8, 1024, 1536, "ragged"),
    (2000, 16, 512, 776, "empty"),
    (777, 4, 1536, 512, "one"),
])
def test_varlen_k_tile_plans(forced_plan, tiles, num_pairs, num_experts, dim_m, dim_n, mode,
                             gather_a, gather_b):
    """varlen-K on 256-row tiles (one CTA, and clusters pairing m-tiles; B gathered on N; A
    gathered: swapped, C stored transposed from 64-row staged blocks), on a cluster sharing
    A (pairs of n-tiles, each CTA half of A's column blocks), and on ping-pong 128 x 128
    tiles (never transposed), against fp32."""
    forced_plan(tiles, varlen_k=True)
    test_varlen_k(num_pairs, num_experts, dim_m, dim_n, mode, gather_a, gather_b)


@pytest.mark.parametrize("gather_a,gather_b",
                         [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("num_pairs,num_experts,dim_m,dim_n,mode", [
    (1, 2, 64, 64, "ragged"),
    (3001, 8, 512, 1536, "ragged"),
    (2000, 16, 200, 136, "empty"),
    (777, 4, 256, 512, "one"),
    (20000, 512, 128, 256, "ragged"),
    (300, 4, 24, 8, "empty"),
    # 4096 rows per expert against M = 4096 (a 32 MiB panel, past half an H100's or H200's
    # L2): with B gathered (dW1) the plan runs it untransposed on 256 x 128 tiles.
    (8192, 2, 4096, 2304, "ragged"),
])
def test_varlen_k(num_pairs, num_experts, dim_m, dim_n, mode, gather_a, gather_b):
    from sonic.kernels.grouped_gemm import grouped_gemm_varlen_k
    from sonic.kernels.grouped_gemm.interface import device_memory

    if (dim_m, gather_a, gather_b) == (4096, False, True):
        assert not heuristic.transpose_varlen_k(
            False, True, "sm_90a", dim_m, dim_n, rows_per_expert=num_pairs // num_experts,
            memory=device_memory(torch.cuda.current_device()))

    gen = torch.Generator().manual_seed(num_pairs + dim_m + dim_n)
    offsets = _offsets(_counts(mode, num_experts, num_pairs, gen))
    num_tokens = max(num_pairs // 2, 1)
    kwargs, rows, args = {}, [], []
    for name, width, gathered in (("a", dim_m, gather_a), ("b", dim_n, gather_b)):
        if gathered:
            src = _rand(num_tokens, width, gen=gen)
            idx = torch.randint(0, num_tokens, (num_pairs,), generator=gen,
                                dtype=torch.int32).cuda()
            kwargs[f"gather_idx_{name}"] = idx
            rows.append(src[idx.long()])
        else:
            src = _rand(num_pairs, width, gen=gen)
            rows.append(src)
        args.append(src)
    ref = _ref_varlen_k(rows[0], rows[1], offsets)
    poison_allocator(512 << 20)
    out = grouped_gemm_varlen_k(args[0], args[1], offsets, **kwargs)
    assert out.shape == (num_experts, dim_m, dim_n) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    assert _rel_err(out, ref) < 1e-2
    torch.testing.assert_close(out.float(), ref, rtol=2e-2,
                               atol=2e-2 * ref.abs().max().clamp_min(1).item())
    poison_allocator(512 << 20)
    assert torch.equal(out, grouped_gemm_varlen_k(args[0], args[1], offsets, **kwargs))


@pytest.mark.parametrize("gather_a,gather_b", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dim_m,dim_n", [(512, 1024), (256, 2560)])
def test_varlen_k_partial_k_tiles_after_nan_rows(dim_m, dim_n, gather_a, gather_b):
    """Expert 0's rows hold NaN, so NaN passes through the operand ring's stages; every other
    expert ends on a partial k-tile (one operand gathered: the expert's last 64 rows, the rows
    already reduced zeroed in the gathered operand) and must come out exact and finite."""
    from sonic.kernels.grouped_gemm import grouped_gemm_varlen_k

    gen = torch.Generator().manual_seed(dim_m + dim_n)
    num_experts, nan_rows = 40, 640
    # Expert 0: whole k-tiles only; the others: never a multiple of 64 rows.
    counts = [nan_rows] + [int(c) + (int(c) % 64 == 0)
                           for c in torch.randint(1, 300, (num_experts - 1,), generator=gen)]
    offsets = _offsets(torch.tensor(counts))
    num_pairs = sum(counts)
    kwargs, rows, args = {}, [], []
    for name, width, gathered in (("a", dim_m, gather_a), ("b", dim_n, gather_b)):
        src = _rand(num_pairs, width, gen=gen)
        src[:nan_rows] = float("nan")
        if gathered:
            # Expert 0's pairs read the NaN rows only, the others' any other row.
            idx = torch.cat([torch.randperm(nan_rows, generator=gen),
                             torch.randint(nan_rows, num_pairs, (num_pairs - nan_rows,),
                                           generator=gen)]).to(torch.int32).cuda()
            kwargs[f"gather_idx_{name}"] = idx
            rows.append(src[idx.long()])
        else:
            rows.append(src)
        args.append(src)
    ref = _ref_varlen_k(rows[0], rows[1], offsets)
    out = grouped_gemm_varlen_k(args[0], args[1], offsets, **kwargs)
    assert out[0].isnan().any()
    assert not out[1:].isnan().any()
    torch.testing.assert_close(out[1:].float(), ref[1:], rtol=2e-2,
                               atol=2e-2 * ref[1:].abs().max().clamp_min(1).item())


def test_validation():
    from sonic.kernels.grouped_gemm import (grouped_gemm, grouped_gemm_swiglu,
                                            grouped_gemm_varlen_k)

    a = torch.randn(16, 64, device="cuda").bfloat16()
    b = torch.randn(2, 32, 64, device="cuda").bfloat16()
    off = torch.tensor([0, 8, 16], dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="a must have dtype bfloat16"):
        grouped_gemm(a.float(), b, off)
    with pytest.raises(ValueError, match="b must have E = 2 experts"):
        grouped_gemm(a, b[:1], off)
    with pytest.raises(ValueError, match="a must have K = 64"):
        grouped_gemm(a[:, :32].contiguous(), b, off)
    with pytest.raises(ValueError, match="K must be a positive multiple of 8"):
        grouped_gemm(a[:, :12].contiguous(), b[:, :, :12].contiguous(), off)
    with pytest.raises(ValueError, match="out must have shape"):
        grouped_gemm(a, b, off, out=torch.empty(16, 31, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="same number of rows"):
        grouped_gemm_varlen_k(a, a[:8].contiguous(), off)
    with pytest.raises(TypeError, match="gather_idx_b must have dtype int32"):
        grouped_gemm_varlen_k(a, a, off, gather_idx_b=off.long())
    idx = torch.arange(16, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="gate_up must be"):
        grouped_gemm_swiglu(a, b, off, idx, "halves")
    with pytest.raises(ValueError, match="gather_idx is required"):
        grouped_gemm_swiglu(a, b, off, None, "concat")
    with pytest.raises(ValueError, match="n a multiple of 64"):
        grouped_gemm_swiglu(a, b, off, idx, "concat")


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
@pytest.mark.parametrize("num_pairs,num_experts,n,dim_k,mode", [
    (1, 1, 128, 64, "ragged"),
    (3001, 16, 256, 1536, "empty"),
    (1000, 8, 64, 136, "ragged"),
    (2000, 4, 1024, 512, "one"),
    (4097, 128, 192, 256, "ragged"),
])
def test_up_proj_swiglu_epilogue(num_pairs, num_experts, n, dim_k, mode, gate_up):
    from sonic.kernels.grouped_gemm import grouped_gemm_swiglu
    from sonic.kernels.swiglu import swiglu
    from sonic.reference import ops as ref

    offsets, w1, x, idx, expected_h = up_proj_problem(num_pairs, num_experts, n, dim_k, mode,
                                                      num_pairs + n + dim_k)
    poison_allocator(512 << 20)
    h, a = grouped_gemm_swiglu(x, w1, offsets, idx, gate_up)
    assert h.shape == (num_pairs, 2 * n) and a.shape == (num_pairs, n)
    assert not h.isnan().any() and not a.isnan().any()
    torch.testing.assert_close(h.float(), expected_h, rtol=2e-2,
                               atol=2e-2 * expected_h.abs().max().item())
    # A is the standalone SwiGLU of the stored H, bitwise (the backward recomputes it so).
    assert torch.equal(a, swiglu(h, gate_up))
    expected_a = ref.swiglu(expected_h, gate_up)
    assert _rel_err(a, expected_a) < 2e-2


@pytest.fixture
def banded(monkeypatch):
    """Make the bf16 varlen-M plans walk N in bands of ``width`` n-groups."""
    return functools.partial(force_n_band, monkeypatch, "bf16")


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("num_pairs,num_experts,n,dim_k,mode", [
    (1, 1, 128, 64, "ragged"),
    (3001, 16, 640, 576, "empty"),      # five 256-wide n-tiles of 2n: an odd pair count
    (2000, 4, 1024, 512, "one"),
    (4097, 128, 192, 256, "ragged"),
])
def test_banded_tile_order_fused_epilogues(banded, width, num_pairs, num_experts, n, dim_k,
                                           mode):
    """The up-proj's SwiGLU epilogue (both layouts) and the dH kernel under banded tile
    orders, against the fp32 references: every tile computed once, whatever the order."""
    from sonic.kernels.grouped_gemm import grouped_gemm_dswiglu, grouped_gemm_swiglu
    from sonic.reference import ops as ref

    banded(width)
    seed = num_pairs + n + dim_k + width
    offsets, w1, x, idx, expected_h = up_proj_problem(num_pairs, num_experts, n, dim_k, mode,
                                                      seed)
    for gate_up in ("concat", "interleaved"):
        poison_allocator(512 << 20)
        h, a = grouped_gemm_swiglu(x, w1, offsets, idx, gate_up)
        assert not h.isnan().any() and not a.isnan().any()
        torch.testing.assert_close(h.float(), expected_h, rtol=2e-2,
                                   atol=2e-2 * expected_h.abs().max().item())
        assert _rel_err(a, ref.swiglu(expected_h, gate_up)) < 2e-2
    offsets, w2, dout, idx, h, scores = dh_problem(num_pairs, num_experts, n, dim_k, mode, seed)
    da_prime = _ref_varlen_m(dout[idx.long()], w2.transpose(1, 2), offsets)
    expected = ref.dswiglu_epilogue(da_prime, h.float(), scores, "concat")
    poison_allocator(512 << 20)
    for out, want in zip(grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores), expected):
        assert not out.isnan().any()
        assert _rel_err(out, want.float()) < 2e-2


@pytest.mark.parametrize("num_pairs,num_experts,n,dim_k,mode", [
    (1, 1, 64, 64, "ragged"),
    (3001, 16, 256, 1536, "empty"),
    (1000, 8, 200, 136, "ragged"),
    (2000, 4, 1024, 512, "one"),
    (4097, 128, 1096, 256, "ragged"),
    (20000, 512, 128, 128, "empty"),
])
def test_dh_dswiglu_epilogue(num_pairs, num_experts, n, dim_k, mode):
    """The dA' GEMM with the dSwiGLU epilogue against the fp32 GEMM and reference epilogue."""
    from sonic.kernels.grouped_gemm import grouped_gemm_dswiglu
    from sonic.reference import ops as ref

    offsets, w2, dout, idx, h, scores = dh_problem(num_pairs, num_experts, n, dim_k, mode,
                                                   num_pairs + n + dim_k + 1)
    da_prime = _ref_varlen_m(dout[idx.long()], w2.transpose(1, 2), offsets)
    ref_dh, ref_a, ref_ds = ref.dswiglu_epilogue(da_prime, h.float(), scores, "concat")
    poison_allocator(512 << 20)
    dh, a_scaled, ds = grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores)
    assert dh.shape == (num_pairs, 2 * n) and a_scaled.shape == (num_pairs, n)
    assert ds.shape == (num_pairs,) and ds.dtype == torch.float32
    for out, expected in ((dh, ref_dh), (a_scaled, ref_a), (ds, ref_ds)):
        assert not out.isnan().any()
        assert _rel_err(out, expected.float()) < 2e-2
    again = grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores)
    assert all(torch.equal(x, y) for x, y in zip(again, (dh, a_scaled, ds)))
    # dH written over H itself: the same results, bitwise, and H's buffer holds dH.
    in_place = grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores, dh_out=h)
    assert in_place[0].data_ptr() == h.data_ptr()
    assert all(torch.equal(x, y) for x, y in zip(in_place, (dh, a_scaled, ds)))


def test_dh_dswiglu_validation():
    from sonic.kernels.grouped_gemm import grouped_gemm_dswiglu

    gen = torch.Generator().manual_seed(0)
    offsets = _offsets(torch.tensor([5, 3]))
    w2, dout = _rand(2, 64, 32, gen=gen), _rand(4, 64, gen=gen)
    idx = torch.zeros(8, dtype=torch.int32, device="cuda")
    h, scores = _rand(8, 64, gen=gen), torch.rand(8, device="cuda")
    with pytest.raises(ValueError, match="h must have shape"):
        grouped_gemm_dswiglu(dout, w2, offsets, idx, h[:, :32].contiguous(), scores)
    with pytest.raises(ValueError, match="row_scores must have P"):
        grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores[:4].contiguous())
    with pytest.raises(TypeError, match="row_scores"):
        grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores.double())
    with pytest.raises(ValueError, match="dh_out must have shape"):
        grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores, dh_out=h[:4])
    shifted = torch.empty(9 * 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="does not overlap h"):
        grouped_gemm_dswiglu(dout, w2, offsets, idx, shifted[:512].view(8, 64), scores,
                             dh_out=shifted[64:].view(8, 64))


@pytest.mark.parametrize("case", ["varlen_m_a", "varlen_m_out", "varlen_k_a"])
def test_index_math_past_2_31_elements(case):
    """Operands or outputs with more than 2³¹ elements (~4.4 GB bf16 each): 64-bit addressing."""
    from sonic.kernels.grouped_gemm import grouped_gemm, grouped_gemm_varlen_k

    gen = torch.Generator().manual_seed(31)
    num_experts = 4
    if case == "varlen_m_a":        # A (P, K): P·K > 2³¹
        num_pairs, dim_n, dim_k = 540_000, 64, 4096
    elif case == "varlen_m_out":    # C (P, N): P·N > 2³¹, A gathered from 1024 rows
        num_pairs, dim_n, dim_k = 270_000, 8192, 64
    else:                           # varlen-K, A (P, M): P·M > 2³¹
        num_pairs, dim_m, dim_n = 540_000, 4096, 64
    offsets = _offsets(_counts("ragged", num_experts, num_pairs, gen))
    if case == "varlen_k_a":
        a = torch.randn(num_pairs, dim_m, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(num_pairs, dim_n, device="cuda", dtype=torch.bfloat16)
        out = grouped_gemm_varlen_k(a, b, offsets)
        ref = _ref_varlen_k(a, b, offsets)
    else:
        b = torch.randn(num_experts, dim_n, dim_k, device="cuda", dtype=torch.bfloat16)
        if case == "varlen_m_out":
            x = torch.randn(1024, dim_k, device="cuda", dtype=torch.bfloat16)
            idx = torch.randint(0, 1024, (num_pairs,), device="cuda", dtype=torch.int32)
            out = grouped_gemm(x, b, offsets, gather_idx=idx)
            # The fp32 reference in row blocks, to keep it small.
            for lo in range(0, num_pairs, 65536):
                hi = min(lo + 65536, num_pairs)
                expert = torch.searchsorted(offsets[1:], torch.arange(lo, hi, device="cuda",
                                                                      dtype=torch.int32),
                                            right=True)
                rows = x[idx[lo:hi].long()].float()
                expected = torch.empty(hi - lo, dim_n, device="cuda")
                for e in expert.unique().tolist():
                    sel = expert == e
                    expected[sel] = rows[sel] @ b[e].float().t()
                assert _rel_err(out[lo:hi], expected) < 1e-2
            return
        a = torch.randn(num_pairs, dim_k, device="cuda", dtype=torch.bfloat16)
        out = grouped_gemm(a, b, offsets)
        ref = _ref_varlen_m(a, b, offsets)
    assert _rel_err(out, ref) < 1e-2


def test_device_memory_reads_the_gpu():
    """The plan's view of the GPU: its SM count, L2 size and (where reported) a DRAM
    bandwidth of a Hopper-class order of magnitude."""
    from sonic.kernels.grouped_gemm.interface import device_memory

    props = torch.cuda.get_device_properties(0)
    memory = device_memory(0)
    assert (memory.sms, memory.l2_bytes) == (props.multi_processor_count, props.L2_cache_size)
    assert memory.dram_bytes_per_s is None or 1e11 < memory.dram_bytes_per_s < 1e14
