"""The FP8 activation cache: H kept for backward as e4m3 + 1x128 fp32 scales.

The expectations are built here from sonic.reference.fp8 and sonic.reference.ops, not from the
code under test: the forward is the bf16 path's bit for bit, and the gradients are exactly those
of the bf16 backward run on dequantize(quantize(H)).
"""

import copy
import dataclasses
import pickle
import weakref

import pytest
import torch

import sonic
from sonic.memory.__main__ import measure
from sonic.ops import routing_metadata_op
from sonic.reference import fp8
from sonic.reference import ops as reference
from sonic.reference.metadata import pairs_metadata
from sonic.train.loop import TrainConfig

from _reference import random_problem

# e4m3 round to nearest keeps 3 mantissa bits: an element of H moves by at most u = 2^-4 of its
# magnitude (normal range; below it by at most 2^-10 of its slice's scale, i.e. 2^-10·amax/448,
# which is smaller than u·|h| for every |h| ≥ amax/448/64 and negligible in a norm). Gradients
# are smooth in H: dH, A' and ds are products of dA' with SwiGLU terms whose relative condition
# numbers in the gate and up values are at most about 1.3 (|g·silu'(g)/silu(g)| = |1 +
# g(1 − σ(g))| ≤ 1.28 for g > 0; the g < 0 tail, where it grows, has tiny silu(g)·up and adds
# little in norm), so each element's relative change is at most ≈ (1 + 1.3)·u; the GEMMs and
# sums that follow average independent per-element errors, so in Frobenius norm the relative
# difference is bounded by that worst case, 2.3·u ≈ 0.144. Random data sits near the rms,
# ≈ 2.3·u/√3 ≈ 0.083 under a uniform rounding error and ≈ 0.05 as measured; the test asserts the
# worst-case bound 2.3·u (and, to catch an H that is not rounded at all, a nonzero difference).
GRAD_BOUND = 2.3 * fp8.FP8_UNIT_ROUNDOFF


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _problem(T=96, d=64, n=128, E=8, K=2, dtype=torch.bfloat16, seed=0, **kw):
    x, w1, w2, s, tok, exp = random_problem(T, d, n, E, K=K, seed=seed, **kw)
    leaves = [t.to(dtype).requires_grad_() for t in (x, w1, w2)] + [s.requires_grad_()]
    return leaves, tok, exp


def _run(leaves, tok, exp, grad, **kw):
    for t in leaves:
        t.grad = None
    out = sonic.moe_experts(*leaves, tok, exp, backend="torch", **kw)
    out.backward(grad)
    return out.detach(), [t.grad.clone() for t in leaves]


def _expected_grads(leaves, tok, exp, grad, gate_up):
    """The bf16 backward (docs/design.md §3) written out with the reference ops, on dequant(quant(H))."""
    x, w1, w2, s = (t.detach() for t in leaves)
    T, E = x.shape[0], w1.shape[0]
    m = pairs_metadata(tok, exp, T, E)
    offsets = m.expert_offsets
    h, _ = reference.up_proj_swiglu(x, w1, offsets, m.gather_idx, gate_up)
    q, scales = fp8.quantize_rows(h)
    h_hat = fp8.dequantize_rows(q, scales).to(x.dtype)
    row_scores = s.index_select(0, m.sorted_pairs.long()).float()
    dout = grad.to(x.dtype)
    dh, a_scaled, ds_rows = reference.dh_dswiglu(dout, w2, offsets, m.gather_idx, h_hat,
                                                 row_scores, gate_up)
    dw2 = reference.grouped_mm_varlen_k(dout, a_scaled, offsets, m.gather_idx, None)
    dx = reference.aggregate(reference.grouped_mm(dh, w1, offsets, None), m.token_rows,
                             m.token_offsets, None)
    dw1 = reference.grouped_mm_varlen_k(dh, x, offsets, None, m.gather_idx)
    ds = ds_rows.index_select(0, m.pair_rows.long()).to(s.dtype)
    return [dx, dw1, dw2, ds]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_forward_unchanged_and_grads_are_those_of_dequantized_h(dtype, gate_up):
    leaves, tok, exp = _problem(dtype=dtype, seed=1)
    grad = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out16, grads16 = _run(leaves, tok, exp, grad, gate_up=gate_up)
    out8, grads8 = _run(leaves, tok, exp, grad, gate_up=gate_up, activation_cache="fp8")
    assert torch.equal(out8, out16)
    for mine, expected in zip(grads8, _expected_grads(leaves, tok, exp, grad, gate_up)):
        assert mine.dtype == expected.dtype
        assert torch.equal(mine, expected)
    for name, mine, full in zip(("dx", "dw1", "dw2", "ds"), grads8, grads16):
        rel = _rel(mine, full)
        assert 0 < rel <= GRAD_BOUND, (name, rel)


