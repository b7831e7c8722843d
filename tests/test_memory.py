"""Activation-memory profiler, the torch-gmm baseline and ``python -m sonic.memory``."""

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from sonic.baselines import torch_gmm_moe
from sonic.memory import profile_activation_memory
from sonic.baselines.configs import CONFIGS, parse_config
from sonic.memory.__main__ import main

MiB = float(1 << 20)


def nbytes(t):
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------- profiler


def test_mul_keeps_both_inputs():
    x = torch.randn(100, requires_grad=True)
    y = torch.randn(100, dtype=torch.float64, requires_grad=True)
    report = profile_activation_memory(lambda a, b: a * b, x, y)
    assert report.activation_bytes == 0
    assert report.input_bytes == nbytes(x) + nbytes(y)
    assert sorted(s.nbytes for s in report.saved) == [nbytes(x), nbytes(y)]
    assert all(s.kind == "input" and s.nodes == ("MulBackward0",) for s in report.saved)
    assert report.peak_bytes is None


class ExpLinear(torch.nn.Module):
    """``exp(x·W)``: matmul saves x and W (inputs), exp saves its output (a new activation)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d_in, d_out))

    def forward(self, x):
        return torch.exp(x @ self.w)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_module_activation_of_known_size(device):
    layer = ExpLinear(24, 40).to(device)
    x = torch.randn(7, 24, device=device)
    report = profile_activation_memory(layer, x)
    assert report.activation_bytes == 7 * 40 * 4
    # x does not require grad, so the matmul keeps only x (for dW), not W.
    assert report.input_bytes == nbytes(x)
    (act,) = [s for s in report.saved if s.kind == "activation"]
    assert act.shape == (7, 40) and act.dtype == torch.float32 and act.nodes == ("ExpBackward0",)
    assert report.saved[0].nbytes >= report.saved[-1].nbytes


def test_views_of_one_storage_count_once():
    x = torch.randn(6, 8, requires_grad=True)

    def fn(a):
        h = a.exp()  # h is saved by exp, then again through two views by mul
        return (a[:, :4] * a[:, 4:]).sum() + (h[:, :3] * h[:, 3:6]).sum()

    report = profile_activation_memory(fn, x)
    assert [s.kind for s in report.saved].count("input") == 1
    assert [s.kind for s in report.saved].count("activation") == 1
    assert report.input_bytes == nbytes(x)
    assert report.activation_bytes == 6 * 8 * 4
    (act,) = [s for s in report.saved if s.kind == "activation"]
    assert set(act.nodes) == {"ExpBackward0", "MulBackward0"}


def test_saved_slice_charges_its_whole_storage():
    x = torch.randn(10, 50, requires_grad=True)
    report = profile_activation_memory(lambda a: a.exp()[:, :5].sin(), x)
    # sin saves a (10, 5) view of exp's (10, 50) output: the whole buffer stays allocated.
    assert report.activation_bytes == 10 * 50 * 4


def test_inputs_found_inside_containers_and_kwargs():
    @dataclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor

    x, y, z = (torch.randn(5, requires_grad=True) for _ in range(3))
    report = profile_activation_memory(lambda p, ts, *, w: p.a * p.b * ts[0] * w["z"],
                                       Pair(x, y), [z], w={"z": z})
    input_storages = {s.nbytes for s in report.saved if s.kind == "input"}
    assert report.input_bytes == 3 * nbytes(x) and input_storages == {nbytes(x)}
    assert report.activation_bytes == 2 * nbytes(x)  # the products x*y and x*y*z


def test_tensors_dropped_before_return_are_not_counted():
    x = torch.randn(1000, requires_grad=True)

    def fn(a):
        a.exp().mul(2)  # graph discarded: exp's saved output is freed before the call returns
        return a.sin()

    report = profile_activation_memory(fn, x)
    assert report.activation_bytes == 0 and report.input_bytes == nbytes(x)


def test_nothing_saved_without_grad():
    x = torch.randn(4, 4)
    report = profile_activation_memory(lambda a: a.exp() * a, x)
    assert report.saved == () and report.activation_bytes == 0 and report.input_bytes == 0


def test_output_supports_backward_and_double_backward():
    x = torch.randn(9, dtype=torch.float64, requires_grad=True)

    def fn(a):
        return (a.sigmoid() * a).exp().sum()

    report = profile_activation_memory(fn, x)
    (g,) = torch.autograd.grad(report.output, x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (g_ref,) = torch.autograd.grad(fn(x), x, create_graph=True)
    (gg_ref,) = torch.autograd.grad(g_ref.sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
    torch.testing.assert_close(gg, gg_ref, rtol=0, atol=0)


def test_report_str_and_dict():
    layer = ExpLinear(16, 32)
    report = profile_activation_memory(layer, torch.randn(3, 16, requires_grad=True))
    text = str(report)
    assert "activation" in text and "MiB" in text and "ExpBackward0" in text
    assert "1 more" in report.format(max_rows=2)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["activation_bytes"] == report.activation_bytes
    assert d["activation_MiB"] == pytest.approx(3 * 32 * 4 / MiB)
    assert {s["kind"] for s in d["saved"]} == {"input", "activation"}
    assert d["saved"][0]["dtype"] == "float32"


@pytest.mark.gpu
def test_cuda_peak_and_allocator_agree():
    x = torch.randn(256, 128, device="cuda", requires_grad=True)
    w = torch.randn(128, 512, device="cuda", requires_grad=True)
    (x @ w).sum().backward()  # cuBLAS allocates its workspace on first use: not the profiled call
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    report = profile_activation_memory(lambda a, b: (a @ b).exp().sum(-1), x, w)
    kept = torch.cuda.memory_allocated() - before - nbytes(report.output)
    assert report.activation_bytes == kept == 256 * 512 * 4
    # the matmul result and the exp result are alive together at the peak
    assert report.peak_bytes >= 2 * 256 * 512 * 4


def test_profiler_rejects_non_callable():
    with pytest.raises(TypeError, match="fn_or_module"):
        profile_activation_memory(torch.randn(3), torch.randn(3))


# ---------------------------------------------------------------------------- torch-gmm


def naive_moe(x, router_weight, w1, w2, k, score="softmax_topk", experts=None):
    """Per token and per chosen expert, straight from docs/design.md §1 (no sort, no grouped GEMM).

    ``experts (T, k)`` overrides the top-K choice, so a high-precision reference can route
    exactly like a bf16 run (bf16 rounding flips near-tied experts otherwise).
    """
    n = w2.shape[2]
    logits = x @ router_weight.t()
    if experts is None:
        experts = logits.topk(k, dim=-1).indices
    if score == "softmax_topk":
        scores = torch.softmax(logits.gather(1, experts).float(), dim=-1)
    else:
        scores = torch.softmax(logits.float(), dim=-1).gather(1, experts)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(k):
            e = experts[t, j]
            h = w1[e] @ x[t]
            acc = acc + scores[t, j].to(x.dtype) * (w2[e] @ (F.silu(h[:n]) * h[n:]))
        rows.append(acc)
    return torch.stack(rows)


def moe_inputs(T, d, n, E, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
        return t.to(device).requires_grad_()

    return (rand(T, d), rand(E, d, scale=d ** -0.5), rand(E, 2 * n, d, scale=d ** -0.5),
            rand(E, d, n, scale=n ** -0.5))


def grads(fn, inputs, k, **kw):
    out = fn(*inputs, k, **kw)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grad_out = grad_out.to(device=out.device, dtype=out.dtype)
    return (out, *torch.autograd.grad(out, inputs, grad_out))


@pytest.mark.parametrize("dtype, d, n", [
    (torch.float32, 32, 16),   # torch._grouped_mm on CPU
    (torch.float64, 32, 16),   # per-expert loop: _grouped_mm takes no float64
    (torch.float32, 6, 2),     # per-expert loop: rows not 16-byte aligned
])
@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax"])
def test_torch_gmm_matches_naive_loop(dtype, d, n, score):
    inputs = moe_inputs(T=24, d=d, n=n, E=6, dtype=dtype)
    x_before = inputs[0].detach().clone()
    got = grads(torch_gmm_moe, inputs, 2, score=score)
    ref = grads(naive_moe, inputs, 2, score=score)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for name, a, b in zip(("out", "dx", "drouter", "dw1", "dw2"), got, ref):
        assert a.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    assert torch.equal(inputs[0].detach(), x_before)


def test_torch_gmm_empty_experts_and_k_equals_e():
    # 3 tokens, 8 experts, K=1: at least 5 experts get no rows.
    inputs = moe_inputs(T=3, d=8, n=4, E=8)
    for k in (1, 8):
        for a, b in zip(grads(torch_gmm_moe, inputs, k), grads(naive_moe, inputs, k)):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_bf16_against_fp64(device):
    inputs = moe_inputs(T=256, d=64, n=32, E=8, dtype=torch.bfloat16, device=device)
    got = grads(torch_gmm_moe, inputs, 2)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    experts = (inputs[0] @ inputs[1].t()).topk(2, dim=-1).indices
    ref = grads(lambda *a: naive_moe(*a, experts=experts), ref_inputs, 2)
    for name, a, b in zip(("out", "dx", "drouter", "dw1", "dw2"), got, ref):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) < 2e-2, (name, rel_err(a, b))


def test_torch_gmm_bf16_close_to_fp64():
    check_bf16_against_fp64("cpu")


@pytest.mark.gpu
def test_torch_gmm_cuda_bf16_close_to_fp64():
    check_bf16_against_fp64("cuda")


def test_torch_gmm_runs_on_meta():
    inputs = moe_inputs(T=64, d=32, n=16, E=8, dtype=torch.bfloat16, device="meta")
    out = torch_gmm_moe(*inputs, 2)
    assert out.shape == (64, 32) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    with pytest.raises(ValueError, match="meta tensors need torch._grouped_mm"):
        torch_gmm_moe(*moe_inputs(T=8, d=32, n=16, E=4, device="meta"), 2)


def test_torch_gmm_rejects_bad_arguments():
    x, wr, w1, w2 = moe_inputs(T=8, d=16, n=8, E=4)
    with pytest.raises(ValueError, match="x must be"):
        torch_gmm_moe(x[0], wr, w1, w2, 2)
    with pytest.raises(ValueError, match="router_weight"):
        torch_gmm_moe(x, wr[:, :3], w1, w2, 2)
    with pytest.raises(ValueError, match="w1"):
        torch_gmm_moe(x, wr, w1[:, :3], w2, 2)
    with pytest.raises(ValueError, match="w2"):
        torch_gmm_moe(x, wr, w1, w2[:, :, :3], 2)
    with pytest.raises(ValueError, match="k must be"):
        torch_gmm_moe(x, wr, w1, w2, 5)
    with pytest.raises(TypeError, match="k must be an int"):
        torch_gmm_moe(x, wr, w1, w2, 2.0)
    with pytest.raises(ValueError, match="score"):
        torch_gmm_moe(x, wr, w1, w2, 2, score="sigmoid")
    with pytest.raises(TypeError, match="w2 must match"):
        torch_gmm_moe(x, wr, w1, w2.double(), 2)
    with pytest.raises(TypeError, match="router_weight must be a torch.Tensor"):
        torch_gmm_moe(x, None, w1, w2, 2)


# ------------------------------------------------------------------------------------ CLI


def run_cli(capsys, *argv):
    assert main(list(argv)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_cli_tiny_config_subprocess():
    proc = subprocess.run([sys.executable, "-m", "sonic.memory", "--config", "64,32,16,8,2",
                           "--json"], capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"config", "T", "d", "n", "E", "K", "sonic_MiB", "torch_MiB"}
    assert (result["T"], result["d"], result["n"], result["E"], result["K"]) == (64, 32, 16, 8, 2)
    assert 0 < result["sonic_MiB"] < result["torch_MiB"]


def test_cli_tiny_config_on_cpu_matches_meta(capsys):
    _, on_meta = run_cli(capsys, "--config", "64,32,16,8,2", "--json")
    _, on_cpu = run_cli(capsys, "--config", "64,32,16,8,2", "--json", "--device", "cpu")
    assert on_cpu == on_meta


def test_cli_7b_matches_analytic_floor(capsys):
    lines, result = run_cli(capsys, "--config", "7B", "--json")
    T, d, n, E, K = CONFIGS["7B"]
    P = T * K
    h_mib = P * 2 * n * 2 / MiB
    # O(P) metadata (docs/design.md §3): 4 int32 index vectors + fp32 scores per pair, and the router's
    # (T, K) int64 top-K indices for the score gradient.
    analytic = h_mib + P * (4 * 4 + 4 + 8) / MiB
    assert result["config"] == "7B" and h_mib == 192
    assert result["sonic_MiB"] == pytest.approx(analytic, rel=0.03)
    assert result["torch_MiB"] > 1536
    assert any("sonic_moe_experts" in line for line in lines)


@pytest.mark.parametrize("text, expected", [
    ("7B", ("7B", (24576, 1536, 256, 128, 8))),
    ("olmoe", ("OLMoE", (32768, 2048, 1024, 64, 8))),
    ("4,8,8,4,4", ("4,8,8,4,4", (4, 8, 8, 4, 4))),
])
def test_parse_config(text, expected):
    assert parse_config(text) == expected


@pytest.mark.parametrize("bad", ["8B", "1,2,3,4", "64,32,16,8,x", "64,32,16,8,0", "64,32,16,2,4"])
def test_cli_bad_config(capsys, bad):
    with pytest.raises(SystemExit) as exc:
        main(["--config", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--config" in err and ("DeepSeek-V3, Qwen3-235B, GLM-4.5, Mixtral-8x7B or five "
                                  "positive integers" in err or "K must be <= E" in err)


def test_cli_rejects_unaligned_sizes_on_meta(capsys):
    with pytest.raises(SystemExit):
        main(["--config", "64,6,4,8,2"])
    assert "multiples of 8" in capsys.readouterr().err
