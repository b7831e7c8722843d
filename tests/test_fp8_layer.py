"""precision="fp8" of the MoE layer on the CPU: the "torch" backend emulates the
CuTe FP8 dataflow, so these tests check its numerics in CI.

Three kinds of checks:

* against an independent emulation written here from the :mod:`sonic.reference.fp8`
  primitives (quantize_rows, quantize_blocks, grouped_mm_fp8_reference), per expert, with the
  backward written out by hand: the same math, so the tolerance is tight (differences only from
  fp32 summation order in the aggregation and the bf16 weight-gradient GEMMs);
* against the fp64 layer, within a stated e4m3 error budget (see ``_FP8_BUDGET``);
* API: errors, the weight-copy cache of ``sonic.MoE``, the train CLI.
"""

import copy
import math
import pickle

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sonic
from sonic.ops import routing_metadata_op
from sonic.reference import fp8 as R
from _benchmarks import load_benchmark

BF16 = torch.bfloat16


# ------------------------------------------------------------------------------ problems


def _problem(T, d, n, E, pairs, seed=0):
    """bf16 x, w1, w2, fp32 scores, pairs ``(tok, exp)`` of kind ``pairs``, and a bf16 dO."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(BF16)
    w1 = (torch.randn(E, 2 * n, d, generator=g) * d ** -0.5).to(BF16)
    w2 = (torch.randn(E, d, n, generator=g) * n ** -0.5).to(BF16)
    if pairs == "topk":
        _, idx = torch.randn(T, E, generator=g).topk(2, dim=1)
        tok, exp = torch.arange(T).repeat_interleave(2), idx.reshape(-1)
    elif pairs == "one_expert":          # every token to expert 1, the others empty
        tok, exp = torch.arange(T), torch.ones(T, dtype=torch.long)
    elif pairs == "empty_experts":       # only experts 0 and E-2; tokens 0, 1 unrouted
        tok = torch.arange(2, T).repeat_interleave(2)
        exp = torch.tensor([0, E - 2]).repeat(T - 2)
    else:                                # ragged: 0..3 experts per token, pairs shuffled
        tok, exp = [], []
        for t in range(T):
            k = int(torch.randint(0, 4, (1,), generator=g))
            tok += [t] * k
            exp += torch.randperm(E, generator=g)[:k].tolist()
        perm = torch.randperm(len(tok), generator=g)
        tok, exp = torch.tensor(tok, dtype=torch.long)[perm], torch.tensor(exp, dtype=torch.long)[perm]
    scores = torch.rand(tok.shape[0], generator=g) + 0.1
    dout = torch.randn(T, d, generator=g).to(BF16)
    return x, w1, w2, scores, tok, exp, dout


def _layer_fp8(x, w1, w2, scores, tok, exp, dout, gate_up="concat", backend="torch", **kw):
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, scores)]
    out = sonic.moe_experts(*leaves, tok, exp, gate_up=gate_up, backend=backend,
                            precision="fp8", **kw)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


# ------------------------------------------------------------------------------ emulation


def _halves(h, gate_up):
    return h.chunk(2, dim=-1) if gate_up == "concat" else (h[:, 0::2], h[:, 1::2])


def _merge(gate, up, gate_up):
    return torch.cat([gate, up], -1) if gate_up == "concat" else torch.stack([gate, up], -1).flatten(-2)


def _emulate(x, w1, w2, scores, tok, exp, dout, gate_up, activation_cache="bf16",
             da_prime_fp32=False, fp8_weight_grads=False):
    """The FP8 layer written out from the recipe's primitives: output and the gradients of
    x, w1, w2 and scores; with the fp8 activation cache the backward reads H as
    dequantize(quantize_rows(H)) rounded to bf16; ``da_prime_fp32``: dSwiGLU of the fp32 dA'
    (the fused dH kernel) instead of its bf16 rounding; ``fp8_weight_grads``: dW1, dW2 from
    operands quantized per 128 x 1 block of each expert's rows (the rows of the transposed
    operand, quantized per 1 x 128 slice), else from the bf16 operands."""
    T, d = x.shape
    E = w1.shape[0]
    order = sorted(range(tok.shape[0]), key=lambda p: (int(exp[p]), int(tok[p])))
    idx = torch.tensor(order, dtype=torch.long)
    rows_tok, s_rows = tok[idx], scores[idx].float()
    counts = torch.bincount(exp[idx], minlength=E)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    bounds = offsets.tolist()

    def gemm(a, b, gather=None, out_dtype=BF16):     # rows of a (or gathered) · b (E, N, K)ᵀ
        a_q, a_s = R.quantize_rows(a)
        b_q, b_s = R.quantize_blocks(b)
        return R.grouped_mm_fp8_reference(a_q, a_s, b_q, b_s, offsets, gather,
                                          out_dtype=out_dtype)

    # Forward: H bf16 from the FP8 up-proj, A from the bf16 H, A quantized for the down-proj.
    h = gemm(x, w1, rows_tok)
    g, u = (t.float() for t in _halves(h, gate_up))
    sig = torch.sigmoid(g)
    act = g * sig * u
    y = gemm(act.to(BF16), w2)
    out = torch.zeros(T, d).index_add_(0, rows_tok, y.float() * s_rows[:, None]).to(BF16)
    # Backward: FP8 dA' (W2ᵀ quantized on its own here, not transposed), dSwiGLU in fp32.
    if activation_cache == "fp8":
        h = R.dequantize_rows(*R.quantize_rows(h)).to(BF16)
        g, u = (t.float() for t in _halves(h, gate_up))
        sig = torch.sigmoid(g)
        act = g * sig * u
    da_prime = gemm(dout, w2.transpose(1, 2).contiguous(), rows_tok,
                    torch.float32 if da_prime_fp32 else BF16).float()
    ds_rows = (da_prime * act).sum(-1)
    da = s_rows[:, None] * da_prime
    dh = _merge(da * u * sig * (1 + g * (1 - sig)), da * g * sig, gate_up).to(BF16)
    a_scaled = (s_rows[:, None] * act).to(BF16)
    dx_rows = gemm(dh, w1.transpose(1, 2).contiguous())
    dx = torch.zeros(T, d).index_add_(0, rows_tok, dx_rows.float()).to(BF16)
    dw1, dw2 = torch.zeros(w1.shape, dtype=BF16), torch.zeros(w2.shape, dtype=BF16)
    def operand_t(rows):      # one expert's rows, transposed, as the weight gradient sees them
        if not fp8_weight_grads:
            return rows.float().t()
        return R.dequantize_rows(*R.quantize_rows(rows.t()))

    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        dw2[e] = (operand_t(dout[rows_tok[lo:hi]]) @ operand_t(a_scaled[lo:hi]).t()).to(BF16)
        dw1[e] = (operand_t(dh[lo:hi]) @ operand_t(x[rows_tok[lo:hi]]).t()).to(BF16)
    dscores = torch.zeros_like(scores).index_copy_(0, idx, ds_rows)
    return out, [dx, dw1, dw2, dscores]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------ numerics


def test_transposed_weight_copy_is_the_quantization_of_the_transpose():
    # A 128x128 block holds the same values in both orientations: same amax, scale, roundings.
    w = (torch.randn(3, 256, 384) * torch.rand(3, 256, 1) * 5).to(BF16)
    w[1, :128, 128:256] = 0                      # an all-zero block keeps scale 1
    q, s = R.quantize_blocks_and_transpose(w)[2:]
    q_ref, s_ref = R.quantize_blocks(w.transpose(1, 2).contiguous())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)


@pytest.fixture(params=["fp8", "bf16"])
def weight_grads(request):
    """Each case under both sonic.backend.set_fp8_weight_grads choices."""
    previous = sonic.backend.set_fp8_weight_grads(request.param)
    yield request.param
    sonic.backend.set_fp8_weight_grads(previous)


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
@pytest.mark.parametrize("case", [
    ("topk", 37, 128, 128, 4), ("ragged", 29, 256, 128, 6), ("one_expert", 20, 128, 256, 4),
    ("empty_experts", 23, 128, 128, 8), ("topk", 1, 128, 128, 3)])
def test_fp8_layer_matches_emulation(case, gate_up, weight_grads):
    pairs, T, d, n, E = case
    problem = _problem(T, d, n, E, pairs, seed=T)
    out, grads = _layer_fp8(*problem, gate_up=gate_up)
    want, want_grads = _emulate(*problem, gate_up=gate_up,
                                fp8_weight_grads=weight_grads == "fp8")
    # Same quantized operands and GEMM math: output and dX differ only by the fp32 order of
    # the aggregation sums, dW1/dW2 by the order of the varlen-K sums (then one bf16 rounding).
    for name, got, ref in zip(("out", "dx", "dw1", "dw2", "dscores"), [out] + grads,
                              [want] + want_grads):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert _rel(got, ref) <= 2e-3, (name, _rel(got, ref))
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -6,
                                   atol=1e-3 * ref.float().abs().max().item(), msg=name)


@pytest.mark.parametrize("case", [("topk", 37, 128, 128, 4), ("empty_experts", 23, 128, 256, 8),
                                  ("topk", 1, 128, 128, 3)])
def test_fp8_layer_with_the_fp8_activation_cache(case):
    # The output is the FP8 layer's bit for bit (the cache is made after the forward used H);
    # the gradients are the emulation's with H read back through e4m3, and differ from the
    # bf16 cache's (H was rounded).
    pairs, T, d, n, E = case
    problem = _problem(T, d, n, E, pairs, seed=T + 1)
    out16, grads16 = _layer_fp8(*problem)
    out8, grads8 = _layer_fp8(*problem, activation_cache="fp8")
    assert torch.equal(out8, out16)
    _, want_grads = _emulate(*problem, gate_up="concat", activation_cache="fp8")
    for name, got, ref, bf16 in zip(("dx", "dw1", "dw2", "dscores"), grads8, want_grads,
                                    grads16):
        assert _rel(got, ref) <= 2e-3, (name, _rel(got, ref))
        assert not torch.equal(got, bf16), name
    # Saved: H as e4m3 + scales instead of bf16.
    saved = []
    x, w1, w2, scores, tok, exp, _ = problem
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sonic.moe_experts(x.requires_grad_(), w1, w2, scores, tok, exp, backend="torch",
                          precision="fp8", activation_cache="fp8")
    P = tok.shape[0]
    assert [t.dtype for t in saved if t.shape == (P, 2 * n)] == [torch.float8_e4m3fn]
    assert [t.dtype for t in saved if t.shape == (2 * n // 128, P)] == [torch.float32]


# Relative Frobenius error budget against the fp64 layer, random data. One e4m3 GEMM of
# random operands errs by r = R.FP8_RELATIVE_RMS_ERROR (≈0.051 bound, ≈0.037 measured)
# relative. The output goes through two quantized GEMMs: H carries r; A = silu(g)·u carries
# ≈ √(1 + 1.1²)·r ≈ 1.5 r (|d log silu(g) / d log g| ≤ 1.1, gate and up errors independent);
# the down-proj adds r in quadrature: ≈ 1.8 r; the aggregation's weighted sums of independent
# rows do not grow it. The gradients chain one more quantized operand (dO, dH) or the same
# A: dA' ≈ r, dH ≈ √(r² + (1.5r)²) ≈ 1.8 r, dX ≈ √((1.8r)² + r²) ≈ 2.1 r, dW1 ≈ dH's 1.8 r,
# dW2 ≈ A's 1.5 r, ds = ⟨dA', A⟩ ≈ 1.8 r. bf16 rounding (≈0.004 measured) is negligible.
# Asserted: 2 r for the output, 3 r for every gradient.
_FP8_BUDGET = {"out": 2.0, "dx": 3.0, "dw1": 3.0, "dw2": 3.0, "dscores": 3.0}


@pytest.mark.parametrize("case", [("topk", 64, 256, 128, 4), ("ragged", 48, 128, 256, 6)])
def test_fp8_layer_error_against_fp64_within_e4m3_budget(case):
    pairs, T, d, n, E = case
    x, w1, w2, scores, tok, exp, dout = _problem(T, d, n, E, pairs, seed=5)
    out, grads = _layer_fp8(x, w1, w2, scores, tok, exp, dout)
    leaves = [t.double().requires_grad_() for t in (x, w1, w2, scores)]
    ref = sonic.moe_experts(*leaves, tok, exp, backend="torch")
    ref.backward(dout.double())
    r = R.FP8_RELATIVE_RMS_ERROR
    for name, got, want in zip(_FP8_BUDGET, [out] + grads, [ref] + [t.grad for t in leaves]):
        err = _rel(got, want.detach())
        assert err <= _FP8_BUDGET[name] * r, (name, err, _FP8_BUDGET[name] * r)
        assert err > 1e-3, (name, "an FP8 result this close to fp64 was not quantized")


def test_fp8_up_proj_within_worst_case_bound():
    # H of the layer (the op's second output) against the fp64 product, per expert, within
    # fp8_error_bound: a worst-case bound that holds for any data, here with outliers.
    T, d, n, E = 40, 256, 128, 3
    x, w1, w2, scores, tok, exp, _ = _problem(T, d, n, E, "topk", seed=2)
    x[3, 5] = 300.0
    w1[1, 7, 200] = -4.0
    meta = routing_metadata_op(tok, exp, T, E, None, "torch")
    fp8_w = sonic.quantize_expert_weights(w1, w2, backend="torch")
    _, h, _ = torch.ops.sonic.moe_experts_fp8(x, w1, w2, scores, meta.packed, list(fp8_w), 0,
                                              "concat", "torch", "bf16", "bf16")
    x_scales = R.quantize_rows(x)[1]
    bounds = meta.expert_offsets.tolist()
    for e in range(E):
        rows = meta.gather_idx[bounds[e]:bounds[e + 1]].long()
        exact = x[rows].double() @ w1[e].double().t()
        bound = R.fp8_error_bound(x[rows], w1[e], x_scales[:, rows].contiguous(),
                                  fp8_w.w1_scales[e], out_dtype=BF16)
        assert ((h[bounds[e]:bounds[e + 1]].double() - exact).abs() <= bound).all()


def test_fp8_weight_copies_given_or_made_per_call_agree():
    problem = _problem(17, 128, 128, 4, "topk", seed=3)
    x, w1, w2 = problem[:3]
    out, grads = _layer_fp8(*problem)
    given, given_grads = _layer_fp8(*problem, fp8_weights=sonic.quantize_expert_weights(w1, w2))
    for a, b in zip([out] + grads, [given] + given_grads):
        assert torch.equal(a, b)


def test_fp8_under_autocast_from_fp32_master_weights():
    layer = sonic.MoE(128, 128, 4, 2, precision="fp8", backend="torch")
    x = torch.randn(3, 7, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        out = layer(x)
    assert out.dtype == BF16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.w1.grad.dtype == torch.float32
    assert torch.isfinite(layer.w1.grad).all() and layer.w1.grad.abs().sum() > 0


def test_opcheck_fp8_ops():
    x, w1, w2, scores, tok, exp, _ = _problem(9, 128, 128, 4, "topk", seed=4)
    meta = routing_metadata_op(tok, exp, 9, 4, None, "torch")
    fp8_w = list(sonic.quantize_expert_weights(w1, w2, backend="torch"))
    # Not test_schema: its mutation check runs ops PyTorch lacks for float8 on the CPU.
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.sonic.moe_experts_fp8.default,
                          (x.requires_grad_(), w1.requires_grad_(), w2, scores, meta.packed,
                           fp8_w, 0, "concat", "torch", "bf16", "bf16"), test_utils=utils)
    torch.library.opcheck(torch.ops.sonic.quantize_rows.default, (x.detach(), "torch"),
                          test_utils=utils)
    # With the fp8 cache, the fake kernel only: AOT's check sums every output, float8 included.
    torch.library.opcheck(torch.ops.sonic.moe_experts_fp8.default,
                          (x, w1, w2, scores, meta.packed, fp8_w, 0, "concat", "torch", "fp8",
                           "fp8"),
                          test_utils=("test_faketensor",))



def _leaves(args):
    for a in args:
        yield from (a if isinstance(a, list) else [a])


@pytest.mark.parametrize("activation_cache", ["bf16", "fp8"])
def test_fp8_ops_keep_their_schema(activation_cache):
    """What opcheck's test_schema checks, by hand: PyTorch's schema checker compares float8
    inputs with allclose, which float8 lacks (pytorch/pytorch#135998). The FP8 ops declare
    no mutation and no aliasing: every input is bitwise unchanged (compared as bytes) and no
    output shares storage with an input."""
    x, w1, w2, scores, tok, exp, _ = _problem(9, 128, 128, 4, "topk", seed=5)
    meta = routing_metadata_op(tok, exp, 9, 4, None, "torch")
    fp8_w = list(sonic.quantize_expert_weights(w1, w2, backend="torch"))
    x_q, x_s = torch.ops.sonic.quantize_rows(x, "torch")
    offsets = meta.expert_offsets
    calls = [
        (torch.ops.sonic.moe_experts_fp8, (x, w1, w2, scores, meta.packed, fp8_w, 0, "concat",
                                           "torch", activation_cache, "bf16")),
        (torch.ops.sonic.grouped_mm_fp8, (x_q, x_s, *fp8_w[:2], offsets, meta.gather_idx,
                                          "torch")),
        (torch.ops.sonic.quantize_blocks, (w1, "torch")),
        (torch.ops.sonic.quantize_rows, (x, "torch")),
    ]
    for op, args in calls:
        tensors = [t for t in _leaves(args) if isinstance(t, torch.Tensor)]
        before = [t.view(torch.uint8).clone() if t.dtype == R.FP8_DTYPE else t.clone()
                  for t in tensors]
        out = op(*args)
        outs = out if isinstance(out, tuple) else (out,)
        for t, b in zip(tensors, before):
            assert torch.equal(t.view(torch.uint8) if t.dtype == R.FP8_DTYPE else t, b), op
        storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
        assert not any(o.numel() and o.untyped_storage().data_ptr() in storages
                       for o in outs), op


# ------------------------------------------------------------------------------ errors


def test_fp8_errors_name_the_argument():
    x, w1, w2, scores, tok, exp, _ = _problem(5, 128, 128, 4, "topk")
    call = lambda *a, **kw: sonic.moe_experts(*a, tok, exp, backend="torch", **kw)  # noqa: E731
    with pytest.raises(ValueError, match="precision"):
        call(x, w1, w2, scores, precision="fp16")
    with pytest.raises(ValueError, match="d_model"):
        call(x[:, :96], w1[..., :96], w2[:, :96], scores, precision="fp8")
    with pytest.raises(ValueError, match="d_expert"):
        call(x, w1[:, :192], w2[..., :96], scores, precision="fp8")
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(TypeError, match="bfloat16"):
            call(x.to(dtype), w1.to(dtype), w2.to(dtype), scores, precision="fp8")
    with pytest.raises(ValueError, match="fp8_weights.w2_q"):
        bad = sonic.quantize_expert_weights(w1, w2)._replace(w2_q=torch.zeros(4, 128, 256,
                                                                           dtype=R.FP8_DTYPE))
        call(x, w1, w2, scores, precision="fp8", fp8_weights=bad)
    with pytest.raises(ValueError, match="d_expert"):
        sonic.quantize_expert_weights(w1[:, :192], w2[..., :96])
    with pytest.raises(ValueError, match="d_model"):
        sonic.MoE(96, 128, 4, 2, precision="fp8")
    with pytest.raises(ValueError, match="d_expert"):
        sonic.MoE(128, 64, 4, 2, precision="fp8")
    layer = sonic.MoE(128, 64, 4, 2)
    with pytest.raises(ValueError, match="d_expert"):
        layer.precision = "fp8"
    assert layer.precision == "bf16"


def test_fp8_refuses_cute_where_it_cannot_run(monkeypatch):
    from sonic import backend
    from sonic.kernels import runtime

    x, w1, w2, scores, tok, exp, _ = _problem(5, 128, 128, 4, "topk")
    with pytest.raises(RuntimeError, match="backend='cute'"):
        sonic.moe_experts(x, w1, w2, scores, tok, exp, backend="cute", precision="fp8")
    # A CUDA GPU that is not Hopper: "cute" and "auto" refuse and say what is supported.
    monkeypatch.setattr(runtime, "device_arch", lambda device=None: "sm_100a")
    for name in ("cute", "auto"):
        with pytest.raises(RuntimeError, match=r"sm_90a.*sm_100a|sm_100a.*sm_90a"):
            backend.check_fp8_backend(name, torch.device("cuda"))
    backend.check_fp8_backend("torch", torch.device("cuda"))
    backend.check_fp8_backend("auto", torch.device("cpu"))


# ------------------------------------------------------------------------------ MoE cache


def _fp8_layer(seed=0):
    torch.manual_seed(seed)
    return sonic.MoE(128, 128, 4, 2, precision="fp8", backend="torch", dtype=BF16)


def _copies_match_weights(layer):
    """All eight copies are those of the current weights (the transposed ones included)."""
    copies = layer.weight_copies()
    w1, w2 = layer.w1.detach(), layer.w2.detach()
    expected = (*R.quantize_blocks(w1), *R.quantize_blocks(w2),
                *R.quantize_blocks(w1.transpose(1, 2).contiguous()),
                *R.quantize_blocks(w2.transpose(1, 2).contiguous()))
    view = (lambda t: t.view(torch.uint8) if t.dtype == R.FP8_DTYPE else t)  # noqa: E731
    return len(copies) == 8 and all(torch.equal(view(a), view(b))
                                    for a, b in zip(copies, expected))


def test_moe_fp8_copies_reused_only_inside_reuse_fp8_weights():
    layer = _fp8_layer()
    x = torch.randn(6, 128, dtype=BF16)
    assert layer.weight_copies() == ()
    layer(x).float().sum().backward()
    first = layer.weight_copies()
    assert _copies_match_weights(layer)
    layer(x)                                                           # outside: remade
    assert all(a is not b for a, b in zip(layer.weight_copies(), first))
    with sonic.reuse_fp8_weights():
        layer(x)
        first = layer.weight_copies()
        with sonic.reuse_fp8_weights():                                # blocks nest
            layer(x)
        layer(x)
        assert all(a is b for a, b in zip(layer.weight_copies(), first))   # reused
        torch.optim.SGD(layer.parameters(), lr=0.5).step()             # bumps the version
        out = layer(x)
        assert all(a is not b for a, b in zip(layer.weight_copies(), first))
        assert _copies_match_weights(layer)
    # The output is the one of copies made from the updated weights.
    want = sonic.moe_experts(x, layer.w1, layer.w2, layer.last_routing.scores,
                             layer.last_routing.token_idx, layer.last_routing.expert_idx,
                             backend="torch", precision="fp8")
    assert torch.equal(out.detach(), want.detach())


def _fresh_output(layer, x):
    """The layer's output computed from a copy with no FP8 copies kept."""
    clone = _fp8_layer()
    clone.load_state_dict(layer.state_dict())
    return clone(x)


@pytest.mark.parametrize("edit", ["data_mul", "data_copy", "copy_", "load_state_dict",
                                  "detach_add", "assign_data"])
def test_moe_fp8_weight_edits_are_seen_by_the_next_forward(edit):
    """Every way of changing the weights between two forwards changes the output, the ones
    that bypass the version counter (``.data``) included."""
    layer = _fp8_layer()
    x = torch.randn(6, 128, dtype=BF16)
    before = layer(x)
    new_w2 = torch.randn_like(layer.w2) * 0.1
    with torch.no_grad():
        if edit == "data_mul":
            layer.w2.data.mul_(3)
        elif edit == "data_copy":
            layer.w2.data.copy_(new_w2)
        elif edit == "copy_":
            layer.w2.copy_(new_w2)
        elif edit == "load_state_dict":
            layer.load_state_dict({**layer.state_dict(), "w2": new_w2})
        elif edit == "detach_add":
            layer.w2.detach().add_(new_w2)
        else:
            layer.w2.data = new_w2.clone()
    after = layer(x)
    assert not torch.equal(after, before)
    assert _copies_match_weights(layer)
    assert torch.equal(after, _fresh_output(layer, x))


def test_moe_fp8_data_edit_seen_after_a_reuse_block():
    layer = _fp8_layer()
    x = torch.randn(6, 128, dtype=BF16)
    with sonic.reuse_fp8_weights():
        layer(x)
    layer.w2.data.mul_(3)
    assert not _copies_match_weights(layer)          # the kept copies are the old weights'
    out = layer(x)
    assert _copies_match_weights(layer)
    assert torch.equal(out, _fresh_output(layer, x))


def test_moe_fp8_deepcopy_edit_does_not_leak_into_the_original():
    layer = _fp8_layer()
    x = torch.randn(6, 128, dtype=BF16)
    with sonic.reuse_fp8_weights():
        before = layer(x)
        clone = copy.deepcopy(layer)
        assert clone.weight_copies() == ()
        clone.w2.data.mul_(3)
        assert torch.equal(layer(x), before)
        assert not torch.equal(clone(x), before)
        assert _copies_match_weights(clone) and _copies_match_weights(layer)


def test_moe_fp8_cache_not_in_state_dict_and_refreshed_by_load_state_dict():
    layer, other = _fp8_layer(0), _fp8_layer(1)
    x = torch.randn(6, 128, dtype=BF16)
    layer(x)
    assert set(layer.state_dict()) == {"w1", "w2", "gate.weight"}
    layer.load_state_dict(other.state_dict())
    layer(x)
    assert _copies_match_weights(layer)
    assert torch.equal(layer(x), other(x))


def test_moe_precision_survives_copies_without_the_cache():
    layer = _fp8_layer()
    layer(torch.randn(4, 128, dtype=BF16))
    assert "precision='fp8'" in repr(layer)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone.precision == "fp8" and clone.weight_copies() == ()
        clone(torch.randn(4, 128, dtype=BF16))
        assert _copies_match_weights(clone)


def test_memory_profile_counts_the_cache_as_the_layers_state():
    x = torch.randn(256, 128, dtype=BF16, requires_grad=True)
    saved = {}
    for precision in ("bf16", "fp8"):
        torch.manual_seed(0)
        layer = sonic.MoE(128, 128, 4, 2, precision=precision, backend="torch", dtype=BF16)
        saved[precision] = sonic.profile_activation_memory(layer, x).activation_bytes
    assert saved["fp8"] == saved["bf16"]          # H bf16, metadata, scores: nothing more


# ------------------------------------------------------------------------------ train CLI


def test_train_cli_fp8(capsys):
    from sonic.train.__main__ import main

    assert main(["--precision", "fp8", "--backend", "torch", "--steps", "2", "--batch-size",
                 "2", "--seq-len", "16", "--d-model", "128", "--layers", "1", "--heads", "2",
                 "--experts", "4", "--d-expert", "128", "--eval-batches", "1", "--device",
                 "cpu", "--no-progress", "--json"]) == 0
    import json
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["precision"] == "fp8" and result["dtype"] == "bfloat16"
    assert math.isfinite(result["val_loss"])
    with pytest.raises(SystemExit):
        main(["--precision", "fp8", "--d-expert", "96", "--steps", "1"])
    with pytest.raises(SystemExit):
        main(["--precision", "fp8", "--dtype", "float32", "--steps", "1"])


@pytest.mark.parametrize("activation_cache", ["bf16", "fp8"])
def test_fp8_layer_compiles_fullgraph_and_matches_eager(activation_cache):
    # The weight copies are made through ops and the backward runs ops, so the FP8 path traces.
    x, w1, w2, _, _, _, dout = _problem(16, 128, 128, 4, "topk", seed=1)
    r = sonic.topk_routing(torch.randn(16, 4), 2, backend="torch")

    def layer(x, w1, w2, s):
        return sonic.moe_experts(x, w1, w2, s, r.token_idx, r.expert_idx, backend="torch",
                                 metadata=sonic.routing_metadata(r, backend="torch"),
                                 precision="fp8", activation_cache=activation_cache)

    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, r.scores.detach())]
        out = fn(*leaves)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("activation_cache", ["bf16", "fp8"])
