"""SonicMoE's MoE layer beside torch-gmm, timed the way ``bench_moe.py`` times sonic's: the run
that ``bench_moe.py --vs-sonicmoe FILE`` compares against.

    python benchmarks/bench_sonicmoe.py [--config NAME|T,d,n,E,K ...] [--sweep] [--profile] \
        > sonicmoe.jsonl
    python benchmarks/bench_sonicmoe.py --wgrads [--power SECONDS] [--config ...]

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

``--wgrads`` times instead SonicMoE's two weight-gradient GEMMs alone, as its backward calls
them: QuACK's varlen-K ``gemm`` gathering the token rows (``A_idx``), autotuned on its first
call, writing SonicMoE's ``(2n, d, E)`` / ``(d, n, E)`` gradient layouts, on the operands,
routing and row format of ``bench_grouped_gemm.py --gemm dW1 --gemm dW2`` (the ``kernel``
column is SonicMoE's; torch: ``index_select`` + ``_grouped_mm``), so that the two programs'
rows, one after the other on one GPU, compare kernel with kernel and each with torch timed
in its own process. ``--power SECONDS`` adds the clock, power and energy per call of each
SonicMoE kernel, as ``bench_grouped_gemm.py --power`` does for sonic's.
"""

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import device_name  # noqa: E402
import bench_grouped_gemm  # noqa: E402
from bench_grouped_gemm import _routing, _row  # noqa: E402
from bench_moe import _kernel_breakdown, chosen_configs, problem, time_row  # noqa: E402

from sonic.baselines import torch_gmm_moe  # noqa: E402
from sonic.baselines.configs import CONFIGS, PAPER_CONFIGS, parse_config  # noqa: E402


def _from_sonicmoe(module: str, name: str):
    """``name`` from ``module`` of SonicMoE's installation (QuACK's come with it).

    Raises:
        SystemExit: it is not importable (the message says what to install).
    """
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise SystemExit(f"bench_sonicmoe.py needs SonicMoE importable as 'sonicmoe' ({err})")


def sonicmoe_layer():
    """SonicMoE's top-K softmax MoE layer as a function of ``(x, router_weight, w1 (E, 2n, d),
    w2 (E, d, n), k)``, the signature of :func:`sonic.baselines.torch_gmm_moe`.

    Raises:
        SystemExit: SonicMoE is not importable (the message says what to install).
    """
    moe_TC_softmax_topk_layer = _from_sonicmoe("sonicmoe.functional", "moe_TC_softmax_topk_layer")

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


def wgrad_rows(name: str, sizes, gemm) -> None:
    """``--wgrads`` rows of one shape: SonicMoE's dW1 (``X_gatheredᵀ·dH``) and dW2
    (``dO_gatheredᵀ·A'``) as ``_up_projection_backward_weight`` and
    ``_down_projection_backward_weight`` of SonicMoE 0.1.2 call QuACK's ``gemm``, beside
    torch."""
    t, d, n, e, k = sizes
    gather_idx, offsets = _routing(t, e, k)
    p, ends, gidx_long = t * k, offsets[1:], gather_idx.long()
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    x, do = torch.randn(t, d, **kw), torch.randn(t, d, **kw)
    dh, act = torch.randn(p, 2 * n, **kw), torch.randn(p, n, **kw)
    # SonicMoE's weights are (2n, d, E) / (d, n, E) views of (E, 2n, d) / (E, d, n) storage.
    dw1 = torch.empty(e, 2 * n, d, **kw)
    dw2 = torch.empty(e, d, n, **kw)

    def sonicmoe_dw1():
        gemm(x.T, dh, out=dw1.permute(0, 2, 1), cu_seqlens_k=offsets, A_idx=gather_idx,
             batch_idx_permute=None, dynamic_scheduler=False)
        return dw1

    def sonicmoe_dw2():
        gemm(do.T, act, out=dw2, cu_seqlens_k=offsets, A_idx=gather_idx,
             batch_idx_permute=None, dynamic_scheduler=False)
        return dw2

    _row(name, "dW1", 2 * p * 2 * n * d, sonicmoe_dw1,
         lambda: torch._grouped_mm(dh.t(), x.index_select(0, gidx_long), offs=ends))
    _row(name, "dW2", 2 * p * d * n, sonicmoe_dw2,
         lambda: torch._grouped_mm(do.index_select(0, gidx_long).t(), act, offs=ends))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=parse_config, action="append",
                        help=f"a named shape ({', '.join(CONFIGS)}) or T,d,n,E,K; repeatable "
                             f"(default: {', '.join(PAPER_CONFIGS)})")
    parser.add_argument("--sweep", action="store_true",
                        help="every named shape, after those given with --config")
    parser.add_argument("--profile", action="store_true",
                        help="SonicMoE's per-kernel CUDA time per step")
    parser.add_argument("--wgrads", action="store_true",
                        help="SonicMoE's dW1 and dW2 GEMMs alone, as bench_grouped_gemm.py's rows")
    parser.add_argument("--power", type=float, default=0.0, metavar="SECONDS",
                        help="with --wgrads: run each kernel this long under the power sampler")
    args = parser.parse_args(argv)
    if args.power < 0 or (args.power and not args.wgrads):
        parser.error(f"--power takes a non-negative number of seconds, with --wgrads; got "
                     f"{args.power}")
    if args.wgrads and args.profile:
        parser.error("--profile profiles the layer's step; --wgrads times GEMMs alone")
    bench_grouped_gemm.POWER_SECONDS = args.power
    configs = chosen_configs(args.config, args.sweep)
    if args.wgrads:
        gemm = _from_sonicmoe("quack.gemm_interface", "gemm")
        print(f"device: {device_name()}  torch {torch.__version__}", file=sys.stderr)
        print("shape  gemm    |  torch us kernel us | torch TF kern TF speedup  rel err")
        for name, sizes in configs:
            wgrad_rows(name, sizes, gemm)
            torch.cuda.empty_cache()
        return
    layer = sonicmoe_layer()
    print(f"device: {device_name()}  torch {torch.__version__}", file=sys.stderr)
    for name, sizes in configs:
        row(name, sizes, "torch-gmm", torch_gmm_moe)
        row(name, sizes, "sonicmoe", layer, args.profile)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
