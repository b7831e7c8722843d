"""Bitonic top-K kernel (`sonic.kernels.topk`) against a stable-sort PyTorch reference.

GPU tests (marker ``gpu``) check selection, order, ties, fused scores, fully written outputs and
bitwise determinism over the grid T x E x K x dtype; the argument checks and a compile check of
edge configurations run on the CPU.
"""

import pytest
import torch

from sonic.kernels import topk

from kernel_checks import require_kernels

T_GRID = (1, 1000, 4097)
E_GRID = (1, 8, 96, 128, 257, 512)
K_GRID = (1, 2, 8, 16)
EK_GRID = [(E, K) for E in E_GRID for K in K_GRID if K <= E]
DTYPES = (torch.bfloat16, torch.float32)
SCORE_MODES = (("softmax_topk", False), ("topk_softmax", False), ("topk_softmax", True))

# Scores are fp32 softmaxes computed in another summation order than PyTorch's: a few ulp apart.
RTOL, ATOL = 1e-5, 1e-7


def reference(logits, k, score, renormalize):
    """(scores fp32 (T,k), indices int64 (T,k)) by a stable descending sort (sonic.topk_routing)."""
    x = logits.float()
    idx = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    if score == "softmax_topk":
        return torch.softmax(x.gather(1, idx), dim=-1), idx
    s = torch.softmax(x, dim=-1).gather(1, idx)
    if renormalize:
        s = s / s.sum(dim=-1, keepdim=True)
    return s, idx


def run_poisoned(logits, k, **kw):
    """``topk_scores`` after the output-sized blocks of the caching allocator were filled with junk,
    so an output element the kernel leaves unwritten shows up as NaN / an invalid index."""
    T = logits.shape[0]
    junk_s = torch.full((T, k), float("nan"), device=logits.device)
    junk_i = torch.full((T, k), -(2**31), dtype=torch.int32, device=logits.device)
    del junk_s, junk_i
    scores, idx = topk.topk_scores(logits, k, **kw)
    assert not scores.isnan().any(), "scores left unwritten (NaN)"
    assert ((idx >= 0) & (idx < logits.shape[1])).all(), "indices out of range / unwritten"
    return scores, idx