def test_fp8_padded_token_rounding_equals_its_exact_pairs(activation_cache):
    # The padded routing's rows past expert_offsets[E] are computed by no GEMM: the layer's
    # output and gradients are those of the trimmed (exact) pairs.
    torch.manual_seed(0)
    layer = sonic.MoE(128, 128, 4, 2, router="token_rounding", tile=8, precision="fp8",
                      backend="torch", dtype=BF16, activation_cache=activation_cache)
    x = torch.randn(30, 128, dtype=BF16, requires_grad=True)
    dout = torch.randn(30, 128, dtype=BF16)
    out = layer(x)
    out.backward(dout)
    r = layer.last_routing
    assert r.num_valid is not None
    exact = r.trim()
    leaves = [t.detach().clone().requires_grad_() for t in (layer.w1, layer.w2)]
    want = sonic.moe_experts(x.detach(), *leaves, exact.scores, exact.token_idx,
                             exact.expert_idx, backend="torch", precision="fp8",
                             activation_cache=activation_cache)
    want.backward(dout)
    assert torch.equal(out.detach(), want.detach())
    # (x's gradient also flows through the router here, so only the weights' compare.)
    for got, ref in zip((layer.w1.grad, layer.w2.grad), (t.grad for t in leaves)):
        torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=1e-6)


