"""Chunked expert parallelism on two GPUs over NCCL (skipped with fewer than two GPUs).

Two spawned ranks run the EP layer (bf16, ``backend="auto"``: CuTe kernels) with
``num_chunks`` 1, 2 and 4 on the same inputs and check

* every chunk count against one process on the whole batch (bf16 tolerance), and against
  ``C = 1``: the chunked pipeline changes nothing but the order of the weight-gradient sums;
* stream safety: the same chunked step repeated five times, back to back with no host
  synchronisation between them, gives bitwise the same output and gradients every time — a
  buffer the caching allocator handed to the other stream too early, or a missing event wait,
  shows up as a difference;
* the comm stream actually ran the all-to-alls (the layer made them on a stream other than
  the compute stream);
* ``recompute_dispatch`` (the received rows sent again in backward on the comm stream, dW1
  waiting for them): bitwise the results without it, for ``C = 2`` and ``4``, and its step
  keeps less memory;
* the experts' other activations (GeGLU in the fused epilogues, ReLU² between the GEMMs) at
  ``C = 2`` against one process.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
from nccl_ranks import init_rank, spawn, step  # noqa: E402

T, D, N, E, K = 2048, 1024, 512, 16, 4


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _one_process(full, x_full, dout_full, mine, local):
    """This rank's share of one process's step on the whole batch: output, dx, the router's
    gradient, and the local experts' dW1 and dW2."""
    x_ref = x_full.clone().requires_grad_()
    full(x_ref).backward(dout_full)
    with torch.no_grad():
        out = full(x_full)[mine]
    return [out, x_ref.grad[mine], full.gate.weight.grad, full.w1.grad[local],
            full.w2.grad[local]]


def _rank(rank, world, port, tmp):
    import sonic
    from sonic.distributed import ExpertParallelMoE, overlap

    device = init_rank(rank, world, port)
    torch.manual_seed(0)
    full = sonic.MoE(D, N, E, K, device=device, dtype=torch.bfloat16)
    g = torch.Generator(device).manual_seed(1)
    x_full = torch.randn(world * T, D, device=device, dtype=torch.bfloat16, generator=g)
    dout_full = torch.randn(world * T, D, device=device, dtype=torch.bfloat16, generator=g)
    mine = slice(rank * T, (rank + 1) * T)
    local = slice(rank * E // world, (rank + 1) * E // world)
    ref = _one_process(full, x_full, dout_full, mine, local)
    layer = ExpertParallelMoE.from_moe(full)
    result, runs = {}, {}
    for c in (1, 2, 4):
        layer.num_chunks = c
        runs[c] = step(layer, x_full[mine], dout_full[mine])
        gate = runs[c][2].clone()
        dist.all_reduce(gate)
        result[f"vs_one_process_C{c}"] = max(_rel(a, b) for a, b in
                                             zip([*runs[c][:2], gate, *runs[c][3:]], ref))
        if c > 1:
            result[f"vs_C1_C{c}"] = max(_rel(a, b) for a, b in zip(runs[c], runs[1]))
    layer.num_chunks = 4
    repeats = [step(layer, x_full[mine], dout_full[mine]) for _ in range(5)]
    torch.cuda.synchronize()
    result["repeat_bitwise"] = all(torch.equal(a, b) for r in repeats[1:]
                                   for a, b in zip(r, repeats[0]))
    # A smaller persistent grid moves tiles between CTAs, not the math of a tile: bitwise equal.
    margins = {}
    for margin in (8, 16, 200):
        layer.comm_sm_margin = margin
        margins[margin] = step(layer, x_full[mine], dout_full[mine])
    layer.comm_sm_margin = 0
    result["margin_bitwise"] = all(torch.equal(a, b) for r in margins.values()
                                   for a, b in zip(r, repeats[0]))
    layer.recompute_dispatch = True
    recomputed = {}
    for c in (2, 4):
        layer.num_chunks = c
        recomputed[c] = step(layer, x_full[mine], dout_full[mine])
    result["recompute_bitwise"] = all(torch.equal(a, b) for a, b in zip(recomputed[4],
                                                                        repeats[0]))
    layer.num_chunks = 2
    result["recompute_C2_bitwise"] = all(torch.equal(a, b) for a, b in zip(recomputed[2],
                                                                           runs[2]))
    kept = {}
    for flag in (False, True):
        layer.recompute_dispatch = flag
        xg = x_full[mine].clone().requires_grad_()
        kept[flag] = sonic.profile_activation_memory(layer, xg).activation_bytes
    result["recompute_keeps_less"] = kept[True] < kept[False]
    layer.recompute_dispatch = False
    for activation in ("geglu", "relu2"):
        torch.manual_seed(2)
        other = sonic.MoE(D, N, E, K, device=device, dtype=torch.bfloat16, activation=activation)
        want = _one_process(other, x_full, dout_full, mine, local)
        split = ExpertParallelMoE.from_moe(other)
        split.num_chunks = 2
        got = step(split, x_full[mine], dout_full[mine])
        gate = got[2].clone()
        dist.all_reduce(gate)
        result[f"{activation}_vs_one_process"] = max(
            _rel(a, b) for a, b in zip([*got[:2], gate, *got[3:]], want))
    result["comm_stream"] = (torch.cuda.current_stream(device).device_index in
                             overlap._COMM_STREAMS)
    dist.destroy_process_group()
    torch.save(result, f"{tmp}/rank{rank}.pt")


def test_chunked_ep_on_two_gpus(tmp_path):
    spawn(_rank, 2, tmp_path)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        for c in (1, 2, 4):
            assert r[f"vs_one_process_C{c}"] < 2e-2, (rank, r)
        for c in (2, 4):
            # bf16 weight gradients accumulated over the rows of all chunks in another order.
            assert r[f"vs_C1_C{c}"] < 1e-2, (rank, r)
        assert r["repeat_bitwise"], rank
        assert r["margin_bitwise"], rank
        assert r["comm_stream"], rank
        assert r["recompute_bitwise"] and r["recompute_C2_bitwise"], rank
        assert r["recompute_keeps_less"], rank
        for activation in ("geglu", "relu2"):
            assert r[f"{activation}_vs_one_process"] < 2e-2, (rank, activation, r)
