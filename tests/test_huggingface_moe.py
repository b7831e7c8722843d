"""moe_from_hf / moe_to_hf: a sonic.MoE reproducing whole Hugging Face MoE blocks (router,
routed experts, shared experts) — output and every gradient, fp64 on CPU, tiny random blocks
built from configs (no downloads) — and hidden_act mapped to sonic's activations."""

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("sonic.integrations.huggingface")

F64 = torch.float64
D = 32
# family -> (config class, block class, config fields)
BLOCKS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                  dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeSparseMoeBlock",
              dict(intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                   norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralSparseMoeBlock",
                dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock",
                  dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       shared_expert_intermediate_size=24, norm_topk_prob=False)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3MoE",
                    dict(moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                         n_group=4, topk_group=2, n_shared_experts=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeMoE",
                 dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                      n_group=2, topk_group=1, n_shared_experts=1, norm_topk_prob=False,
                      routed_scaling_factor=1.5)),
}


def tiny_block(family, **overrides):
    config_cls, block_cls, fields = BLOCKS[family]
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        config = getattr(transformers, config_cls)(hidden_size=D, **{**fields, **overrides})
    except (ImportError, AttributeError):
        pytest.skip(f"transformers {transformers.__version__} has no {block_cls}")
    torch.manual_seed(0)
    block = getattr(module, block_cls)(config).to(F64)
    with torch.no_grad():        # routers start at zeros: every choice would be a tie
        for p in block.parameters():
            p.normal_(0, 0.3)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.05)
    return block


def _hf_choice(block, x):
    """The HF router's top-K expert indices ``(T, K)``."""
    with torch.no_grad():
        return block.gate(x.reshape(-1, D))[2]


def _grads(out, params, dout):
    return torch.autograd.grad((out * dout).sum(), params)


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_block_output_and_gradients_match(family):
    block = tiny_block(family)
    layer = hf.moe_from_hf(block, backend="torch")
    x = torch.randn(2, 7, D, dtype=F64, requires_grad=True)
    dout = torch.randn(2, 7, D, dtype=F64)
    expect = block(x)
    out = layer(x)
    # Every HF router computes its probabilities in fp32 whatever the block's dtype (sonic's
    # fp64 layer in fp64): the same experts, weights within fp32 rounding.
    tol = gtol = dict(rtol=1e-4, atol=1e-5)
    assert torch.equal(layer.last_routing.expert_idx.view(14, -1).sort(-1).values.long(),
                       _hf_choice(block, x).sort(-1).values)
    torch.testing.assert_close(out, expect, **tol)
    _, _, shared, gate = (None, None, *hf._check_block(block)[1:])
    pairs = hf._weight_pairs(layer, block, shared, gate)
    hf_params = [t for _, _, t in pairs if t.requires_grad]
    names = [n for n, _, t in pairs if t.requires_grad]
    views = [v for _, v, t in pairs if t.requires_grad]
    want = _grads(expect, [x, *hf_params], dout)
    got = _grads(out, [x, *{n: layer.get_parameter(n) for n in names}.values()], dout)
    got_by_name = dict(zip(dict.fromkeys(names), got[1:]))
    torch.testing.assert_close(got[0], want[0], **gtol)
    for name, view, w in zip(names, views, want[1:]):
        torch.testing.assert_close(view(got_by_name[name]), w, **gtol,
                                   msg=lambda m: f"{family} {name}: {m}")
    assert layer.shared_expert_d == {"qwen2_moe": 24, "deepseek_v3": 32, "glm4_moe": 16}.get(
        family, 0)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_activation_comes_from_hidden_act(hidden_act):
    block = tiny_block("qwen2_moe", hidden_act=hidden_act)
    layer = hf.moe_from_hf(block)
    assert layer.activation == {"gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
                                "relu": "reglu"}[hidden_act]
    x = torch.randn(9, D, dtype=F64).view(1, 9, D)
    torch.testing.assert_close(layer(x), block(x), rtol=1e-4, atol=1e-5)


def test_moe_to_hf_writes_the_weights_back():
    block = tiny_block("deepseek_v3")
    layer = hf.moe_from_hf(block)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
        layer.expert_bias.add_(0.01)
    x = torch.randn(1, 11, D, dtype=F64)
    assert not torch.allclose(layer(x), block(x))
    assert hf.moe_to_hf(layer, block) is block
    torch.testing.assert_close(block(x), layer(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(block.gate.e_score_correction_bias, layer.expert_bias,
                               check_dtype=False)
    with pytest.raises(ValueError, match="num_experts=8 but the DeepseekV3MoE needs 16"):
        hf.moe_to_hf(hf.moe_from_hf(tiny_block("glm4_moe")), block)


def test_other_blocks_are_refused_naming_the_difference():
    with pytest.raises(ValueError, match="moe_from_hf supports the MoE blocks .* got Linear"):
        hf.moe_from_hf(torch.nn.Linear(4, 4))
    block = tiny_block("mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        hf.moe_from_hf(block)
    block = tiny_block("qwen3_moe")
    block.gate = torch.nn.Linear(D, 8)
    with pytest.raises(ValueError, match="gate is Linear, expected Qwen3MoeTopKRouter"):
        hf.moe_from_hf(block)
    with pytest.raises(ValueError, match="quick_gelu"):
        hf.moe_from_hf(tiny_block("olmoe", hidden_act="quick_gelu"))


def test_unsupported_experts_refused_at_model_build_and_load(tmp_path):
    hf.register()
    common = dict(vocab_size=64, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, moe_intermediate_size=16, num_experts=4,
                  num_experts_per_tok=2)
    config = transformers.Qwen3MoeConfig(**common, hidden_act="quick_gelu")
    config._experts_implementation = "sonic"
    with pytest.raises(ValueError, match=r"model\..*experts: .*quick_gelu"):
        transformers.Qwen3MoeForCausalLM(config)
    config._experts_implementation = None
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quick_gelu"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                          experts_implementation="sonic")
    # A supported activation loads with sonic and runs it.
    good = transformers.Qwen3MoeConfig(**common, hidden_act="gelu")
    transformers.Qwen3MoeForCausalLM(good).save_pretrained(tmp_path / "gelu")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gelu",
                                                              experts_implementation="sonic")
    ids = torch.randint(0, 64, (1, 6))
    logits = model(ids).logits
    model.set_experts_implementation("grouped_mm")
    torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["relu2", "gelu"])
def test_ungated_experts_run_through_sonic(act):
    try:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
    except ImportError:
        pytest.skip("no Nemotron-H (ungated experts) in this transformers")
    config = transformers.NemotronHConfig(hidden_size=D, n_routed_experts=6,
                                          moe_intermediate_size=12, mlp_hidden_act=act)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = NemotronHExperts(config).to(F64)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(10, D, dtype=F64, requires_grad=True)
    index = torch.stack([torch.randperm(6)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, dtype=F64, requires_grad=True)
    expect = experts(x, index, weights)
    assert hf.expert_activation(experts) == act
    out = hf.sonic_experts_forward(experts, x, index, weights)
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-12)
    params = [x, weights, experts.up_proj, experts.down_proj]
    for a, b in zip(torch.autograd.grad(out.sum(), params),
                    torch.autograd.grad(expect.sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
