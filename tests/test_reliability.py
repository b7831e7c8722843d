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
