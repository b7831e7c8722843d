"""The top-K kernel's sigmoid scoring, selection bias and group-limited selection
(`sonic.kernels.topk`, DeepSeek-V3 §2.1.2) against the torch path of `sonic.topk_routing`.

    python -m pytest -m gpu tests/gpu/test_topk_sigmoid_kernel.py

The kernel computes the sigmoid as PyTorch's CUDA kernel does and orders the fp32 choice values
exactly, so the selected experts and their order must equal the torch path's bit for bit, ties
included (the lower expert, or group, first). Scores are sigmoids of the same logits; only the
renormalising sum's order differs (a few ulp). The CPU tests at the end check the argument
errors, and the layout invariant that group selection relies on (its edge plans compile in
test_topk_kernel.py).
"""

import pytest
import torch

import sonic
from sonic.kernels import topk
from sonic.reference.ops import scored_topk

from kernel_checks import poison_allocator, require_kernels

RTOL, ATOL = 1e-5, 1e-7
DTYPES = (torch.bfloat16, torch.float32)
# (E, K, n_group, topk_group): DeepSeek-V3's shape first; groups of one expert and all groups
# kept reduce to the plain top-K; E=96 has padding columns past E inside the lanes' registers.
GROUPS = [(256, 8, 8, 4), (256, 8, 8, 1), (256, 16, 2, 1), (512, 16, 8, 4), (512, 8, 16, 3),
          (96, 6, 3, 2), (128, 8, 16, 5), (64, 8, 64, 16), (64, 8, 4, 4), (8, 2, 2, 1)]


def _ids(v):
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None


