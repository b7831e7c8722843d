"""End-to-end MoE layer (router + experts): sonic vs torch-gmm in the same run.

    python benchmarks/bench_moe.py                       # 7B, OLMoE, 30B (ANCHORS.md)
    python benchmarks/bench_moe.py --config 8192,4096,1024,256,8 --router both

Per configuration prints forward, backward and forward+backward TFLOPS (DESIGN §3 counts:
forward ``6·P·d·n``, backward ``12·P·d·n``; router time included, its FLOPs not), the MiB kept
for backward ("saved", :func:`sonic.profile_activation_memory`) and the peak extra MiB of one
forward+backward, for sonic (``backend="auto"``: CuTe kernels where they exist) and for the
torch-gmm baseline, and the sonic/torch-gmm ratios. ``--router token_rounding`` runs sonic with
token rounding (paper §5.2) on the same data; the FLOP count then uses its own ``P``.
``--router both`` runs sonic with top-K and with token rounding, and prints their time ratio.
``--profile`` adds, per configuration, sonic's forward+backward time per GPU kernel
(``torch.profiler``), to show where the time goes.

A timed forward+backward is one training step's worth: the parameter and input gradients are
dropped before each backward (``zero_grad(set_to_none=True)``), so no gradient-accumulation
kernels are timed for either implementation.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, device_name  # noqa: E402

import sonic  # noqa: E402
from sonic.baselines import torch_gmm_moe  # noqa: E402
from sonic.baselines.configs import CONFIGS, parse_config  # noqa: E402

MiB = float(1 << 20)


def _sonic_layer(router: str, tile: int):
    def layer(x, router_weight, w1, w2, k):
        logits = x @ router_weight.t()
        if router == "token_rounding":
            r = sonic.token_rounding_routing(logits, k, tile=tile)
        else:
            r = sonic.topk_routing(logits, k)
        layer.pairs = r.num_pairs
        return sonic.moe_experts(x, w1, w2, r.scores, r.token_idx, r.expert_idx,
                                 metadata=sonic.routing_metadata(r))
    layer.pairs = 0
    return layer


def _peak_mib(fn, grad):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn().backward(grad)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MiB


def _kernel_breakdown(fn, rows: int = 14):
    """Print the CUDA time of each kernel of one ``fn()`` (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"
              and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    print(f"  per-kernel CUDA time of one sonic forward+backward: {total / 1e3:.2f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        label = e.key.replace("kernel_cutlass_kernel_sonickernels", "sonic:")
        label = label if len(label) <= 72 else f"{label[:34]}...{label[-35:]}"
        print(f"    {e.self_device_time_total / 1e3:7.3f} ms {100 * e.self_device_time_total / total:5.1f}%"
              f"  x{e.count:<3d} {label}")


def _steps(layer, x, params, k, grad):
    """The timed callables of one implementation: forward, and a training step's
    forward+backward (gradients dropped first, as ``zero_grad(set_to_none=True)``)."""
    def fwd():
        return layer(x, *params, k)

    def fwd_bwd():
        for t in (x, *params):
            t.grad = None
        fwd().backward(grad)

    return fwd, fwd_bwd


def measure(name, sizes, router, tile, profile_kernels=False):
    T, d, n, E, K = sizes
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    x = torch.randn(T, d, **kw).requires_grad_()
    router_weight = (torch.randn(E, d, **kw) * d ** -0.5).requires_grad_()
    w1 = (torch.randn(E, 2 * n, d, **kw) * d ** -0.5).requires_grad_()
    w2 = (torch.randn(E, d, n, **kw) * n ** -0.5).requires_grad_()
    grad = torch.randn(T, d, **kw)
    params = (router_weight, w1, w2)
    rows, steps = {}, {}
    routers = ("topk", "token_rounding") if router == "both" else (router,)
    impls = {_impl_name(r, router): _sonic_layer(r, tile) for r in routers}
    first = next(iter(impls))   # the sonic row the ratios and the profile use
    impls["torch-gmm"] = torch_gmm_moe
    for impl, layer in impls.items():
        fwd, fwd_bwd = _steps(layer, x, params, K, grad)
        fwd_bwd()  # compile kernels, warm the allocator
        steps[impl] = fwd_bwd
        fwd_us = bench(fwd)
        total_us = bench(fwd_bwd)
        pairs = T * K if impl == "torch-gmm" else layer.pairs
        flops = 6 * pairs * d * n
        saved = sonic.profile_activation_memory(layer, x, *params, K).activation_bytes / MiB
        for t in (x, *params):
            t.grad = None
        rows[impl] = {
            "fwd_us": fwd_us, "fwd_bwd_us": total_us,
            "fwd_TFLOPS": flops / fwd_us / 1e6,
            "bwd_TFLOPS": 2 * flops / max(total_us - fwd_us, 1e-9) / 1e6,
            "fwd_bwd_TFLOPS": 3 * flops / total_us / 1e6,
            "saved_MiB": saved, "peak_MiB": _peak_mib(fwd, grad), "P": pairs,
        }
    s, t = rows[first], rows["torch-gmm"]
    print(f"\n{name}  T={T} d={d} n={n} E={E} K={K}  sonic router={router}")
    print(f"  {'impl':10s} {'fwd TF':>8s} {'bwd TF':>8s} {'f+b TF':>8s} {'f+b ms':>8s} "
          f"{'saved MiB':>10s} {'peak MiB':>9s}")
    for impl, r in rows.items():
        print(f"  {impl:10s} {r['fwd_TFLOPS']:8.1f} {r['bwd_TFLOPS']:8.1f} {r['fwd_bwd_TFLOPS']:8.1f} "
              f"{r['fwd_bwd_us'] / 1e3:8.2f} {r['saved_MiB']:10.1f} {r['peak_MiB']:9.1f}")
    ratio = t["fwd_bwd_us"] / s["fwd_bwd_us"]
    print(f"  sonic / torch-gmm: fwd {t['fwd_us'] / s['fwd_us']:.2f}x, fwd+bwd (time) {ratio:.2f}x, "
          f"saved {s['saved_MiB'] / t['saved_MiB']:.2f}x")
    result = {"config": name, "router": router, "sonic": s, "torch_gmm": t,
              "fwd_bwd_speedup": ratio}
    if router == "both":
        tr = rows["sonic-TR"]
        result["sonic_token_rounding"] = tr
        result["token_rounding_speedup"] = s["fwd_bwd_us"] / tr["fwd_bwd_us"]
        print(f"  token rounding / top-K, fwd+bwd (time): {result['token_rounding_speedup']:.2f}x "
              f"faster (P = {tr['P']} vs {s['P']})")
    if profile_kernels:
        _kernel_breakdown(steps[first])
    return result


def _impl_name(router: str, requested: str) -> str:
    if requested != "both":
        return "sonic"
    return "sonic-topK" if router == "topk" else "sonic-TR"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=parse_config, action="append",
                        help="7B, OLMoE, 30B or T,d,n,E,K (repeatable; default: the three)")
    parser.add_argument("--router", choices=("topk", "token_rounding", "both"), default="topk")
    parser.add_argument("--tile", type=int, default=128, help="token-rounding tile")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="also print sonic's forward+backward time per GPU kernel")
    args = parser.parse_args(argv)
    configs = args.config or list(CONFIGS.items())
    print(f"device: {device_name()}  torch {torch.__version__}  backend: "
          f"{sonic.explain_backend('auto', 'cuda')}")
    results = [measure(name, sizes, args.router, args.tile, args.profile)
               for name, sizes in configs]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
