"""Routing metadata: GPU kernels vs the PyTorch reference path (argsort + scatter_add + cumsum).

    python benchmarks/bench_routing_metadata.py

At the paper's configurations (docs/design.md §5; T = 24576 / 32768, E = 64 / 128, K = 8) prints the median µs of the
top-K kernel (two launches), the arbitrary-pairs kernel (four launches) and the PyTorch path
(``sonic.routing.metadata.pairs_metadata``) on the same pairs, and the speedups (target ≥ 5×):
called eagerly, and replayed from a CUDA graph (device time alone; this also checks that every
path is graph-capturable). Last, the host time of one call at T = 1 (launch overhead).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, device_name, graph_us, host_overhead_us  # noqa: E402

from sonic.kernels.routing_metadata import routing_metadata_pairs, routing_metadata_topk  # noqa: E402
from sonic.routing.metadata import pairs_metadata  # noqa: E402

SHAPES = [(24576, 64, 8), (24576, 128, 8), (32768, 64, 8), (32768, 128, 8)]


def main():
    print(f"device: {device_name()}")
    print(f"{'T':>6} {'E':>4} {'K':>2} {'mode':>5} | {'torch us':>9} {'topk us':>8} {'speedup':>7} | "
          f"{'pairs us':>8} {'speedup':>7}")
    for t, e, k in SHAPES:
        logits = torch.randn(t, e, device="cuda")
        experts = logits.topk(k, dim=1).indices.to(torch.int32).contiguous()
        tokens = torch.arange(t, dtype=torch.int32, device="cuda").repeat_interleave(k)
        flat = experts.reshape(-1)
        paths = (lambda: pairs_metadata(tokens, flat, t, e), lambda: routing_metadata_topk(experts, e),
                 lambda: routing_metadata_pairs(tokens, flat, t, e))
        for mode, timer in (("eager", bench), ("graph", graph_us)):
            torch_us, topk_us, pairs_us = (timer(fn) for fn in paths)
            print(f"{t:>6} {e:>4} {k:>2} {mode:>5} | {torch_us:>9.1f} {topk_us:>8.1f} "
                  f"{torch_us / topk_us:>6.1f}x | {pairs_us:>8.1f} {torch_us / pairs_us:>6.1f}x")
    tiny = torch.randint(0, 64, (1, 8), dtype=torch.int32, device="cuda")
    from sonic.kernels import runtime

    mode = "TVM-FFI" if runtime.tvm_ffi_enabled() else "plain"
    print(f"host us per call, T=1 [{mode}]: topk "
          f"{host_overhead_us(lambda: routing_metadata_topk(tiny, 64)):.1f}, pairs "
          f"{host_overhead_us(lambda: routing_metadata_pairs(tiny[0], tiny[0], 8, 64)):.1f}")

    kernel_times(32768, 128, 8)


def kernel_times(t, e, k, calls=20):
    """Device µs per launch of each kernel (torch.profiler / CUPTI), top-K and pairs paths."""
    from torch.profiler import ProfilerActivity, profile

    experts = torch.randn(t, e, device="cuda").topk(k, dim=1).indices.to(torch.int32)
    tokens = torch.arange(t, dtype=torch.int32, device="cuda").repeat_interleave(k)
    routing_metadata_pairs(tokens, experts.reshape(-1), t, e)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            routing_metadata_topk(experts, e)
            routing_metadata_pairs(tokens, experts.reshape(-1), t, e)
        torch.cuda.synchronize()
    print(f"per-kernel device time at T={t} E={e} K={k} ({calls} calls of each path):")
    for evt in sorted(prof.key_averages(), key=lambda x: -x.device_time_total)[:10]:
        print(f"  {evt.key[:70]:<70} {evt.count:>4} x {evt.device_time_total / evt.count:8.1f} us")


if __name__ == "__main__":
    main()
