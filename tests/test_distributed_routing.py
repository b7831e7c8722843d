"""Expert parallelism with the routing options that act before dispatch (sigmoid scores,
renormalisation, ``routed_scaling_factor``, group-limited routing, an expert bias and its
aux-loss-free update) and the sequence-wise and z losses, on gloo CPU ranks: the layer equals
single-process sonic on the concatenated batch, and with ``n_group`` a multiple of the EP size
a token's pairs reach at most ``topk_group`` ranks; token rounding rounds the choice these
options make, as on one process."""

import pytest
import torch

import sonic
from sonic.distributed import ExpertParallelMoE
from test_distributed import D, N, TOL, _catch, _rel, _spawn, layer_step

E, K = 16, 4
OPTIONS = dict(score="sigmoid", renormalize=True, routed_scaling_factor=2.5, n_group=4,
               topk_group=2, expert_bias=True)


def _ranks_per_token(routing, num_ranks):
    """Distinct EP ranks (contiguous placement) each token's pairs go to, ``(T,)``."""
    hit = torch.zeros(routing.num_tokens, num_ranks, dtype=torch.bool)
    rank_of = routing.expert_idx.long() // (routing.num_experts // num_ranks)
    hit[routing.token_idx.long(), rank_of] = True
    return hit.sum(1)


def _routing_case(rank, world):
    torch.manual_seed(0)
    full = sonic.MoE(D, N, E, K, backend="torch", dtype=torch.float64, **OPTIONS)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # A bias large enough to change choices, and a router spread enough to separate groups.
        full.expert_bias.copy_(torch.randn(E, generator=g) * 0.3)
        full.gate.weight.normal_(generator=g)
    counts = [5 + 3 * r for r in range(world)]
    x_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    grad_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    layer = ExpertParallelMoE.from_moe(full)
    x, out, x_ref, out_ref, gate_grad = layer_step(layer, full, x_full, grad_full, counts, rank)
    lo, local = sum(counts[:rank]), E // world
    experts = slice(rank * local, (rank + 1) * local)
    result = {
        "out": _rel(out.detach(), out_ref.detach()[lo:lo + counts[rank]]),
        "x": _rel(x.grad, x_ref.grad[lo:lo + counts[rank]]),
        "gate": _rel(gate_grad, full.gate.weight.grad),
        "w1": _rel(layer.w1.grad, full.w1.grad[experts]),
        "w2": _rel(layer.w2.grad, full.w2.grad[experts]),
    }
    # The same pairs and scores as the single-process routing of this rank's rows.
    mine, ref = layer.last_routing, full.last_routing
    ref_rows = (ref.token_idx >= lo) & (ref.token_idx < lo + counts[rank])
    same = (torch.equal(mine.token_idx, ref.token_idx[ref_rows] - lo)
            and torch.equal(mine.expert_idx, ref.expert_idx[ref_rows]))
    result["pairs_differ"] = float(not same)
    result["scores"] = _rel(mine.scores, ref.scores[ref_rows]) if same else 1.0
    result["ranks_per_token"] = _ranks_per_token(mine, world).tolist()
    # Without group limiting the same router sends tokens to more ranks: the bound is the
    # groups' doing.
    free = ExpertParallelMoE.from_moe(sonic.MoE(D, N, E, K, backend="torch", dtype=torch.float64,
                                                score="sigmoid"))
    with torch.no_grad():
        free.gate.weight.copy_(full.gate.weight)
    free(x.detach())
    result["free_ranks_per_token"] = _ranks_per_token(free.last_routing, world).tolist()
    # Token rounding under EP rounds the choice these options make, as one process does.
    for moe in (layer, full):
        moe.router, moe.tile = "token_rounding", 4
        moe.zero_grad(set_to_none=True)
    x, out, x_ref, out_ref, gate_grad = layer_step(layer, full, x_full, grad_full, counts, rank)
    ref = full.last_routing.trim()
    ref_rows = (ref.token_idx >= lo) & (ref.token_idx < lo + counts[rank])
    mine = layer.last_routing
    same = (torch.equal(mine.token_idx, ref.token_idx[ref_rows] - lo)
            and torch.equal(mine.expert_idx, ref.expert_idx[ref_rows]))
    result["tr_pairs_differ"] = float(not same)
    result["tr_rounded"] = float(not torch.equal(
        torch.bincount(ref.expert_idx.long(), minlength=E) % 4, torch.zeros(E, dtype=torch.long)))
    result["tr"] = {
        "out": _rel(out.detach(), out_ref.detach()[lo:lo + counts[rank]]),
        "x": _rel(x.grad, x_ref.grad[lo:lo + counts[rank]]),
        "gate": _rel(gate_grad, full.gate.weight.grad),
        "w1": _rel(layer.w1.grad, full.w1.grad[experts]),
        "w2": _rel(layer.w2.grad, full.w2.grad[experts]),
        "scores": _rel(mine.scores, ref.scores[ref_rows]) if same else 1.0,
    }
    return result


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"ep{w}")
def routing_results(request, tmp_path_factory):
    world = request.param
    return world, _spawn(world, _routing_case, tmp_path_factory.mktemp(f"routing{world}"))


