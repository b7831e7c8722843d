"""Padded token rounding on the CuTe expert kernels: the rows past ``expert_offsets[E]`` (the
padding, which belongs to no expert and no tile) of every output are what the PyTorch
reference gives them, zeros, and the routed rows match the reference.

Fresh random inputs on every run; each CuTe call runs with its outputs allocated NaN-filled,
so a row that a kernel leaves unwritten reads as NaN rather than as a stale zero.
"""

import contextlib
from unittest import mock

import pytest
import torch

import sonic
from sonic.backend import set_fp8_epilogues

from kernel_checks import fp8_kernels, rel_err, require_kernels  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu

# Every output is over 1 MiB, so it comes from the allocator's large pool, which
# poison_allocator fills; "nearest" leaves some 500 padding rows of 2560.
T, D, N, E, K, TILE = 1024, 512, 512, 8, 2, 128


def _problem():
    """Weights, tokens, output gradient and a padded token-rounding routing with its CuTe
    metadata, drawn from the default generator without a fixed seed."""
    x = torch.randn(T, D, device="cuda").bfloat16()
    w1 = (torch.randn(E, 2 * N, D, device="cuda") / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, N, device="cuda") / N ** 0.5).bfloat16()
    dout = torch.randn(T, D, device="cuda").bfloat16()
    r = sonic.token_rounding_routing(torch.randn(T, E, device="cuda"), K, tile=TILE,
                                     padded=True)
    meta = sonic.routing_metadata(r, backend="cute")
    valid = int(r.num_valid)
    assert valid < r.num_pairs, "the routing must have padding rows"
    return x, w1, w2, dout, r, meta, valid


@contextlib.contextmanager
def _poisoned(rows: int, cols: int):
    """Inside: every floating-point CUDA tensor made by ``torch.empty``, ``torch.empty_like`` or
    ``Tensor.new_empty`` (how the ops allocate their outputs) is filled with 0xFF bytes (NaN in
    bf16, fp32 and e4m3), so an element a kernel leaves unwritten reads as NaN rather than as a
    stale zero; checked on fresh ``(rows, cols)`` bf16 and ``(rows,)`` fp32 buffers, so the
    checks below can fail. (A memory pool filled beforehand did not poison every small
    allocation reliably.)"""
    real_empty, real_like, real_new = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda and t.is_floating_point() and t.numel():
            flat = t.view(-1) if t.is_contiguous() else None
            if flat is not None and flat.element_size() in (1, 2, 4, 8):
                flat.view(torch.uint8).fill_(255)
            else:
                t.fill_(float("nan"))
        return t

    with mock.patch.object(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k))), \
            mock.patch.object(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k))), \
            mock.patch.object(torch.Tensor, "new_empty",
                              lambda self, *a, **k: poison(real_new(self, *a, **k))):
        assert torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda").isnan().all()
        assert torch.empty(rows, dtype=torch.float32, device="cuda").isnan().all()
        assert torch.ones(1, device="cuda").new_empty(rows).isnan().all()
        yield


def _check(name: str, got: torch.Tensor, want: torch.Tensor, valid: int, tol: float) -> None:
    """Padding rows (dim 0; dim 1 of a ``(blocks, P)`` scale tensor) equal the reference's
    exactly, and are zeros (an e4m3 row's scales: the reference's 1.0 of an all-zero block);
    the routed rows of a bf16 / fp32 output are within ``tol`` relative error."""
    assert got.shape == want.shape, name
    scales = name.endswith("scales")
    if scales:
        got, want = got.t(), want.t()
    pad_got, pad_want = got[valid:].float(), want[valid:].float()
    assert torch.equal(pad_got, pad_want), (
        f"{name}: padding rows differ from the reference ({pad_got.isnan().sum().item()} NaN)")
    assert scales or pad_want.eq(0).all(), name
    if got.dtype in (torch.bfloat16, torch.float32):
        err = rel_err(got[:valid], want[:valid])
        assert err < tol, (name, err)


def _compare(steps: dict, rows: int, valid: int, names: dict | None = None) -> None:
    """Each step's outputs on the CuTe backend (from a poisoned pool) against the reference's
    (:func:`_check`); ``steps[name](backend)`` runs a step, ``names[name]`` names its
    outputs (by position otherwise)."""
    for step, run in steps.items():
        want = run("torch")
        with _poisoned(rows, 2 * N):
            got = run("cute")
            torch.cuda.synchronize()
            for i, (g, w) in enumerate(zip(got, want)):
                name = names[step][i] if names and step in names else f"[{i}]"
                _check(f"{step} {name}", g, w, valid, tol=2e-2)


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_bf16_expert_steps_fill_the_padding_rows(gate_up):
    """Up-proj + SwiGLU (H, A), the dH step (dH, A', ds: the fused kernel for "concat", the
    dA' GEMM and the one-pass epilogue for "interleaved"), the down-proj Y and the dX rows,
    each through its ``torch.ops.sonic`` op, CuTe against the reference."""
    require_kernels()
    x, w1, w2, dout, r, meta, valid = _problem()
    off, gidx, P = meta.expert_offsets, meta.gather_idx, r.num_pairs
    row_scores = r.scores.index_select(0, meta.sorted_pairs).float()
    ops = torch.ops.sonic
    h, a = ops.up_proj_swiglu(x, w1, off, gidx, gate_up, "torch")
    dh = ops.dh_dswiglu(dout, w2, off, gidx, h, row_scores, gate_up, "torch")[0]
    steps = {
        "up_proj_swiglu": lambda b: ops.up_proj_swiglu(x, w1, off, gidx, gate_up, b),
        "dh_dswiglu": lambda b: ops.dh_dswiglu(dout, w2, off, gidx, h, row_scores, gate_up, b),
        "down_proj": lambda b: (ops.grouped_mm(a, w2.transpose(1, 2), off, None, b),),
        "dx_rows": lambda b: (ops.grouped_mm(dh, w1, off, None, b),),
    }
    _compare(steps, P, valid)


