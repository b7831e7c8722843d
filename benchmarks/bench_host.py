"""Host time of sonic's MoE layer: what the CPU spends enqueuing each call, beside GPU time.

    python benchmarks/bench_host.py                 # 7B (where the host matters)
    python benchmarks/bench_host.py --config OLMoE
    python benchmarks/bench_host.py --router token_rounding   # padded, as sonic.MoE routes

Per call, with the GPU kept busy first (``torch.cuda._sleep``) so the host never waits on an
empty queue, the median over rounds of the mean host µs of 20 calls of: the router
(``sonic.topk_routing``, or ``sonic.token_rounding_routing`` with ``--router token_rounding``),
``sonic.routing_metadata``, ``sonic.moe_experts`` (with autograd), the functional forward and
training step that ``bench_moe.py`` times, and ``sonic.MoE``'s forward and step. Then the GPU
side: ``do_bench`` of the forward and step, and the forward's GPU time alone (replayed as a CUDA
graph, without autograd). A layer whose host time exceeds its GPU time is host-bound: its
``bench_moe.py`` time is the host's. For an A/B of a host-side change, run it from two trees
in one device call (a dispatch mode cannot stand in for the old code: it adds Python to every
ATen op).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, device_name, graph_us  # noqa: E402
from bench_moe import _route, _sonic_layer, _steps, problem  # noqa: E402

import sonic  # noqa: E402
from sonic.baselines.configs import CONFIGS, parse_config  # noqa: E402


def host_us(fn, calls: int = 20, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean host µs per ``fn()`` over ``calls`` calls enqueued
    behind a busy GPU."""
    means = []
    for _ in range(rounds):
        torch.cuda._sleep(int(2e9 * 0.03))      # ~30 ms of GPU work at ~2 GHz
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(means)[rounds // 2]


def measure(name: str, sizes, router: str = "topk") -> None:
    T, d, n, E, K = sizes
    x, router_weight, w1, w2, grad = problem(sizes)
    leaves = (x, router_weight, w1, w2)
    fwd, fwd_bwd = _steps(_sonic_layer(router, 128), x, leaves[1:], K, grad)
    layer = sonic.MoE(d, n, E, K, router=router, device="cuda", dtype=torch.bfloat16)
    layer_leaves = (x, *layer.parameters())

    def step():
        for t in leaves:
            t.grad = None
        fwd_bwd()

    def layer_step():
        for t in layer_leaves:
            t.grad = None
        layer(x).backward(grad)

    logits = x @ router_weight.t()
    routing = _route(router, 128, logits, K)
    metadata = sonic.routing_metadata(routing)
    calls = {
        router: lambda: _route(router, 128, logits, K),
        "routing_metadata": lambda: sonic.routing_metadata(routing),
        "moe_experts": lambda: sonic.moe_experts(x, w1, w2, routing.scores, routing.token_idx,
                                                 routing.expert_idx, metadata=metadata),
        "forward": fwd,
        "step": step,
        "MoE forward": lambda: layer(x),
        "MoE step": layer_step,
    }
    for _ in range(3):
        step()
        layer_step()
    torch.cuda.synchronize()
    host = {label: host_us(fn) for label, fn in calls.items()}
    gpu = {"forward": bench(fwd), "step": bench(fwd_bwd, grad_to_none=leaves),
           "MoE step": bench(layer_step)}
    with torch.no_grad():
        gpu_alone = graph_us(fwd)
    print(f"{name}  T={T} d={d} n={n} E={E} K={K}  router={router}")
    print("  host µs per call: " + ", ".join(f"{k} {v:.0f}" for k, v in host.items()))
    print("  do_bench µs: " + ", ".join(f"{k} {v:.0f}" for k, v in gpu.items())
          + f"; forward on the GPU alone (CUDA graph, no autograd) {gpu_alone:.0f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=parse_config, action="append",
                        help="7B, OLMoE, 30B or T,d,n,E,K (repeatable; default: 7B)")
    parser.add_argument("--router", choices=("topk", "token_rounding"), default="topk")
    args = parser.parse_args(argv)
    print(f"device: {device_name()}  torch {torch.__version__}")
    for name, sizes in args.config or [("7B", CONFIGS["7B"])]:
        measure(name, sizes, args.router)


if __name__ == "__main__":
    main()
