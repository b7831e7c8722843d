"""Expert aggregation: GPU kernel vs PyTorch (gather + scale + sum in fp32), bandwidth-bound.

    python benchmarks/bench_aggregation.py

At the paper's configurations (docs/design.md §5: T, d, K) with random top-K routing prints median µs of the kernel and
of PyTorch, the kernel's GB/s (bytes read: y rows, indices, scores; written: output), its
percentage of the same-run device copy bandwidth (target ≥ 70%) and the speedup.
"""

import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, copy_bandwidth, device_name, host_overhead_us  # noqa: E402

from sonic.kernels.aggregation import aggregate  # noqa: E402
from sonic.routing.metadata import pairs_metadata  # noqa: E402

# (name, T, d, E, K) of the paper's configurations (docs/design.md §5).
SHAPES = [("7B", 24576, 1536, 128, 8), ("OLMoE", 32768, 2048, 64, 8), ("30B", 32768, 4096, 128, 8)]


def main():
    copy = copy_bandwidth()
    print(f"device: {device_name()}; copy bandwidth {copy:.0f} GB/s (read + write)")
    print(f"{'shape':<6} {'T':>6} {'d':>5} {'K':>2} {'scores':>6} | {'torch us':>9} {'kernel us':>9} "
          f"{'GB/s':>6} {'% copy':>6} {'speedup':>7}")
    for name, t, d, e, k in SHAPES:
        experts = torch.randn(t, e, device="cuda").topk(k, dim=1).indices.to(torch.int32)
        tokens = torch.arange(t, dtype=torch.int32, device="cuda").repeat_interleave(k)
        meta = pairs_metadata(tokens, experts.reshape(-1), t, e)
        p = meta.num_pairs
        y = torch.randn(p, d, device="cuda", dtype=torch.bfloat16)
        scores = torch.rand(p, device="cuda")
        rows = meta.token_rows
        for scored in (True, False):
            s = scores if scored else None

            def torch_path():
                g = y[rows].float().view(t, k, d)
                if scored:
                    g = g * scores[rows].view(t, k, 1)
                return g.sum(1).to(y.dtype)

            torch_us = bench(torch_path)
            kern_us = bench(lambda: aggregate(y, rows, meta.token_offsets, s))
            nbytes = p * d * 2 + t * d * 2 + p * 4 + (t + 1) * 4 + (p * 4 if scored else 0)
            gbs = nbytes / (kern_us * 1e-6) / 1e9
            print(f"{name:<6} {t:>6} {d:>5} {k:>2} {str(scored):>6} | {torch_us:>9.1f} {kern_us:>9.1f} "
                  f"{gbs:>6.0f} {100 * gbs / copy:>5.1f}% {torch_us / kern_us:>6.2f}x")
    launch_overhead()


def launch_overhead():
    """Host µs per call at T = 1: the entry point, and the compiled launcher with and without
    TVM-FFI (``--enable-tvm-ffi`` needs the ``apache-tvm-ffi`` wheel, not a dependency of
    nvidia-cutlass-dsl 4.8.1; ``sonic.kernels.runtime`` uses it when importable)."""
    from sonic.kernels import aggregation, runtime

    y = torch.randn(8, 1536, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(8, dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    out = torch.empty(1, 1536, device="cuda", dtype=torch.bfloat16)
    mode = "TVM-FFI" if runtime.tvm_ffi_enabled() else "plain"
    print(f"host us per call, T=1: aggregate() [{mode}] "
          f"{host_overhead_us(lambda: aggregate(y, rows, offsets)):.1f}", end="")
    args = (y.data_ptr(), rows.data_ptr(), offsets.data_ptr(), offsets.data_ptr(), out.data_ptr(), 1)
    for tvm in (False, True):
        if tvm and importlib.util.find_spec("tvm_ffi") is None:
            print(", TVM-FFI: apache-tvm-ffi not installed", end="")
            continue
        runtime._TVM_FFI = tvm
        fn = aggregation._compile(torch.bfloat16, 1536, False)
        out.fill_(float("nan"))
        fn(*args)
        torch.cuda.synchronize()
        assert torch.equal(out, aggregate(y, rows, offsets))
        print(f", launcher {'TVM-FFI' if tvm else 'plain'} {host_overhead_us(lambda: fn(*args)):.1f}",
              end="")
    runtime._TVM_FFI = None
    print()

if __name__ == "__main__":
    main()
