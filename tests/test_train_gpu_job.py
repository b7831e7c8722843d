"""The main job's GPU-facing parts on the CPU: presets, FLOPs and MFU, the torch-gmm
comparison in one process, the plot."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sonic
from sonic.train.loop import (PRESETS, TrainConfig, flops_per_token, moe_flops_share,
                              preset_config, train)
from sonic.train.model import TorchGmmMoE, switch_load_balancing_loss

REPO = Path(__file__).resolve().parents[1]
TINY = ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--d-model", "32", "--layers",
        "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--d-expert", "16",
        "--eval-batches", "1", "--eval-every", "2", "--device", "cpu", "--no-progress",
        "--log-level", "warning"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sonic.train", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_presets():
    assert preset_config("cpu") == TrainConfig()
    gpu = preset_config("gpu", steps=7)
    assert gpu.steps == 7 and (gpu.d_model, gpu.layers, gpu.experts, gpu.top_k,
                               gpu.d_expert) == (1024, 8, 64, 8, 1024)
    assert 1024 <= gpu.d_model <= 2048 and 8 <= gpu.layers <= 16 and 512 <= gpu.d_expert <= 1024
    assert moe_flops_share(gpu) > 0.8 > moe_flops_share(TrainConfig())
    with pytest.raises(ValueError, match="preset: expected one of"):
        preset_config("tpu")
    assert set(PRESETS) == {"cpu", "gpu"}


def test_flops_per_token_by_hand():
    c = TrainConfig(d_model=64, layers=3, heads=4, experts=8, top_k=2, d_expert=32, seq_len=16)
    moe = 3 * (2 * 64 * 2 * 32 + 2 * 32 * 64) * 2            # fwd+bwd = 3x fwd, per pair
    router = 3 * 2 * 64 * 8
    attn_proj = 3 * (2 * 64 * 3 * 64 + 2 * 64 * 64)
    attn_scores = 3 * 2 * (2 * 16 * 64) // 2                 # QK^T and AV, causal half
    head = 3 * 2 * 64 * 256
    assert flops_per_token(c) == 3 * (moe + router + attn_proj + attn_scores) + head
    assert moe_flops_share(c) == pytest.approx(3 * 18 * 2 * 64 * 32 / flops_per_token(c))


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_gmm_layer_equals_sonic(seed):
    torch.manual_seed(seed)
    moe = sonic.MoE(24, 16, 6, 2, aux_loss_coef=0.01, backend="torch", dtype=torch.float64)
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    with sonic.collect_aux_losses(moe) as aux:
        ref = moe(x)
    baseline = TorchGmmMoE(moe)
    out = baseline(x)
    torch.testing.assert_close(out, ref)
    (got_aux,) = baseline.aux_losses
    torch.testing.assert_close(got_aux, aux[0])
    grads = torch.autograd.grad((out.square().sum() + got_aux), [x, moe.w1, moe.gate.weight])
    refs = torch.autograd.grad((ref.square().sum() + aux[0]), [x, moe.w1, moe.gate.weight])
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r)
    baseline.eval()
    baseline(x)
    assert len(baseline.aux_losses) == 1   # eval mode adds no aux loss


@pytest.mark.parametrize("T, E, k", [(37, 8, 2), (1, 4, 4), (64, 16, 1)])
def test_switch_load_balancing_loss_equals_sonic(T, E, k):
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    ref = sonic.load_balancing_loss(logits, sonic.topk_routing(logits, k))
    got = switch_load_balancing_loss(logits, k)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(torch.autograd.grad(got, logits)[0],
                               torch.autograd.grad(ref, logits)[0])


def test_torch_gmm_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="experts_impl: torch-gmm trains top-K"):
        TrainConfig(experts_impl="torch-gmm", router="token_rounding")
    with pytest.raises(ValueError, match="experts_impl: expected one of"):
        TrainConfig(experts_impl="megablocks")
    with pytest.raises(ValueError, match="torch-gmm runs top-K"):
        TorchGmmMoE(sonic.MoE(8, 4, 4, 2, router="token_rounding"))


def test_compare_trains_the_same_model(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "run.png"
    proc = run_cli(*TINY, "--compare", "torch-gmm", "--plot", str(plot), "--json",
                   "--peak-tflops", "0.001")
    assert proc.returncode == 0, proc.stderr
    both = json.loads(proc.stdout.strip().splitlines()[-1])
    sonic_run, gmm = both["sonic"], both["torch-gmm"]
    assert (sonic_run["experts_impl"], gmm["experts_impl"]) == ("sonic", "torch-gmm")
    assert {k: v for k, v in sonic_run["config"].items() if k != "experts_impl"} == \
        {k: v for k, v in gmm["config"].items() if k != "experts_impl"}
    # Same parameters, data and routing in fp32: the losses agree to rounding.
    assert sonic_run["losses"] == pytest.approx(gmm["losses"], rel=1e-4)
    assert [s for s, _ in sonic_run["val_history"]] == [0, 2, 4]
    for run in (sonic_run, gmm):
        assert run["mfu"] == pytest.approx(run["tokens_per_s"] * run["flops_per_token"] / 1e9)
        assert len(run["tokens_per_s_history"]) == 4 and run["peak_memory_MiB"] is None
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_prints_side_by_side():
    proc = run_cli(*TINY, "--compare", "torch-gmm")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["sonic", "torch-gmm"])
    table = lines[header:]
    labels = ["tokens/s", "speed vs torch-gmm", "MFU", "peak memory MiB",
              "activation MiB per MoE layer", "val loss at step 4", "train loss at step 4"]
    for label in labels:
        assert any(line.startswith(label) and len(line[28:].split()) == 2 for line in table), label
    assert "MFU n/a" in proc.stdout   # no known peak on a CPU


@pytest.mark.parametrize("args, message", [
    (["--router", "token_rounding"], "experts_impl: torch-gmm trains top-K"),
    (["--save", "c.pt"], "--compare: not with --save"),
    (["--log-jsonl", "log.jsonl"], "--compare: not with --log-jsonl"),
    (["--plot", "no/such/folder/p.png"], "does not exist"),
    (["--plot", "p.xyz"], "cannot write '.xyz' images"),
])
def test_compare_and_plot_errors_before_training(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "sonic.train", *TINY, "--compare", "torch-gmm",
                           *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


def test_plot_of_one_resumed_run(tmp_path):
    pytest.importorskip("matplotlib")
    from sonic.train.report import plot_runs

    config = TrainConfig(steps=4, batch_size=2, seq_len=16, d_model=32, layers=1, heads=2,
                         experts=4, top_k=2, d_expert=16, tile=4, eval_batches=1, eval_every=2,
                         device="cpu")
    train(config, progress=False, save=str(tmp_path / "c.pt"), stop_after=2)
    resumed = train(config, progress=False, resume=str(tmp_path / "c.pt"))
    assert len(resumed["tokens_per_s_history"]) == 2 and len(resumed["losses"]) == 4
    plot_runs({"sonic": resumed}, tmp_path / "r.svg")
    assert b"<svg" in (tmp_path / "r.svg").read_bytes()[:500]


def test_preset_auto_is_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: auto picks gpu")
    proc = run_cli(*TINY, "--json")
    assert json.loads(proc.stdout.strip().splitlines()[-1])["config"]["d_model"] == 32
    from sonic.train.__main__ import build_parser

    args = build_parser().parse_args([])
    assert args.preset == "auto" and args.d_model is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_preset_compare_speedup(tmp_path):
    """The main job on a GPU: the gpu preset against torch-gmm in one process runs both to
    finite losses on the CuTe backend and draws the plot; it prints tokens/s, MFU and peak
    memory of both (the speed-up itself is a measurement: docs/performance.md)."""
    proc = run_cli("--steps", "60", "--eval-every", "0", "--eval-batches", "2", "--no-progress",
                   "--compare", "torch-gmm", "--json", "--plot", str(tmp_path / "gpu.png"))
    assert proc.returncode == 0, proc.stderr
    both = json.loads(proc.stdout.strip().splitlines()[-1])
    s, g = both["sonic"], both["torch-gmm"]
    print(f"tokens/s sonic {s['tokens_per_s']:.0f} torch-gmm {g['tokens_per_s']:.0f} "
          f"({s['tokens_per_s'] / g['tokens_per_s']:.2f}x), MFU {s['mfu']} / {g['mfu']}, "
          f"peak MiB {s['peak_memory_MiB']:.0f} / {g['peak_memory_MiB']:.0f}")
    assert s["config"]["d_model"] == 1024 and s["backend"].startswith("cute")
    assert all(math.isfinite(v) for v in s["losses"] + g["losses"])
    assert (tmp_path / "gpu.png").stat().st_size > 1000
