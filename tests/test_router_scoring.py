"""Router scoring options against naive fp64 implementations written from the papers.

DeepSeek-V3 (arXiv 2412.19437) §2.1.2: sigmoid affinities, renormalised top-K weights,
routed scaling factor, aux-loss-free bias (selection only, sign-rule update), node-limited
(group-limited) routing, sequence-wise balance loss (eqs. 17–20). DeepSeek-V2 (arXiv
2405.04434) §2.1.2: device-limited routing by a group's highest softmax affinity. ST-MoE
(arXiv 2202.08906) eq. 5: router z-loss.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import sonic
from sonic.routing.losses import router_z_loss, sequence_balance_loss

F64 = torch.float64


def _logits(T, E, seed=0, dtype=F64):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def naive_route(logits, k, *, score, renormalize=False, bias=None, n_group=1, topk_group=None,
                scaling=1.0):
    """Per-token Python loops: ``(experts (T, k) list, weights (T, k) tensor)``."""
    T, E = logits.shape
    topk_group = n_group if topk_group is None else topk_group
    size = E // n_group
    experts, weights = [], []
    for t in range(T):
        row = logits[t]
        s = torch.sigmoid(row) if score == "sigmoid" else torch.softmax(row, -1)
        choice = [float(s[e].detach()) + (0.0 if bias is None else float(bias[e])) for e in range(E)]
        allowed = set(range(E))
        if n_group > 1:
            group_scores = []
            for g in range(n_group):
                members = sorted(choice[g * size:(g + 1) * size], reverse=True)
                group_scores.append(sum(members[:2]) if score == "sigmoid" else members[0])
            best = sorted(range(n_group), key=lambda g: -group_scores[g])[:topk_group]
            allowed = {e for g in best for e in range(g * size, (g + 1) * size)}
        chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
        if score == "softmax_topk":
            w = torch.softmax(row[chosen], -1)
        else:
            w = s[chosen]
            if renormalize:
                w = w / w.sum()
        experts.append(chosen)
        weights.append(w * scaling)
    return experts, torch.stack(weights)


def _check(r, logits, k, **opts):
    experts, weights = naive_route(logits, k, **opts)
    T = logits.shape[0]
    assert r.top_k == k and r.validated
    assert r.expert_idx.view(T, k).tolist() == experts
    torch.testing.assert_close(r.scores.view(T, k), weights, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_sigmoid_topk_matches_naive(renormalize, scaling):
    logits = _logits(37, 16)
    r = sonic.topk_routing(logits, 4, score="sigmoid", renormalize=renormalize,
                           scaling_factor=scaling)
    _check(r, logits, 4, score="sigmoid", renormalize=renormalize, scaling=scaling)


@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax", "sigmoid"])
def test_expert_bias_selects_but_does_not_weigh(score):
    logits = _logits(29, 12, seed=1)
    bias = torch.randn(12, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    r = sonic.topk_routing(logits, 3, score=score, expert_bias=bias, renormalize=True)
    _check(r, logits, 3, score=score, renormalize=True, bias=bias)
    # A large bias forces an expert into every token's choice, its weight still unbiased.
    big = torch.zeros(12)
    big[5] = 10.0
    r = sonic.topk_routing(logits, 3, score=score, expert_bias=big)
    assert (r.expert_idx.view(-1, 3) == 5).any(dim=1).all()
    if score == "sigmoid":
        pos = (r.expert_idx == 5).nonzero().flatten()
        torch.testing.assert_close(r.scores[pos], torch.sigmoid(logits[:, 5]))


@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax", "sigmoid"])
@pytest.mark.parametrize("n_group,topk_group,k", [(4, 2, 3), (4, 1, 2), (16, 3, 3),
                                                  (16, 16, 5), (2, 2, 4), (8, 4, 8)])
def test_group_limited_routing_matches_naive(score, n_group, topk_group, k):
    logits = _logits(41, 16, seed=3)
    bias = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(4))
    r = sonic.topk_routing(logits, k, score=score, n_group=n_group, topk_group=topk_group,
                           expert_bias=bias, renormalize=True, scaling_factor=1.5)
    _check(r, logits, k, score=score, n_group=n_group, topk_group=topk_group, bias=bias,
           renormalize=True, scaling=1.5)
    # Every token's experts lie in at most topk_group groups.
    groups = r.expert_idx.view(41, k).long() // (16 // n_group)
    assert max(len(set(row)) for row in groups.tolist()) <= topk_group


def test_all_groups_kept_is_plain_topk():
    logits = _logits(23, 12, seed=5)
    plain = sonic.topk_routing(logits, 3, score="sigmoid")
    grouped = sonic.topk_routing(logits, 3, score="sigmoid", n_group=3, topk_group=3)
    assert torch.equal(plain.expert_idx, grouped.expert_idx)
    assert torch.equal(plain.scores, grouped.scores)


def test_group_ties_prefer_lower_group_and_expert():
    logits = torch.zeros(2, 8, dtype=F64)       # every score equal
    r = sonic.topk_routing(logits, 2, score="sigmoid", n_group=4, topk_group=1)
    assert r.expert_idx.view(2, 2).tolist() == [[0, 1], [0, 1]]


@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax", "sigmoid"])
def test_scores_gradient_matches_naive(score):
    logits = _logits(9, 8, seed=6).requires_grad_()
    bias = torch.randn(8, generator=torch.Generator().manual_seed(7)) * 0.1
    opts = dict(score=score, renormalize=True, n_group=4, topk_group=2)
    r = sonic.topk_routing(logits, 3, expert_bias=bias, scaling_factor=2.0, **opts)
    weights = torch.randn(9 * 3, dtype=F64, generator=torch.Generator().manual_seed(8))
    (got,) = torch.autograd.grad((r.scores * weights).sum(), logits)
    _, naive = naive_route(logits, 3, bias=bias, scaling=2.0, **opts)
    (expect,) = torch.autograd.grad((naive.flatten() * weights).sum(), logits)
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-14)
    assert torch.autograd.gradcheck(
        lambda lg: sonic.topk_routing(lg, 3, expert_bias=bias, **opts).scores, (logits,))


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_sigmoid_op_matches_naive_to_second_order(groups, renormalize):
    """The op ``sonic::topk_routing`` with the sigmoid options (what the CuTe backend runs on a
    GPU; here its torch selection) against the naive router: selection, scores, the registered
    backward and its derivative (create_graph), and the op's registration (opcheck)."""
    from sonic.ops import call
    n_group, topk_group = groups
    logits = _logits(9, 8, seed=11).requires_grad_()
    bias = torch.randn(8, generator=torch.Generator().manual_seed(12), dtype=F64) * 0.1
    args = (3, "sigmoid", renormalize, "torch", bias, n_group, topk_group)
    scores, idx = call.topk_routing(logits, *args)
    experts, naive = naive_route(logits, 3, score="sigmoid", renormalize=renormalize, bias=bias,
                                 n_group=n_group, topk_group=topk_group)
    assert idx.tolist() == experts
    torch.testing.assert_close(scores, naive, rtol=1e-12, atol=1e-14)
    weights = torch.randn(9, 3, dtype=F64, generator=torch.Generator().manual_seed(13))
    (got,) = torch.autograd.grad((scores * weights).sum(), logits, create_graph=True)
    (expect,) = torch.autograd.grad((naive * weights).sum(), logits, create_graph=True)
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-14)
    (got2,) = torch.autograd.grad(got.square().sum(), logits)
    (expect2,) = torch.autograd.grad(expect.square().sum(), logits)
    torch.testing.assert_close(got2, expect2, rtol=1e-12, atol=1e-14)
    assert got2.abs().sum() > 0
    torch.library.opcheck(torch.ops.sonic.topk_routing.default, (logits,) + args)


