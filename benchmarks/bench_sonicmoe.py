"""SonicMoE's MoE layer beside torch-gmm, timed the way ``bench_moe.py`` times sonic's: the run
that ``bench_moe.py --vs-sonicmoe FILE`` compares against.

    python benchmarks/bench_sonicmoe.py [--config NAME|T,d,n,E,K ...] [--sweep] [--profile] \
        > sonicmoe.jsonl
    python benchmarks/bench_sonicmoe.py --gemm NAME [--gemm NAME ...] [--power SECONDS] \
        [--json FILE] [--config ...]

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
QuACK writes each autotune's timings (and its compiled kernels) under ``QUACK_CACHE_DIR``; a
later process given the same directory reads the timings back and picks the same tiles
without compiling or timing the other candidates (on the same machine it also loads the
compiled kernels): the seven named shapes took 15 minutes with a fresh cache and 2 with that
of the first run, on one two-H200 machine. Keep the directory to rerun SonicMoE cheaply on
the same GPU type; a cache from another GPU type would carry that GPU's choices.

``--profile`` adds SonicMoE's per-kernel CUDA time per step (three back-to-back steps after
three, as ``bench_moe.py --profile`` takes sonic's), its six GEMM launches named by sonic's
roles in launch order (up-proj, down-proj, dH, dW2, dX, dW1: SonicMoE 0.1.2's launches follow
that order, as each launch's FLOPs and cluster shape show).

``--gemm NAME`` (repeatable) times instead SonicMoE's grouped GEMMs alone, each called as
SonicMoE's forward or backward calls it (QuACK's ``gemm``, ``gemm_gated`` and
``gemm_dgated``, varlen-M or varlen-K, gathering the token rows through ``A_idx``; autotuned
on its first call), on SonicMoE's weight layouts (``(2n, d, E)`` / ``(d, n, E)`` views, W1's
rows read as interleaved gate/up pairs): ``up+act`` (H and A), ``down``, ``dA'+dH`` (dH, A'
and ds), ``dX``, ``dW1``, ``dW2``. The operands, routing and row format are those of
``bench_grouped_gemm.py --gemm NAME`` (the ``kernel`` column is SonicMoE's; torch: the
same references, the SwiGLU ones on interleaved columns), so that the two programs' rows, one
after the other on one GPU, compare kernel with kernel and each with torch timed in its own
process. ``--power SECONDS`` adds the clock, power and energy per call of each kernel, as
``bench_grouped_gemm.py --power`` does for sonic's; ``--json FILE`` appends the rows to
``FILE`` as ``bench_grouped_gemm.py --json`` does, so that ``bench_grouped_gemm.py --results
sonic.jsonl sonicmoe.jsonl`` sets the two programs' kernels side by side.
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
from sonic.reference.ops import dswiglu_epilogue as torch_dswiglu_epilogue  # noqa: E402
from sonic.reference.ops import swiglu as torch_swiglu  # noqa: E402
from bench_moe import _kernel_breakdown, chosen_configs, problem, time_row  # noqa: E402

from sonic.baselines import torch_gmm_moe  # noqa: E402
from sonic.baselines.configs import CONFIGS, PAPER_CONFIGS, parse_config  # noqa: E402


def _sonicmoe_module(module: str):
    """``module`` of SonicMoE's installation (QuACK's come with it).

    Raises:
        SystemExit: it is not importable (the message says what to install).
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise SystemExit(f"bench_sonicmoe.py needs SonicMoE importable as 'sonicmoe' ({err})")


def sonicmoe_layer():
    """SonicMoE's top-K softmax MoE layer as a function of ``(x, router_weight, w1 (E, 2n, d),
    w2 (E, d, n), k)``, the signature of :func:`sonic.baselines.torch_gmm_moe`.

    Raises:
        SystemExit: SonicMoE is not importable (the message says what to install).
    """
    moe_TC_softmax_topk_layer = _sonicmoe_module("sonicmoe.functional").moe_TC_softmax_topk_layer

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


GEMMS = ("up+act", "down", "dA'+dH", "dX", "dW1", "dW2")


