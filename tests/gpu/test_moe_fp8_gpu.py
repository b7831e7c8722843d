"""precision="fp8" of the MoE layer on a Hopper GPU: the CuTe path (FP8 quantize kernels, FP8
grouped GEMM, SwiGLU / dSwiGLU kernels) against the "torch" backend's emulation of the same
math, and a training step without host synchronisation.

Both backends quantize bitwise alike (tests/gpu/test_fp8_quant_gpu.py), so each FP8 GEMM sees
the same e4m3 values and scales; the results differ only by the order (and, inside one FP8
WGMMA, the ~14-bit precision, DeepSeek-V3 §3.3) of the fp32 sums and by the bf16 rounding
those move, plus the rare e4m3 rounding of A, dO or dH that such a last-bit change flips.
"""

import pytest
import torch

import sonic
from sonic.ops import routing_metadata_op
from sonic.reference import fp8 as R

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _require_hopper():
    from kernel_checks import require_kernels
    from sonic.kernels.runtime import device_arch

    require_kernels()
    if device_arch() != "sm_90a":
        pytest.skip("the FP8 grouped GEMM runs on Hopper (sm_90a) only")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _problem(T, d, n, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    w1 = torch.randn(E, 2 * n, d, generator=g) * d ** -0.5
    w2 = torch.randn(E, d, n, generator=g) * n ** -0.5
    logits = torch.randn(T, E, generator=g)
    dout = torch.randn(T, d, generator=g)
    return [t.cuda().to(BF16) for t in (x, w1, w2, dout)] + [logits.cuda()]


@pytest.fixture(params=["store", "quantizing", "fused"])
def fp8_epilogues(request):
    """Each CuTe FP8 test runs with the store-GEMM path, with its SwiGLU kernel writing A
    quantized, and with the fused epilogue kernels (sonic.backend.set_fp8_epilogues). The
    torch emulation follows the choice: under "fused" it takes dSwiGLU of the fp32 dA' as the
    fused kernel does (with the bf16 dA' instead, dX lands 1.4e-2 away: e4m3 roundings of dH
    flip)."""
    from sonic.backend import set_fp8_epilogues

    previous = set_fp8_epilogues(request.param)
    yield request.param
    set_fp8_epilogues(previous)


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
@pytest.mark.parametrize("router", ["topk", "token_rounding"])
@pytest.mark.parametrize("activation_cache", ["bf16", "fp8"])
def test_fp8_cute_matches_torch_emulation(gate_up, router, activation_cache, fp8_epilogues):
    _require_hopper()
    T, d, n, E, K = 2000, 512, 256, 16, 4
    x, w1, w2, dout, logits = _problem(T, d, n, E, K, seed=1)
    if router == "topk":
        r = sonic.topk_routing(logits, K)
    else:   # padded: rows past expert_offsets[E] that no GEMM writes
        r = sonic.token_rounding_routing(logits, K, tile=128, padded=True)
    scores = r.scores.detach()
    results = {}
    for backend in ("cute", "torch"):
        meta = sonic.routing_metadata(r, backend=backend)
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, scores)]
        out = sonic.moe_experts(*leaves, r.token_idx, r.expert_idx, gate_up=gate_up,
                                backend=backend, metadata=meta, precision="fp8",
                                activation_cache=activation_cache)
        out.backward(dout)
        results[backend] = [out.detach()] + [t.grad for t in leaves]
    # 1e-2 relative: the last-bit differences above, propagated; an FP8 error (~5e-2) or a
    # scale / layout bug (O(1)) is far above it.
    for name, got, want in zip(("out", "dx", "dw1", "dw2", "dscores"), results["cute"],
                               results["torch"]):
        assert torch.isfinite(got).all(), name
        assert _rel(got, want) <= 1e-2, (name, _rel(got, want))