def test_set_fp8_epilogues_validates_and_defaults_to_quantizing():
    from sonic.backend import FP8_EPILOGUES, set_fp8_epilogues

    previous = set_fp8_epilogues("store")
    assert previous == "quantizing"         # the default: every test restores its choice
    try:
        with pytest.raises(ValueError, match="kind must be one of"):
            set_fp8_epilogues("epilogue")
        assert set_fp8_epilogues("fused") == "store"
        assert set(FP8_EPILOGUES) == {"store", "quantizing", "fused"}
    finally:
        set_fp8_epilogues(previous)


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_reference_emulates_the_chosen_fp8_epilogues(gate_up):
    """The reference follows set_fp8_epilogues: "store" and "quantizing" are one math;
    "fused" takes dSwiGLU of the fp32 dA' where the fused dH kernel runs (concat halves,
    gathered rows: the layer's dH step) and is "store" elsewhere. Its forward is unchanged."""
    from sonic.backend import FP8_EPILOGUES, set_fp8_epilogues

    problem = _problem(37, 128, 128, 4, "topk", seed=9)
    results = {}
    for kind in FP8_EPILOGUES:
        previous = set_fp8_epilogues(kind)
        try:
            out, grads = _layer_fp8(*problem, gate_up=gate_up)
        finally:
            set_fp8_epilogues(previous)
        results[kind] = [out, *grads]
    assert all(torch.equal(a, b) for a, b in zip(results["store"], results["quantizing"]))
    assert torch.equal(results["fused"][0], results["store"][0])
    fused_math = gate_up == "concat"
    _, want = _emulate(*problem, gate_up=gate_up, da_prime_fp32=fused_math)
    _, other = _emulate(*problem, gate_up=gate_up, da_prime_fp32=not fused_math)
    for name, got, ref, wrong in zip(("dx", "dw1", "dw2", "dscores"), results["fused"][1:],
                                     want, other):
        assert _rel(got, ref) <= 2e-3, (name, _rel(got, ref))
    # The two maths are told apart at this tolerance (e4m3 roundings of dH flip).
    assert max(_rel(g, w) for g, w in zip(results["fused"][1:3], other[:2])) > 4e-3
    same = all(torch.equal(a, b) for a, b in zip(results["fused"], results["store"]))
    assert same != fused_math


