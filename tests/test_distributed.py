"""Expert parallelism on CPU: gloo process groups of 1, 2 and 4 spawned ranks.

Each spawned run executes every case once and saves per-case relative errors; the tests below
read them. Every rank builds the whole problem from one seed, runs its share expert-parallel,
and compares with single-process sonic on the concatenated batch (fp64, reference backend).
"""

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sonic
from sonic.distributed import (ExpertLoad, ExpertParallelMoE, Placement, ep_moe_experts,
                               plan_placement, reduce_replica_grads)
from _benchmarks import load_benchmark

D, N = 8, 4
TOL = 1e-10


def _entry(rank, world, tmp, target, pg_timeout, synced_exit):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
    result = target(rank, world)
    torch.save(result, f"{tmp}/rank{rank}.pt")
    # A rank that tears its gloo pairs down while a peer still uses them can die in gloo's
    # worker threads (std::terminate, SIGABRT; seen once in CI): leave together. A target
    # that breaks the group on purpose (a peer that never joins) cannot meet at a barrier.
    if synced_exit:
        dist.barrier()
    dist.destroy_process_group()


def _spawn(world, target, tmp_path, *, pg_timeout=30, timeout=120, synced_exit=True):
    """Run ``target(rank, world)`` on ``world`` gloo ranks; their results, by rank. Never
    hangs: past ``timeout`` the ranks are killed and the test fails. ``synced_exit=False``
    for targets that leave the process group unusable on purpose."""
    ctx = mp.start_processes(_entry, args=(world, str(tmp_path), target, pg_timeout,
                                           synced_exit),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks still running after {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _rel(a, b):
    assert a.shape == b.shape
    scale = b.norm()
    return ((a - b).norm() / (scale if scale > 0 else 1)).item()


# --- the layer: ExpertParallelMoE against sonic.MoE -------------------------------------------

LAYER_CASES = {
    # name: (tokens on rank r, E, K, forced routing[, activation, num_chunks])
    "topk_ragged": (lambda r: 2 + 3 * r, 8, 2, None),
    "tokens_1": (lambda r: 1, 8, 2, None),
    "k_equals_e": (lambda r: 3, 4, 4, None),
    "empty_expert": (lambda r: 4 + r, 8, 2, "empty_expert"),
    "rank_without_tokens": (lambda r: 5, 8, 3, "last_rank"),
    # Other activations: gated (w1 (E/ep, 2n, d)) unchunked, non-gated (w1 (E/ep, n, d))
    # through the chunked pipeline.
    "geglu": (lambda r: 2 + 3 * r, 8, 2, None, "geglu", 1),
    "relu2_chunked": (lambda r: 6 + r, 8, 2, None, "relu2", 2),
}


def layer_step(layer, full, x_full, grad_full, counts, rank):
    """One backward of the EP ``layer`` on this rank's rows of ``x_full`` and of the
    single-process ``full`` on all of them (same ``grad_full``): ``(x, out, x_ref, out_ref,
    router gradient summed over ranks)``."""
    lo = sum(counts[:rank])
    x = x_full[lo:lo + counts[rank]].clone().requires_grad_()
    out = layer(x)
    (out * grad_full[lo:lo + counts[rank]]).sum().backward()
    x_ref = x_full.clone().requires_grad_()
    out_ref = full(x_ref)
    (out_ref * grad_full).sum().backward()
    gate_grad = layer.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    return x, out, x_ref, out_ref, gate_grad


def _layer_case(rank, world, name, seed):
    tokens_of, num_experts, top_k, forced, *extra = LAYER_CASES[name]
    activation, num_chunks = extra or ("swiglu", 1)
    torch.manual_seed(seed)
    full = sonic.MoE(D, N, num_experts, top_k, backend="torch", dtype=torch.float64,
                     activation=activation)
    counts = [tokens_of(r) for r in range(world)]
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    grad_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    local = num_experts // world
    avoided = []
    if forced is not None:
        # Feature 0 is positive for every token; a large negative router weight on it keeps
        # the avoided experts out of every token's top K.
        x_full[:, 0] = x_full[:, 0].abs() + 1
        avoided = [1] if forced == "empty_expert" else list(range(num_experts - local, num_experts))
        with torch.no_grad():
            full.gate.weight[avoided, 0] = -10.0
    layer = ExpertParallelMoE.from_moe(full, num_chunks=num_chunks)
    lo = sum(counts[:rank])
    x, out, x_ref, out_ref, gate_grad = layer_step(layer, full, x_full, grad_full, counts, rank)
    experts = slice(rank * local, (rank + 1) * local)
    picked = layer.last_routing.expert_idx.long()
    # The aux loss is MoE's, of this rank's tokens: returned, or collected like a MoE layer's.
    layer.aux_loss_coef = full.aux_loss_coef = 0.01
    x_local = x.detach()
    _, aux = layer(x_local, return_aux_loss=True)
    with sonic.collect_aux_losses(layer) as collected:
        layer(x_local)
    _, aux_ref = full(x_local, return_aux_loss=True)
    return {
        "aux": _rel(aux.detach(), aux_ref.detach()),
        "aux_collected": float(len(collected) != 1 or not torch.equal(collected[0], aux)),
        "out": _rel(out.detach(), out_ref.detach()[lo:lo + counts[rank]]),
        "x": _rel(x.grad, x_ref.grad[lo:lo + counts[rank]]),
        "gate": _rel(gate_grad, full.gate.weight.grad),
        "w1": _rel(layer.w1.grad, full.w1.grad[experts]),
        "w2": _rel(layer.w2.grad, full.w2.grad[experts]),
        "avoided_routed": bool(torch.isin(picked, torch.tensor(avoided, dtype=torch.long)).any()),
    }


# --- the function: ep_moe_experts against sonic.moe_experts on hand-built pairs --------------

PAIR_CASES = {
    # name: (tokens on rank r, E, experts a pair may pick)
    "pairs_ragged": (lambda r: 3 + 2 * r, 8, "any"),
    "pairs_rank_gets_nothing": (lambda r: 4, 8, "not_last_rank"),
    "pairs_rank_without_tokens": (lambda r: 0 if r == 1 else 4, 8, "any"),
}


def _pairs(g, num_tokens, choices):
    """0..len(choices) distinct experts per token (tokens without any included)."""
    token_idx, expert_idx = [], []
    for t in range(num_tokens):
        k = int(torch.randint(0, len(choices) + 1, (1,), generator=g))
        picked = choices[torch.randperm(len(choices), generator=g)[:k]]
        token_idx += [t] * k
        expert_idx += picked.tolist()
    return torch.tensor(token_idx, dtype=torch.int32), torch.tensor(expert_idx, dtype=torch.int64)


def _pairs_problem(g, counts, per_rank, num_experts, rank):
    """Random fp64 data for hand-built pairs ``per_rank`` (each rank's local ``(tokens,
    experts)``): the concatenated batch, weights, scores, dO and global pairs, then this rank's
    token and pair offsets and its pairs."""
    x_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    w1 = torch.randn(num_experts, 2 * N, D, generator=g, dtype=torch.float64) / D ** 0.5
    w2 = torch.randn(num_experts, D, N, generator=g, dtype=torch.float64) / N ** 0.5
    scores_full = torch.rand(sum(len(t) for t, _ in per_rank), generator=g, dtype=torch.float64)
    grad_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    starts = torch.tensor([0] + counts).cumsum(0)
    tok_full = torch.cat([t + starts[r] for r, (t, _) in enumerate(per_rank)]).to(torch.int32)
    exp_full = torch.cat([e for _, e in per_rank])
    lo, p_lo = sum(counts[:rank]), sum(len(t) for t, _ in per_rank[:rank])
    tok, exp = per_rank[rank]
    return (x_full, w1, w2, scores_full, grad_full, tok_full, exp_full, lo, p_lo, tok, exp)


def _pairs_case(rank, world, name, seed):
    tokens_of, num_experts, allowed = PAIR_CASES[name]
    local = num_experts // world
    g = torch.Generator().manual_seed(seed)
    top = num_experts - local if allowed == "not_last_rank" and world > 1 else num_experts
    choices = torch.arange(top)
    counts = [tokens_of(r) for r in range(world)]
    per_rank = [_pairs(g, c, choices) for c in counts]
    (x_full, w1, w2, scores_full, grad_full, tok_full, exp_full,
     lo, p_lo, tok, exp) = _pairs_problem(g, counts, per_rank, num_experts, rank)
    experts = slice(rank * local, (rank + 1) * local)
    x = x_full[lo:lo + counts[rank]].clone().requires_grad_()
    s = scores_full[p_lo:p_lo + len(tok)].clone().requires_grad_()
    w1_local = w1[experts].clone().requires_grad_()
    w2_local = w2[experts].clone().requires_grad_()
    out = ep_moe_experts(x, w1_local, w2_local, s, tok, exp, group=None,
                         num_experts=num_experts, backend="torch")
    (out * grad_full[lo:lo + counts[rank]]).sum().backward()

    ref_in = [t.clone().requires_grad_() for t in (x_full, w1, w2, scores_full)]
    out_ref = sonic.moe_experts(*ref_in[:3], ref_in[3], tok_full, exp_full, backend="torch")
    (out_ref * grad_full).sum().backward()
    x_ref, w1_ref, w2_ref, s_ref = ref_in
    return {
        "out": _rel(out.detach(), out_ref.detach()[lo:lo + counts[rank]]),
        "x": _rel(x.grad, x_ref.grad[lo:lo + counts[rank]]),
        "scores": _rel(s.grad, s_ref.grad[p_lo:p_lo + len(tok)]),
        "w1": _rel(w1_local.grad, w1_ref.grad[experts]),
        "w2": _rel(w2_local.grad, w2_ref.grad[experts]),
    }


# --- EPLB: the layer and the function with a replicated-expert placement --------------------

def _eplb_layer_case(rank, world, seed):
    """Skewed routing (experts 0 and 1 hot), a plan from the measured load with one redundant
    slot per rank, the layer from ``from_moe(placement=)``; replica gradients reduced."""
    num_experts, top_k = 8, 2
    torch.manual_seed(seed)
    full = sonic.MoE(D, N, num_experts, top_k, backend="torch", dtype=torch.float64)
    counts = [6 + r for r in range(world)]
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    grad_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    x_full[:, 0] = x_full[:, 0].abs() + 1
    with torch.no_grad():
        full.gate.weight[0, 0], full.gate.weight[1, 0] = 3.0, 1.0

    x_ref = x_full.clone().requires_grad_()
    out_ref = full(x_ref)
    (out_ref * grad_full).sum().backward()
    measured = ExpertLoad(num_experts)
    measured.update(full.last_routing)
    placement = plan_placement(measured.counts(), world, num_experts // world + 1)

    layer = ExpertParallelMoE.from_moe(full, placement=placement)
    layer.expert_load = ExpertLoad(num_experts)
    lo = sum(counts[:rank])
    x = x_full[lo:lo + counts[rank]].clone().requires_grad_()
    out = layer(x)
    (out * grad_full[lo:lo + counts[rank]]).sum().backward()
    mine = placement.rank_experts(rank)
    replicated = placement.replica_counts()[mine] > 1
    # Every replica slot got some of its expert's pairs (the split happened) ...
    split = bool((layer.w1.grad[replicated].flatten(1).abs().sum(1) > 0).all())
    layer.reduce_replica_grads()
    gate_grad = layer.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    # Replicas of a freshly built layer start equal on all ranks.
    fresh = ExpertParallelMoE(D, N, num_experts, top_k, placement=placement, backend="torch",
                              dtype=torch.float64)
    gathered = [torch.empty_like(fresh.w1.data) for _ in range(world)]
    dist.all_gather(gathered, fresh.w1.data)
    slots = torch.cat(gathered)
    unequal = sum(float((slots[placement.replicas(e)] - slots[placement.replicas(e)[0]])
                        .abs().max()) for e in range(num_experts))
    return {
        "out": _rel(out.detach(), out_ref.detach()[lo:lo + counts[rank]]),
        "x": _rel(x.grad, x_ref.grad[lo:lo + counts[rank]]),
        "gate": _rel(gate_grad, full.gate.weight.grad),
        "w1": _rel(layer.w1.grad, full.w1.grad[mine]),
        "w2": _rel(layer.w2.grad, full.w2.grad[mine]),
        "load": float((layer.expert_load.counts(all_reduce=True) - measured.counts()).abs().sum()),
        "fresh_replicas_unequal": unequal,
        "replicas": int(placement.replica_counts().max()),
        "split": split,
    }


def _eplb_pairs_case(rank, world, seed):
    """``ep_moe_experts`` with a hand-made placement: one extra slot per rank, all holding
    expert 0 — so expert 0 has world + 1 replicas, two of them on rank 0."""
    num_experts = 8
    local = num_experts // world
    slot_expert = torch.cat([torch.cat([torch.arange(r * local, (r + 1) * local),
                                        torch.tensor([0])]) for r in range(world)])
    placement = Placement(slot_expert, world, local + 1, num_experts)
    g = torch.Generator().manual_seed(seed)
    counts = [5 + r for r in range(world)]
    per_rank = [_pairs(g, c, torch.arange(num_experts)) for c in counts]
    (x_full, w1, w2, scores_full, grad_full, tok_full, exp_full,
     lo, p_lo, tok, exp) = _pairs_problem(g, counts, per_rank, num_experts, rank)
    mine = placement.rank_experts(rank)
    x = x_full[lo:lo + counts[rank]].clone().requires_grad_()
    s = scores_full[p_lo:p_lo + len(tok)].clone().requires_grad_()
    w1_local = w1[mine].clone().requires_grad_()
    w2_local = w2[mine].clone().requires_grad_()
    out = ep_moe_experts(x, w1_local, w2_local, s, tok, exp, group=None,
                         num_experts=num_experts, backend="torch", placement=placement)
    (out * grad_full[lo:lo + counts[rank]]).sum().backward()
    reduce_replica_grads([w1_local, w2_local], placement)

    ref_in = [t.clone().requires_grad_() for t in (x_full, w1, w2, scores_full)]
    out_ref = sonic.moe_experts(*ref_in[:3], ref_in[3], tok_full, exp_full, backend="torch")
    (out_ref * grad_full).sum().backward()
    x_ref, w1_ref, w2_ref, s_ref = ref_in
    result = {
        "out": _rel(out.detach(), out_ref.detach()[lo:lo + counts[rank]]),
        "x": _rel(x.grad, x_ref.grad[lo:lo + counts[rank]]),
        "scores": _rel(s.grad, s_ref.grad[p_lo:p_lo + len(tok)]),
        "w1": _rel(w1_local.grad, w1_ref.grad[mine]),
        "w2": _rel(w2_local.grad, w2_ref.grad[mine]),
    }
    # Ranks holding different placements: raised on every rank by the count exchange.
    if world > 1:
        other = Placement(slot_expert.roll(rank), world, local + 1, num_experts)
        result["disagree"] = _catch(lambda: ep_moe_experts(
            x.detach(), w1_local.detach(), w2_local.detach(), s.detach(), tok, exp, group=None,
            num_experts=num_experts, backend="torch", placement=other))
    return result


EPLB_CASES = {"eplb_layer": _eplb_layer_case, "eplb_pairs": _eplb_pairs_case}


def _all_cases(rank, world):
    results = {}
    for seed, name in enumerate(LAYER_CASES):
        results[name] = _layer_case(rank, world, name, seed)
    for seed, name in enumerate(PAIR_CASES):
        results[name] = _pairs_case(rank, world, name, 100 + seed)
    for seed, (name, case) in enumerate(EPLB_CASES.items()):
        results[name] = case(rank, world, 200 + seed)
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"ep{w}")
def ep_results(request, tmp_path_factory):
    world = request.param
    return world, _spawn(world, _all_cases, tmp_path_factory.mktemp(f"ep{world}"))


@pytest.mark.parametrize("case", [*LAYER_CASES, *PAIR_CASES])
def test_ep_matches_single_process(ep_results, case):
    world, results = ep_results
    if case in ("rank_without_tokens", "pairs_rank_without_tokens") and world == 1:
        pytest.skip("needs a second rank")
    for rank, result in enumerate(results):
        errors = {k: v for k, v in result[case].items() if k != "avoided_routed"}
        assert all(v <= TOL for v in errors.values()), (rank, errors)
        assert not result[case].get("avoided_routed", False), rank


@pytest.mark.parametrize("case", EPLB_CASES)
def test_eplb_placement_matches_single_process(ep_results, case):
    """A replicated-expert placement: output, dX, scores / router gradient (summed over ranks)
    and every expert's weight gradient, replicas' reduced by ``reduce_replica_grads``, equal
    single-process sonic on the concatenated batch."""
    world, results = ep_results
    flags = ("replicas", "split", "disagree", "load", "fresh_replicas_unequal")
    for rank, result in enumerate(results):
        errors = {k: v for k, v in result[case].items() if k not in flags}
        assert errors and all(v <= TOL for v in errors.values()), (rank, errors)
        if case == "eplb_layer":
            assert result[case]["replicas"] >= 2 and result[case]["split"], rank
            assert result[case]["load"] == 0 and result[case]["fresh_replicas_unequal"] == 0
        if world > 1 and case == "eplb_pairs":
            assert "EP ranks disagree on placement" in result[case]["disagree"], rank


# --- errors -----------------------------------------------------------------------------------

def _catch(fn):
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _error_cases(rank, world):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, D, generator=g)
    tok = torch.tensor([0, 1, 2], dtype=torch.int32)
    exp = torch.tensor([0, 3, 1])
    s = torch.rand(3, generator=g)
    w1, w2 = torch.randn(2, 2 * N, D), torch.randn(2, D, N)

    def call(x=x, w1=w1, w2=w2, exp=exp, num_experts=4, group=None):
        return ep_moe_experts(x, w1, w2, s, tok, exp, group=group, num_experts=num_experts,
                              backend="torch")

    out = {
        "indivisible": _catch(lambda: call(num_experts=3)),
        "wrong_local_experts": _catch(lambda: call(num_experts=8)),
        "disagree_d": _catch(lambda: call(
            x=torch.randn(3, D + rank), w1=torch.randn(2, 2 * N, D + rank),
            w2=torch.randn(2, D + rank, N))),
        "index_out_of_range": _catch(lambda: call(exp=exp + 2 * rank)),
        "disagree_top_k": _catch(lambda: ExpertParallelMoE(D, N, 4, 1 + rank, backend="torch")),
        "unknown_router": _catch(lambda: ExpertParallelMoE(D, N, 4, 2, router="expert_choice")),
        "unknown_transport": _catch(lambda: ExpertParallelMoE(D, N, 4, 2, transport="nvshmem")),
        # Peer memory needs CUDA ranks of one host: refused on every gloo rank, after the
        # count exchange (so a rank that asks for it cannot leave the others waiting).
        "copy_engine_on_gloo": _catch(lambda: ExpertParallelMoE(
            D, N, 4, 2, backend="torch", transport="copy_engine")(x)),
    }
    # "auto" falls back to torch.distributed: the same result as "nccl".
    torch.manual_seed(3)
    layer = ExpertParallelMoE(D, N, 4, 2, backend="torch", dtype=torch.float64)
    x64 = x.double()
    reference = layer(x64)
    layer.transport = "auto"
    out["auto_equal"] = torch.equal(layer(x64), reference)
    # A group that only rank 0 belongs to: size 1 runs locally there; rank 1 is no member.
    solo = dist.new_group([0])
    out["solo_group"] = _catch(lambda: call(w1=torch.randn(4, 2 * N, D),
                                            w2=torch.randn(4, D, N), group=solo))
    dist.barrier()
    # Rank 1 never joins: rank 0's count exchange must end at the process group's timeout.
    if rank == 0:
        start = time.monotonic()
        out["peer_missing"] = _catch(call)
        out["waited_s"] = time.monotonic() - start
    else:
        time.sleep(5)
    return out


def test_errors_are_raised_on_every_rank(tmp_path):
    r0, r1 = _spawn(2, _error_cases, tmp_path, pg_timeout=3, timeout=90,
                    synced_exit=False)
    for r in (r0, r1):
        assert "num_experts=3 must be divisible by the EP size 2" in r["indivisible"]
        assert "w1_local must have shape (E/ep=4" in r["wrong_local_experts"]
        assert "EP ranks disagree on d (x.shape[1])" in r["disagree_d"]
        assert "out of range" in r["index_out_of_range"]
        assert "EP ranks disagree on top_k" in r["disagree_top_k"]
        assert "router must be one of 'topk', 'token_rounding'" in r["unknown_router"]
        assert "transport must be one of 'nccl', 'copy_engine', 'auto'" in \
            r["unknown_transport"]
        assert r["copy_engine_on_gloo"].startswith("ValueError: transport='copy_engine' needs "
                                                   "CUDA tensors and an NCCL group")
        assert r["auto_equal"]
    assert "EP rank 1" in r0["index_out_of_range"]
    assert "this rank" in r1["index_out_of_range"]
    assert r0["solo_group"] == "no error"
    assert "not a member" in r1["solo_group"]
    # gloo reports the expired 3 s process-group timeout as a RuntimeError.
    assert r0["peer_missing"].startswith("RuntimeError") and 2 < r0["waited_s"] < 15


@pytest.mark.parametrize("name", ["bench_ep", "bench_ep_transport"])
def test_nccl_benchmarks_import_without_a_gpu(name):
    load_benchmark(name)


def test_uninitialised_process_group():
    assert not dist.is_initialized()
    x = torch.randn(2, D)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ep_moe_experts(x, torch.randn(1, 2 * N, D), torch.randn(1, D, N), torch.rand(2),
                       torch.tensor([0, 1]), torch.tensor([0, 0]), group=None, num_experts=1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelMoE(D, N, 4, 2)


# --- settings the ranks must agree on, checked in every forward ------------------------------

def _settings_cases(rank, world):
    """Each case changes one setting on the last rank only after construction; every case
    must raise on every rank at the same exchange, so the group stays usable for the next."""
    torch.manual_seed(0)
    num_experts = 2 * world
    layer = ExpertParallelMoE(D, N, num_experts, 2, backend="torch", dtype=torch.float64, tile=2)
    x = torch.randn(5 + rank, D, dtype=torch.float64)
    last = rank == world - 1
    out = {}

    def case(name, change, run=lambda: layer(x)):
        saved = {k: getattr(layer, k) for k in ("router", "tile", "top_k", "score",
                                                "renormalize", "rounding", "training",
                                                "routed_scaling_factor", "n_group",
                                                "transport", "bias_update_rate")}
        if last:
            change()
        out[name] = _catch(run)
        for k, v in saved.items():
            setattr(layer, k, v)
        layer.train(saved["training"])

    case("agree", lambda: None)
    layer.router = "token_rounding"
    case("agree_token_rounding", lambda: None)
    case("tile", lambda: setattr(layer, "tile", 4))
    # A rank whose scoring token rounding refuses still meets the others' first exchange.
    case("score_token_rounding", lambda: setattr(layer, "score", "sigmoid"))
    case("rounding", lambda: setattr(layer, "rounding", "up"))
    case("top_k_token_rounding", lambda: setattr(layer, "top_k", 1))
    case("training", lambda: layer.eval())
    case("router", lambda: setattr(layer, "router", "topk"))
    layer.router = "topk"
    case("top_k", lambda: setattr(layer, "top_k", 3))
    case("score", lambda: setattr(layer, "score", "topk_softmax"))
    case("renormalize", lambda: setattr(layer, "renormalize", True))
    case("routed_scaling_factor", lambda: setattr(layer, "routed_scaling_factor", 2.5))
    case("n_group", lambda: setattr(layer, "n_group", 2))
    case("transport", lambda: setattr(layer, "transport", "auto"))
    case("bias_update_rate", lambda: setattr(layer, "bias_update_rate", 0.5))
    # The functional forms: scores of another dtype; token rounding of another tile.
    w1, w2 = layer.w1.detach(), layer.w2.detach()
    tok = torch.arange(3, dtype=torch.int32)
    exp = torch.tensor([0, 1, 3])
    scores = torch.rand(3, dtype=torch.float32 if last else torch.float64)
    out["scores_dtype"] = _catch(lambda: ep_moe_experts(
        x[:3], w1, w2, scores, tok, exp, group=None, num_experts=num_experts, backend="torch"))
    out["activation"] = _catch(lambda: ep_moe_experts(
        x[:3], w1, w2, scores.double(), tok, exp, group=None, num_experts=num_experts,
        backend="torch", activation="geglu" if last else "swiglu"))
    logits = torch.randn(6, num_experts, dtype=torch.float64)
    out["tr_tile"] = _catch(lambda: sonic.distributed.ep_token_rounding_routing(
        logits, 2, tile=8 if last else 2))
    out["tr_dtype"] = _catch(lambda: sonic.distributed.ep_token_rounding_routing(
        logits.float() if last else logits, 2, tile=2))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_disagreeing_on_a_setting_raise_on_every_rank(tmp_path, world):
    results = _spawn(world, _settings_cases, tmp_path, pg_timeout=20, timeout=120)
    expected = {"tile": "tile: 2 on EP rank", "rounding": "rounding: 'nearest' on EP rank",
                "top_k_token_rounding": "top_k: 2 on EP rank", "training": "training: True",
                "router": "router: 'token_rounding'", "top_k": "top_k: 2 on EP rank",
                "score": "score: 'softmax_topk'", "renormalize": "renormalize: False",
                "score_token_rounding": "score: 'softmax_topk' on EP rank",
                "routed_scaling_factor": "routed_scaling_factor: 1.0 on EP rank",
                "n_group": "n_group: 1 on EP rank", "transport": "transport: 'nccl' on EP rank",
                "bias_update_rate": "bias_update_rate: 0.0 on EP rank",
                "scores_dtype": "dtype of scores: torch.float64", "tr_tile": "tile: 2 on EP rank",
                "activation": "activation: 'swiglu' on EP rank",
                "tr_dtype": "dtype of scores: torch.float64"}
    others = ", ".join(map(str, range(world - 1)))
    for rank, result in enumerate(results):
        assert result["agree"] == "no error" and result["agree_token_rounding"] == "no error"
        for case, text in expected.items():
            message = result[case]
            assert message.startswith("ValueError: EP ranks disagree on "), (rank, case, message)
            assert text in message, (rank, case, message)
            # Every rank's value is named, with the ranks holding it.
            assert f"EP rank{'s' if world > 2 else ''} {others}" in message, (rank, message)
            assert f"on EP rank {world - 1}" in message, (rank, message)
            assert f"this rank is {rank}" in message, (rank, message)


def test_auto_transport_picks_copy_engines_only_where_faster(monkeypatch):
    """``"auto"`` takes the copy engines for a one-host NCCL group of at most two ranks (where
    they beat NCCL); ``"copy_engine"`` takes them at any size (the availability check and the
    transport are stubbed: they need CUDA and NCCL)."""
    import sonic.distributed.experts as ep

    monkeypatch.setattr(ep, "peer_transport_available", lambda group, device: True)
    monkeypatch.setattr(ep, "peer_transport", lambda group, device: "peer")
    cpu = torch.device("cpu")
    for size, want in ((2, "peer"), (4, None)):
        monkeypatch.setattr(ep, "check_group", lambda group, size=size: (size, 0))
        assert ep._resolve_transport("auto", None, cpu) == want
        assert ep._resolve_transport("nccl", None, cpu) is None
    assert ep._resolve_transport("copy_engine", None, cpu) == "peer"
