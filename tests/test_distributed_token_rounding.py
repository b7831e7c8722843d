"""Token rounding across EP ranks on CPU: gloo groups of 2 and 4 spawned ranks.

Each spawned run executes every case once and returns, per case, this rank's pairs with global
token indices, their scores and the logits gradient; the tests compare their union with
single-process :func:`sonic.token_rounding_routing` on the concatenated logits. The layer cases
compare :class:`ExpertParallelMoE` ``(router="token_rounding")`` with :class:`sonic.MoE` on the
concatenated batch (fp64, reference backend).
"""

import itertools

import pytest
import torch
import torch.distributed as dist

import sonic
from sonic.distributed import ExpertParallelMoE, ep_token_rounding_routing
from test_distributed import _rel, _spawn, layer_step

D, N = 8, 4
TOL = 1e-12

# Function cases: (dtype, rounding, tile, ties), each with its own seed; the sizes vary by seed.
ROUTING_CASES = list(itertools.product(("float32", "float64"), ("nearest", "up", "down"),
                                       (1, 4, 16), ("none", "rounded", "few_values")))
# Extra shapes: (name, tokens on rank r, E, K, tile, rounding, ties).
EDGE_CASES = {
    "rank_without_tokens": (lambda r, w: 0 if r == w - 1 else 9 + 4 * r, 6, 2, 4, "up",
                            "few_values"),
    "one_token_per_rank": (lambda r, w: 1, 4, 2, 4, "nearest", "none"),
    "k_equals_e": (lambda r, w: 5 + r, 4, 4, 16, "up", "none"),
    "repeated_rows": (lambda r, w: 20 + 3 * r, 8, 2, 16, "nearest", "repeated_rows"),
    "tile_larger_than_batch": (lambda r, w: 3 + r, 6, 2, 128, "nearest", "rounded"),
}
# Layer cases: (rounding, tile, whether the last rank has no tokens).
LAYER_CASES = [("nearest", 4, False), ("up", 16, False), ("down", 4, False),
               ("nearest", 16, False), ("up", 4, True)]


def _case_name(case):
    dtype, rounding, tile, ties = case
    return f"{dtype}-{rounding}-tile{tile}-{ties}"


def _layer_name(case):
    rounding, tile, last_empty = case
    return f"layer-{rounding}-tile{tile}" + ("-last_rank_empty" if last_empty else "")


def _logits(seed, counts, num_experts, dtype, ties):
    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    logits = torch.randn(total, num_experts, generator=g, dtype=torch.float64)
    if ties == "rounded":        # a handful of values: ties in picks' scores and non-picks' probs
        logits = (logits * 2).round() / 2
    elif ties == "few_values":   # three values only: whole columns tie at every boundary
        logits = torch.randint(0, 3, (total, num_experts), generator=g).to(torch.float64)
    elif ties == "repeated_rows":
        logits = logits[torch.arange(total) % 3]
    weights = torch.randn(total, num_experts, generator=g, dtype=torch.float64)
    return logits.to(dtype), weights.to(dtype)


def _routing_problem(seed, world, spec):
    """(counts per rank, full logits, loss weights, k, tile, rounding)."""
    if isinstance(spec, tuple) and len(spec) == 4:
        dtype, rounding, tile, ties = spec
        g = torch.Generator().manual_seed(1000 + seed)
        counts = [int(torch.randint(3, 40, (1,), generator=g)) for _ in range(world)]
        num_experts = int(torch.randint(4, 9, (1,), generator=g))
        k = int(torch.randint(1, 4, (1,), generator=g))
        dtype = getattr(torch, dtype)
    else:
        tokens_of, num_experts, k, tile, rounding, ties = EDGE_CASES[spec]
        counts = [tokens_of(r, world) for r in range(world)]
        dtype = torch.float64
    logits, weights = _logits(seed, counts, num_experts, dtype, ties)
    return counts, logits, weights, k, tile, rounding


def _routing_case(rank, world, seed, spec):
    counts, logits, weights, k, tile, rounding = _routing_problem(seed, world, spec)
    lo = sum(counts[:rank])
    mine = logits[lo:lo + counts[rank]].clone().requires_grad_()
    r = ep_token_rounding_routing(mine, k, group=None, tile=tile, rounding=rounding,
                                  backend="torch")
    tokens, experts = r.token_idx.long(), r.expert_idx.long()
    (r.scores * weights[lo + tokens, experts].to(r.scores.dtype)).sum().backward()
    return {"tokens": tokens + lo, "experts": experts, "scores": r.scores.detach(),
            "grad": mine.grad.clone(), "num_tokens": r.num_tokens,
            "pairs_ordered": bool(torch.all((experts * max(counts[rank], 1) + tokens).diff() > 0))}