@pytest.mark.parametrize("kw,match", [
    (dict(n_group=3), "n_group=3 must divide"),
    (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1, k=3), "top_k=3 is more than"),
    (dict(scaling_factor=0.0), "scaling_factor"),
    (dict(scaling_factor=float("nan")), "scaling_factor"),
    (dict(score="tanh"), "score"),
    (dict(expert_bias=torch.zeros(7)), r"expert_bias must have shape \(E=8,\)"),
])
def test_bad_scoring_options_raise(kw, match):
    k = kw.pop("k", 2)
    with pytest.raises((ValueError, TypeError), match=match):
        sonic.topk_routing(_logits(4, 8), k, **kw)


# ---------------------------------------------------------------------------- token rounding


def naive_token_rounding(logits, k, tile, *, score, **opts):
    """SonicMoE Algorithm 4 over any scoring, per expert, with Python sorts: the set of
    (token, expert, weight) triples."""
    T, E = logits.shape
    scaling = opts.pop("scaling", 1.0)
    experts, weights = naive_route(logits, k, score=score, **opts)
    s = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
    out = {}
    for e in range(E):
        picks = {t: float(weights[t][experts[t].index(e)]) for t in range(T) if e in experts[t]}
        f = len(picks)
        r = min((f + tile // 2) // tile * tile, T)
        combined = {t: picks.get(t, float(s[t, e]) - 1) for t in range(T)}
        kept = sorted(range(T), key=lambda t: (-combined[t], t))[:r]
        for t in kept:
            out[(t, e)] = (picks[t] if t in picks else float(s[t, e])) * scaling
    return out


@pytest.mark.parametrize("score", ["topk_softmax", "sigmoid"])
def test_token_rounding_over_sigmoid_groups_and_bias(score):
    logits = _logits(40, 8, seed=9)
    bias = 0.05 * torch.randn(8, generator=torch.Generator().manual_seed(10))
    opts = dict(score=score, renormalize=False, bias=bias, n_group=4, topk_group=2)
    r = sonic.token_rounding_routing(logits, 2, tile=8, score=score, expert_bias=bias,
                                     n_group=4, topk_group=2, scaling_factor=2.0)
    expect = naive_token_rounding(logits, 2, 8, scaling=2.0, **opts)
    got = {(t, e): s for t, e, s in zip(r.token_idx.tolist(), r.expert_idx.tolist(),
                                        r.scores.tolist())}
    assert got.keys() == expect.keys()
    for key, value in expect.items():
        assert math.isclose(got[key], value, rel_tol=1e-12), key
    counts = torch.bincount(r.expert_idx.long(), minlength=8)
    assert (counts % 8 == 0).all() or (counts == 40).any()


# ---------------------------------------------------------------------------- aux losses


def naive_sequence_loss(logits, experts, seq_len, k, score):
    """DeepSeek-V3 eqs. 17–20 (without α), averaged over sequences."""
    T, E = logits.shape
    losses = []
    for start in range(0, T, seq_len):
        total = 0
        for i in range(E):
            f = E / (k * seq_len) * sum(i in experts[t] for t in range(start, start + seq_len))
            p = 0
            for t in range(start, start + seq_len):
                s = torch.sigmoid(logits[t]) if score == "sigmoid" else torch.softmax(logits[t], -1)
                p = p + s[i] / s.sum()
            total = total + f * p / seq_len
        losses.append(total)
    return sum(losses) / len(losses)


@pytest.mark.parametrize("score", ["topk_softmax", "sigmoid"])
@pytest.mark.parametrize("seq_len", [1, 5, 15])
def test_sequence_balance_loss_matches_paper(score, seq_len):
    logits = _logits(15, 6, seed=11).requires_grad_()
    r = sonic.topk_routing(logits, 2, score=score)
    got = sequence_balance_loss(logits, r, seq_len, score=score)
    experts = r.expert_idx.view(15, 2).tolist()
    expect = naive_sequence_loss(logits, experts, seq_len, 2, score)
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=0)
    g1, = torch.autograd.grad(got, logits)
    g2, = torch.autograd.grad(expect, logits)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-14)