@pytest.mark.parametrize("activation_cache", ["bf16", "fp8"])
def test_fp8_backward_writes_dh_over_h_and_matches_the_kept_graph(activation_cache,
                                                                  fp8_epilogues):
    """The eager FP8 backward writes dH over the saved H (or over its dequantized copy): its
    gradients equal those of a backward that keeps the graph (no in-place) bit for bit, and a
    kept graph's second backward gives them again."""
    _require_hopper()
    T, d, n, E, K = 1500, 256, 256, 8, 2
    x, w1, w2, dout, logits = _problem(T, d, n, E, K, seed=3)
    r = sonic.topk_routing(logits, K)
    meta = sonic.routing_metadata(r)
    grads = {}
    for keep in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, r.scores.detach())]
        out = sonic.moe_experts(*leaves, r.token_idx, r.expert_idx, metadata=meta,
                                precision="fp8", activation_cache=activation_cache)
        out.backward(dout, retain_graph=keep)
        grads[keep] = [t.grad for t in leaves]
        if keep:    # a kept graph runs backward again, on the intact H
            for t in leaves:
                t.grad = None
            out.backward(dout)
            assert all(torch.equal(a, b.grad) for a, b in zip(grads[keep], leaves))
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


def test_fp8_cute_up_proj_differs_from_emulation_only_by_accumulation_and_rounding():
    # H of both backends against each other, elementwise: |ΔH| ≤ 2^-8 (|H_cute| + |H_torch|)
    # (each output's bf16 rounding) + 2·d·2^-14 · |x̂|·|ŵ|ᵀ (fp32 sums in another order, at
    # the ~14-bit precision of an FP8 WGMMA before each k-block's promotion).
    _require_hopper()
    T, d, n, E, K = 700, 512, 256, 8, 2
    x, w1, w2, _, logits = _problem(T, d, n, E, K, seed=2)
    r = sonic.topk_routing(logits, K)
    meta = routing_metadata_op(r.token_idx, r.expert_idx, T, E, K, "torch")
    fp8_w = sonic.quantize_expert_weights(w1, w2, backend="cute")
    h = {b: torch.ops.sonic.moe_experts_fp8(x, w1, w2, r.scores.detach(), meta.packed,
                                            list(fp8_w), K, "concat", b, "bf16", "bf16")[1]
         for b in ("cute", "torch")}
    x_hat = R.dequantize_rows(*R.quantize_rows(x)).abs()
    w_hat = R.dequantize_blocks(fp8_w.w1_q, fp8_w.w1_scales).abs()
    bounds = meta.expert_offsets.tolist()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        rows = meta.gather_idx[lo:hi].long()
        hc, ht = h["cute"][lo:hi].float(), h["torch"][lo:hi].float()
        bound = 2 ** -8 * (hc.abs() + ht.abs()) + 2 * d * 2 ** -14 * (x_hat[rows] @ w_hat[e].t())
        assert ((hc - ht).abs() <= bound).all(), e


@pytest.fixture(params=["bf16", "fp8"])
def weight_grads(request):
    """The test under both sonic.backend.set_fp8_weight_grads choices."""
    from sonic.backend import set_fp8_weight_grads

    previous = set_fp8_weight_grads(request.param)
    yield request.param
    set_fp8_weight_grads(previous)


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_fp8_weight_grads_cute_match_torch_emulation(router, weight_grads):
    """The FP8 weight gradients (quantize_cols_grouped + the FP8 varlen-K GEMM) against the
    torch emulation of the same math, and against the bf16 weight gradients (an FP8 rounding
    apart, ~4%: so the setting took effect)."""
    _require_hopper()
    T, d, n, E, K = 3000, 512, 256, 16, 4
    x, w1, w2, dout, logits = _problem(T, d, n, E, K, seed=2)
    r = (sonic.topk_routing(logits, K) if router == "topk"
         else sonic.token_rounding_routing(logits, K, tile=128, padded=True))
    results = {}
    for backend in ("cute", "torch"):
        meta = sonic.routing_metadata(r, backend=backend)
        leaves = [t.clone().requires_grad_() for t in (w1, w2)]
        sonic.moe_experts(x, *leaves, r.scores.detach(), r.token_idx, r.expert_idx,
                          backend=backend, metadata=meta, precision="fp8").backward(dout)
        results[backend] = [t.grad for t in leaves]
    for name, got, want in zip(("dw1", "dw2"), results["cute"], results["torch"]):
        assert torch.isfinite(got).all(), name
        assert _rel(got, want) <= 1e-2, (name, _rel(got, want))
    from sonic.backend import set_fp8_weight_grads
    other = set_fp8_weight_grads("bf16" if weight_grads == "fp8" else "fp8")
    try:
        meta = sonic.routing_metadata(r, backend="cute")
        leaves = [t.clone().requires_grad_() for t in (w1, w2)]
        sonic.moe_experts(x, *leaves, r.scores.detach(), r.token_idx, r.expert_idx,
                          backend="cute", metadata=meta, precision="fp8").backward(dout)
    finally:
        set_fp8_weight_grads(other)
    for got, alt in zip(results["cute"], (t.grad for t in leaves)):
        assert 1e-2 < _rel(got, alt) < 0.08