def test_ep_routing_options_match_single_process(routing_results):
    _, results = routing_results
    for rank, r in enumerate(results):
        errors = {k: r[k] for k in ("out", "x", "gate", "w1", "w2", "scores")}
        assert r["pairs_differ"] == 0, rank
        assert all(v <= TOL for v in errors.values()), (rank, errors)


def test_group_limited_routing_bounds_the_ranks_a_token_reaches(routing_results):
    world, results = routing_results
    limited = [n for r in results for n in r["ranks_per_token"]]
    assert max(limited) <= OPTIONS["topk_group"] and min(limited) >= 1
    if world == 4:
        assert max(limited) == 2
        assert max(n for r in results for n in r["free_ranks_per_token"]) > 2


def test_ep_token_rounding_with_routing_options_matches_single_process(routing_results):
    """Sigmoid scores, renormalisation, a scaling factor, groups and a bias: EP token rounding
    keeps the pairs single-process token rounding keeps on the whole batch (every expert a
    multiple of the tile), with the same output and gradients."""
    for rank, r in enumerate(routing_results[1]):
        assert r["tr_pairs_differ"] == 0 and r["tr_rounded"] == 0, rank
        assert all(v <= TOL for v in r["tr"].values()), (rank, r["tr"])


def _balancing_case(rank, world):
    """Aux-loss-free balancing and the sequence-wise / z losses under EP against one process
    on the concatenated batch: three training steps of forward, backward and bias update."""
    torch.manual_seed(0)
    options = dict(score="sigmoid", bias_update_rate=0.05, seq_aux_loss_coef=0.01,
                   z_loss_coef=0.001, aux_loss_coef=0.01)
    full = sonic.MoE(D, N, E, K, backend="torch", dtype=torch.float64, **options)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        full.gate.weight.normal_(generator=g)
    layer = ExpertParallelMoE.from_moe(full)
    counts = [6 + 2 * r for r in range(world)]
    lo = sum(counts[:rank])
    result = {"out": 0.0, "aux": 0.0, "bias_equal": True, "bias_moved": False}
    for _ in range(3):
        x_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
        out, aux = layer(x_full[lo:lo + counts[rank]], return_aux_loss=True)
        (out.sum() + aux).backward()
        with torch.no_grad():
            out_ref = full(x_full)
            # The per-rank losses: the single-process layer on this rank's tokens alone.
            _, aux_ref = full(x_full[lo:lo + counts[rank]], return_aux_loss=True)
        # The single-process counts cover the whole batch once; the rank-only forward above
        # counted this rank's tokens a second time.
        full.tokens_per_expert.zero_()
        full(x_full)
        result["out"] = max(result["out"], _rel(out.detach(), out_ref[lo:lo + counts[rank]]))
        result["aux"] = max(result["aux"], abs(aux.item() - aux_ref.item()))
        layer.update_expert_bias()
        full.update_expert_bias()
        result["bias_equal"] &= torch.equal(layer.expert_bias, full.expert_bias)
    result["bias_moved"] = bool(full.expert_bias.abs().sum() > 0)
    return result


def test_ep_aux_loss_free_balancing_and_losses_match_single_process(tmp_path):
    for r in _spawn(2, _balancing_case, tmp_path):
        assert r["bias_equal"] and r["bias_moved"], r
        assert r["out"] <= TOL and r["aux"] <= 1e-12, r


@pytest.mark.parametrize("kwargs, named", [
    (dict(num_shared_experts=1), "shared_expert_d=4"),
    (dict(num_shared_experts=1, activation="gelu"), "shared_expert_d=4"),
])
def test_from_moe_names_the_options_it_cannot_carry(kwargs, named):
    moe = sonic.MoE(D, N, E, K, backend="torch", **OPTIONS, **kwargs)
    with pytest.raises(ValueError, match=f"cannot carry {named}"):
        ExpertParallelMoE.from_moe(moe)


def _bad_scoring_case(rank, world):
    logits = torch.randn(6, E, dtype=torch.float64)
    return {name: _catch(lambda kw=kw: sonic.distributed.ep_token_rounding_routing(
                logits, K, tile=2, **kw))
            for name, kw in (("score", dict(score="bogus")),
                             ("scaling_factor", dict(scaling_factor=-1.0)),
                             ("n_group", dict(n_group=3)),
                             ("expert_bias", dict(expert_bias=torch.zeros(E - 1))))}


def test_ep_token_rounding_checks_its_scoring_options(tmp_path):
    (r,) = _spawn(1, _bad_scoring_case, tmp_path)
    assert r["score"].startswith("ValueError: score must be one of"), r
    assert "scaling_factor must be finite and > 0" in r["scaling_factor"], r
    assert f"n_group=3 must divide num_experts={E}" in r["n_group"], r
    assert f"expert_bias must have shape (E={E},)" in r["expert_bias"], r
