"""The router's scoring options on the CuTe backend against the torch backend.

    python -m pytest -m gpu tests/gpu/test_router_options_gpu.py

Sigmoid scores with an expert bias and groups run in the fused top-K kernel, softmax with a
bias or groups in torch on the GPU; both feed the CuTe metadata and expert kernels: pairs must
equal the CPU's exactly, the layer within bf16 rounding of the torch backend, and routing must
make no host read.
"""

import pytest
import torch

import sonic

pytestmark = pytest.mark.gpu

D, N, E, K = 256, 128, 64, 8
OPTIONS = {
    "sigmoid_groups_bias": dict(score="sigmoid", renormalize=True, routed_scaling_factor=2.5,
                                n_group=8, topk_group=4, bias_update_rate=1e-3),
    "softmax_groups": dict(score="topk_softmax", n_group=4, topk_group=2, expert_bias=True),
    "groups_of_one": dict(score="sigmoid", n_group=64, topk_group=16),
    "scaled_softmax": dict(routed_scaling_factor=1.5),
}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_routing_on_cuda_equals_cpu_and_reads_nothing_back(name):
    opts = dict(OPTIONS[name])
    opts.pop("bias_update_rate", None)
    opts.pop("expert_bias", None)
    opts["scaling_factor"] = opts.pop("routed_scaling_factor", 1.0)
    logits = torch.randn(4096, E, generator=torch.Generator().manual_seed(0))
    bias = 0.05 * torch.randn(E, generator=torch.Generator().manual_seed(1))
    cpu = sonic.topk_routing(logits, K, expert_bias=bias, backend="torch", **opts)
    # The host-to-device copies synchronise by themselves: made before the checked region.
    logits_gpu, bias_gpu = logits.cuda(), bias.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = sonic.topk_routing(logits_gpu, K, expert_bias=bias_gpu, backend="cute", **opts)
        meta = sonic.routing_metadata(gpu, backend="cute")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(gpu.expert_idx.cpu(), cpu.expert_idx)
    torch.testing.assert_close(gpu.scores.cpu(), cpu.scores, rtol=1e-6, atol=1e-7)
    ref = sonic.routing_metadata(cpu, backend="torch")
    assert torch.equal(meta.expert_offsets.cpu(), ref.expert_offsets)


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_layer_cute_matches_torch_backend(name, router):
    torch.manual_seed(0)
    layers = {b: sonic.MoE(D, N, E, K, router=router, tile=64, backend=b, device="cuda",
                           dtype=torch.bfloat16, aux_loss_coef=0.01, seq_aux_loss_coef=1e-3,
                           z_loss_coef=1e-3, **OPTIONS[name]) for b in ("cute", "torch")}
    layers["torch"].load_state_dict(layers["cute"].state_dict())
    if hasattr(layers["cute"], "expert_bias"):
        bias = 0.05 * torch.randn(E, device="cuda")
        for layer in layers.values():
            layer.expert_bias.copy_(bias)
    x = torch.randn(4, 512, D, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    results = {}
    for backend, layer in layers.items():
        xb = x.clone().requires_grad_()
        out, aux = layer(xb, return_aux_loss=True)
        grads = torch.autograd.grad((out.float() * dout).sum() + aux,
                                    [xb, layer.gate.weight, layer.w1, layer.w2])
        results[backend] = (out, aux, grads, layer.last_routing)
    (out_c, aux_c, g_c, r_c), (out_t, aux_t, g_t, r_t) = results["cute"], results["torch"]
    assert torch.equal(r_c.expert_idx, r_t.expert_idx)
    assert _rel(out_c, out_t) < 1e-2
    assert _rel(aux_c, aux_t) < 1e-3
    for a, b in zip(g_c, g_t):
        assert _rel(a, b) < 2e-2
    if layers["cute"].bias_update_rate:
        torch.testing.assert_close(layers["cute"].tokens_per_expert,
                                   layers["torch"].tokens_per_expert)


@pytest.mark.parametrize("activation", ["geglu", "relu2"])
def test_activation_and_shared_experts_on_cuda_match_cpu(activation):
    """Non-SwiGLU activations and SwiGLU shared experts on the GPU (fp32) against the CPU."""
    kw = dict(activation=activation, num_shared_experts=1, shared_expert_gate=True,
              score="sigmoid", n_group=8, topk_group=4)
    torch.manual_seed(0)
    cpu = sonic.MoE(D, N, E, K, backend="torch", **kw)
    gpu = sonic.MoE(D, N, E, K, backend="auto", device="cuda", **kw)
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 256, D)
    out_c = cpu(x.requires_grad_())
    out_c.square().mean().backward()
    xg = x.detach().cuda().requires_grad_()
    out_g = gpu(xg)
    out_g.square().mean().backward()
    assert _rel(out_g.cpu(), out_c) < 1e-3
    assert _rel(xg.grad.cpu(), x.grad) < 1e-3
    for (name, p), q in zip(gpu.named_parameters(), cpu.parameters()):
        assert _rel(p.grad.cpu(), q.grad) < 1e-3, name


def test_shared_swiglu_expert_cute_matches_torch_bf16():
    torch.manual_seed(0)
    layers = {b: sonic.MoE(D, N, E, K, backend=b, num_shared_experts=2, device="cuda",
                           dtype=torch.bfloat16) for b in ("cute", "torch")}
    layers["torch"].load_state_dict(layers["cute"].state_dict())
    x = torch.randn(2048, D, device="cuda", dtype=torch.bfloat16)
    outs = {b: layer(x) for b, layer in layers.items()}
    assert _rel(outs["cute"], outs["torch"]) < 1e-2