def gemm_rows(name: str, sizes, quack, only, device: str = "cuda") -> None:
    """``--gemm`` rows of one shape: each GEMM of :data:`GEMMS` in ``only``, called as
    SonicMoE 0.1.2's ``_up_projection_forward``, ``_down_projection_forward``,
    ``_down_projection_backward_act``, ``_up_projection_backward_act``,
    ``_up_projection_backward_weight`` and ``_down_projection_backward_weight`` call QuACK
    (``quack``: its ``gemm_interface`` module), beside torch (on ``device``)."""
    t, d, n, e, k = sizes
    gather_idx, offsets = _routing(t, e, k, device)
    p, ends, gidx_long = t * k, offsets[1:], gather_idx.long()
    kw = {"device": device, "dtype": torch.bfloat16}
    x, do = torch.randn(t, d, **kw), torch.randn(t, d, **kw)
    # (E, 2n, d) / (E, d, n) storage; SonicMoE's weights are its (2n, d, E) / (d, n, E) views.
    w1 = torch.randn(e, 2 * n, d, **kw) / d ** 0.5
    w2 = torch.randn(e, d, n, **kw) / n ** 0.5
    act, dh = torch.randn(p, n, **kw), torch.randn(p, 2 * n, **kw)
    h, scores = torch.randn(p, 2 * n, **kw), torch.rand(p, device=device)
    xg, dog = (lambda: x.index_select(0, gidx_long)), (lambda: do.index_select(0, gidx_long))
    out = {"h": torch.empty(p, 2 * n, **kw), "a": torch.empty(p, n, **kw),
           "y": torch.empty(p, d, **kw), "dh": torch.empty(p, 2 * n, **kw),
           "a'": torch.empty(p, n, **kw), "dx": torch.empty(p, d, **kw),
           "dw1": torch.empty(e, 2 * n, d, **kw), "dw2": torch.empty(e, d, n, **kw)}

    def up_act():
        quack.gemm_gated(x, w1.transpose(1, 2), activation="swiglu", cu_seqlens_m=offsets,
                         A_idx=gather_idx, preact_out=out["h"], postact_out=out["a"],
                         store_preact=True)
        return out["a"]

    def dh_kernel():
        quack.gemm_dgated(do, w2, PreAct=h, activation="swiglu", dx_out=out["dh"],
                          postact_out=out["a'"], colvec_scale=scores, colvec_reduce=True,
                          cu_seqlens_m=offsets, A_idx=gather_idx, dynamic_scheduler=False)
        return out["dh"]

    def call(fn, result, *args, **kwargs):
        def run():
            fn(*args, **kwargs)
            return result
        return run

    cases = {
        "up+act": (2 * p * 2 * n * d, up_act, lambda: torch_swiglu(
            torch._grouped_mm(xg(), w1.transpose(1, 2), offs=ends), "interleaved")),
        "down": (2 * p * d * n,
                 call(quack.gemm, out["y"], act, w2.transpose(1, 2), out=out["y"],
                      cu_seqlens_m=offsets),
                 lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)),
        "dA'+dH": (2 * p * d * n, dh_kernel, lambda: torch_dswiglu_epilogue(
            torch._grouped_mm(dog(), w2, offs=ends), h, scores, "interleaved")[0]),
        "dX": (2 * p * 2 * n * d,
               call(quack.gemm, out["dx"], dh, w1, out=out["dx"], cu_seqlens_m=offsets,
                    dynamic_scheduler=False),
               lambda: torch._grouped_mm(dh, w1, offs=ends)),
        "dW1": (2 * p * 2 * n * d,
                call(quack.gemm, out["dw1"], x.T, dh, out=out["dw1"].transpose(1, 2),
                     cu_seqlens_k=offsets, A_idx=gather_idx, batch_idx_permute=None,
                     dynamic_scheduler=False),
                lambda: torch._grouped_mm(dh.t(), xg(), offs=ends)),
        "dW2": (2 * p * d * n,
                call(quack.gemm, out["dw2"], do.T, act, out=out["dw2"], cu_seqlens_k=offsets,
                     A_idx=gather_idx, batch_idx_permute=None, dynamic_scheduler=False),
                lambda: torch._grouped_mm(dog().t(), act, offs=ends)),
    }
    for gemm in GEMMS:
        if gemm in only:
            _row(name, gemm, *cases[gemm])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=parse_config, action="append",
                        help=f"a named shape ({', '.join(CONFIGS)}) or T,d,n,E,K; repeatable "
                             f"(default: {', '.join(PAPER_CONFIGS)})")
    parser.add_argument("--sweep", action="store_true",
                        help="every named shape, after those given with --config")
    parser.add_argument("--profile", action="store_true",
                        help="SonicMoE's per-kernel CUDA time per step")
    parser.add_argument("--gemm", choices=GEMMS, action="append",
                        help="time this SonicMoE GEMM alone, as bench_grouped_gemm.py's rows "
                             "(repeatable) instead of the layer")
    parser.add_argument("--power", type=float, default=0.0, metavar="SECONDS",
                        help="with --gemm: run each kernel this long under the power sampler")
    parser.add_argument("--json", metavar="FILE",
                        help="with --gemm: also append each row to FILE as a JSON line "
                             "(bench_grouped_gemm.py --results reads it)")
    args = parser.parse_args(argv)
    if args.power < 0 or (args.power and not args.gemm):
        parser.error(f"--power takes a non-negative number of seconds, with --gemm; got "
                     f"{args.power}")
    if args.gemm and args.profile:
        parser.error("--profile profiles the layer's step; --gemm times GEMMs alone")
    if args.json and not args.gemm:
        parser.error("--json writes --gemm rows (the layer's rows go to standard output)")
    bench_grouped_gemm.POWER_SECONDS = args.power
    bench_grouped_gemm.JSON_PATH = args.json
    bench_grouped_gemm.KERNEL_IMPL = "sonicmoe"
    configs = chosen_configs(args.config, args.sweep)
    if args.gemm:
        quack = _sonicmoe_module("quack.gemm_interface")
        print(f"device: {device_name()}  torch {torch.__version__}", file=sys.stderr)
        print("shape  gemm    |  torch us kernel us | torch TF kern TF speedup  rel err")
        for name, sizes in configs:
            gemm_rows(name, sizes, quack, args.gemm)
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
