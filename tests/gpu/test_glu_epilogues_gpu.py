"""The fused up-proj and dH epilogues of the GLU variants other than SwiGLU (GeGLU, its tanh
form, ReGLU), against the reference activations; and the layer with each activation on the CuTe
backend against the torch backend."""

import pytest
import torch

import sonic
from kernel_checks import (dh_problem, poison_allocator, ref_varlen_m, rel_err,
                           require_kernels, up_proj_problem)
from sonic.reference import activations

pytestmark = pytest.mark.gpu

GLU_VARIANTS = ["geglu", "geglu_tanh", "reglu"]


@pytest.fixture(autouse=True)
def _needs_kernels():
    require_kernels()


CASES = [(1, 1, 128, 64, "ragged"), (3001, 16, 256, 1536, "empty"),
         (1000, 8, 64, 136, "ragged"), (2000, 4, 1024, 512, "one")]


@pytest.mark.parametrize("activation", GLU_VARIANTS)
@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
@pytest.mark.parametrize("num_pairs,num_experts,n,dim_k,mode", CASES)
def test_up_proj_epilogue(num_pairs, num_experts, n, dim_k, mode, gate_up, activation):
    from sonic.kernels.grouped_gemm import grouped_gemm_swiglu

    offsets, w1, x, idx, expected_h = up_proj_problem(num_pairs, num_experts, n, dim_k, mode,
                                                      num_pairs + n + dim_k)
    poison_allocator(512 << 20)
    h, a = grouped_gemm_swiglu(x, w1, offsets, idx, gate_up, activation=activation)
    assert h.shape == (num_pairs, 2 * n) and a.shape == (num_pairs, n)
    assert not h.isnan().any() and not a.isnan().any()
    assert rel_err(h, expected_h) < 1e-2
    # A from the stored bf16 H, as the backward recomputes it: the reference's fp32 math on
    # the same H, up to the rounding of A and the device's erf / tanh.
    on_h = activations.activate(h.float(), activation, gate_up)
    assert rel_err(a, on_h) < 4e-3
    swiglu = grouped_gemm_swiglu(x, w1, offsets, idx, gate_up)[1]
    if num_pairs > 1:
        assert not torch.equal(a, swiglu)        # the activation reached the epilogue


@pytest.mark.parametrize("activation", GLU_VARIANTS)
@pytest.mark.parametrize("num_pairs,num_experts,n,dim_k,mode", [
    (1, 1, 64, 64, "ragged"), (3001, 16, 256, 1536, "empty"), (1000, 8, 200, 136, "ragged"),
    (4097, 128, 1096, 256, "ragged")])
def test_dh_epilogue(num_pairs, num_experts, n, dim_k, mode, activation):
    from sonic.kernels.grouped_gemm import grouped_gemm_dswiglu

    offsets, w2, dout, idx, h, scores = dh_problem(num_pairs, num_experts, n, dim_k, mode,
                                                   num_pairs + n + dim_k + 1)
    da_prime = ref_varlen_m(dout[idx.long()], w2.transpose(1, 2), offsets)
    ref_dh, ref_a, ref_ds = activations.activation_backward(da_prime, h.float(), scores,
                                                            activation)
    poison_allocator(512 << 20)
    dh, a_scaled, ds = grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores,
                                            activation=activation)
    assert dh.shape == (num_pairs, 2 * n) and a_scaled.shape == (num_pairs, n)
    for out, expected in ((dh, ref_dh), (a_scaled, ref_a), (ds, ref_ds)):
        assert not out.isnan().any()
        assert rel_err(out, expected.float()) < 2e-2
    in_place = grouped_gemm_dswiglu(dout, w2, offsets, idx, h, scores, dh_out=h,
                                    activation=activation)
    assert in_place[0].data_ptr() == h.data_ptr()
    assert all(torch.equal(x, y) for x, y in zip(in_place, (dh, a_scaled, ds)))


@pytest.mark.parametrize("activation", GLU_VARIANTS + ["relu2", "gelu"])
def test_layer_cute_matches_torch(activation):
    """``sonic.MoE(activation=...)`` on the CuTe kernels against the same layer on the torch
    backend: output and every gradient."""
    torch.manual_seed(7)
    layer = sonic.MoE(512, 256, 16, 4, activation=activation, backend="cute",
                      device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for backend in ("cute", "torch"):
        layer.backend = backend
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        out.backward(dout)
        results.append([out, x.grad, layer.w1.grad, layer.w2.grad, layer.gate.weight.grad])
    for got, expected in zip(*results):
        assert got is not None and not got.float().isnan().any()
        assert rel_err(got, expected.float()) < 2e-2
