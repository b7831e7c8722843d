"""Every bad input gets a clear error naming the argument."""

import pytest
import torch

import sonic

from _reference import random_problem


@pytest.fixture
def problem():
    return random_problem(10, 8, 4, 3, K=2, seed=0)


def _call(x, w1, w2, s, tok, exp, **kw):
    return sonic.moe_experts(x, w1, w2, s, tok, exp, backend="torch", **kw)


@pytest.mark.parametrize("index,replace,error,match", [
    (0, lambda t: t.numpy(), TypeError, "x must be a torch.Tensor"),
    (0, lambda t: t[None], ValueError, "x must be 2-D"),
    (0, lambda t: t.long(), TypeError, "x must have dtype"),
    (1, lambda t: t[:, :, :4].contiguous(), ValueError, "w1 must have shape"),
    (1, lambda t: t[:, :7], ValueError, "w1 must have shape"),
    (1, lambda t: t.double(), TypeError, "w1 must have x's dtype"),
    (2, lambda t: t[:, :, :3], ValueError, "w2 must have shape"),
    (3, lambda t: t[:-1], ValueError, "token_idx must have shape"),
    (3, lambda t: t[:, None], ValueError, "scores must be 1-D"),
    (4, lambda t: t.float(), TypeError, "token_idx must have dtype"),
    (4, lambda t: t + 10, ValueError, r"token_idx values must be in \[0, 10\)"),
    (4, lambda t: t - 1, ValueError, r"token_idx values must be in \[0, 10\)"),
    (5, lambda t: t + 3, ValueError, r"expert_idx values must be in \[0, 3\)"),
    (5, lambda t: t.to("meta"), ValueError, "expert_idx is on meta"),
])
def test_moe_experts_bad_input(problem, index, replace, error, match):
    args = list(problem)
    args[index] = replace(args[index])
    with pytest.raises(error, match=match):
        _call(*args)


def test_moe_experts_bad_options(problem):
    with pytest.raises(ValueError, match="gate_up must be one of"):
        _call(*problem, gate_up="split")
    with pytest.raises(ValueError, match="backend must be one of"):
        sonic.moe_experts(*problem, backend="triton")


@pytest.mark.parametrize("router", [sonic.topk_routing, sonic.token_rounding_routing])
def test_router_bad_input(router):
    logits = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        router(logits, 5)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        router(logits, 0)
    with pytest.raises(TypeError, match="k must be an int"):
        router(logits, 2.0)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        router(logits[0], 1)
    with pytest.raises(TypeError, match="logits must have dtype"):
        router(logits.long(), 1)


def test_router_bad_options():
    logits = torch.randn(6, 4)
    with pytest.raises(ValueError, match="score must be one of"):
        sonic.topk_routing(logits, 2, score="tanh")
    with pytest.raises(ValueError, match="rounding must be one of"):
        sonic.token_rounding_routing(logits, 2, rounding="sideways")
    with pytest.raises(ValueError, match="tile must be >= 1"):
        sonic.token_rounding_routing(logits, 2, tile=0)


def test_moe_layer_bad_input():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        sonic.MoE(8, 4, 4, 5)
    with pytest.raises(ValueError, match="router must be one of"):
        sonic.MoE(8, 4, 4, 2, router="expert_choice")
    layer = sonic.MoE(8, 4, 4, 2)
    with pytest.raises(ValueError, match="router must be one of"):
        layer.router = "hash"
    with pytest.raises(ValueError, match="d_model=8"):
        layer(torch.randn(3, 9))


def test_zero_tokens_give_empty_result():
    layer = sonic.MoE(8, 4, 4, 2)
    out = layer(torch.randn(0, 8))
    assert out.shape == (0, 8)
    r = sonic.topk_routing(torch.randn(0, 4), 2)
    assert r.num_pairs == 0
    assert sonic.token_rounding_routing(torch.randn(0, 4), 2, tile=4).num_pairs == 0


def test_moe_experts_rejects_metadata_of_other_pairs(problem):
    x, w1, w2, s, tok, exp = problem
    other = sonic.routing_metadata(sonic.Routing(tok[:-2], exp[:-2], s[:-2], 10, 3))
    with pytest.raises(ValueError, match="metadata must describe P=20 pairs"):
        _call(x, w1, w2, s, tok, exp, metadata=other)


def test_routing_metadata_checks_hand_built_pairs(problem):
    _, _, _, s, tok, exp = problem
    with pytest.raises(ValueError, match=r"expert_idx values must be in \[0, 3\)"):
        sonic.routing_metadata(sonic.Routing(tok, exp + 1, s, 10, 3))
    with pytest.raises(ValueError, match=r"token_idx values must be in \[0, 10\)"):
        sonic.routing_metadata(sonic.Routing(tok - 1, exp, s, 10, 3))


def test_kernel_address_checks_name_the_argument():
    """A misaligned tensor handed to a kernel launch is named in the error (CPU: the check is
    on the address alone)."""
    from sonic.kernels import runtime

    storage = torch.zeros(9, dtype=torch.float32)
    shifted = storage[1:]
    assert runtime.address(storage, 16, "b_scales") == storage.data_ptr()
    with pytest.raises(ValueError, match="b_scales data at .* is not 16-byte aligned"):
        runtime.address(shifted, 16, "b_scales")
    with pytest.raises(ValueError, match="tensor data at .* is not 16-byte aligned"):
        runtime.address(shifted)
