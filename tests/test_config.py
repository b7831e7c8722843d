"""`sonic.MoEConfig`: the one configuration of `sonic.MoE`, its expert-parallel share and the
training job's layers — round trips, the checks (the constructor's errors, naming the field),
settings assigned after construction, pickling, and an EP layer built from a config on gloo
ranks."""

import copy
import dataclasses
import pickle

import pytest
import torch

import sonic
from sonic import MoEConfig
from sonic.distributed import ExpertParallelMoE
from test_distributed import D, N, TOL, _rel, _spawn, layer_step

F64 = torch.float64
OPTION_SETS = [
    {},
    dict(router="token_rounding", tile=16, rounding="up", aux_loss_coef=0.01),
    dict(score="sigmoid", renormalize=True, routed_scaling_factor=2.5, n_group=4,
         topk_group=2, bias_update_rate=0.1, seq_aux_loss_coef=0.001, z_loss_coef=0.01),
    dict(n_group=2),                                 # topk_group None: n_group
    dict(activation="gelu", num_shared_experts=2, shared_expert_gate=True),
    dict(shared_expert_d=24, expert_bias=True, gate_up="interleaved", backend="torch"),
]


@pytest.mark.parametrize("options", OPTION_SETS)
def test_kwargs_config_layer_config_round_trip(options):
    config = MoEConfig(D, N, 8, 2, **options)
    layer = sonic.MoE.from_config(config, dtype=F64)
    assert layer.config == config
    assert sonic.MoE(D, N, 8, 2, **options).config == config
    assert dataclasses.asdict(config) == {**dataclasses.asdict(MoEConfig(D, N, 8, 2)), **options}
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert copied.config == config
    # The same layer as the keyword constructor builds: parameters, buffers, forward.
    torch.manual_seed(0)
    a = sonic.MoE.from_config(config, dtype=F64)
    torch.manual_seed(0)
    b = sonic.MoE(D, N, 8, 2, dtype=F64, **options)
    assert a.state_dict().keys() == b.state_dict().keys()
    x = torch.randn(2, 5, D, dtype=F64)
    assert torch.equal(a(x), b(x))


def test_config_follows_settings_assigned_later():
    layer = sonic.MoE(D, N, 8, 2, n_group=2)
    layer.top_k, layer.router, layer.backend = 3, "token_rounding", "torch"
    layer.aux_loss_coef = 0.5
    assert layer.config == MoEConfig(D, N, 8, 3, router="token_rounding", aux_loss_coef=0.5,
                                     backend="torch", n_group=2)
    layer.topk_group = 1            # a plain attribute: the config reports it once it differs
    assert layer.config.topk_group == 1


@pytest.mark.parametrize("field, value, error, message", [
    ("d_model", 0, ValueError, "d_model must be >= 1, got 0"),
    ("d_expert", 4.0, TypeError, "d_expert must be an int"),
    ("num_experts", True, TypeError, "num_experts must be an int"),
    ("top_k", 9, ValueError, r"top_k must be in \[1, 8\], got 9"),
    ("router", "expert_choice", ValueError, "router must be one of"),
    ("tile", 0, ValueError, "tile must be >= 1"),
    ("score", "tanh", ValueError, "score must be one of"),
    ("renormalize", 1, TypeError, "renormalize must be a bool"),
    ("rounding", "floor", ValueError, "rounding must be one of"),
    ("gate_up", "split", ValueError, "gate_up must be one of"),
    ("aux_loss_coef", float("nan"), ValueError, "aux_loss_coef must be finite and >= 0"),
    ("backend", "triton", ValueError, "backend must be one of"),
    ("precision", "fp8", ValueError, r"precision='fp8' needs d_model \(d\)"),
    ("activation_cache", "fp8", ValueError, "activation_cache='fp8' needs 2\\*d_expert"),
    ("routed_scaling_factor", 0.0, ValueError, "routed_scaling_factor must be finite and > 0"),
    ("n_group", 3, ValueError, "n_group=3 must divide num_experts=8"),
    ("topk_group", 2, ValueError, r"topk_group must be in \[1, 1\]"),
    ("expert_bias", "yes", TypeError, "expert_bias must be a bool"),
    ("bias_update_rate", -0.1, ValueError, "bias_update_rate must be finite and >= 0"),
    ("seq_aux_loss_coef", "0.1", TypeError, "seq_aux_loss_coef must be a real number"),
    ("z_loss_coef", float("inf"), ValueError, "z_loss_coef must be finite and >= 0"),
    ("activation", "swish", ValueError, "activation must be one of"),
    ("num_shared_experts", -1, ValueError, "num_shared_experts must be >= 0"),
    ("shared_expert_d", 0, ValueError, "shared_expert_d must be >= 1"),
    ("shared_expert_gate", True, ValueError, "shared_expert_gate=True needs shared experts"),
])
def test_invalid_values_raise_naming_the_field(field, value, error, message):
    kwargs = {**dict(d_model=12, d_expert=20, num_experts=8, top_k=2), field: value}
    with pytest.raises(error, match=message):
        MoEConfig(**kwargs)
    with pytest.raises(error, match=message):
        sonic.MoE(**kwargs)
    with pytest.raises(error, match=message):
        dataclasses.replace(MoEConfig(12, 20, 8, 2), **{field: value})


