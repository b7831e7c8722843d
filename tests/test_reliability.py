"""Issue 15: no silent wrong answers (higher-order gradients, copies, degenerate sizes, settings
that mean nothing, confusing errors)."""

import copy
import io
import pickle

import pytest
import torch

import sonic

from _reference import naive_moe, random_problem


# ----------------------------------------------- 1. higher-order gradients: exact or an error

def _experts_leaves(dtype=torch.float32):
    x, w1, w2, s, tok, exp = random_problem(9, 8, 4, 4, K=2, dtype=dtype, seed=11)
    return [t.requires_grad_() for t in (x, w1, w2, s)], tok, exp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wrt", [0, 1, 2, 3])
def test_moe_experts_create_graph_raises(dtype, wrt):
    """A gradient penalty / Hessian-vector product through the hand-written backward must fail
    loudly rather than return a gradient of the wrong graph."""
    leaves, tok, exp = _experts_leaves(dtype)
    out = sonic.moe_experts(*leaves, tok, exp, backend="torch")
    with pytest.raises(RuntimeError, match="not twice differentiable.*create_graph"):
        torch.autograd.grad(out.square().sum(), leaves[wrt], create_graph=True)


def test_moe_layer_gradient_penalty_raises():
    layer = sonic.MoE(8, 4, 4, 2, backend="torch")
    x = torch.randn(6, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)


def test_moe_experts_first_order_unaffected_by_the_guard():
    leaves, tok, exp = _experts_leaves(torch.float64)
    ref = [t.detach().clone().requires_grad_() for t in leaves]
    grads = torch.autograd.grad(sonic.moe_experts(*leaves, tok, exp, backend="torch").sum(), leaves)
    expect = torch.autograd.grad(naive_moe(*ref, tok, exp).sum(), ref)
    for a, b in zip(grads, expect):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("score,renormalize", [("softmax_topk", False), ("topk_softmax", False),
                                               ("topk_softmax", True)])
def test_topk_router_double_backward_is_exact(score, renormalize):
    logits = torch.randn(7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits.requires_grad_()

    def fn(logits):
        return sonic.topk_routing(logits, 3, score=score, renormalize=renormalize,
                                  backend="torch").scores

    assert torch.autograd.gradgradcheck(fn, (logits,))


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_token_rounding_double_backward_is_exact(rounding):
    logits = torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits.requires_grad_()

    def fn(logits):
        return sonic.token_rounding_routing(logits, 2, tile=4, rounding=rounding,
                                            backend="torch").scores

    assert torch.autograd.gradgradcheck(fn, (logits,))


# --------------------------------------------- 3. every size the constructor accepts runs

# (T, d, n, E, K): d = 1, n = 1, E = 1, K = E, T = 1, T = 0, odd sizes, a lone aligned size.
SIZES = [(7, 1, 4, 4, 2), (7, 8, 1, 4, 2), (7, 8, 4, 1, 1), (7, 8, 4, 3, 3), (1, 8, 4, 4, 2),
         (0, 8, 4, 4, 2), (9, 3, 5, 4, 2), (5, 1, 1, 1, 1)]
TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "T{}-d{}-n{}-E{}-K{}".format(*s))
def test_degenerate_sizes_forward_backward(size, dtype):
    T, d, n, E, K = size
    x, w1, w2, s, tok, exp = random_problem(T, d, n, E, K=K, dtype=torch.float64, seed=12)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w1, w2, s)]
    leaves = [t.to(dtype).requires_grad_() for t in (x, w1, w2)] + [s.clone().requires_grad_()]
    out = sonic.moe_experts(*leaves, tok, exp)
    ref = naive_moe(*ref_leaves, tok, exp)
    assert out.shape == (T, d) and out.dtype == dtype
    grad = torch.randn(T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out.backward(grad.to(dtype))
    if T == 0:
        assert [t.grad.shape for t in leaves] == [t.shape for t in leaves]
        assert all(t.grad.abs().sum() == 0 for t in leaves)
        return
    ref.backward(grad)
    assert _rel(out, ref) < TOL[dtype]
    for mine, theirs in zip(leaves, ref_leaves):
        assert _rel(mine.grad, theirs.grad) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dims", [(1, 4, 4, 2), (8, 1, 4, 2), (3, 5, 4, 4), (8, 4, 1, 1)])
def test_degenerate_layer_trains(dims, dtype):
    layer = sonic.MoE(*dims, aux_loss_coef=0.01, dtype=dtype)
    x = torch.randn(2, 5, dims[0], dtype=dtype, requires_grad=True)
    out = layer(x)
    (out.float().sum() + layer.aux_loss).backward()
    assert out.shape == x.shape and torch.isfinite(out.float()).all()
    assert all(torch.isfinite(p.grad.float()).all() for p in layer.parameters())


@pytest.mark.parametrize("config", ["8,8,1,4,2", "8,1,4,4,2", "5,3,5,3,3"])
def test_memory_cli_degenerate_config_on_cpu(config, capsys):
    from sonic.memory.__main__ import main

    assert main(["--config", config, "--device", "cpu"]) == 0
    assert "torch-gmm / sonic" in capsys.readouterr().out


def test_train_cli_d_expert_1():
    import subprocess
    import sys
    from pathlib import Path

    args = ["--steps", "1", "--batch-size", "2", "--seq-len", "8", "--d-model", "8", "--layers",
            "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--d-expert", "1", "--tile",
            "4", "--eval-batches", "1", "--device", "cpu", "--no-progress"]
    proc = subprocess.run([sys.executable, "-m", "sonic.train", *args], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert "val loss" in proc.stdout