def test_fp8_training_step_makes_no_host_sync(weight_grads):
    _require_hopper()
    torch.manual_seed(0)
    layer = sonic.MoE(256, 256, 32, 4, router="token_rounding", tile=128, precision="fp8",
                      device="cuda", dtype=BF16)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    x = torch.randn(2048, 256, device="cuda", dtype=BF16, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        layer(x).backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()                                  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()                              # re-quantizes the weights after the last step
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p).all() for p in layer.parameters())


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
@pytest.mark.parametrize("activation_cache", ["bf16", "fp8"])
@pytest.mark.parametrize("keep_graph", [False, True])
def test_quantizing_epilogues_give_the_store_paths_results_bitwise(gate_up, activation_cache,
                                                                   keep_graph):
    """set_fp8_epilogues("quantizing") writes A in e4m3 from the SwiGLU kernel and dH in e4m3
    from the dSwiGLU kernel (for the dX GEMM) instead of quantizing the bf16 A and dH
    afterwards: the same values, so the layer's output and gradients are bitwise those of
    "store" (also where the graph is kept and dH is not quantized by the kernel)."""
    from sonic.backend import set_fp8_epilogues

    _require_hopper()
    T, d, n, E, K = 1500, 256, 384, 8, 2
    x, w1, w2, dout, logits = _problem(T, d, n, E, K, seed=4)
    r = sonic.topk_routing(logits, K)
    results = {}
    for kind in ("store", "quantizing"):
        previous = set_fp8_epilogues(kind)
        try:
            leaves = [t.clone().requires_grad_() for t in (x, w1, w2, r.scores.detach())]
            out = sonic.moe_experts(*leaves, r.token_idx, r.expert_idx, precision="fp8",
                                    metadata=sonic.routing_metadata(r), gate_up=gate_up,
                                    activation_cache=activation_cache)
            out.backward(dout, retain_graph=keep_graph)
            results[kind] = [out.detach()] + [t.grad for t in leaves]
        finally:
            set_fp8_epilogues(previous)
    assert all(torch.equal(a, b) for a, b in zip(results["store"], results["quantizing"]))


@pytest.mark.parametrize("edit", ["data_mul", "copy_"])
def test_fp8_layer_sees_weight_edits_on_the_kernels(edit):
    """The CuTe path quantizes the weights the forward reads: an edit through ``.data`` (no
    version bump) or ``copy_`` between two forwards gives the output of a fresh layer with the
    edited weights; inside ``reuse_fp8_weights`` the copies are reused bit for bit."""
    _require_hopper()
    torch.manual_seed(0)
    layer = sonic.MoE(256, 128, 8, 2, precision="fp8", backend="cute", device="cuda",
                      dtype=torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    with sonic.reuse_fp8_weights():
        before = layer(x)
        assert torch.equal(layer(x), before)
    with torch.no_grad():
        if edit == "data_mul":
            layer.w2.data.mul_(3)
        else:
            layer.w2.copy_(torch.randn_like(layer.w2) * 0.05)
    after = layer(x)
    fresh = sonic.MoE(256, 128, 8, 2, precision="fp8", backend="cute", device="cuda",
                      dtype=torch.bfloat16)
    fresh.load_state_dict(layer.state_dict())
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh(x))