def random_logits(T, E, dtype, seed, kind="normal"):
    """Router-like logits; ``kind='ties'`` draws integers from a small range (many exact ties, ±0),
    ``'grid'`` rounds to 1/256 so fp32 values keep their low mantissa bits zero."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "ties":
        # Random signs also turn half of the zeros into -0.0, which must tie with +0.0.
        sign = torch.randint(0, 2, (T, E), generator=g, device="cuda").float() * 2 - 1
        x = torch.randint(-3, 4, (T, E), generator=g, device="cuda").float() * sign
    else:
        x = 2.0 * torch.randn(T, E, generator=g, device="cuda")
        if kind == "grid":
            x = torch.round(x * 256) / 256
    return x.to(dtype)


def check_against_reference(logits, k, score="softmax_topk", renormalize=False):
    before = logits.clone()
    scores, idx = run_poisoned(logits, k, score=score, renormalize=renormalize)
    ref_s, ref_i = reference(logits, k, score, renormalize)
    assert torch.equal(logits, before), "logits were modified"
    assert scores.dtype == torch.float32 and idx.dtype == torch.int32
    assert scores.shape == idx.shape == (logits.shape[0], k)
    assert torch.equal(idx.long(), ref_i), "selected experts / order differ from a stable sort"
    torch.testing.assert_close(scores, ref_s, rtol=RTOL, atol=ATOL)
    return scores, idx


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("E,k", EK_GRID)
@pytest.mark.parametrize("T", T_GRID)
def test_grid_matches_stable_sort(T, E, k, dtype):
    require_kernels()
    # fp32 logits on a 1/256 grid: exact order expected (see the precision note of the module).
    kind = "normal" if dtype == torch.bfloat16 else "grid"
    check_against_reference(random_logits(T, E, dtype, seed=T * 1000 + E * 17 + k, kind=kind), k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("E,k", [(8, 8), (96, 6), (128, 8), (257, 16), (512, 16), (512, 1)])
def test_exact_ties_keep_lower_expert_first(E, k, dtype):
    require_kernels()
    check_against_reference(random_logits(4097, E, dtype, seed=E + k, kind="ties"), k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("E,k", [(8, 2), (96, 6), (128, 8), (257, 16), (512, 16)])
@pytest.mark.parametrize("score,renormalize", SCORE_MODES)
def test_score_modes(score, renormalize, E, k, dtype):
    require_kernels()
    kind = "normal" if dtype == torch.bfloat16 else "grid"
    logits = random_logits(1000, E, dtype, seed=E * k, kind=kind)
    check_against_reference(logits, k, score, renormalize)
    check_against_reference(random_logits(1000, E, dtype, seed=E * k + 1, kind="ties"), k, score,
                            renormalize)


@pytest.mark.gpu
@pytest.mark.parametrize("E,k", [(128, 8), (257, 16), (512, 16)])
def test_fp32_full_precision_logits(E, k):
    """Unrounded fp32: the order may differ from torch only between logits equal in their top
    ``23 - log2(E_pad)`` mantissa bits; scores are exact softmaxes of the selected logits."""
    require_kernels()
    logits = random_logits(4097, E, torch.float32, seed=E + 7)
    scores, idx = run_poisoned(logits, k)
    picked = logits.gather(1, idx.long())
    ref_vals = torch.topk(logits, k, dim=-1).values
    rel = 2.0 ** -(23 - topk._Plan(torch.float32, E, k, "softmax_topk", False, True).index_bits)
    torch.testing.assert_close(picked, ref_vals, rtol=2 * rel, atol=0.0)
    torch.testing.assert_close(scores, torch.softmax(picked, dim=-1), rtol=RTOL, atol=ATOL)
    assert (idx.sort(dim=-1).values.diff(dim=-1) > 0).all(), "an expert was picked twice"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_bitwise_deterministic(dtype):
    require_kernels()
    logits = random_logits(4097, 257, dtype, seed=3)
    for score, renormalize in SCORE_MODES:
        s1, i1 = run_poisoned(logits, 16, score=score, renormalize=renormalize)
        s2, i2 = run_poisoned(logits, 16, score=score, renormalize=renormalize)
        assert torch.equal(i1, i2)
        assert torch.equal(s1.view(torch.int32), s2.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_unaligned_and_strided_inputs(dtype):
    require_kernels()
    T, E, k = 1000, 128, 8
    kind = "normal" if dtype == torch.bfloat16 else "grid"
    # A view one element into its storage: not 16-byte aligned, takes the scalar-load variant.
    flat = random_logits(1, T * E + 1, dtype, seed=11, kind=kind).flatten()
    check_against_reference(flat[1:].view(T, E), k)
    # A column slice: not contiguous, copied before the launch.
    wide = random_logits(T, E + 5, dtype, seed=12, kind=kind)
    check_against_reference(wide[:, 2:E + 2], k)


@pytest.mark.gpu
def test_matches_sonic_topk_routing():
    require_kernels()
    import sonic

    logits = random_logits(1000, 96, torch.bfloat16, seed=5)
    for score, renormalize in SCORE_MODES:
        routing = sonic.topk_routing(logits, 6, score=score, renormalize=renormalize)
        scores, idx = run_poisoned(logits, 6, score=score, renormalize=renormalize)
        assert torch.equal(idx.flatten(), routing.expert_idx)
        torch.testing.assert_close(scores.flatten(), routing.scores.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    """The launch is ordered after earlier work of the caller's stream: logits written there
    behind a long sleep are the ones selected from."""
    require_kernels()
    T, E, k = 4097, 128, 8
    source = random_logits(T, E, torch.bfloat16, seed=21)
    logits = random_logits(T, E, torch.bfloat16, seed=22)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms: a launch on another stream would overtake it
        logits.copy_(source)
        scores, idx = topk.topk_scores(logits, k)
    torch.cuda.synchronize()
    ref_s, ref_i = reference(source, k, "softmax_topk", False)
    assert torch.equal(idx.long(), ref_i)
    torch.testing.assert_close(scores, ref_s, rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
def test_empty_batch():
    require_kernels()
    scores, idx = topk.topk_scores(torch.randn(0, 64, device="cuda"), 4)
    assert scores.shape == idx.shape == (0, 4)


# ---------------------------------------------------------------------------------------------
# CPU: argument checks and compile check of edge configurations.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,kwargs,error,match", [
    (([[1.0, 2.0]], 1), {}, TypeError, "logits must be a torch.Tensor"),
    ((torch.zeros(4, 8, dtype=torch.int32), 1), {}, TypeError, "bfloat16 or float32"),
    ((torch.randn(4, 8, dtype=torch.float16), 1), {}, TypeError, "bfloat16 or float32"),
    ((torch.randn(2, 4, 8), 1), {}, ValueError, "2-D"),
    ((torch.randn(4, 513), 2), {}, ValueError, "E <= 512"),
    ((torch.empty(2**22, 512, device="meta"), 2), {}, ValueError, "fewer than 2\\*\\*31"),
    ((torch.randn(4, 8), 0), {}, ValueError, r"k must be in \[1"),
    ((torch.randn(4, 8), 9), {}, ValueError, r"k must be in \[1, 8\]"),
    ((torch.randn(4, 64), 17), {}, ValueError, r"k must be in \[1, 16\]"),
    ((torch.randn(4, 8), 2.0), {}, TypeError, "k must be an int"),
    ((torch.randn(4, 8), 2), {"score": "softmax"}, ValueError, "score must be one of"),
    ((torch.randn(4, 8), 2), {}, ValueError, "CUDA device"),
])
def test_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        topk.topk_scores(*args, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run these")
@pytest.mark.parametrize("plan", [
    (torch.bfloat16, 1, 1, "softmax_topk", False, True, dict()),
    (torch.float32, 257, 16, "topk_softmax", True, False, dict()),
    (torch.bfloat16, 100, 3, "topk_softmax", False, True, dict()),
    (torch.float32, 8, 8, "softmax_topk", False, True, dict()),
    # Sigmoid scores (64-bit keys) with a selection bias and groups.
    (torch.bfloat16, 1, 1, "sigmoid", False, True, dict()),
    (torch.float32, 257, 16, "sigmoid", True, False, dict(bias=True)),
    (torch.float32, 64, 8, "sigmoid", True, False, dict(bias=True, n_group=4, topk_group=2)),
    (torch.bfloat16, 512, 16, "sigmoid", False, True, dict(n_group=16, topk_group=3)),
], ids=lambda p: f"{str(p[0]).removeprefix('torch.')}_E{p[1]}_K{p[2]}_{p[3]}"
                 + "".join(f"_{k}{v}" for k, v in sorted(p[6].items())))
def test_edge_plans_compile_for_sm90a(sm90a_compile, plan):
    *args, kw = plan
    assert topk._compile(topk._plan(*args, **kw)) is not None
