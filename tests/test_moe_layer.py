import torch

import sonic

from _reference import naive_moe


def _layer(router="topk", seed=0, **kw):
    torch.manual_seed(seed)
    return sonic.MoE(16, 8, 6, 2, router=router, tile=8, backend="torch", **kw)


def test_forward_matches_naive_and_keeps_shape():
    layer = _layer()
    x = torch.randn(2, 9, 16)
    out = layer(x)
    assert out.shape == x.shape
    tokens = x.reshape(-1, 16)
    r = layer.route(layer.gate(tokens))
    ref = naive_moe(tokens, layer.w1, layer.w2, r.scores, r.token_idx, r.expert_idx)
    torch.testing.assert_close(out.reshape(-1, 16), ref, rtol=1e-4, atol=1e-5)


def test_training_step_reduces_loss_and_reaches_every_parameter():
    layer = _layer(aux_loss_coef=0.01)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(64, 16)
    target = torch.randn(64, 16)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        out, aux_loss = layer(x, return_aux_loss=True)
        loss = torch.nn.functional.mse_loss(out, target) + aux_loss
        loss.backward()
        losses.append(loss.item())
        for name, p in layer.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
    assert losses[-1] < losses[0]
    assert aux_loss.item() > 0


def test_router_switch_and_eval_uses_topk():
    layer = _layer()
    x = torch.randn(100, 16)
    layer.router = "token_rounding"
    layer(x)
    counts = torch.bincount(layer.last_routing.expert_idx.long(), minlength=6)
    assert torch.all((counts % 8 == 0) | (counts == 100))
    layer.eval()
    layer(x)
    assert layer.last_routing.num_pairs == 100 * 2
    torch.testing.assert_close(layer.last_routing.token_idx.long(),
                               torch.arange(100).repeat_interleave(2))


def test_token_rounding_training_step():
    layer = _layer(router="token_rounding")
    x = torch.randn(50, 16, requires_grad=True)
    layer(x).square().mean().backward()
    assert layer.gate.weight.grad.abs().sum() > 0
    assert torch.isfinite(x.grad).all()


def test_deterministic_training_step():
    def step():
        layer = _layer(seed=3, aux_loss_coef=0.1)
        x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
        with sonic.collect_aux_losses(layer) as aux:
            out = layer(x)
        (out.sum() + sum(aux)).backward()
        return [p.grad for p in layer.parameters()]

    for a, b in zip(step(), step()):
        assert torch.equal(a, b)


def test_interleaved_layout_and_bfloat16():
    layer = _layer(gate_up="interleaved").to(torch.bfloat16)
    out = layer(torch.randn(12, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_eval_mode_has_no_aux_loss_graph():
    layer = _layer(aux_loss_coef=0.5).eval()
    _, aux_loss = layer(torch.randn(30, 16), return_aux_loss=True)
    assert aux_loss.item() == 0 and aux_loss.grad_fn is None
