"""Chunked expert parallelism (``num_chunks=C``) on CPU: gloo groups of 2 and 4 spawned ranks.

Every case runs the same fp64 problem with ``C = 1`` (the unchunked path) and ``C = 2, 3, 4``
(the pipelined path, sequential on the CPU), and ``recompute_dispatch=True`` with ``C = 1``
and ``2`` (the received rows sent again in backward), and compares the outputs and every
gradient: the chunking only reorders the sums of the weight gradients over chunks, so they
agree within 1e-12; recomputing moves the same bytes, so it changes nothing bit for bit. The ``C = 1`` results themselves are compared with single-process sonic by
``tests/test_distributed.py``; here one case per kind is also compared with it directly.
"""

import pytest
import torch
import torch.distributed as dist

import sonic
from sonic.distributed import (MAX_CHUNKS, ExpertParallelMoE, Placement, ep_moe_experts,
                               plan_placement, reduce_replica_grads)
from test_distributed import D, N, _catch, _pairs, _pairs_problem, _rel, _spawn
from _benchmarks import load_benchmark

TOL = 1e-12
CHUNKS = (2, 3, 4)
# (num_chunks, recompute_dispatch) of the runs besides the unchunked C = 1.
RUNS = [(c, False) for c in CHUNKS] + [(1, True), (2, True)]


def _layer_run(full, x_local, grad_local, num_chunks, placement=None, recompute=False):
    """Output and gradients (x, router summed over ranks, w1, w2) of this rank's share of
    ``full`` with ``num_chunks`` chunks."""
    layer = ExpertParallelMoE.from_moe(full, placement=placement, num_chunks=num_chunks,
                                       recompute_dispatch=recompute)
    x = x_local.clone().requires_grad_()
    out = layer(x)
    (out * grad_local).sum().backward()
    if placement is not None:
        layer.reduce_replica_grads()
    gate = layer.gate.weight.grad.clone()
    dist.all_reduce(gate)
    return [out.detach(), x.grad, gate, layer.w1.grad, layer.w2.grad]


def _compare(runs):
    """Worst relative difference of each run of :data:`RUNS` from the unchunked C = 1 run
    (``runs[(1, False)]``); ``recompute_bitwise``: whether C = 2 with recompute_dispatch gave
    C = 2's results bit for bit."""
    base = runs[(1, False)]
    return {"vs_unchunked": max(_rel(a, b) for key in RUNS for a, b in zip(runs[key], base)),
            "recompute_bitwise": all(torch.equal(a, b)
                                     for a, b in zip(runs[(2, True)], runs[(2, False)]))}


# name: (tokens on rank r, E, K, router, what the routing is forced to)
LAYER_CASES = {
    "topk_ragged": (lambda r: 7 + 5 * r, 8, 2, "topk", None),
    "topk_tokens_1": (lambda r: 1, 8, 2, "topk", None),        # C > T: empty chunks
    "topk_empty_expert": (lambda r: 9 + r, 8, 2, "topk", "empty_expert"),
    "topk_rank_gets_nothing": (lambda r: 10, 8, 3, "topk", "last_rank"),
    "topk_rank_without_tokens": (lambda r: 0 if r == 1 else 11, 8, 2, "topk", None),
    "token_rounding": (lambda r: 12 + 3 * r, 8, 2, "token_rounding", None),
    "token_rounding_rank_without_tokens": (lambda r: 0 if r == 0 else 13, 8, 2,
                                           "token_rounding", None),
}


def _layer_problem(world, name, seed):
    tokens_of, num_experts, top_k, router, forced = LAYER_CASES[name]
    torch.manual_seed(seed)
    full = sonic.MoE(D, N, num_experts, top_k, router=router, tile=4, backend="torch",
                     dtype=torch.float64)
    counts = [tokens_of(r) for r in range(world)]
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    grad_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    if forced is not None:
        # Feature 0 is positive for every token; a large negative router weight on it keeps
        # the avoided experts out of every token's top K.
        x_full[:, 0] = x_full[:, 0].abs() + 1
        local = num_experts // world
        avoided = [1] if forced == "empty_expert" else list(range(num_experts - local,
                                                                   num_experts))
        with torch.no_grad():
            full.gate.weight[avoided, 0] = -10.0
    return full, counts, x_full, grad_full


