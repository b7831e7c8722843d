"""sonic as a Hugging Face transformers experts implementation (sonic.integrations.huggingface).

Tiny random-weight models built from configs, fp32 on CPU: sonic's experts must reproduce
transformers' own implementations — logits, the router aux loss and every parameter gradient.
"""

import copy
import subprocess
import sys

import pytest
import torch

import sonic

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("sonic.integrations.huggingface")

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, output_router_logits=True)

# family -> (config class, model class, MoE-specific config fields): 4-8 experts, top-2.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, shared_expert_intermediate_size=32)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    # LFM2-MoE's experts call the function F.silu (act_fn is no module); one dense layer.
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 dict(intermediate_size=32, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, num_dense_layers=1,
                      layer_types=["conv", "full_attention"])),
    # Aria stores its experts transposed, (E, d, 2n) and (E, n, d).
    "aria": ("AriaTextConfig", "AriaTextForCausalLM",
             dict(intermediate_size=32, moe_num_experts=8, moe_topk=2,
                  moe_num_shared_experts=1)),
}


def tiny_model(family, dtype=torch.float32, **overrides):
    config_cls, model_cls, moe = FAMILIES[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    config = getattr(transformers, config_cls)(**{**COMMON, **moe, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype)
    # Random routers: some families initialise the router to zeros, which makes every token's
    # top-K a tie and would leave most of the experts (and their gradients) untested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name and "proj" not in name:
                p.normal_(0, 0.5)
    return model


def batch():
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: padded positions still go through the MoE blocks
    return ids, mask


def step(model):
    """Logits, aux loss and every parameter's gradient of one training step."""
    ids, mask = batch()
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    aux = getattr(out, "aux_loss", None)
    return out.logits.detach(), None if aux is None else aux.detach(), grads


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("reference", ["default", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_transformers_experts(family, reference):
    """Logits, aux loss and all gradients equal those of transformers' default implementation
    (grouped_mm on CPU) and of the modeling file's own loop ("eager")."""
    model = tiny_model(family)
    if reference == "eager":
        model.set_experts_implementation("eager")
    ref_logits, ref_aux, ref_grads = step(model)
    hf.use_sonic_experts(model, backend="torch")
    assert model.config._experts_implementation == "sonic"
    logits, aux, grads = step(model)
    assert rel(logits, ref_logits) < 1e-5
    if family in ("aria", "lfm2_moe"):  # their outputs carry no router aux loss
        assert aux is None and ref_aux is None
    else:
        assert rel(aux, ref_aux) < 1e-6
    assert grads.keys() == ref_grads.keys()
    experts_grads = [n for n in grads if "experts" in n]
    assert experts_grads and all(grads[n].abs().sum() > 0 for n in experts_grads)
    for name in grads:
        assert rel(grads[name], ref_grads[name]) < 1e-5, name


def test_bf16_and_mixed_dtype():
    """bf16 weights: close to grouped_mm; fp32 hidden states with bf16 weights (autocast-like)
    are cast to the weights' dtype and the result returned in fp32."""
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    ref_logits, _, _ = step(model)
    hf.use_sonic_experts(model, backend="torch")
    logits, _, grads = step(model)
    assert rel(logits.float(), ref_logits.float()) < 2e-2
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(5, 64)
    top_k_index = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7]])
    weights = torch.rand(5, 2)
    out = hf.sonic_experts_forward(experts, x, top_k_index, weights)
    assert out.dtype == torch.float32 and out.shape == (5, 64)


def test_expert_parallel_sentinels_match_grouped_mm():
    """Under expert parallelism, indices >= E (another rank's experts, zero weight) contribute
    nothing and get no score gradient — as in transformers' grouped_mm."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    torch.manual_seed(2)
    x = torch.randn(6, 64, requires_grad=True)
    top_k_index = torch.tensor([[0, 8], [3, 1], [8, 8], [7, 2], [5, 8], [6, 4]])
    weights = torch.rand(6, 2).masked_fill(top_k_index >= 8, 0.0).requires_grad_()
    results = []
    for fn in (grouped_mm_experts_forward, hf.sonic_experts_forward):
        x.grad = weights.grad = None
        experts.zero_grad()
        out = fn(experts, x, top_k_index, weights)
        out.square().sum().backward()
        results.append((out.detach(), x.grad.clone(), weights.grad.clone(),
                        experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    for ref, got in zip(*results):
        assert rel(got, ref) < 1e-5
    assert (results[1][2][top_k_index >= 8] == 0).all()


def test_out_of_range_expert_index_raises():
    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    with pytest.raises(ValueError, match="expert_idx"):
        hf.sonic_experts_forward(experts, torch.randn(2, 64), torch.tensor([[0, 8], [1, 2]]),
                                 torch.rand(2, 2))


def test_save_and_load_without_sonic(tmp_path):
    """save_pretrained writes a plain HF checkpoint: transformers loads it in a process that never
    imports sonic and computes the same logits; from_pretrained(experts_implementation="sonic")
    loads it back onto sonic."""
    model = tiny_model("qwen3_moe")
    hf.use_sonic_experts(model, backend="torch")
    model.eval()
    ids, mask = batch()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    assert "sonic" not in (tmp_path / "config.json").read_text()
    torch.save({"ids": ids, "mask": mask}, tmp_path / "batch.pt")
    script = (
        "import sys, torch, transformers\n"
        f"path = {str(tmp_path)!r}\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(path).eval()\n"
        "b = torch.load(path + '/batch.pt')\n"
        "with torch.no_grad():\n"
        "    out = m(b['ids'], attention_mask=b['mask']).logits\n"
        "torch.save(out, path + '/plain_logits.pt')\n"
        "assert not any(name.startswith('sonic') for name in sys.modules), 'sonic imported'\n"
        "print(m.config._experts_implementation)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] != "sonic"
    assert rel(torch.load(tmp_path / "plain_logits.pt"), logits) < 1e-5

    hf.register()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="sonic").eval()
    assert reloaded.config._experts_implementation == "sonic"
    with torch.no_grad():
        assert rel(reloaded(ids, attention_mask=mask).logits, logits) < 1e-5


def test_switch_back():
    model = tiny_model("olmoe")
    ref_logits, _, _ = step(model)
    hf.use_sonic_experts(model, backend="torch")
    model.set_experts_implementation("grouped_mm")
    logits, _, _ = step(model)
    assert torch.equal(logits, ref_logits)


def test_any_silu_form_is_accepted_and_other_functions_name_where_they_differ():
    model = tiny_model("qwen3_moe")
    experts = next(m for m in model.modules() if hf.is_experts_module(m))

    def set_act(fn):
        experts._modules.pop("act_fn", None)    # a module attribute takes only modules
        experts.__dict__.pop("act_fn", None)
        setattr(experts, "act_fn", fn)

    for silu in (torch.nn.functional.silu, torch.nn.SiLU(), lambda x: x * torch.sigmoid(x)):
        set_act(silu)
        assert hf.check_experts(experts) == "concat"
        assert hf.expert_activation(experts) == "swiglu"
    # Another activation sonic computes, as a bare function: recognised by its values.
    set_act(torch.nn.functional.gelu)
    assert hf.expert_activation(experts) == "geglu"
    cases = {torch.tanh: r"none of sonic's activations.*not SiLU: at x=.* it gives .*silu gives",
             (lambda x: torch.sigmoid(1.702 * x) * x): "not SiLU",
             torch.nn.PReLU(): "has parameters",
             (lambda x: x[:1]): "elementwise", None: "not callable",
             (lambda x: x.cuda_only_method()): "failed on a float64 probe"}
    for act_fn, message in cases.items():
        set_act(act_fn)
        with pytest.raises(ValueError, match=message):
            hf.check_experts(experts)


def test_unsupported_activation_names_config_field():
    model = tiny_model("qwen3_moe", hidden_act="quick_gelu")
    with pytest.raises(ValueError, match=r"config\.hidden_act='quick_gelu'"):
        hf.use_sonic_experts(model)
    assert model.config._experts_implementation != "sonic"


def test_unsupported_experts_raise():
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("no GPT-OSS in this transformers")
    config = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 32,
                                          "num_local_experts": 4, "num_experts_per_tok": 2,
                                          "head_dim": 16})
    model = transformers.GptOssForCausalLM(config)
    with pytest.raises(ValueError, match="biases"):
        hf.use_sonic_experts(model)
    experts = model.model.layers[0].mlp.experts
    experts.has_bias = False  # what remains is its clamped, interleaved custom gate
    with pytest.raises(ValueError, match="_apply_gate"):
        hf.check_experts(experts)


def test_argument_errors():
    with pytest.raises(ValueError, match="backend"):
        hf.use_sonic_experts(tiny_model("mixtral"), backend="cuda")
    with pytest.raises(TypeError, match="model"):
        hf.use_sonic_experts(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="experts module"):
        hf.check_experts(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["qwen3_moe", "aria"])
def test_fp8_precision_and_fp8_activation_cache(family):
    """use_sonic_experts(precision="fp8", activation_cache="fp8") on bf16 weights whose sizes
    fit the FP8 blocks: the experts run sonic's FP8 path (the "torch" backend's emulation):
    logits within e4m3 error of the bf16 experts and visibly quantized; every experts gradient
    present; each experts module's FP8 copies made once and remade after an optimizer step.
    Aria stores its weights transposed."""
    sizes = dict(hidden_size=128, intermediate_size=128)
    sizes["moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"] = 128
    model = tiny_model(family, dtype=torch.bfloat16, **sizes)
    ref_logits, _, _ = step(model)
    hf.use_sonic_experts(model, backend="torch", precision="fp8", activation_cache="fp8")
    logits, _, grads = step(model)
    err = rel(logits.float(), ref_logits.float())
    assert 1e-3 < err < 5e-2, err
    assert all(grads[n].abs().sum() > 0 for n in grads if "experts" in n)
    experts = [m for m in model.modules() if hf.is_experts_module(m)]
    with sonic.reuse_fp8_weights():
        step(model)
        copies = [m._sonic_fp8_cache.tensors()[0] for m in experts]
        step(model)                               # same weights: the same copies
        assert all(m._sonic_fp8_cache.tensors()[0] is c for m, c in zip(experts, copies))
        torch.optim.SGD(model.parameters(), lr=1e-2).step()
        step(model)                               # updated weights: new copies
        assert all(m._sonic_fp8_cache.tensors()[0] is not c for m, c in zip(experts, copies))
    # Outside the block an edit through .data (no version bump) is seen.
    before, _, _ = step(model)
    for m in experts:
        m.down_proj.data.mul_(3)
    after, _, _ = step(model)
    assert not torch.equal(after, before)
    clone = copy.deepcopy(model)
    assert all(m._sonic_fp8_cache.tensors() == () for m in clone.modules()
               if hf.is_experts_module(m))
    assert torch.equal(step(clone)[0], after)


def test_fp8_options_check_sizes_before_switching():
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)        # hidden 64, experts 32
    with pytest.raises(ValueError, match=r"model\..*experts: precision='fp8' needs d_model"):
        hf.use_sonic_experts(model, backend="torch", precision="fp8")
    with pytest.raises(ValueError, match="d_expert"):
        hf.use_sonic_experts(model, backend="torch", activation_cache="fp8")
    assert model.config._experts_implementation != "sonic"
    with pytest.raises(ValueError, match="precision"):
        hf.use_sonic_experts(model, precision="fp16")


def test_a_probed_activation_is_probed_once():
    """An act_fn recognised by its values (a bare function) is probed on first use only:
    the experts' forward asks for it on every call."""
    model = tiny_model("qwen3_moe")
    experts = next(m for m in model.modules() if hf.is_experts_module(m))
    calls = []

    def silu(x):
        calls.append(1)
        return torch.nn.functional.silu(x)

    experts._modules.pop("act_fn", None)
    setattr(experts, "act_fn", silu)
    assert hf.expert_activation(experts) == "swiglu"
    assert hf.check_experts(experts) == "concat"
    assert hf.expert_activation(experts) == "swiglu"
    assert len(calls) == 1