def test_train_seeds_benchmark_smoke(capsys):
    """``benchmarks/train_seeds.py`` on the CPU emulation, tiny: every (variant, seed) trains,
    the paired gaps are to bf16 of the same seed, and the fused choice is restored after."""
    import json

    from sonic import backend

    bench = load_benchmark("train_seeds")
    tiny = '{"eval_every": 0, "eval_batches": 1, "batch_size": 2, "seq_len": 16, "layers": 1}'
    assert bench.main(["--device", "cpu", "--backend", "torch", "--steps", "2", "--seeds", "0",
                       "1", "--variants", "bf16", "fp8", "fp8-fused", "fp8-wgrad", "--config",
                       tiny]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    variants = summary["variants"]
    assert set(variants) == {"bf16", "fp8", "fp8-fused", "fp8-wgrad"}
    assert variants["bf16"]["mean_gap"] == 0.0
    for name in ("fp8", "fp8-fused", "fp8-wgrad"):
        for seed in ("0", "1"):
            gap = variants[name]["val_loss"][seed] / variants["bf16"]["val_loss"][seed] - 1
            assert variants[name]["gap_to_bf16"][seed] == pytest.approx(gap)
        b, v = variants["bf16"], variants[name]
        assert v["gap_of_means"] == pytest.approx(v["mean"] / b["mean"] - 1)
        se = ((v["std"] ** 2 + b["std"] ** 2) / 2) ** 0.5 / b["mean"]
        assert v["gap_of_means_se"] == pytest.approx(se)
    assert "gap_of_means" not in variants["bf16"]
    assert backend.fp8_epilogues() == "quantizing" and backend.fp8_weight_grads() == "auto"


def test_train_seeds_gap_of_means_standard_error():
    """The unpaired gap and its Welch standard error, on three seeds' losses worked by
    hand: means 2.0 and 1.9, sample standard deviations 0.1 and 0.2."""
    bench = load_benchmark("train_seeds")
    bf16 = {"mean": 2.0, "std": 0.1}
    gap, se = bench._gap_of_means({"mean": 1.9, "std": 0.2}, bf16, 3)
    assert gap == pytest.approx(-0.05)
    assert se == pytest.approx((0.05 / 3) ** 0.5 / 2.0)


def _compile_problem():
    """A small FP8 expert layer on the torch backend with fixed routing, for the process-wide
    FP8 choices under torch.compile: ``(layer, inputs, dout)``."""
    x, w1, w2, _, _, _, dout = _problem(16, 128, 128, 4, "topk", seed=3)
    r = sonic.topk_routing(torch.randn(16, 4), 2, backend="torch")

    def layer(x, w1, w2, s):
        return sonic.moe_experts(x, w1, w2, s, r.token_idx, r.expert_idx, backend="torch",
                                 metadata=sonic.routing_metadata(r, backend="torch"),
                                 precision="fp8")

    return layer, (x, w1, w2, r.scores.detach()), dout


def _grads_under(setter, kind, fn, inputs, dout, switch_before_backward=None):
    """Gradients of ``fn(*inputs)`` with ``setter(kind)`` (optionally switched between the
    forward and the backward), the previous choice restored."""
    previous = setter(kind)
    try:
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        if switch_before_backward:
            setter(switch_before_backward)
        out.backward(dout)
        return [t.grad for t in leaves]
    finally:
        setter(previous)


def test_fp8_weight_grads_choice_travels_with_the_graph_and_keys_compile():
    """set_fp8_weight_grads is read when the forward runs: a graph built under one choice
    keeps it through its backward, and a compiled layer recompiles when it changes (its
    gradients equal eager's under each choice)."""
    layer, inputs, dout = _compile_problem()
    setter = sonic.backend.set_fp8_weight_grads
    eager = {k: _grads_under(setter, k, layer, inputs, dout) for k in ("bf16", "fp8")}
    assert not torch.equal(eager["bf16"][1], eager["fp8"][1])
    switched = _grads_under(setter, "fp8", layer, inputs, dout, switch_before_backward="bf16")
    assert all(torch.equal(a, b) for a, b in zip(switched, eager["fp8"]))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for kind in ("bf16", "fp8", "bf16"):
        got = _grads_under(setter, kind, compiled, inputs, dout)
        assert all(torch.equal(a, b) for a, b in zip(got, eager[kind])), kind
    assert counter.frame_count == 2      # one graph per choice, the first one reused


def test_auto_weight_grads_resolve_by_layer_size(monkeypatch):
    """"auto" (the default) takes FP8 weight gradients where d·n / (2d + 3n) reaches
    FP8_WEIGHT_GRADS_MIN_INTENSITY — at the named layers, where the H200 measured them
    faster: DeepSeek-V3, Mixtral-8x7B, GLM-4.5 — and bf16 ones elsewhere; an explicit choice
    passes through; sizes that are not positive ints are refused by name; a layer under
    "auto" computes bitwise what it computes under the choice "auto" resolves to, whichever
    that is."""
    from sonic.backend import fp8_weight_grads, fp8_weight_grads_for
    from sonic.baselines.configs import CONFIGS

    assert fp8_weight_grads() == "auto"
    want = {"DeepSeek-V3": "fp8", "Mixtral-8x7B": "fp8", "GLM-4.5": "fp8",
            "Qwen3-235B": "bf16", "30B": "bf16", "OLMoE": "bf16", "7B": "bf16"}
    assert set(want) == set(CONFIGS)
    for name, kind in want.items():
        _, d, n, _, _ = CONFIGS[name]
        assert fp8_weight_grads_for(d, n) == kind, name
    setter = sonic.backend.set_fp8_weight_grads
    previous = setter("fp8")
    try:
        assert fp8_weight_grads_for(1536, 256) == "fp8"
        setter("bf16")
        assert fp8_weight_grads_for(7168, 2048) == "bf16"
    finally:
        setter(previous)
    for bad, error in ((0, ValueError), (-128, ValueError), (128.0, TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match="^d must"):
            fp8_weight_grads_for(bad, 1024)
        with pytest.raises(error, match="^n must"):
            fp8_weight_grads_for(1024, bad)
    layer, inputs, dout = _compile_problem()
    for threshold, kind in ((0, "fp8"), (10 ** 9, "bf16")):
        monkeypatch.setattr(sonic.backend, "FP8_WEIGHT_GRADS_MIN_INTENSITY", threshold)
        auto = _grads_under(setter, "auto", layer, inputs, dout)
        explicit = _grads_under(setter, kind, layer, inputs, dout)
        assert all(torch.equal(a, b) for a, b in zip(auto, explicit)), kind


def test_compiled_layer_follows_set_fp8_epilogues_at_run_time():
    """set_fp8_epilogues is read inside the ops' implementations, which run opaque in a
    compiled graph: switching it changes a compiled layer's math as it does eager's, with no
    recompilation ("fused" takes dSwiGLU of the fp32 dA', so its gradients differ)."""
    layer, inputs, dout = _compile_problem()
    setter = sonic.backend.set_fp8_epilogues
    eager = {k: _grads_under(setter, k, layer, inputs, dout) for k in ("quantizing", "fused")}
    assert not torch.equal(eager["quantizing"][0], eager["fused"][0])
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for kind in ("quantizing", "fused", "quantizing"):
        got = _grads_under(setter, kind, compiled, inputs, dout)
        assert all(torch.equal(a, b) for a, b in zip(got, eager[kind])), kind
    assert counter.frame_count == 1


def test_fp8_op_rejects_an_unknown_weight_grads_choice():
    x, w1, w2, scores, tok, exp, _ = _problem(16, 128, 128, 4, "topk", seed=4)
    meta = routing_metadata_op(tok, exp, 16, 4, None, "torch")
    fp8_w = sonic.quantize_expert_weights(w1, w2, backend="torch")
    with pytest.raises(ValueError, match="weight_grads must be one of"):
        torch.ops.sonic.moe_experts_fp8(x, w1, w2, scores, meta.packed, list(fp8_w), 0,
                                        "concat", "torch", "bf16", "e4m3")
