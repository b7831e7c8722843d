"""Expert parallelism with ``precision="fp8"`` and ``activation_cache="fp8"`` on CPU: 2 and 4
gloo ranks, bf16, the "torch" backend's emulation of the FP8 dataflow.

Each rank quantizes the rows it received per 1×128 block, exactly as one process quantizes
the same tokens, so the expert GEMMs see the same e4m3 values and scales; the results differ
from one process on the concatenated batch by where bf16 rounds the sums only (each rank
rounds its score-weighted partial outputs to bf16 before the combine adds them; one process
rounds once). Bound 2^-6; measured at most 3.6e-3 for the output and the router gradient, and
dX, dW1, dW2 bitwise equal (with K = 2 a token's dX is the sum of at most two bf16 rows,
whatever the grouping). An FP8 error is ~5% and a row sent to the wrong rank O(1). The
chunked path (``num_chunks=2``, and ``recompute_dispatch`` at ``C = 1``) is held to the same
bound against the unchunked one (it sums the weight gradients' rows in another order; measured
at most 1e-5 — so it quantizes as the unchunked path does: without the fp8 cache's rounding of
H, or without FP8 GEMMs, the gradients would move by ~5%).
"""

import pytest
import torch

import sonic
from sonic.distributed import ExpertParallelMoE
from test_distributed import _rel, _spawn, layer_step

D = N = 128
E, K = 8, 2
TOL = 2 ** -6


def _case(rank, world, precision, activation_cache, weight_grads="bf16"):
    previous = sonic.backend.set_fp8_weight_grads(weight_grads)
    try:
        return _case_with(rank, world, precision, activation_cache)
    finally:
        sonic.backend.set_fp8_weight_grads(previous)


def _case_with(rank, world, precision, activation_cache):
    torch.manual_seed(0)
    full = sonic.MoE(D, N, E, K, backend="torch", dtype=torch.bfloat16, precision=precision,
                     activation_cache=activation_cache)
    counts = [5 + 4 * r for r in range(world)]
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(sum(counts), D, generator=g).to(torch.bfloat16)
    grad_full = torch.randn(sum(counts), D, generator=g).to(torch.bfloat16)
    layer = ExpertParallelMoE.from_moe(full)
    x, out, x_ref, out_ref, gate_grad = layer_step(layer, full, x_full, grad_full, counts,
                                                   rank)
    lo = sum(counts[:rank])
    local = slice(rank * E // world, (rank + 1) * E // world)
    errors = {"out": _rel(out.detach().float(), out_ref.detach()[lo:lo + counts[rank]].float()),
              "dx": _rel(x.grad.float(), x_ref.grad[lo:lo + counts[rank]].float()),
              "dgate": _rel(gate_grad.float(), full.gate.weight.grad.float()),
              "dw1": _rel(layer.w1.grad.float(), full.w1.grad[local].float()),
              "dw2": _rel(layer.w2.grad.float(), full.w2.grad[local].float())}
    unchunked = [out.detach(), x.grad, gate_grad, layer.w1.grad, layer.w2.grad]
    chunked = {}
    for num_chunks, recompute in ((2, False), (1, True)):
        layer.num_chunks, layer.recompute_dispatch = num_chunks, recompute
        for p in (*layer.parameters(), *full.parameters()):
            p.grad = None
        run = layer_step(layer, full, x_full, grad_full, counts, rank)
        results = [run[1].detach(), run[0].grad, run[4], layer.w1.grad, layer.w2.grad]
        chunked[(num_chunks, recompute)] = max(_rel(a.float(), b.float())
                                              for a, b in zip(results, unchunked))
    # The same layer in bf16: the FP8 run must differ from it (it was quantized).
    plain = sonic.MoE(D, N, E, K, backend="torch", dtype=torch.bfloat16)
    plain.load_state_dict(full.state_dict())
    quantized = _rel(out_ref.detach().float(), plain(x_full).detach().float())
    return {"errors": errors, "quantized": quantized, "chunked": chunked,
            "options": (layer.precision, layer.activation_cache), "dw1": unchunked[3]}


def _disagreement(rank):
    """Ranks asking for different precisions: raised on every rank, after the count exchange
    (each rank's local experts would otherwise compute differently, silently)."""
    torch.manual_seed(0)
    full = sonic.MoE(D, N, E, K, backend="torch", dtype=torch.bfloat16,
                     precision="fp8" if rank == 0 else "bf16")
    layer = ExpertParallelMoE.from_moe(full)
    try:
        layer(torch.randn(4, D, dtype=torch.bfloat16))
    except ValueError as err:
        return str(err)
    return "no error"


def _all(rank, world):
    results = {(p, c): _case(rank, world, p, c)
               for p, c in (("fp8", "bf16"), ("fp8", "fp8"), ("bf16", "fp8"))}
    # FP8 weight gradients: every expert here has fewer than 128 rows, so one 128 x 1 block
    # holds all of an expert's rows, on one rank in any order (with more rows the blocks
    # would group rows by arrival, and the scales, hence the roundings, would differ).
    results[("fp8w", "bf16")] = _case(rank, world, "fp8", "bf16", weight_grads="fp8")
    results["disagree"] = _disagreement(rank)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"ep{w}")
def fp8_results(request, tmp_path_factory):
    return _spawn(request.param, _all, tmp_path_factory.mktemp(f"fp8ep{request.param}"),
                  timeout=240)


@pytest.mark.parametrize("options", [("fp8", "bf16"), ("fp8", "fp8"), ("bf16", "fp8"),
                                     ("fp8w", "bf16")],
                         ids=lambda o: f"precision={o[0]}-cache={o[1]}")
def test_ep_fp8_matches_single_process(fp8_results, options):
    for rank, result in enumerate(fp8_results):
        r = result[options]
        assert r["options"] == (options[0][:4].rstrip("w"), options[1])
        assert max(r["errors"].values()) <= TOL, (rank, r["errors"])
        if options[0] != "bf16":
            assert r["quantized"] > 1e-2, (rank, r["quantized"])
        assert max(r["chunked"].values()) <= TOL, (rank, r["chunked"])
        if options[0] == "fp8w":   # the weight gradients did take the FP8 path
            bf16_wgrad = result[("fp8", "bf16")]["dw1"].float()
            assert _rel(r["dw1"].float(), bf16_wgrad) > 1e-2, rank


def test_ranks_disagreeing_on_precision_raise_on_every_rank(fp8_results):
    for rank, result in enumerate(fp8_results):
        assert "EP ranks disagree on precision" in result["disagree"], (rank, result)
