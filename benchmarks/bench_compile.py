"""torch.compile of a sonic.MoE layer: compile time and training-step time, eager vs compiled.

    python benchmarks/bench_compile.py                          # OLMoE-like layer, T=8192, bf16
    python benchmarks/bench_compile.py --config 16384,1536,256,128,8 --modes default reduce-overhead
    python benchmarks/bench_compile.py --device cpu --config 512,64,32,8,2 --steps 3   # smoke run
    python benchmarks/bench_compile.py --config 24576,1536,256,128,8 --router token_rounding \
        --modes cuda-graph                  # a host-bound layer, its eager step graph-captured

A step is forward + backward (``layer(x, return_aux_loss=True)``, loss ``⟨out, dO⟩ + aux``)
with gradients set to None before it. For each mode it prints the wall time of the first call
(dynamo + inductor compilation, and CUDA-graph recording for ``reduce-overhead``; for
``cuda-graph`` the eager step's warm-up, capture and first replay), then the
median step time over ``--steps`` further steps (CUDA-synchronised), against eager. Importable
without a GPU; ``--device cpu`` runs the same measurements on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import captured  # noqa: E402

import sonic  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(step, device, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def measure(config: tuple[int, int, int, int, int], *, device: str, dtype: torch.dtype,
            modes: list[str], steps: int, backend: str = "auto",
            router: str = "topk") -> dict:
    """``{"eager": {...}, mode: {...}}`` with ``first_call_s`` and ``step_ms`` per variant.
    ``modes``: torch.compile modes, and ``"cuda-graph"``: the eager step captured in a CUDA
    graph and replayed (``router="token_rounding"`` routes padded, with no host read)."""
    T, d, n, E, K = config
    dev = torch.device(device)
    if "cuda-graph" in modes and dev.type != "cuda":
        raise ValueError(f"mode 'cuda-graph' needs a CUDA device, got {device}")
    torch.manual_seed(0)
    layer = sonic.MoE(d, n, E, K, router=router, aux_loss_coef=0.01, backend=backend,
                      device=dev, dtype=dtype)
    x = torch.randn(T, d, device=dev, dtype=dtype)
    dout = torch.randn(T, d, device=dev, dtype=dtype)

    def make_step(fn):
        def step():
            for p in layer.parameters():
                p.grad = None
            if dev.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out, aux = fn(x, return_aux_loss=True)
            ((out * dout).sum().float() + aux).backward()
        return step

    def graphed(step):
        # Captured at its first call, so the first call's time includes warm-up and capture.
        replay = None

        def call():
            nonlocal replay
            if replay is None:
                with torch.cuda.device(dev):
                    replay = captured(step)
            replay()
        return call

    eager_step = make_step(layer)
    variants = [("eager", eager_step)] + [
        (mode, graphed(eager_step) if mode == "cuda-graph" else make_step(
            torch.compile(layer, mode=None if mode == "default" else mode, fullgraph=True)))
        for mode in modes]
    results = {}
    for name, step in variants:
        first = _timed_steps(step, dev, 1)[0]
        _timed_steps(step, dev, 2)                      # CUDA-graph recording, allocator warm-up
        times = _timed_steps(step, dev, steps)
        results[name] = {"first_call_s": first, "step_ms": 1e3 * statistics.median(times)}
    eager = results["eager"]["step_ms"]
    for name in modes:
        results[name]["speedup_vs_eager"] = eager / results[name]["step_ms"]
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="8192,2048,1024,64,8", help="T,d,n,E,K")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--backend", choices=("auto", "torch", "cute"), default="auto")
    p.add_argument("--modes", nargs="+", default=["default", "reduce-overhead"],
                   choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs",
                            "cuda-graph"),
                   help="torch.compile modes, and cuda-graph: the eager step captured in a "
                        "CUDA graph (CUDA only)")
    p.add_argument("--router", choices=("topk", "token_rounding"), default="topk")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    config = tuple(int(v) for v in args.config.split(","))
    if len(config) != 5:
        p.error("--config must be T,d,n,E,K")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available (use --device cpu for a smoke run)")
    if "cuda-graph" in args.modes and not args.device.startswith("cuda"):
        p.error("--modes cuda-graph needs --device cuda")
    results = measure(config, device=args.device, dtype=getattr(torch, args.dtype),
                      modes=args.modes, steps=args.steps, backend=args.backend,
                      router=args.router)
    if args.json:
        print(json.dumps({"config": args.config, "device": args.device, "dtype": args.dtype,
                          "router": args.router,
                          "backend": sonic.explain_backend(args.backend, args.device),
                          "results": results}))
        return 0
    print(f"sonic.MoE T,d,n,E,K={args.config} {args.router} {args.dtype} on {args.device} "
          f"({sonic.explain_backend(args.backend, args.device)})")
    print(f"  {'variant':<28} {'first call s':>12} {'step ms':>10} {'vs eager':>9}")
    for name, r in results.items():
        speed = f"{r['speedup_vs_eager']:.2f}x" if "speedup_vs_eager" in r else ""
        print(f"  {name:<28} {r['first_call_s']:>12.2f} {r['step_ms']:>10.3f} {speed:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