def _layer_case(rank, world, name, seed):
    full, counts, x_full, grad_full = _layer_problem(world, name, seed)
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    runs = {(c, r): _layer_run(full, x_full[lo:hi], grad_full[lo:hi], c, recompute=r)
            for c, r in [(1, False), *RUNS]}
    result = _compare(runs)
    # C = 4 against single-process sonic on the concatenated batch.
    x_ref = x_full.clone().requires_grad_()
    (full(x_ref) * grad_full).sum().backward()
    out, dx, gate, _, _ = runs[(4, False)]
    result["vs_single_process"] = max(_rel(out, full(x_full).detach()[lo:hi]),
                                      _rel(dx, x_ref.grad[lo:hi]),
                                      _rel(gate, full.gate.weight.grad))
    return result


def _eplb_case(rank, world, seed):
    """The layer with a planned replicated-expert placement (hot experts 0 and 1)."""
    num_experts, top_k = 8, 2
    torch.manual_seed(seed)
    full = sonic.MoE(D, N, num_experts, top_k, backend="torch", dtype=torch.float64)
    counts = [9 + 2 * r for r in range(world)]
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    grad_full = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    x_full[:, 0] = x_full[:, 0].abs() + 1
    with torch.no_grad():
        full.gate.weight[0, 0], full.gate.weight[1, 0] = 3.0, 1.0
    load = torch.bincount(full.route(full.gate(x_full)).expert_idx.long(),
                          minlength=num_experts)
    placement = plan_placement(load, world, num_experts // world + 1)
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    runs = {(c, r): _layer_run(full, x_full[lo:hi], grad_full[lo:hi], c, placement, r)
            for c, r in [(1, False), *RUNS]}
    return {**_compare(runs), "replicas": int(placement.replica_counts().max())}


def _pairs_case(rank, world, seed, placement_kind):
    """``ep_moe_experts`` on hand-built ragged pairs (tokens with 0..E experts), with the
    contiguous placement or a hand placement holding extra replicas of expert 0."""
    num_experts = 8
    local = num_experts // world
    placement = None
    if placement_kind == "replicated":
        slot_expert = torch.cat([torch.cat([torch.arange(r * local, (r + 1) * local),
                                            torch.tensor([0])]) for r in range(world)])
        placement = Placement(slot_expert, world, local + 1, num_experts)
    g = torch.Generator().manual_seed(seed)
    counts = [6 + 3 * r for r in range(world)]
    per_rank = [_pairs(g, c, torch.arange(num_experts)) for c in counts]
    (x_full, w1, w2, scores_full, grad_full, tok_full, exp_full,
     lo, p_lo, tok, exp) = _pairs_problem(g, counts, per_rank, num_experts, rank)
    mine = (slice(rank * local, (rank + 1) * local) if placement is None
            else placement.rank_experts(rank))
    runs, kept = {}, {}
    for c, recompute in [(1, False), *RUNS]:
        x = x_full[lo:lo + counts[rank]].clone().requires_grad_()
        s = scores_full[p_lo:p_lo + len(tok)].clone().requires_grad_()
        w1_local = w1[mine].clone().requires_grad_()
        w2_local = w2[mine].clone().requires_grad_()
        # Through sonic's activation profiler: every kept tensor passes autograd's hooks.
        report = sonic.profile_activation_memory(
            lambda *a: ep_moe_experts(*a, tok, exp, group=None, num_experts=num_experts,
                                      backend="torch", placement=placement, num_chunks=c,
                                      recompute_dispatch=recompute), x, w1_local, w2_local, s)
        out = report.output
        kept[(c, recompute)] = (report.activation_bytes, report.input_bytes)
        (out * grad_full[lo:lo + counts[rank]]).sum().backward()
        if placement is not None:
            reduce_replica_grads([w1_local, w2_local], placement)
        runs[(c, recompute)] = [out.detach(), x.grad, s.grad, w1_local.grad, w2_local.grad]
    ref_in = [t.clone().requires_grad_() for t in (x_full, w1, w2, scores_full)]
    out_ref = sonic.moe_experts(*ref_in, tok_full, exp_full, backend="torch")
    (out_ref * grad_full).sum().backward()
    out, dx, ds, dw1, dw2 = runs[(3, False)]
    return {**_compare(runs), "kept": kept, "x_bytes": counts[rank] * D * 8,
            "vs_single_process": max(_rel(out, out_ref.detach()[lo:lo + counts[rank]]),
                                     _rel(dx, ref_in[0].grad[lo:lo + counts[rank]]),
                                     _rel(ds, ref_in[3].grad[p_lo:p_lo + len(tok)]),
                                     _rel(dw1, ref_in[1].grad[mine]),
                                     _rel(dw2, ref_in[2].grad[mine]))}


def _partial_grads_case(rank, world, seed):
    """Only some inputs require grad (x and w2; scores and w1 frozen), a second backward of a
    retained graph, and a call under no_grad."""
    num_experts = 8
    local = num_experts // world
    g = torch.Generator().manual_seed(seed)
    counts = [8 + r for r in range(world)]
    per_rank = [_pairs(g, c, torch.arange(num_experts)) for c in counts]
    (x_full, w1, w2, scores_full, grad_full, _, _, lo, p_lo, tok, exp) = _pairs_problem(
        g, counts, per_rank, num_experts, rank)
    mine = slice(rank * local, (rank + 1) * local)
    runs = {}
    for c, recompute in [(1, False), *RUNS]:
        x = x_full[lo:lo + counts[rank]].clone().requires_grad_()
        w2_local = w2[mine].clone().requires_grad_()
        out = ep_moe_experts(x, w1[mine], w2_local, scores_full[p_lo:p_lo + len(tok)], tok,
                             exp, group=None, num_experts=num_experts, backend="torch",
                             num_chunks=c, recompute_dispatch=recompute)
        loss = (out * grad_full[lo:lo + counts[rank]]).sum()
        loss.backward(retain_graph=True)
        first = [x.grad.clone(), w2_local.grad.clone()]
        loss.backward()                      # the retained graph again: gradients double
        with torch.no_grad():
            plain = ep_moe_experts(x, w1[mine], w2_local, scores_full[p_lo:p_lo + len(tok)],
                                   tok, exp, group=None, num_experts=num_experts,
                                   backend="torch", num_chunks=c, recompute_dispatch=recompute)
        runs[(c, recompute)] = [out.detach(), plain, *first, x.grad / 2, w2_local.grad / 2]
    return {**_compare(runs),
            "retained_twice": max(_rel(a, b) for key in RUNS
                                  for a, b in zip(runs[key][2:4], runs[key][4:6])),
            "no_grad_equal": max(_rel(runs[key][1], runs[key][0]) for key in RUNS)}


def _w1_only_case(rank, world, seed):
    """Only w1 requires grad (no A' buffer, dH kept for dW1 alone), with an SM margin (no
    effect on the reference: results must still be equal); create_graph=True is refused."""
    num_experts = 8
    local = num_experts // world
    g = torch.Generator().manual_seed(seed)
    counts = [5 + 2 * r for r in range(world)]
    per_rank = [_pairs(g, c, torch.arange(num_experts)) for c in counts]
    (x_full, w1, w2, scores_full, grad_full, _, _, lo, p_lo, tok, exp) = _pairs_problem(
        g, counts, per_rank, num_experts, rank)
    mine = slice(rank * local, (rank + 1) * local)
    runs = {}
    for c, recompute in [(1, False), *RUNS]:
        w1_local = w1[mine].clone().requires_grad_()
        out = ep_moe_experts(x_full[lo:lo + counts[rank]], w1_local, w2[mine],
                             scores_full[p_lo:p_lo + len(tok)], tok, exp, group=None,
                             num_experts=num_experts, backend="torch", num_chunks=c,
                             comm_sm_margin=16, recompute_dispatch=recompute)
        (out * grad_full[lo:lo + counts[rank]]).sum().backward()
        runs[(c, recompute)] = [out.detach(), w1_local.grad]
    w1_local = w1[mine].clone().requires_grad_()
    out = ep_moe_experts(x_full[lo:lo + counts[rank]], w1_local, w2[mine],
                         scores_full[p_lo:p_lo + len(tok)], tok, exp, group=None,
                         num_experts=num_experts, backend="torch", num_chunks=2)
    refused = _catch(lambda: torch.autograd.grad(out.sum(), w1_local, create_graph=True))
    return {**_compare(runs), "create_graph": refused}


def _error_case(rank, world):
    x = torch.randn(3, D, dtype=torch.float64)
    tok, exp = torch.tensor([0, 1, 2]), torch.tensor([0, 3, 1])
    s = torch.rand(3, dtype=torch.float64)
    w1 = torch.randn(4 // world, 2 * N, D, dtype=torch.float64)
    w2 = torch.randn(4 // world, D, N, dtype=torch.float64)

    def call(num_chunks):
        return ep_moe_experts(x, w1, w2, s, tok, exp, group=None, num_experts=4,
                              backend="torch", num_chunks=num_chunks)

    y = (x * 1).requires_grad_()
    y_in = y * 1
    out = ep_moe_experts(y_in, w1, w2, s, tok, exp, group=None, num_experts=4,
                         backend="torch", recompute_dispatch=True)
    y_in.add_(1)        # every rank changes the kept input in place before backward
    modified = _catch(lambda: out.sum().backward())
    return {"modified": modified,
            "not_bool": _catch(lambda: ep_moe_experts(x, w1, w2, s, tok, exp, group=None,
                                                      num_experts=4, recompute_dispatch=1)),
            "disagree": _catch(lambda: call(2 + rank)),
            "too_many": _catch(lambda: call(MAX_CHUNKS + 1)),
            "layer_zero": _catch(lambda: ExpertParallelMoE(D, N, 4, 2, num_chunks=0)),
            "margin": _catch(lambda: ExpertParallelMoE(D, N, 4, 2, comm_sm_margin=-1))}


def _all_cases(rank, world):
    results = {}
    for seed, name in enumerate(LAYER_CASES):
        results[name] = _layer_case(rank, world, name, 300 + seed)
    results["eplb_layer"] = _eplb_case(rank, world, 320)
    results["pairs"] = _pairs_case(rank, world, 330, "contiguous")
    results["pairs_replicated"] = _pairs_case(rank, world, 331, "replicated")
    results["partial_grads"] = _partial_grads_case(rank, world, 340)
    results["w1_only"] = _w1_only_case(rank, world, 350)
    results["errors"] = _error_case(rank, world)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"ep{w}")
def chunked(request, tmp_path_factory):
    world = request.param
    return world, _spawn(world, _all_cases, tmp_path_factory.mktemp(f"chunks{world}"),
                         timeout=240)


CASES = [*LAYER_CASES, "eplb_layer", "pairs", "pairs_replicated", "partial_grads", "w1_only"]


@pytest.mark.parametrize("case", CASES)
def test_chunked_equals_unchunked(chunked, case):
    """Output and gradients with C = 2, 3, 4 equal C = 1 (and single-process sonic)."""
    world, results = chunked
    for rank, result in enumerate(results):
        r = result[case]
        assert r["vs_unchunked"] <= TOL, (rank, r)
        assert r["recompute_bitwise"], (rank, r)
        if "kept" in r:
            # The profiler sees x_recv (R x D fp64, R >= 1) and H for every C (the chunked
            # path saves what it keeps: within a few per-chunk index bytes of unchunked, and
            # the plan's send indices, cut from buffers of ep x (T padded to whole chunks)
            # int64 + int32 entries); recompute_dispatch trades x_recv for x, an input.
            kept = r["kept"]
            assert abs(kept[(2, False)][0] - kept[(1, False)][0]) < D * 8 + 12 * world, \
                (rank, kept)
            (act, inputs), (act_rd, inputs_rd) = kept[(2, False)], kept[(2, True)]
            assert act - act_rd > 0 and (act - act_rd) % (D * 8) == 0, (rank, kept)
            assert inputs_rd - inputs == r["x_bytes"], (rank, kept)
            assert kept[(1, True)][0] < kept[(1, False)][0], (rank, kept)
        for key in ("vs_single_process", "retained_twice", "no_grad_equal"):
            assert r.get(key, 0.0) <= 1e-10, (rank, key, r)
        if case == "eplb_layer":
            assert r["replicas"] >= 2
        if case == "w1_only":
            assert "not twice differentiable" in r["create_graph"], (rank, r)


def test_chunk_count_errors(chunked):
    world, results = chunked
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert "EP ranks disagree on num_chunks" in errors["disagree"], (rank, errors)
        assert f"num_chunks must be in [1, {MAX_CHUNKS}]" in errors["too_many"]
        assert "num_chunks must be in [1, 16], got 0" in errors["layer_zero"]
        assert "comm_sm_margin" in errors["margin"], (rank, errors)
        assert "modified by an inplace operation" in errors["modified"], (rank, errors)
        assert "recompute_dispatch must be a bool" in errors["not_bool"], (rank, errors)


# --- the weak-scaling benchmark, smoke-tested on CPU ranks --------------------------------------

def _bench():
    return load_benchmark("bench_ep")


def _bench_smoke(rank, world):
    bench = _bench()
    return bench.run(bench.parse_args(["--smoke", "--chunks", "1,2", "--recompute-dispatch",
                                       "--comm-priorities", "normal,high", "--nccl-ctas"]),
                     torch.device("cpu"))


def _bench_skew_smoke(rank, world):
    bench = _bench()
    return bench.run_skew(bench.parse_args(["--smoke", "--zipf", "1.2", "--config",
                                            "64,16,8,8,4"]), torch.device("cpu"))


def test_benchmark_skew_smoke(tmp_path):
    """``bench_ep.py --smoke --zipf 1.2``: Zipf routing is skewed over the contiguous
    placement, EPLB's one redundant slot per rank evens it out, and the EPLB layer matches
    one process on the whole batch."""
    r0, r1 = _spawn(2, _bench_skew_smoke, tmp_path, timeout=120)
    assert r0 == r1
    assert r0["ok"] and r0["eplb_rel_error"] < 1e-5
    balance = r0["max_over_mean"]
    assert balance["zipf contiguous"] > 1.1 and balance["zipf EPLB"] < balance["zipf contiguous"]
    assert set(r0["ms"]) == {"1gpu zipf", "balanced", "zipf contiguous", "zipf EPLB"}


def test_benchmark_smoke(tmp_path):
    """``benchmarks/bench_ep.py --smoke`` on two gloo ranks: every measurement (comm-stream
    priority variants included) is there, the EP layer matches one process for each chunk
    count, the ranks agree on the summary, and rank 0's phase timelines name every phase of
    both paths."""
    r0, r1 = _spawn(2, _bench_smoke, tmp_path, timeout=120)
    assert r0 == r1
    assert r0["ok"] and r0["max_rel_error"] < 1e-5
    # The comm-stream priority variants of the chunked runs; on CPU ranks --nccl-ctas adds none.
    runs = ["C=1", "C=2", "C=1 rd", "C=2 rd", "C=2 m=8", "C=2 m=16"]
    runs += [f"{r} high-prio" for r in runs if r.startswith("C=2")]
    assert set(r0["ms"]) == {"1gpu", "a2a", *(f"{k} {r}" for k in ("ep", "compute") for r in runs)}
    assert all(t > 0 for m in r0["ms"].values() for t in m.values())
    assert set(r0["hidden"]) == {f"{r} {p}" for r in runs for p in ("fwd", "step")}
    assert set(r0["peak_MiB"]) == set(runs)
    phases = {c: {row[0] for row in rows} for c, rows in r0["phases_rank0"].items()}
    assert set(phases) == {"C=1", "C=2"}
    common = {"plan exchanges (counts, pairs)", "dispatch a2a", "local experts fwd",
              "combine a2a", "per-token sum", "dO a2a (combine bwd)",
              "dX/ds a2a (dispatch bwd)", "forward", "backward"}
    assert phases["C=1"] == common, phases["C=1"]
    assert phases["C=2"] == common | {"activation grads (dH, dX, ds)", "weight grads (dW1, dW2)"}


def test_benchmark_kernel_breakdown():
    """``bench_ep.py --profile``'s breakdown: families by name fragment (the first that
    matches), idle time only where no stream runs a kernel, empty steps give zeros; and
    ``--profile`` is refused with ``--smoke`` (it breaks down CUDA kernels) and with
    ``--zipf`` (whose runs it does not profile)."""
    bench = _bench()
    kernels = [(0.0, 1000.0, "kernel_cutlass_kernel_sonickernelsgrouped_gemm_x"),
               (500.0, 1500.0, "ncclDevKernel_SendRecv"),          # overlaps the GEMM
               (2000.0, 2250.0, "sonic aggregation_kernel"),
               (2250.0, 2500.0, "at::native::vectorized_gather_kernel"),
               (3000.0, 3050.0, "at::native::elementwise_kernel"),
               # torch's scatter kernels (the plan) are not row gathers
               (3050.0, 3100.0, "at::native::_scatter_gather_elementwise_kernel")]
    row = bench.kernel_breakdown(kernels)
    assert row == pytest.approx({"span": 3.1, "idle": 0.5 + 0.5, "grouped GEMMs": 1.0,
                                 "all-to-alls": 1.0, "per-token sums": 0.25,
                                 "row gathers": 0.25, "other kernels": 0.1})
    assert bench.kernel_breakdown([]) == {"span": 0.0, "idle": 0.0, "grouped GEMMs": 0.0,
                                          "all-to-alls": 0.0, "per-token sums": 0.0,
                                          "row gathers": 0.0, "other kernels": 0.0}
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--profile"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--zipf", "1.2", "--profile"])