def _layer_case(rank, world, rounding, tile, last_empty, seed):
    counts = [0 if last_empty and r == world - 1 else 5 + 7 * r for r in range(world)]
    torch.manual_seed(seed)
    full = sonic.MoE(D, N, 8, 2, router="token_rounding", tile=tile, rounding=rounding,
                     backend="torch", dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    grad_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    layer = ExpertParallelMoE.from_moe(full)
    lo, local = sum(counts[:rank]), 8 // world
    x, out, x_ref, out_ref, gate_grad = layer_step(layer, full, x_full, grad_full, counts, rank)
    experts = slice(rank * local, (rank + 1) * local)
    pairs = torch.tensor([layer.last_routing.num_pairs])
    dist.all_reduce(pairs)
    pairs_differ = float(pairs.item() != full.last_routing.trim().num_pairs)
    # Eval mode routes by top-K on both.
    layer.eval()
    full.eval()
    with torch.no_grad():
        out_eval = layer(x.detach())
        out_eval_ref = full(x_full)[lo:lo + counts[rank]]
    return {
        "out": _rel(out.detach(), out_ref.detach()[lo:lo + counts[rank]]),
        "x": _rel(x.grad, x_ref.grad[lo:lo + counts[rank]]),
        "gate": _rel(gate_grad, full.gate.weight.grad),
        "w1": _rel(layer.w1.grad, full.w1.grad[experts]),
        "w2": _rel(layer.w2.grad, full.w2.grad[experts]),
        "pairs": pairs_differ,
        "eval": _rel(out_eval, out_eval_ref),
        "eval_is_topk": float(layer.last_routing.top_k != 2),
    }


def _all_cases(rank, world):
    results = {}
    for seed, case in enumerate(ROUTING_CASES):
        results[_case_name(case)] = _routing_case(rank, world, seed, case)
    for seed, name in enumerate(EDGE_CASES):
        results[name] = _routing_case(rank, world, 500 + seed, name)
    for seed, case in enumerate(LAYER_CASES):
        results[_layer_name(case)] = _layer_case(rank, world, *case, seed)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"ep{w}")
def ep_results(request, tmp_path_factory):
    world = request.param
    return world, _spawn(world, _all_cases, tmp_path_factory.mktemp(f"eptr{world}"))


def _check_routing(world, results, name, seed, spec):
    counts, logits, weights, k, tile, rounding = _routing_problem(seed, world, spec)
    full = logits.clone().requires_grad_()
    ref = sonic.token_rounding_routing(full, k, tile=tile, rounding=rounding, backend="torch")
    tokens, experts = ref.token_idx.long(), ref.expert_idx.long()
    (ref.scores * weights[tokens, experts].to(ref.scores.dtype)).sum().backward()
    ref_scores = {(t, e): s for t, e, s in
                  zip(tokens.tolist(), experts.tolist(), ref.scores.tolist())}
    mine = {}
    for rank, result in enumerate(results):
        r = result[name]
        assert r["num_tokens"] == counts[rank]
        assert r["pairs_ordered"], rank          # grouped by expert, tokens ascending
        for t, e, s in zip(r["tokens"].tolist(), r["experts"].tolist(), r["scores"].tolist()):
            assert (t, e) not in mine
            mine[(t, e)] = s
    assert set(mine) == set(ref_scores), (name, sorted(set(mine) ^ set(ref_scores))[:10])
    assert mine == ref_scores                    # scores equal exactly
    grad = torch.cat([r[name]["grad"] for r in results])
    tol = TOL if logits.dtype == torch.float64 else 1e-6
    assert _rel(grad, full.grad) <= tol


@pytest.mark.parametrize("case", ROUTING_CASES, ids=_case_name)
def test_ep_token_rounding_equals_single_process(ep_results, case):
    world, results = ep_results
    _check_routing(world, results, _case_name(case), ROUTING_CASES.index(case), case)


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_ep_token_rounding_edge_cases(ep_results, name):
    world, results = ep_results
    _check_routing(world, results, name, 500 + list(EDGE_CASES).index(name), name)


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: _layer_name(c))
def test_ep_layer_token_rounding_matches_moe(ep_results, case):
    world, results = ep_results
    for rank, result in enumerate(results):
        errors = result[_layer_name(case)]
        assert all(v <= 1e-10 for v in errors.values()), (rank, sorted(errors.items()))


@pytest.mark.parametrize("kwargs,match", [
    ({"router": "expert_choice"}, "router must be one of 'topk', 'token_rounding'"),
    ({"router": "token_rounding", "rounding": "sideways"}, "rounding must be one of"),
    ({"router": "token_rounding", "tile": 0}, "tile")])
def test_layer_rejects_unknown_router_rounding_and_tile(kwargs, match):
    # Checked before the process group is looked at.
    with pytest.raises(ValueError, match=match):
        ExpertParallelMoE(D, N, 4, 2, **kwargs)