def _saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def test_saved_tensors_are_e4m3_h_and_scales_at_most_55_percent_of_bf16():
    T, d, n, E, K = 1024, 128, 256, 8, 4
    leaves, tok, exp = _problem(T, d, n, E, K, seed=3)

    def saved_bytes(cache):
        _, saved = _saved(lambda: sonic.moe_experts(*leaves, tok, exp, backend="torch",
                                                    activation_cache=cache))
        new = [t for t in saved if all(t is not leaf for leaf in leaves)]
        storages = {t.untyped_storage().data_ptr(): t for t in new}
        return sum(t.untyped_storage().nbytes() for t in storages.values()), new

    bf16_bytes, bf16_saved = saved_bytes("bf16")
    fp8_bytes, fp8_saved = saved_bytes("fp8")
    P = T * K
    assert [(tuple(t.shape), t.dtype) for t in bf16_saved if t.numel() >= P * 2 * n] == [
        ((P, 2 * n), torch.bfloat16)]
    assert [(tuple(t.shape), t.dtype) for t in fp8_saved
            if t.numel() >= P and t.dtype != torch.int32] == [
        ((P, 2 * n), torch.float8_e4m3fn), ((2 * n // 128, P), torch.float32)]
    assert fp8_bytes <= 0.55 * bf16_bytes, (fp8_bytes, bf16_bytes)


@pytest.mark.parametrize("config", ["30B", "OLMoE"])
def test_sonic_memory_fp8_cache_at_most_55_percent_at_paper_configs(config):
    from sonic.baselines.configs import CONFIGS
    reports = measure(CONFIGS[config], torch.device("meta"), "fp8")
    ratio = reports["sonic-fp8c"].activation_bytes / reports["sonic"].activation_bytes
    assert ratio <= 0.55, ratio     # 0.518 at both


def test_h_is_freed_before_the_down_proj_allocates():
    """The forward quantizes H and drops it before the down-proj GEMM runs, so its peak never
    holds the bf16 H and Y together."""
    import sonic.ops as sonic_ops
    from sonic.backend import TORCH_OPS

    alive = []

    def up_proj(*args, **kw):
        h, act = TORCH_OPS.up_proj_swiglu(*args, **kw)
        alive.append(weakref.ref(h))
        return h, act

    def grouped_mm(a, b, offsets, gather_idx=None):
        if b.shape[-1] == d:        # the down-proj (act · W2ᵀ)
            seen.append(alive[-1]() is None)
        return TORCH_OPS.grouped_mm(a, b, offsets, gather_idx)

    ops = dataclasses.replace(TORCH_OPS, up_proj_swiglu=up_proj, grouped_mm=grouped_mm)
    leaves, tok, exp = _problem(seed=4)
    d = leaves[0].shape[1]
    seen = []
    original = sonic_ops._impl
    sonic_ops._impl = lambda backend, device: ops
    try:
        with torch.no_grad():
            sonic.moe_experts(*leaves, tok, exp, backend="torch", activation_cache="fp8")
            sonic.moe_experts(*leaves, tok, exp, backend="torch")
    finally:
        sonic_ops._impl = original
    assert seen == [True, False]


def test_retain_graph_and_create_graph_behave_as_the_bf16_path():
    leaves, tok, exp = _problem(seed=5)
    grad = torch.randn(leaves[0].shape).bfloat16()
    out = sonic.moe_experts(*leaves, tok, exp, backend="torch", activation_cache="fp8")
    first = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    second = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    third = torch.autograd.grad(out, leaves, grad)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(RuntimeError, match="second time|freed"):
        torch.autograd.grad(out, leaves, grad)
    out = sonic.moe_experts(*leaves, tok, exp, backend="torch", activation_cache="fp8")
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(out, leaves, grad, create_graph=True)


@pytest.mark.parametrize("case", ["empty_experts", "T1", "one_expert_takes_all", "no_pairs"])
def test_edge_cases_match_the_dequantized_expectation(case):
    E, K = 8, 2
    if case == "empty_experts":      # experts 1, 4, 6 get no tokens
        pairs = lambda g: (torch.arange(40).repeat_interleave(2),
                           torch.tensor([0, 2, 3, 5, 7])[torch.randint(0, 5, (80,), generator=g)])
        leaves, tok, exp = _problem(T=40, E=E, seed=6, generator_pairs=pairs)
    elif case == "T1":
        leaves, tok, exp = _problem(T=1, E=E, K=K, seed=7)
    elif case == "one_expert_takes_all":
        pairs = lambda g: (torch.arange(33), torch.full((33,), 3))
        leaves, tok, exp = _problem(T=33, E=E, seed=8, generator_pairs=pairs)
    else:
        pairs = lambda g: (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        leaves, tok, exp = _problem(T=5, E=E, seed=9, generator_pairs=pairs)
    grad = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(10)).bfloat16()
    out16, _ = _run(leaves, tok, exp, grad)
    out8, grads8 = _run(leaves, tok, exp, grad, activation_cache="fp8")
    assert torch.equal(out8, out16)
    for mine, expected in zip(grads8, _expected_grads(leaves, tok, exp, grad, "concat")):
        assert torch.equal(mine, expected)


def test_errors():
    leaves, tok, exp = _problem(n=96, seed=11)          # 2n = 192: not a multiple of 128
    with pytest.raises(ValueError, match="d_expert=96"):
        sonic.moe_experts(*leaves, tok, exp, backend="torch", activation_cache="fp8")
    leaves, tok, exp = _problem(seed=12)
    with pytest.raises(ValueError, match="activation_cache"):
        sonic.moe_experts(*leaves, tok, exp, backend="torch", activation_cache="e5m2")
    for dtype in (torch.float32, torch.float64):
        exact = [t.detach().to(dtype) for t in leaves[:3]] + [leaves[3].detach().to(dtype)]
        with pytest.raises(TypeError, match="activation_cache='fp8'.*" + str(dtype)):
            sonic.moe_experts(*exact, tok, exp, backend="torch", activation_cache="fp8")
    with pytest.raises(ValueError, match="d_expert=96"):
        sonic.MoE(64, 96, 8, 2, activation_cache="fp8")
    with pytest.raises(ValueError, match="activation_cache"):
        sonic.MoE(64, 128, 8, 2, activation_cache="fp16")
    layer = sonic.MoE(64, 96, 8, 2)
    with pytest.raises(ValueError, match="d_expert=96"):
        layer.activation_cache = "fp8"
    assert layer.activation_cache == "bf16"


def test_fp32_layer_under_autocast_keeps_h_in_fp8():
    torch.manual_seed(0)
    layer = sonic.MoE(64, 64, 8, 2, backend="torch", activation_cache="fp8")
    x = torch.randn(50, 64)
    with pytest.raises(TypeError, match="activation_cache='fp8'"):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, saved = _saved(lambda: layer(x))
    out.float().sum().backward()
    assert any(t.dtype == torch.float8_e4m3fn for t in saved)
    assert layer.w1.grad.dtype == torch.float32 and layer.w1.grad.abs().sum() > 0


def test_moe_layer_option_repr_copy_pickle():
    torch.manual_seed(0)
    layer = sonic.MoE(64, 128, 8, 2, backend="torch", activation_cache="fp8",
                      dtype=torch.bfloat16)
    assert "activation_cache='fp8'" in repr(layer)
    assert "activation_cache" not in repr(sonic.MoE(64, 128, 8, 2))
    x = torch.randn(30, 64, dtype=torch.bfloat16)
    layer(x)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert twin.activation_cache == "fp8"
        assert torch.equal(twin(x), layer(x))
    state = layer.__getstate__()
    del state["_activation_cache"]          # pickled before the option existed
    old = sonic.MoE.__new__(sonic.MoE)
    old.__setstate__(state)
    assert old.activation_cache == "bf16"


def test_train_config_checks_the_activation_cache():
    TrainConfig(activation_cache="fp8", dtype="bfloat16")
    with pytest.raises(ValueError, match="activation_cache"):
        TrainConfig(activation_cache="int8")
    with pytest.raises(ValueError, match="bfloat16"):
        TrainConfig(activation_cache="fp8", dtype="float32")
    with pytest.raises(ValueError, match="d_expert"):
        TrainConfig(activation_cache="fp8", dtype="bfloat16", d_expert=96)
    TrainConfig(activation_cache="fp8", dtype="bfloat16", ep=2, ep_chunks=2)


def test_opcheck_with_the_fp8_cache():
    # Schema and fake kernel only: opcheck's AOT-autograd check sums every output, and torch
    # has no sum of float8.
    leaves, tok, exp = _problem(seed=13)
    m = routing_metadata_op(tok, exp, leaves[0].shape[0], leaves[1].shape[0], None, "torch")
    x, w1, w2, s = leaves
    torch.library.opcheck(torch.ops.sonic.moe_experts.default,
                          (x, w1, w2, s.detach(), m.packed, 0, "concat", "torch", "fp8"),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fp8_cache_step_equals_eager(backend):
    """Traced, the backward dequantizes H as graph ops and calls the dH op without writing in
    place; the gradients equal eager mode's."""
    torch.manual_seed(0)
    layer = sonic.MoE(32, 64, 4, 2, backend="torch", activation_cache="fp8",
                      dtype=torch.bfloat16)
    x = torch.randn(24, 32, dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)

    def step(fn):
        layer.zero_grad(set_to_none=True)
        out = fn(x)
        out.float().square().sum().backward()
        return out.detach(), [p.grad.clone() for p in layer.parameters()]

    (out_c, grads_c), (out_e, grads_e) = step(compiled), step(layer)
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_padded_token_rounding_with_the_fp8_cache():
    """A padded routing's rows past expert_offsets[E] hold whatever the up-proj left there; the
    cache quantizes them too, and no gradient reads them."""
    torch.manual_seed(0)
    layer = sonic.MoE(64, 64, 8, 2, router="token_rounding", tile=8, backend="torch",
                      dtype=torch.bfloat16)
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    grads = []
    for cache in ("bf16", "fp8"):
        layer.zero_grad(set_to_none=True)
        layer.activation_cache = cache
        out = layer(x)
        out.float().square().sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for g16, g8 in zip(*grads):
        assert torch.isfinite(g8).all()
        assert _rel(g8, g16) <= GRAD_BOUND