def random_inputs(T, E, dtype, seed, kind="normal"):
    """``(logits (T, E) dtype, bias (E,) fp32)`` on the GPU. ``kind="ties"`` draws logits and
    bias from a few values, so that whole experts and groups tie exactly."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "ties":
        x = torch.randint(-2, 3, (T, E), generator=g, device="cuda").float()
        bias = 0.25 * torch.randint(-1, 2, (E,), generator=g, device="cuda").float()
    else:
        x = 2.0 * torch.randn(T, E, generator=g, device="cuda")
        bias = 0.1 * torch.randn(E, generator=g, device="cuda")
    return x.to(dtype), bias


def check(logits, k, *, bias=None, n_group=1, topk_group=None, renormalize=False):
    """The kernel against :func:`scored_topk` on the same GPU; returns ``(scores, idx)``."""
    assert topk.kernel_fits(logits, k, "sigmoid", n_group, topk_group)
    before = logits.clone()
    poison_allocator(64 << 20)
    scores, idx = topk.topk_scores(logits, k, score="sigmoid", renormalize=renormalize,
                                   expert_bias=bias, n_group=n_group, topk_group=topk_group)
    assert torch.equal(logits, before), "logits were modified"
    assert scores.dtype == torch.float32 and idx.dtype == torch.int32
    assert scores.shape == idx.shape == (logits.shape[0], k)
    ref_s, ref_i = scored_topk(logits, k, "sigmoid", renormalize, bias, n_group,
                               n_group if topk_group is None else topk_group)
    assert torch.equal(idx, ref_i), "selected experts / order differ from the torch path"
    torch.testing.assert_close(scores, ref_s, rtol=RTOL, atol=ATOL)
    return scores, idx


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("E,k", [(1, 1), (8, 8), (96, 6), (128, 8), (256, 8), (257, 16),
                                 (384, 16), (512, 1), (512, 16)])
@pytest.mark.parametrize("T", (1, 1000, 4097))
def test_sigmoid_bias_matches_torch(T, E, k, dtype):
    require_kernels()
    logits, bias = random_inputs(T, E, dtype, seed=T * 1000 + E * 17 + k)
    check(logits, k)
    check(logits, k, bias=bias, renormalize=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("E,k,n_group,topk_group", GROUPS)
@pytest.mark.parametrize("kind", ("normal", "ties"))
def test_groups_match_torch(kind, E, k, n_group, topk_group, dtype):
    require_kernels()
    logits, bias = random_inputs(4097, E, dtype, seed=E * n_group + topk_group, kind=kind)
    check(logits, k, bias=bias, n_group=n_group, topk_group=topk_group, renormalize=True)
    check(logits[:1], k, bias=bias, n_group=n_group, topk_group=topk_group)
    check(logits, k, n_group=n_group, topk_group=topk_group)


@pytest.mark.gpu
def test_groups_change_the_selection():
    """Guards the group tests against a vacuous pass: on these inputs the group limit must
    pick other experts than the plain top-K (else the masking is never exercised)."""
    require_kernels()
    logits, bias = random_inputs(4097, 256, torch.bfloat16, seed=5)
    _, plain = topk.topk_scores(logits, 8, score="sigmoid", expert_bias=bias)
    _, grouped = topk.topk_scores(logits, 8, score="sigmoid", expert_bias=bias, n_group=8,
                                  topk_group=4)
    assert (plain != grouped).any(dim=-1).float().mean() > 0.1
    # And the bias must matter for the selection while leaving the weights unbiased.
    s_nb, i_nb = topk.topk_scores(logits, 8, score="sigmoid")
    s_b, i_b = topk.topk_scores(logits, 8, score="sigmoid", expert_bias=bias)
    assert not torch.equal(i_nb, i_b)
    torch.testing.assert_close(s_b, torch.sigmoid(logits.float().gather(1, i_b.long())),
                               rtol=0, atol=0)


@pytest.mark.gpu
def test_unaligned_strided_and_bias_views():
    require_kernels()
    T, E, k = 1000, 256, 8
    flat, _ = random_inputs(1, T * E + 1, torch.bfloat16, seed=11)
    bias_store = 0.1 * torch.randn(E + 1, device="cuda")
    # A view one element into its storage: the scalar-load plan; a bias view off 16 bytes.
    check(flat.flatten()[1:].view(T, E), k, bias=bias_store[1:], n_group=8, topk_group=4)
    wide, _ = random_inputs(T, E + 3, torch.float32, seed=12)
    check(wide[:, 1:E + 1], k, bias=bias_store[:E].double(), n_group=8, topk_group=4)


@pytest.mark.gpu
def test_bitwise_deterministic():
    require_kernels()
    logits, bias = random_inputs(4097, 256, torch.bfloat16, seed=3)
    kw = dict(score="sigmoid", renormalize=True, expert_bias=bias, n_group=8, topk_group=4)
    s1, i1 = topk.topk_scores(logits, 8, **kw)
    s2, i2 = topk.topk_scores(logits, 8, **kw)
    assert torch.equal(i1, i2) and torch.equal(s1.view(torch.int32), s2.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("renormalize", (False, True))
def test_routing_forward_and_backward_match_torch_backend(renormalize, dtype):
    """``sonic.topk_routing`` on the CuTe backend (the kernel and the op's backward) against
    the torch backend (autograd through the torch selection), with no host read."""
    require_kernels()
    logits, bias = random_inputs(2048, 256, dtype, seed=7)
    kw = dict(k=8, score="sigmoid", renormalize=renormalize, expert_bias=bias, n_group=8,
              topk_group=4, scaling_factor=2.5)
    calls = []
    original = topk.topk_scores

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    weights = torch.randn(2048 * 8, device="cuda")
    out = {}
    for backend in ("cute", "torch"):
        x = logits.detach().clone().requires_grad_()
        topk.topk_scores = counted
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            r = sonic.topk_routing(x, backend=backend, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            topk.topk_scores = original
        grad, = torch.autograd.grad((r.scores * weights).sum(), x, create_graph=True)
        grad2, = torch.autograd.grad(grad.float().square().sum(), x)
        out[backend] = (r, grad, grad2)
    assert len(calls) == 1, "the CuTe backend did not run the kernel (or torch did)"
    (rc, gc, hc), (rt, gt, ht) = out["cute"], out["torch"]
    assert torch.equal(rc.expert_idx, rt.expert_idx)
    torch.testing.assert_close(rc.scores, rt.scores, rtol=RTOL, atol=ATOL)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    torch.testing.assert_close(gc, gt, **tol)
    torch.testing.assert_close(hc, ht, **tol)


@pytest.mark.gpu
def test_groups_the_kernel_does_not_serve_fall_back_to_torch():
    """Groups of 2 experts with 16 lanes per row (E=512): torch selects, same result."""
    require_kernels()
    logits, bias = random_inputs(512, 512, torch.bfloat16, seed=9)
    assert not topk.kernel_fits(logits, 8, "sigmoid", 256, 64)
    kw = dict(k=8, score="sigmoid", expert_bias=bias, n_group=256, topk_group=64)
    rc = sonic.topk_routing(logits, backend="cute", **kw)
    rt = sonic.topk_routing(logits, backend="torch", **kw)
    assert torch.equal(rc.expert_idx, rt.expert_idx)
    torch.testing.assert_close(rc.scores, rt.scores, rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
def test_layer_routes_with_the_kernel():
    """sonic.MoE with DeepSeek-V3's router options on the CuTe backend runs the kernel, and
    its routing equals the torch backend's."""
    require_kernels()
    kw = dict(score="sigmoid", renormalize=True, n_group=8, topk_group=4,
              routed_scaling_factor=2.5, bias_update_rate=1e-3, device="cuda",
              dtype=torch.bfloat16)
    torch.manual_seed(0)
    layers = {b: sonic.MoE(256, 128, 64, 8, backend=b, **kw) for b in ("cute", "torch")}
    layers["torch"].load_state_dict(layers["cute"].state_dict())
    bias = 0.05 * torch.randn(64, device="cuda")
    for layer in layers.values():
        layer.expert_bias.copy_(bias)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
    calls = []
    original = topk.topk_scores
    topk.topk_scores = lambda *a, **k: calls.append(k) or original(*a, **k)
    try:
        layers["cute"](x)
    finally:
        topk.topk_scores = original
    layers["torch"](x)
    assert len(calls) == 1 and calls[0]["n_group"] == 8
    assert torch.equal(layers["cute"].last_routing.expert_idx,
                       layers["torch"].last_routing.expert_idx)


# ---------------------------------------------------------------------------------------------
# CPU: argument checks, the group layout invariant, compile of edge plans.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(expert_bias=torch.zeros(8)), ValueError, "need score='sigmoid'"),
    (dict(score="topk_softmax", n_group=2), ValueError, "need score='sigmoid'"),
    (dict(score="sigmoid", expert_bias=torch.zeros(7)), ValueError, r"shape \(E=8,\)"),
    (dict(score="sigmoid", expert_bias=torch.zeros(8, dtype=torch.int32)), TypeError, "float"),
    (dict(score="sigmoid", n_group=3), ValueError, "n_group must divide"),
    (dict(score="sigmoid", n_group=2.0), TypeError, "n_group must be an int"),
    (dict(score="sigmoid", n_group=4, topk_group=5), ValueError, "topk_group must be in"),
    (dict(score="sigmoid", n_group=4, topk_group=0), ValueError, "topk_group must be in"),
    (dict(score="sigmoid", n_group=4, topk_group=1), ValueError, "eligible experts"),
    (dict(score="sigmoid"), ValueError, "CUDA device"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        topk.topk_scores(torch.randn(4, 8), 3, **kwargs)


def test_groups_the_lanes_split_are_refused():
    # E=512: 16 lanes share a row; groups of 2 experts cannot be whole rows of lanes.
    with pytest.raises(ValueError, match="multiple of the lanes per row"):
        topk.topk_scores(torch.randn(4, 512), 8, score="sigmoid", n_group=256, topk_group=64)
    assert not topk.kernel_fits(torch.randn(4, 512), 8, "sigmoid", 256, 64)
    assert topk.kernel_fits(torch.randn(4, 512), 8, "sigmoid", 512, 64)  # groups of one
    assert topk.kernel_fits(torch.randn(4, 256), 8, "sigmoid", 8, 4)
    assert not topk.kernel_fits(torch.randn(4, 256), 8, "topk_softmax", 8, 4)


@pytest.mark.parametrize("aligned", (True, False))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_every_group_is_static_per_register(dtype, aligned):
    """The invariant ``limit_groups`` relies on: for every plan the kernel accepts, register
    ``t`` of every lane holds a column of the same group (or padding on every lane), so a
    lane's registers of one group are known at trace time."""
    checked = 0
    for E in (8, 64, 96, 128, 192, 256, 320, 512):
        for n_group in range(2, E // 2 + 1):
            if E % n_group:
                continue
            plan = topk._plan(dtype, E, 8 if E >= 16 else 2, "sigmoid", False, aligned,
                              bias=True, n_group=n_group, topk_group=1)
            if not plan.groups_fit:
                continue
            G, V, vec, size = plan.lanes_per_row, plan.keys_per_lane, plan.vec, plan.group_size
            for t in range(V):
                cols = [((t // vec) * G + lane) * vec + t % vec for lane in range(G)]
                groups = {c // size if c < E else None for c in cols}
                first = (t // vec) * G * vec
                assert groups == {first // size if first < E else None}, (E, n_group, t)
            checked += 1
    assert checked > 40
