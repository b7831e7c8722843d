"""No silent wrong answers (higher-order gradients, copies, degenerate sizes, settings
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


# --------------------------------------- 2. a layer can be copied and pickled after forward

def _trained_once(**kw):
    torch.manual_seed(0)
    layer = sonic.MoE(8, 4, 4, 2, aux_loss_coef=0.1, **kw)
    out = layer(torch.randn(6, 8))
    return layer, out


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_deepcopy_after_forward(router):
    layer, out = _trained_once(router=router, tile=2)
    clone = copy.deepcopy(layer)
    for (name, p), q in zip(layer.named_parameters(), clone.parameters()):
        assert torch.equal(p, q) and p is not q, name
    # The copy keeps the values of the last forward, without its graph.
    assert clone.aux_loss.grad_fn is None and torch.equal(clone.aux_loss, layer.aux_loss.detach())
    assert clone.last_routing.scores.grad_fn is None
    torch.testing.assert_close(clone.last_routing.scores, layer.last_routing.scores.detach())
    # The original's aux_loss still trains its router.
    (out.sum() + layer.aux_loss).backward()
    assert layer.gate.weight.grad.abs().sum() > 0
    assert clone.gate.weight.grad is None


def test_averaged_model_and_ema_after_forward():
    layer, out = _trained_once()
    ema = torch.optim.swa_utils.AveragedModel(
        layer, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    (out.sum() + layer.aux_loss).backward()
    ema.update_parameters(layer)                      # the first update copies
    with torch.no_grad():
        layer.w1.add_(1.0)
    ema.update_parameters(layer)
    torch.testing.assert_close(ema.module.w1, layer.w1 - 0.9)


def test_pickle_module_and_state_dict_after_forward():
    layer, _ = _trained_once()
    for obj in (layer, layer.state_dict()):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=False)
    restored = pickle.loads(pickle.dumps(layer))
    assert torch.equal(restored.w2, layer.w2)
    assert restored(torch.randn(3, 8)).shape == (3, 8)


# ------------------------------------------ 4. non-finite or meaningless settings are refused

def test_empty_batch_aux_loss_is_zero_and_trains():
    layer = sonic.MoE(8, 4, 4, 2, aux_loss_coef=0.5)
    x = torch.randn(0, 8, requires_grad=True)
    out = layer(x)
    assert layer.aux_loss.item() == 0
    (out.sum() + layer.aux_loss).backward()
    assert torch.isfinite(layer.gate.weight.grad).all()


@pytest.mark.parametrize("coef,error", [(-1.0, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("0.1", TypeError),
                                        (True, TypeError)])
def test_aux_loss_coef_validated(coef, error):
    with pytest.raises(error, match="aux_loss_coef"):
        sonic.MoE(8, 4, 4, 2, aux_loss_coef=coef)
    layer = sonic.MoE(8, 4, 4, 2)
    with pytest.raises(error, match="aux_loss_coef"):
        layer.aux_loss_coef = coef


@pytest.mark.parametrize("coef", ["-1", "nan", "inf"])
def test_train_cli_rejects_aux_loss_coef(coef, capsys):
    from sonic.train.__main__ import main
    from sonic.train.loop import TrainConfig

    with pytest.raises(SystemExit) as exc:
        main(["--aux-loss-coef", coef, "--steps", "1"])
    assert exc.value.code == 2 and "--aux-loss-coef" in capsys.readouterr().err
    with pytest.raises(ValueError, match="aux_loss_coef"):
        TrainConfig(aux_loss_coef=float(coef))


@pytest.mark.parametrize("field", ["token_idx", "expert_idx"])
def test_float_indices_in_routing_raise(field):
    _, _, _, s, tok, exp = random_problem(10, 8, 4, 3, K=2)
    pairs = {"token_idx": tok, "expert_idx": exp}
    pairs[field] = pairs[field].float() + 0.5
    with pytest.raises(TypeError, match=field):
        sonic.Routing(pairs["token_idx"], pairs["expert_idx"], s, 10, 3)


def test_renormalize_must_be_bool():
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        sonic.MoE(8, 4, 4, 2, renormalize="no")
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        sonic.topk_routing(torch.randn(5, 4), 2, score="topk_softmax", renormalize="no")


def test_routing_top_k_must_match_pair_count():
    r = sonic.topk_routing(torch.randn(5, 4), 2)
    with pytest.raises(ValueError, match="top_k"):
        sonic.Routing(r.token_idx[:-1], r.expert_idx[:-1], r.scores[:-1], 5, 4, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        sonic.Routing(r.token_idx, r.expert_idx, r.scores, 5, 4, top_k=3)


def test_routing_top_k_must_be_token_major():
    r = sonic.topk_routing(torch.randn(5, 4), 2)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    shuffled = sonic.Routing(r.token_idx[perm], r.expert_idx[perm], r.scores[perm], 5, 4, top_k=2)
    with pytest.raises(ValueError, match="token-major"):
        sonic.routing_metadata(shuffled)
    # Without top_k the same pairs are fine and give the same layer output.
    general = sonic.Routing(r.token_idx[perm], r.expert_idx[perm], r.scores[perm], 5, 4)
    assert sonic.routing_metadata(general).num_pairs == 10


@pytest.mark.parametrize("kw,error", [({"num_tokens": 5.0}, TypeError),
                                      ({"num_experts": -1}, ValueError),
                                      ({"validated": 1}, TypeError),
                                      ({"scores": torch.ones(10, dtype=torch.int32)}, TypeError),
                                      ({"scores": torch.ones(9)}, ValueError)])
def test_routing_fields_validated(kw, error):
    r = sonic.topk_routing(torch.randn(5, 4), 2)
    fields = dict(token_idx=r.token_idx, expert_idx=r.expert_idx, scores=r.scores,
                  num_tokens=5, num_experts=4)
    fields.update(kw)
    with pytest.raises(error, match=next(iter(kw))):
        sonic.Routing(**fields)


def test_float64_layer_keeps_float64_scores_and_passes_gradcheck():
    torch.manual_seed(0)
    layer = sonic.MoE(6, 3, 4, 2, dtype=torch.float64)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    params = dict(layer.named_parameters())

    def fn(x, gate, w1, w2):
        return torch.func.functional_call(layer, {"gate.weight": gate, "w1": w1, "w2": w2}, (x,))

    assert torch.autograd.gradcheck(fn, (x, params["gate.weight"], params["w1"], params["w2"]))


def test_float32_and_bfloat16_layers_keep_fp32_scores():
    for dtype in (torch.float32, torch.bfloat16):
        layer = sonic.MoE(8, 4, 4, 2, dtype=dtype)
        layer(torch.randn(3, 8, dtype=dtype))
        assert layer.last_routing.scores.dtype == torch.float32


# ------------------------------------------------------------- 5. errors that say what to do

def test_wrong_input_dtype_names_x_and_layer_dtype():
    layer = sonic.MoE(8, 4, 4, 2)
    with pytest.raises(TypeError, match=r"x .*float64.*float32"):
        layer(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([[0.0] * 8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_layer_runs_shape_only(dtype):
    layer = sonic.MoE(8, 4, 4, 2, device="meta", dtype=dtype, aux_loss_coef=0.1)
    out = layer(torch.empty(2, 3, 8, device="meta", dtype=dtype, requires_grad=True))
    assert out.shape == (2, 3, 8) and out.device.type == "meta"
    (out.sum() + layer.aux_loss).backward()
    assert layer.w1.grad.shape == layer.w1.shape


@pytest.mark.parametrize("text", ["1" * 20 + ",8,8,4,2", "64,8,8,4," + "9" * 20,
                                  "2147483647,2147483647,2147483647,8,2"])
def test_parse_config_rejects_huge_sizes(text, capsys):
    import argparse

    from sonic.baselines.configs import parse_config
    from sonic.memory.__main__ import main

    with pytest.raises(argparse.ArgumentTypeError, match="at most"):
        parse_config(text)
    with pytest.raises(SystemExit) as exc:
        main(["--config", text])
    assert exc.value.code == 2 and "--config" in capsys.readouterr().err


def test_train_cli_empty_data_file(tmp_path, capsys):
    from sonic.train.__main__ import main

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["--data", str(empty), "--steps", "1", "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--data" in err and "empty" in err


# ------------------------------------------- training under anomaly detection / determinism

class _TinyLM(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.moe = sonic.MoE(16, 8, 4, 2, router=router, tile=4, aux_loss_coef=0.01)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.moe(h))


def _train_step(router, seed=0):
    torch.manual_seed(seed)
    model = _TinyLM(router)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 32, (3, 10), generator=torch.Generator().manual_seed(seed))
    with sonic.collect_aux_losses(model) as aux:
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
    (loss + sum(aux)).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_training_step_under_anomaly_detection(router):
    with torch.autograd.set_detect_anomaly(True):
        params = _train_step(router)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_training_step_under_deterministic_algorithms(router):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = _train_step(router), _train_step(router)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_explain_backend_says_cute_would_raise():
    line = sonic.explain_backend("cute", "cpu")
    assert "raise" in line and "not a CUDA GPU" in line


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_still_works_with_the_guard(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = sonic.MoE(8, 4, 4, 2)
    x = torch.randn(6, 8, requires_grad=True)
    checkpoint(layer, x, use_reentrant=use_reentrant).sum().backward()
    expect = torch.autograd.grad(layer(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expect)