def test_opcheck_on_padded_routing_with_the_cute_backend():
    """``torch.library.opcheck`` on the routing-metadata and up-proj ops, and on the expert op
    (schema, autograd registration, fake tensors), with the CuTe backend: its runs agree only
    if every output is a function of the inputs; the expert op's H has the reference's zero
    padding rows."""
    require_kernels()
    x, w1, w2, _, r, meta, valid = _problem()
    with _poisoned(r.num_pairs, 2 * N):
        torch.library.opcheck(torch.ops.sonic.routing_metadata.default,
                              (r.token_idx, r.expert_idx, T, E, 0, "cute"))
        torch.library.opcheck(torch.ops.sonic.up_proj_swiglu.default,
                              (x, w1, meta.expert_offsets, meta.gather_idx, "concat", "cute"))
    args = (x.requires_grad_(), w1.requires_grad_(), w2.requires_grad_(),
            r.scores.detach().requires_grad_(), meta.packed, 0, "concat", "cute")
    with _poisoned(r.num_pairs, 2 * N):
        # Not opcheck's AOT-dispatch test: it reads the op's H output after an eager backward,
        # which on the CuTe backend writes dH over H (the documented contract of the raw op;
        # the memory-minimal backward holds one P x 2n buffer). The forward's H is checked below.
        torch.library.opcheck(torch.ops.sonic.moe_experts.default, args,
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor"))
        _, h, _ = torch.ops.sonic.moe_experts(*args)
        assert h[valid:].eq(0).all() and h[:valid].ne(0).any()


@pytest.mark.parametrize("activation_cache", ["bf16", "fp8"])
def test_expert_op_cache_padding_is_the_references(activation_cache):
    """The expert op's activation cache (H, or its e4m3 copy and 1×128 scales) on a padded
    routing: the padding rows as the reference has them (zeros; an all-zero block's scale)."""
    require_kernels()
    x, w1, w2, _, r, meta, valid = _problem()
    args = (x, w1, w2, r.scores.detach(), meta.packed, 0, "concat")
    want = torch.ops.sonic.moe_experts(*args, "torch", activation_cache)
    with _poisoned(r.num_pairs, 2 * N):
        got = torch.ops.sonic.moe_experts(*args, "cute", activation_cache)
        torch.cuda.synchronize()
        _check("out", got[0], want[0], x.shape[0], tol=2e-2)
        _check("cache", got[1], want[1], valid, tol=2e-2)
        if activation_cache == "fp8":
            _check("cache scales", got[2], want[2], valid, tol=2e-2)


@pytest.mark.parametrize("epilogues", ["store", "quantizing", "fused"])
def test_fp8_expert_steps_fill_the_padding_rows(epilogues, fp8_kernels):
    """The FP8 ops with P rows under each ``set_fp8_epilogues`` choice (the store FP8 GEMM and
    the one-pass kernels, or the fused SwiGLU / dSwiGLU GEMMs): the dH step (dH, A', ds), the
    dX rows, and the FP8 expert op's e4m3 activation cache with its scales."""
    x, w1, w2, dout, r, meta, valid = _problem()
    off, gidx, P = meta.expert_offsets, meta.gather_idx, r.num_pairs
    row_scores = r.scores.index_select(0, meta.sorted_pairs).float()
    fp8_w = sonic.quantize_expert_weights(w1, w2, backend="cute")
    ops = torch.ops.sonic
    h = ops.up_proj_swiglu(x, w1, off, gidx, "concat", "torch")[0]
    do_q, do_scales = ops.quantize_rows(dout, "torch")
    dh = ops.dh_dswiglu(dout, w2, off, gidx, h, row_scores, "concat", "torch")[0]
    dh_q, dh_scales = ops.quantize_rows(dh, "torch")
    previous = set_fp8_epilogues(epilogues)
    try:
        steps = {
            "dh_dswiglu_fp8": lambda b: ops.dh_dswiglu_fp8(
                do_q, do_scales, fp8_w.w2t_q, fp8_w.w2t_scales, off, gidx, h, row_scores,
                "concat", b),
            "dx_rows_fp8": lambda b: (ops.grouped_mm_fp8(dh_q, dh_scales, fp8_w.w1t_q,
                                                         fp8_w.w1t_scales, off, None, b),),
            "moe_experts_fp8": lambda b: ops.moe_experts_fp8(
                x, w1, w2, r.scores.detach(), meta.packed, list(fp8_w), 0, "concat", b, "fp8",
                "bf16")[1:],
        }
        _compare(steps, P, valid, names={"moe_experts_fp8": ("cache", "cache scales")})
    finally:
        set_fp8_epilogues(previous)