def test_sequence_balance_loss_uniform_is_one_and_errors():
    # Every token routes to experts (t, t+1) mod E with equal logits: perfectly uniform.
    E, K, S = 4, 2, 4
    logits = torch.zeros(S, E, dtype=F64)
    tokens = torch.arange(S).repeat_interleave(K).to(torch.int32)
    experts = torch.stack([torch.arange(S), (torch.arange(S) + 1) % E], 1).flatten().int()
    r = sonic.Routing(tokens, experts, torch.ones(S * K, dtype=F64), S, E, top_k=K)
    torch.testing.assert_close(sequence_balance_loss(logits, r, S), torch.tensor(1.0, dtype=F64))
    with pytest.raises(ValueError, match="seq_len=3 must divide"):
        sequence_balance_loss(logits, r, 3)
    with pytest.raises(ValueError, match="logits has"):
        sequence_balance_loss(logits[:2], r, 2)


def test_router_z_loss_matches_st_moe():
    logits = _logits(11, 7, seed=12).requires_grad_()
    expect = sum(torch.log(torch.exp(logits[t]).sum()) ** 2 for t in range(11)) / 11
    torch.testing.assert_close(router_z_loss(logits), expect, rtol=1e-12, atol=0)
    assert router_z_loss(torch.zeros(0, 4)).item() == 0