def test_cross_field_checks_and_frozen():
    with pytest.raises(ValueError, match="top_k=4 is more than the topk_group"):
        MoEConfig(D, N, 8, 4, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="activation='gelu'.*precision='fp8'"):
        MoEConfig(128, 128, 8, 2, activation="gelu", precision="fp8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        MoEConfig(D, N, 8, 2).top_k = 3
    with pytest.raises(TypeError, match="config must be a sonic.MoEConfig, got dict"):
        sonic.MoE.from_config(dict(d_model=D, d_expert=N, num_experts=8, top_k=2))


def test_assignments_are_checked_by_the_config():
    layer = sonic.MoE(D, N, 8, 2, activation="gelu", n_group=4, topk_group=2)
    for name, value, message in (("activation_cache", "fp8", "activation_cache='fp8'"),
                                 ("backend", "triton", "backend must be one of"),
                                 ("top_k", 5, "top_k=5 is more than the topk_group")):
        before = getattr(layer, name)
        with pytest.raises(ValueError, match=message):
            setattr(layer, name, value)
        assert getattr(layer, name) == before


def test_layer_pickled_without_a_config_gets_one():
    layer = sonic.MoE(D, N, 8, 2, n_group=2, bias_update_rate=0.1, num_shared_experts=1)
    state = layer.__getstate__()
    del state["_config"]
    old = sonic.MoE.__new__(sonic.MoE)
    old.__setstate__(state)
    # The resolved values of the fields the layer keeps resolved: the same layer.
    assert old.config == dataclasses.replace(layer.config, topk_group=2, expert_bias=True,
                                             num_shared_experts=0, shared_expert_d=N)
    assert sonic.MoE.from_config(old.config).state_dict().keys() == layer.state_dict().keys()


def test_expert_parallel_from_config_refuses_what_it_cannot_carry():
    # Refused before any collective: no process group needed.
    with pytest.raises(ValueError, match="ExpertParallelMoE cannot carry shared_expert_d=8 yet"):
        ExpertParallelMoE.from_config(MoEConfig(D, N, 8, 2, activation="gelu",
                                                num_shared_experts=2))
    with pytest.raises(TypeError, match="config must be a sonic.MoEConfig"):
        ExpertParallelMoE.from_config(sonic.MoE(D, N, 8, 2))


EP_CONFIG = MoEConfig(D, N, 8, 2, backend="torch", score="sigmoid", renormalize=True,
                      n_group=4, topk_group=2, bias_update_rate=0.1, aux_loss_coef=0.01)


def _from_config_case(rank, world):
    torch.manual_seed(0)
    full = sonic.MoE.from_config(EP_CONFIG, dtype=F64)
    layer = ExpertParallelMoE.from_config(EP_CONFIG, dtype=F64)
    local = slice(rank * 8 // world, (rank + 1) * 8 // world)
    with torch.no_grad():
        layer.gate.weight.copy_(full.gate.weight)
        layer.w1.copy_(full.w1[local])
        layer.w2.copy_(full.w2[local])
    counts = [6 + 2 * r for r in range(world)]
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(sum(counts), D, generator=g, dtype=F64)
    grad_full = torch.randn(sum(counts), D, generator=g, dtype=F64)
    _, out, _, out_ref, _ = layer_step(layer, full, x_full, grad_full, counts, rank)
    lo = sum(counts[:rank])
    return {"config": layer.config == EP_CONFIG, "local_experts": layer.num_local_experts,
            "from_moe": ExpertParallelMoE.from_moe(full).config == full.config,
            "out": _rel(out.detach(), out_ref.detach()[lo:lo + counts[rank]])}


def test_expert_parallel_layer_from_config_on_two_ranks(tmp_path):
    for r in _spawn(2, _from_config_case, tmp_path):
        assert r["config"] and r["from_moe"] and r["local_experts"] == 4, r
        assert r["out"] <= TOL, r


def test_train_config_produces_the_layers_config():
    from sonic.train import ByteMoELM, TrainConfig

    config = TrainConfig(d_model=32, heads=2, experts=4, top_k=2, d_expert=16, tile=4,
                         router="token_rounding")
    moe = config.moe_config()
    assert moe == MoEConfig(32, 16, 4, 2, router="token_rounding", tile=4, aux_loss_coef=0.01)
    model = ByteMoELM(max_seq_len=16, num_layers=2, num_heads=2, moe=moe)
    assert [layer.config for layer in model.moe_layers] == [moe, moe]
    for fields, message in ((dict(router="expert_choice"), "router must be one of"),
                            (dict(top_k=9), r"top_k must be in \[1, 8\], got 9"),
                            (dict(backend="triton"), "backend must be one of"),
                            (dict(precision="fp8", d_model=64, heads=2), "d_model")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**fields)
