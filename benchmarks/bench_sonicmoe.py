"""SonicMoE's MoE layer beside torch-gmm, timed the way ``bench_moe.py`` times sonic's: the run
that ``bench_moe.py --vs-sonicmoe FILE`` compares against.

    python benchmarks/bench_sonicmoe.py [--config NAME|T,d,n,E,K ...] [--sweep] [--profile] \
        > sonicmoe.jsonl

Needs SonicMoE (the ``sonic-moe`` package, Guo et al., arXiv 2512.14080) importable as
``sonicmoe``. It pins its own CuTe DSL, so run it in SonicMoE's environment (sonic's package
importable beside it: only its PyTorch baseline and this folder's helpers are used, no sonic
kernel), on another GPU of the same machine at the same time as ``bench_moe.py``, or one after
the other on one GPU.

Per shape, in this order (``bench_moe.py``'s: under a power cap a GPU heated by the row before
runs slower, so both programs time torch-gmm first): torch-gmm
(:func:`sonic.baselines.torch_gmm_moe`), then SonicMoE's ``moe_TC_softmax_topk_layer`` on the
same inputs (``problem``: seed 0, bf16; SonicMoE takes ``(2n, d, E)`` / ``(d, n, E)`` views of
the same weights and reads W1's rows as interleaved gate/up pairs, which changes what it
computes, not the work). Each row is ``bench_moe.time_row``, the procedure of every row of
``bench_moe.py``: forward and forward + backward medians of ``do_bench`` (L2 flushed,
gradients set to None), clock, power and energy per step, the MiB kept for backward
(:func:`sonic.profile_activation_memory`, which sees any autograd function's saved tensors)
and the peak MiB of a step. One JSON line per (shape, implementation) on stdout, with the keys
``bench_moe.read_sonicmoe`` reads.

SonicMoE autotunes each GEMM in its first step (QuACK compiles and times several tile configurations
per GEMM: 9 and 22 for the first two at DeepSeek-V3, the first taking 90 s to compile with 16
workers on a fresh machine), so the first row of each shape takes minutes before its timing starts.

``--profile`` adds SonicMoE's per-kernel CUDA time per step (three back-to-back steps after
three, as ``bench_moe.py --profile`` takes sonic's), its six GEMM launches named by sonic's
roles in launch order (up-proj, down-proj, dH, dW2, dX, dW1: SonicMoE 0.1.2's launches follow
that order, as each launch's FLOPs and cluster shape show).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import device_name  # noqa: E402
from bench_moe import _kernel_breakdown, chosen_configs, problem, time_row  # noqa: E402

from sonic.baselines import torch_gmm_moe  # noqa: E402
from sonic.baselines.configs import CONFIGS, PAPER_CONFIGS, parse_config  # noqa: E402


def sonicmoe_layer():
    """SonicMoE's top-K softmax MoE layer as a function of ``(x, router_weight, w1 (E, 2n, d),
    w2 (E, d, n), k)``, the signature of :func:`sonic.baselines.torch_gmm_moe`.

    Raises:
        SystemExit: SonicMoE is not importable (the message says what to install).
    """
    try:
        from sonicmoe.functional import moe_TC_softmax_topk_layer
    except ImportError as err:
        raise SystemExit(f"bench_sonicmoe.py needs SonicMoE importable as 'sonicmoe' ({err})")

    def layer(x, router_weight, w1, w2, k):
        return moe_TC_softmax_topk_layer(x, router_weight, w1.permute(1, 2, 0), None,
                                         w2.permute(1, 2, 0), None, k, 0)[0]
    return layer


def json_row(name: str, sizes, impl: str, fwd_us: float, step_us: float, saved_mib: float,
             peak_mib: float) -> dict:
    """One output line: times in ms, TFLOPS with the layer's ``6·T·K·d·n`` forward FLOPs
    (three times that for forward + backward), MiB."""
    T, d, n, E, K = sizes
    flops = 6 * T * K * d * n
    return {"config": name, "T": T, "d": d, "n": n, "E": E, "K": K, "impl": impl,
            "fwd_ms": round(fwd_us / 1e3, 3), "fwdbwd_ms": round(step_us / 1e3, 3),
            "fwd_tflops": round(flops / fwd_us / 1e6, 1),
            "fwdbwd_tflops": round(3 * flops / step_us / 1e6, 1),
            "saved_MiB": round(saved_mib, 1), "peak_MiB": round(peak_mib, 1)}


def row(name: str, sizes, impl: str, layer, profile: bool = False) -> dict:
    """Time ``layer`` at ``sizes`` as ``bench_moe.py`` times each of its rows
    (:func:`bench_moe.time_row`; SonicMoE compiles and autotunes in its first step), print and
    return its JSON row."""
    x, router_weight, w1, w2, grad = problem(sizes)
    params = (router_weight, w1, w2)
    leaves = (x, *params)
    timed, step = time_row(impl, layer, x, params, sizes[4], grad, leaves)
    result = json_row(name, sizes, impl, timed["fwd_us"], timed["fwd_bwd_us"],
                      timed["saved_MiB"], timed["peak_MiB"])
    result.update(sm_mhz=timed["sm_mhz"], watts=timed["watts"], J_per_step=timed["J_per_step"])
    print(json.dumps(result), flush=True)
    if profile:
        _kernel_breakdown(step, what=f"{impl} forward+backward", grad_to_none=leaves,
                          gemm_marker="gemm")
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=parse_config, action="append",
                        help=f"a named shape ({', '.join(CONFIGS)}) or T,d,n,E,K; repeatable "
                             f"(default: {', '.join(PAPER_CONFIGS)})")
    parser.add_argument("--sweep", action="store_true",
                        help="every named shape, after those given with --config")
    parser.add_argument("--profile", action="store_true",
                        help="SonicMoE's per-kernel CUDA time per step")
    args = parser.parse_args(argv)
    layer = sonicmoe_layer()
    configs = chosen_configs(args.config, args.sweep)
    print(f"device: {device_name()}  torch {torch.__version__}", file=sys.stderr)
    for name, sizes in configs:
        row(name, sizes, "torch-gmm", torch_gmm_moe)
        row(name, sizes, "sonicmoe", layer, args.profile)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
