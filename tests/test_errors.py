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


# --------------------------------------------------------------- arguments of the wrong kind


def _routed(T=6, E=4, K=2, seed=0):
    torch.manual_seed(seed)
    layer = sonic.MoE(16, 8, E, K, backend="torch")
    x = torch.randn(T, 16)
    r = sonic.topk_routing(torch.randn(T, E), K, backend="torch")
    return layer, x, r


def test_metadata_given_a_routing_names_what_to_pass():
    layer, x, r = _routed()
    with pytest.raises(TypeError, match=r"metadata must be a sonic.RoutingMetadata.*got "
                                        r"Routing \(pass sonic.routing_metadata\(routing\)"):
        sonic.moe_experts(x, layer.w1, layer.w2, r.scores, r.token_idx, r.expert_idx,
                          backend="torch", metadata=r)


def test_routing_metadata_given_a_tuple_names_the_type():
    _, _, r = _routed()
    with pytest.raises(TypeError, match=r"routing must be a sonic.Routing, got tuple; wrap"):
        sonic.routing_metadata((r.token_idx, r.expert_idx), backend="torch")


@pytest.mark.parametrize("field", ["token_idx", "expert_idx"])
def test_validated_routing_with_an_out_of_range_index_raises_on_the_cpu(field):
    layer, x, r = _routed()
    fields = {"token_idx": r.token_idx, "expert_idx": r.expert_idx}
    fields[field] = fields[field].clone()
    fields[field][3] = 6 if field == "token_idx" else 4
    bad = sonic.Routing(fields["token_idx"], fields["expert_idx"], r.scores, 6, 4,
                        validated=True)
    with pytest.raises(ValueError, match=rf"validated=True.*{field} values must be in"):
        sonic.routing_metadata(bad, backend="torch")
    # A padded routing's padding (expert E) is in range.
    padded = sonic.token_rounding_routing(torch.randn(9, 4), 2, tile=4, backend="torch",
                                          padded=True)
    assert padded.expert_idx.max() == 4
    assert sonic.routing_metadata(padded, backend="torch").num_pairs == padded.num_pairs


def test_torch_func_transforms_raise_naming_the_alternative():
    layer, x, _ = _routed()
    with pytest.raises(RuntimeError, match=r"does not support torch.func transforms.*"
                                           r"torch.autograd.grad"):
        torch.func.grad(lambda inp: layer(inp).sum())(x)
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.vmap(lambda inp: layer(inp))(x[None])
    # After the transform, the layer runs and trains as before.
    layer(x).sum().backward()
    assert layer.w1.grad.abs().sum() > 0


@pytest.mark.parametrize("name, value, message", [
    ("top_k", 99, r"top_k must be in \[1, 4\], got 99"), ("top_k", 0, "top_k"),
    ("top_k", 2.0, "top_k"), ("tile", 0, "tile"), ("score", "tanh", "score must be one of"),
    ("rounding", "floor", "rounding must be one of"), ("renormalize", 1, "renormalize")])
def test_layer_settings_are_checked_on_assignment(name, value, message):
    layer, x, _ = _routed()
    before = getattr(layer, name)
    with pytest.raises((TypeError, ValueError), match=message):
        setattr(layer, name, value)
    assert getattr(layer, name) == before
    layer.top_k = 3
    assert layer(x).shape == x.shape and layer.last_routing.top_k == 3


def test_layer_pickled_with_plain_setting_attributes_loads():
    layer, x, _ = _routed()
    state = layer.__getstate__()
    for name in ("top_k", "tile", "score", "rounding", "renormalize"):
        state[name] = state.pop("_" + name)
    old = sonic.MoE.__new__(sonic.MoE)
    old.__setstate__(state)
    assert old.top_k == 2 and old.tile == 128 and old.score == "softmax_topk"
    assert torch.equal(old(x), layer(x))


def test_string_options_are_literal_types_that_the_checks_use():
    """Each option's Literal type (sonic.types) is what the public signatures declare and
    what the runtime check accepts, value for value."""
    import inspect
    import typing

    from sonic import types
    from sonic.activation_cache import ACTIVATION_CACHES
    from sonic.experts.moe_experts import PRECISIONS
    from sonic.backend import BACKENDS
    from sonic.nn.moe import ROUTERS
    from sonic.routing.token_rounding import ROUNDINGS
    from sonic.routing.topk import SCORES

    pairs = {"Router": ROUTERS, "Score": SCORES, "Rounding": ROUNDINGS, "Backend": BACKENDS,
             "Precision": PRECISIONS, "ActivationCache": ACTIVATION_CACHES,
             "GateUp": types.GATE_UP_LAYOUTS}
    for name, values in pairs.items():
        assert typing.get_args(getattr(types, name)) == values, name
    declared = {n: p.annotation for n, p in inspect.signature(sonic.MoE).parameters.items()}
    assert {declared[k] for k in ("router", "score", "rounding", "backend", "precision",
                                  "activation_cache", "gate_up")} == set(pairs)
    for fn, names in ((sonic.moe_experts, ("gate_up", "backend", "precision",
                                           "activation_cache")),
                      (sonic.topk_routing, ("score", "backend")),
                      (sonic.token_rounding_routing, ("rounding", "backend")),
                      (sonic.routing_metadata, ("backend",))):
        params = inspect.signature(fn).parameters
        assert all(params[n].annotation in pairs for n in names), fn