# ---------------------------------------------------------------------------- the layer


def _layer(**kw):
    torch.manual_seed(0)
    return sonic.MoE(12, 6, 8, 2, dtype=F64, backend="torch", **kw)


def naive_layer(layer, x):
    tokens = x.reshape(-1, layer.d_model)
    logits = tokens @ layer.gate.weight.T
    bias = getattr(layer, "expert_bias", None)
    experts, weights = naive_route(logits, layer.top_k, score=layer.score,
                                   renormalize=layer.renormalize, bias=bias,
                                   n_group=layer.n_group, topk_group=layer.topk_group,
                                   scaling=layer.routed_scaling_factor)
    out = torch.zeros_like(tokens)
    rows = []
    for t in range(tokens.shape[0]):
        acc = 0
        for e, w in zip(experts[t], weights[t]):
            g, u = (layer.w1[e] @ tokens[t]).chunk(2)
            acc = acc + w * (layer.w2[e] @ (F.silu(g) * u))
        rows.append(acc)
    out = torch.stack(rows)
    return out.reshape(x.shape), logits, experts


def test_layer_with_deepseek_v3_routing_matches_naive():
    layer = _layer(score="sigmoid", renormalize=True, routed_scaling_factor=2.5, n_group=4,
                   topk_group=2, expert_bias=True, aux_loss_coef=0.01, seq_aux_loss_coef=0.003,
                   z_loss_coef=0.001)
    with torch.no_grad():
        layer.expert_bias.copy_(0.05 * torch.randn(8))
    x = torch.randn(3, 5, 12, dtype=F64, requires_grad=True)
    out, aux = layer(x, return_aux_loss=True)
    expect, logits, experts = naive_layer(layer, x)
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-12)
    r = layer.last_routing
    lb = sonic.load_balancing_loss(logits, r)
    seq = naive_sequence_loss(logits, experts, 5, 2, "sigmoid")
    z = sum(torch.logsumexp(logits[t], -1) ** 2 for t in range(15)) / 15
    torch.testing.assert_close(aux, 0.01 * lb + 0.003 * seq + 0.001 * z, rtol=1e-10, atol=0)
    dout = torch.randn_like(out)
    params = [x, layer.gate.weight, layer.w1, layer.w2]
    got = torch.autograd.grad((out * dout).sum() + aux, params)
    want = torch.autograd.grad((expect * dout).sum() + 0.01 * lb + 0.003 * seq + 0.001 * z,
                               params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_bias_update_follows_deepseek_v3_rule():
    gamma = 1e-3
    layer = _layer(score="sigmoid", bias_update_rate=gamma)
    assert "expert_bias" in layer.state_dict() and "tokens_per_expert" not in layer.state_dict()
    counts = torch.zeros(8)
    bias = torch.zeros(8)
    for step in range(3):
        for micro in range(2):          # counts accumulate over micro-batches
            x = torch.randn(7, 12, dtype=F64)
            layer(x).sum().backward()
            counts += torch.bincount(layer.last_routing.expert_idx.long(), minlength=8)
            # The selection used the bias as it stood.
            experts, _ = naive_route(x @ layer.gate.weight.T, 2, score="sigmoid", bias=bias)
            assert layer.last_routing.expert_idx.view(7, 2).tolist() == experts
        torch.testing.assert_close(layer.tokens_per_expert, counts)
        layer.update_expert_bias()
        for i in range(8):              # §2.1.2: overloaded −γ, underloaded +γ
            mean = counts.mean()
            bias[i] += -gamma if counts[i] > mean else gamma if counts[i] < mean else 0.0
        torch.testing.assert_close(layer.expert_bias, bias)
        assert not layer.expert_bias.requires_grad
        assert layer.tokens_per_expert.eq(0).all()
        counts.zero_()
    layer.eval()
    layer(torch.randn(5, 12, dtype=F64))
    assert layer.tokens_per_expert.eq(0).all(), "eval forwards must not count"
    copy = _layer(score="sigmoid", bias_update_rate=gamma)
    copy.load_state_dict(layer.state_dict())
    assert torch.equal(copy.expert_bias, layer.expert_bias)


def test_bias_update_balances_a_skewed_router():
    layer = _layer(score="sigmoid", bias_update_rate=0.002)
    with torch.no_grad():
        layer.gate.weight[0] += 0.5            # expert 0 is preferred by every token
    x = torch.randn(64, 12, dtype=F64, generator=torch.Generator().manual_seed(3))
    loads = []
    with torch.no_grad():
        for _ in range(300):
            layer(x)
            loads.append(layer.tokens_per_expert.max().item())
            layer.update_expert_bias()
    # The sign rule oscillates around balance; on average the hottest expert cools down.
    assert sum(loads[-50:]) / 50 < 0.75 * loads[0]


def test_layer_option_errors():
    with pytest.raises(ValueError, match="bias_update_rate"):
        _layer(bias_update_rate=-1.0)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        _layer(routed_scaling_factor=-2.0)
    with pytest.raises(ValueError, match="n_group=3 must divide"):
        _layer(n_group=3)
    with pytest.raises(ValueError, match="z_loss_coef"):
        _layer(z_loss_coef=float("inf"))
    with pytest.raises(RuntimeError, match="bias_update_rate > 0"):
        _layer().update_expert_bias()


def test_token_rounding_layer_uses_the_scoring():
    layer = _layer(score="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=3.0,
                   router="token_rounding", tile=4, bias_update_rate=0.01)
    x = torch.randn(20, 12, dtype=F64)
    out = layer(x)
    r = layer.last_routing.trim()
    logits = x @ layer.gate.weight.T
    expect = sonic.token_rounding_routing(logits, 2, tile=4, score="sigmoid", n_group=2,
                                          topk_group=1, scaling_factor=3.0,
                                          expert_bias=torch.zeros(8))
    assert torch.equal(r.expert_idx, expect.expert_idx)
    torch.testing.assert_close(r.scores, expect.scores)
    torch.testing.assert_close(layer.tokens_per_expert,
                               torch.bincount(r.expert_idx.long(), minlength=8).float())
    torch.testing.assert_close(out, sonic.moe_experts(x, layer.w1, layer.w2, expect.scores,
                                                      expect.token_idx, expect.expert_idx))


def test_expert_parallel_copy_refuses_options_it_cannot_carry():
    from sonic.distributed import ExpertParallelMoE
    layer = _layer(score="sigmoid", n_group=2, z_loss_coef=0.1, activation="gelu")
    assert layer.options_beyond() == ["score='sigmoid'", "activation='gelu'", "n_group=2",
                                      "z_loss_coef=0.1"]
    assert layer.options_beyond(("score", "n_group")) == ["activation='gelu'", "z_loss_coef=0.1"]
    assert _layer(score="topk_softmax").options_beyond() == []
    # The expert-parallel layer carries the routing options, the losses and the activations,
    # not shared experts.
    with pytest.raises(ValueError, match="cannot carry shared_expert_d=6 yet"):
        ExpertParallelMoE.from_moe(_layer(activation="gelu", num_shared_experts=1))


def test_update_expert_biases_reaches_every_layer():
    model = torch.nn.Sequential(_layer(score="sigmoid", bias_update_rate=0.1), _layer())
    model(torch.randn(6, 12, dtype=F64))
    counts = model[0].tokens_per_expert.clone()
    sonic.nn.update_expert_biases(model)
    torch.testing.assert_close(model[0].expert_bias, 0.1 * torch.sign(counts.mean() - counts))


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_unit_scaling_factor_adds_no_multiply_and_others_scale(router):
    """Eagerly a factor of 1 leaves the scores as the selection made them (no kernel, no
    autograd node: host time in host-bound steps); any other factor multiplies them,
    gradients included."""
    logits = _logits(64, 8, seed=4, dtype=torch.float32).requires_grad_()

    def route(scaling):
        if router == "topk":
            return sonic.topk_routing(logits, 2, scaling_factor=scaling)
        return sonic.token_rounding_routing(logits, 2, tile=8, padded=True,
                                            scaling_factor=scaling)

    one, scaled = route(1.0), route(2.5)
    assert "Mul" not in type(one.scores.grad_fn).__name__
    torch.testing.assert_close(scaled.scores, 2.5 * one.scores, rtol=0, atol=0)
    w = torch.randn(one.scores.shape[0], generator=torch.Generator().manual_seed(5))
    grads = [torch.autograd.grad((r.scores * w).sum(), logits)[0] for r in (one, scaled)]
    torch.testing.assert_close(grads[1], 2.5 * grads[0], rtol=1e-5, atol=1e-6)
