"""Grouped GEMMs: sonic's CuTe-DSL kernels vs ``torch._grouped_mm`` in the same run.

    python benchmarks/bench_grouped_gemm.py [--config NAME|T,d,n,E,K ...] [--gemm NAME ...]
                                            [--ceiling] [--plans | --share both] [--fp8]
                                            [--power SECONDS] [--routing topk|balanced]
                                            [--json FILE]
    python benchmarks/bench_grouped_gemm.py --results FILE [FILE ...]

At the paper's shapes (docs/design.md §5: T, d, n, E, K; ``--config`` for others, as
``bench_moe.py``) with random top-K routing (P = T·K rows sorted by expert; ``--routing
balanced`` gives every expert P / E rows instead, ±1, so that where that is a multiple of 64
no weight gradient has a partial k-tile: what ragged experts cost) prints, per GEMM, median
µs and TFLOPS (``2·P·N·K`` flops) of the kernel and of torch, the speedup and the kernel's
relative error against torch:

* ``up``: varlen-M, ``gather(X)·W1ᵀ`` (N = 2n, K = d) — torch: ``index_select`` +
  ``_grouped_mm``;
* ``down``: varlen-M, contiguous ``A·W2ᵀ`` (N = d, K = n) — torch: ``_grouped_mm``;
* ``up+act``: the up-proj with the SwiGLU epilogue (``grouped_gemm_swiglu``, H and A in one
  launch; the path ``"auto"`` takes) — torch: ``index_select`` + ``_grouped_mm`` + SwiGLU;
  ``up+act*``: sonic unfused (gathered GEMM, then the one-pass SwiGLU kernel);
* ``dA'``: varlen-M, ``gather(dO)·W2`` with W2 read N-major (N = n, K = d) — torch:
  ``index_select`` + ``_grouped_mm``;
* ``dA'+dH``: the dH kernel, ``dA'`` with the dSwiGLU epilogue (``grouped_gemm_dswiglu``: dH,
  A' and ds in one launch) — torch: ``index_select`` + ``_grouped_mm`` + the reference
  epilogue; ``dA'+dH*``: sonic unfused (the dA' GEMM, then the standalone epilogue kernel);
* ``dX``: varlen-M, contiguous ``dH·W1`` with W1 read N-major (N = d, K = 2n) — torch:
  ``_grouped_mm``;
* ``dW1``: varlen-K, ``dHᵀ·gather(X)`` (M = 2n, N = d) — torch: ``index_select`` +
  ``_grouped_mm`` of ``dHᵀ`` and the gathered rows;
* ``dW2``: varlen-K, ``gather(dO)ᵀ·A'`` (M = d, N = n) — torch: ``index_select`` +
  ``_grouped_mm``.

``--ceiling`` adds, per GEMM, what its work costs without what sonic's design adds to it:
``/pre-gathered`` is sonic's kernel on rows gathered beforehand (the gather's cost; planned
for contiguous operands, so a weight gradient may get another plan than its gathered call),
and for a weight gradient whose gathered call is stored transposed
(``heuristic.transpose_varlen_k``) ``/pre-gathered-same-plan``, the pre-gathered call on the
gathered call's plan (:func:`forced_transpose`; its output checked bitwise against the
gathered call's): the gathered row copies' own cost, nothing else changed; ``/bmm``
is cuBLAS ``torch.bmm`` on perfectly balanced experts (``P / E`` rows each: no varlen, no
gather, no epilogue), the same work as a dense library runs it — a reference, not a bound
(sonic's clustered kernels beat it at times); ``up`` vs ``up+act`` and
``dA'`` vs ``dA'+dH`` show the fused epilogues' cost; a last line per shape sums the six
GEMMs a training step runs (``up+act``, ``down``, ``dA'+dH``, ``dX``, ``dW1``, ``dW2``) against
the six ``bmm`` rows of the same work.

``--plans`` times instead the contiguous-A GEMMs (``down``, ``dX``) and the weight gradients
(``dW1``, ``dW2``; with ``--gemm``, those named) under every candidate tile plan of
``PLAN_CANDIDATES`` (labelled ``tile_m x tile_n``, schedule, cluster, ``A`` when the cluster
shares A), in two alternating rounds — the same-run A/B behind ``heuristic.plan``'s choice for
them — each candidate's relative error against torch beside its time. The candidate replaces
``heuristic.plan``'s answer in this process only (:func:`forced_plan`). ``--plans --fp8`` does
the same for the block-scaled FP8 GEMMs ``up`` and ``dA'`` (gathered), ``down``, ``dX``,
``dW1`` and ``dW2`` under ``FP8_PLAN_CANDIDATES`` (128 x 256 or 128 x 128 cooperative tiles,
one CTA or a 2-CTA cluster; the relative error is against torch's bf16 GEMM on the unquantized
data). A candidate the kernel's configuration rejects at a shape (a 256-wide FP8 tile where N
is not a multiple of 256) gets a row saying so instead of a time.

``--share both`` times instead the gathered GEMMs (``up``, ``up+act``, ``dA'``, ``dA'+dH``; with
``--gemm``, those named) with the 2-CTA cluster sharing A (``multicast_a``), then B, in two
alternating rounds — the same-run A/B behind ``heuristic.b_outgrows_l2`` — each output
compared bitwise with the first choice's.

``--fp8`` times instead the block-scaled FP8 GEMMs (``grouped_gemm_fp8``, Hopper) at the OLMoE
and 30B shapes (``--config`` for others; ``--gemm`` picks among these eight): ``up``
(gathered), ``up+act`` (gathered, SwiGLU epilogue: ``grouped_gemm_fp8_swiglu``, rel err on A),
``down`` (contiguous), ``dA'`` (gathered ``dO`` on a K-major e4m3 ``W2ᵀ``: the dH step of the
default ``"quantizing"`` FP8 path, before its dSwiGLU kernel) and ``dA'+dH`` (the dH kernel,
``grouped_gemm_fp8_dswiglu``, rel err on dH) on e4m3 operands quantized once beforehand, beside
sonic's bf16 kernel and torch's bf16 ``_grouped_mm`` on the same unquantized data; ``rel err``
is the FP8 output's against torch bf16 (the e4m3 rounding, ≈4%). Beside ``up``, ``down``,
``dA'`` and ``dX``, ``/torch-fp8`` times PyTorch's own FP8 grouped GEMM
(``torch._scaled_grouped_mm``, rowwise scales) on the same work, rows gathered beforehand, and
beside the gathered ``up`` and ``dA'`` ``/torch-fp8+gather`` the same with the gather of the
e4m3 rows and their scales (``index_select``) timed with it: sonic's gathered call does both. Then
``dX`` (contiguous ``dH·W1`` on a K-major e4m3 ``W1ᵀ``) and the weight gradients ``dW1``,
``dW2`` (``grouped_gemm_varlen_k_fp8`` on the K-major ``128 x 1``-scaled copies of
``quantize_cols_grouped``, made before the timing; their cost is in
``benchmarks/bench_fp8_quant.py``). With ``--ceiling``, each distinct GEMM shape also runs as
one dense cuBLAS GEMM with the recipe's own scaling (``torch._scaled_mm``, ``1 x 128`` A and
``128 x 128`` B scales, ``P`` rows): what a dense block-scaled FP8 GEMM of the same work
reaches on this GPU, a reference for the FP8 grouped GEMMs (no gather, no varlen, no epilogue);
with ``--gemm``, only the shapes of the picked GEMMs' work.

``--power SECONDS`` also runs each kernel (each ``--ceiling`` row and ``--plans`` candidate
too) back to back for that long and prints, beside its time, the median SM clock (MHz), the
mean board power (W) and the board energy per call (mJ), the last two from NVML's energy
counter (``pynvml``); the step line then sums the energy too. On a GPU held at its power cap
(the H200 at 700 W) every GEMM, cuBLAS's included, runs below its top clock, and a kernel's
time follows the energy its work takes.

``--json FILE`` also appends each GEMM row (the default mode's and ``--fp8``'s) to ``FILE`` as
a JSON line: shape, GEMM, implementation, device, kernel and torch µs, relative error, FLOPs,
and with ``--power`` the clock, power and mJ. ``bench_sonicmoe.py --gemm NAME --json FILE``
writes SonicMoE's rows the same way. ``--results FILE [FILE ...]`` measures nothing and prints
such rows side by side, per shape and GEMM: each implementation's time in every run and its
mean, with ``--power``'s columns its clock range, megacycles and energy, and SonicMoE's mean
time over sonic's where both ran — the per-kernel comparison of two programs run one after
the other on one GPU.
"""

import argparse
import contextlib
import json
import math
import os
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, device_name, energy_per_call  # noqa: E402
from bench_moe import options_given  # noqa: E402

from sonic.baselines.configs import CONFIGS, PAPER_CONFIGS, parse_config  # noqa: E402
from sonic.kernels import runtime  # noqa: E402
from sonic.kernels.fp8_quant import quantize_cols_grouped  # noqa: E402
from sonic.kernels.grouped_gemm import (grouped_gemm, grouped_gemm_dswiglu,  # noqa: E402
                                        grouped_gemm_fp8, grouped_gemm_fp8_dswiglu,
                                        grouped_gemm_fp8_swiglu, grouped_gemm_swiglu,
                                        grouped_gemm_varlen_k, grouped_gemm_varlen_k_fp8,
                                        heuristic)
from sonic.kernels.grouped_gemm.config import CLUSTER  # noqa: E402
from sonic.kernels.grouped_gemm.interface import device_memory  # noqa: E402
from sonic.kernels.swiglu import dswiglu_epilogue, swiglu  # noqa: E402
from sonic.reference.ops import dswiglu_epilogue as torch_dswiglu_epilogue  # noqa: E402
from sonic.reference.fp8 import padded_offsets, quantize_blocks, quantize_rows  # noqa: E402
from sonic.reference.ops import swiglu as torch_swiglu  # noqa: E402

# (name, T, d, n, E, K) measured when no --config is given.
SHAPES = [(name, *CONFIGS[name]) for name in PAPER_CONFIGS]


def _routing(t, e, k, device="cuda"):
    """``(gather_idx, offsets)`` of T tokens routed to K of E experts each, by
    :data:`ROUTING`: "topk" takes each token's top K of random scores, "balanced" sends slot
    ``i`` of the ``T·K`` to expert ``i mod E`` (a token's K experts stay distinct)."""
    if ROUTING == "balanced":
        experts = torch.arange(t * k, device=device) % e
    else:
        experts = torch.randn(t, e, device=device).topk(k, dim=1).indices.reshape(-1)
    order = torch.argsort(experts, stable=True)
    gather_idx = (order // k).to(torch.int32)
    counts = torch.bincount(experts, minlength=e)
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=device)
    offsets[1:] = counts.cumsum(0)
    return gather_idx, offsets


def _rel_err(out, ref, chunk=1 << 26):
    # In chunks of the flat tensors: an fp32 copy of a DeepSeek-V3 weight gradient is 28 GiB.
    out, ref = out.reshape(-1), ref.reshape(-1)
    diff = norm = 0.0
    for i in range(0, out.numel(), chunk):
        o, r = out[i:i + chunk].float(), ref[i:i + chunk].float()
        diff += (o - r).square().sum().item()
        norm += r.square().sum().item()
    return (diff / norm) ** 0.5 if norm else float("inf")


class Timing(NamedTuple):
    """A kernel's median µs and, with ``--power``, its board energy per call (mJ)."""

    us: float
    mj: float | None = None


# Seconds each kernel runs under the power sampler (--power); 0: no power columns.
POWER_SECONDS = 0.0
# File each GEMM row is also appended to as a JSON line (--json), or None; and whose kernel
# the rows time (bench_sonicmoe.py --gemm sets "sonicmoe").
JSON_PATH = None
KERNEL_IMPL = "sonic"
# How tokens pick their experts (--routing): "topk" or "balanced" (see _routing).
ROUTING = "topk"


def _power(fn) -> tuple[str, dict]:
    """The power columns of ``fn`` and its ``{"sm_mhz", "watts", "mj"}`` (mJ per call; empty
    without ``--power`` or NVML samples)."""
    if not POWER_SECONDS:
        return "", {}
    stats = energy_per_call(fn, seconds=POWER_SECONDS)
    if stats["sm_mhz"] is None or stats["J_per_call"] is None:
        return " | no NVML samples", {}
    mj = stats["J_per_call"] * 1e3
    return (f" | {stats['sm_mhz']:>5} MHz {stats['watts']:>4.0f} W {mj:>7.1f} mJ "
            f"throttle {stats['throttle']}"), {"sm_mhz": stats["sm_mhz"],
                                               "watts": stats["watts"], "mj": mj}


def _row(shape, gemm, flops, kernel, torch_fn):
    out = kernel()
    kern_us = bench(kernel)
    note, power = _power(kernel)
    try:
        ref = torch_fn()
        torch_us = bench(torch_fn)
        rel_err = _rel_err(out, ref)
        err = f"{rel_err:.1e}"
        torch_tf = f"{flops / torch_us / 1e6:>7.0f}"
        speedup = f"{torch_us / kern_us:>6.2f}x"
    except (RuntimeError, TypeError) as exc:  # a torch build without this _grouped_mm form
        torch_us, rel_err, err = float("nan"), None, "n/a"
        torch_tf, speedup = "    n/a", "   n/a"
        print(f"  torch baseline failed: {exc}".splitlines()[0])
    print(f"{shape:<6} {gemm:<7} | {torch_us:>9.1f} {kern_us:>9.1f} | {torch_tf} "
          f"{flops / kern_us / 1e6:>7.0f} {speedup} {err:>8}{note}", flush=True)
    if JSON_PATH is not None:
        with open(JSON_PATH, "a") as f:
            f.write(json.dumps({
                "shape": shape, "gemm": gemm, "impl": KERNEL_IMPL, "device": device_name(),
                "kernel_us": kern_us, "torch_us": None if math.isnan(torch_us) else torch_us,
                "rel_err": rel_err, "flops": flops,
                **power}) + "\n")
    return Timing(kern_us, power.get("mj"))


def results_table(paths) -> None:
    """Print the ``--json`` rows of one or more runs side by side (``--results``): per shape
    and GEMM, each implementation's kernel µs in every run and their mean; with ``--power``'s
    columns also its SM clock range, mean megacycles (µs × MHz) and mean mJ per call; and
    where sonic and SonicMoE (``bench_sonicmoe.py --gemm --json``) both ran, SonicMoE's mean
    time over sonic's.

    Raises:
        SystemExit: a file holds no row, a line that is not JSON or a row without the fields
            ``--json`` writes (the message names the file).
    """
    groups: dict = {}
    for path in paths:
        with open(path) as f:
            try:
                rows = [json.loads(line) for line in f if line.strip()]
            except json.JSONDecodeError as err:
                raise SystemExit(f"--results: {path} is not JSON lines ({err})") from err
        if not rows:
            raise SystemExit(f"--results: {path} holds no GEMM row (write one with --json)")
        keys = ("shape", "gemm", "impl", "kernel_us")
        if not all(isinstance(r, dict) and all(k in r for k in keys) for r in rows):
            raise SystemExit(f"--results: {path} holds a line without the fields --json "
                             f"writes ({', '.join(keys)})")
        for r in rows:
            groups.setdefault((r["shape"], r["gemm"]), {}).setdefault(r["impl"], []).append(r)
    print(f"{'shape':<11} {'gemm':<8} {'impl':<9} | {'kernel us, each run':<36} {'mean':>8} | "
          "MHz, Mcycles, mJ")
    for (shape, gemm), impls in groups.items():
        mean_us = {}
        for impl, rows in impls.items():
            us = [r["kernel_us"] for r in rows]
            mean_us[impl] = sum(us) / len(us)
            line = (f"{shape:<11} {gemm:<8} {impl:<9} | "
                    f"{' / '.join(f'{u:.0f}' for u in us):<36} {mean_us[impl]:>8.0f} |")
            if all(r.get("sm_mhz") for r in rows):
                mhz = [r["sm_mhz"] for r in rows]
                cycles = sum(u * m for u, m in zip(us, mhz)) / len(rows) / 1e6
                line += f" {min(mhz)}-{max(mhz)} MHz {cycles:.1f} Mcycles"
            if all(r.get("mj") is not None for r in rows):
                line += f" {sum(r['mj'] for r in rows) / len(rows):.0f} mJ"
            print(line)
        if "sonic" in mean_us and "sonicmoe" in mean_us:
            print(f"{shape:<11} {gemm:<8} SonicMoE / sonic time: "
                  f"{mean_us['sonicmoe'] / mean_us['sonic']:.3f}x")


GEMMS = ("up", "up+act", "up+act*", "down", "dA'", "dA'+dH", "dA'+dH*", "dX", "dW1", "dW2")
# The kernels a bf16 training step of the layer runs ("auto"), and the bmm ceiling row of each
# (the fused epilogues' GEMM without its epilogue).
STEP_GEMMS = {"up+act": "up", "down": "down", "dA'+dH": "dA'", "dX": "dX", "dW1": "dW1",
              "dW2": "dW2"}
FP8_SHAPES = ("OLMoE", "30B")
# The GEMMs --fp8 times, and the dense ceiling shape (``--ceiling``) each one's work has.
FP8_GEMMS = {"up": "up", "up+act": "up", "down": "down", "dA'": "dA'", "dA'+dH": "dA'",
             "dX": "dX", "dW1": "up", "dW2": "dA'"}


def fp8_rows(name, t, d, n, e, k, ceiling=False, only=tuple(FP8_GEMMS)):
    """FP8 ``up``, ``up+act`` (SwiGLU epilogue, "concat"), ``down``, ``dA'``, ``dA'+dH``
    (dSwiGLU epilogue), ``dX``, ``dW1`` and ``dW2`` beside sonic bf16 and torch bf16 at one
    shape (those of them in ``only``); with ``ceiling``, the dense block-scaled cuBLAS GEMM of
    each distinct shape of their work."""
    gather_idx, offsets = _routing(t, e, k)
    p, ends, gidx_long = t * k, offsets[1:], gather_idx.long()
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(e, 2 * n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5
    act = torch.randn(p, n, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(e, d, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5
    for gemm, a, w, idx, flops in (("up", x, w1, gather_idx, 2 * p * 2 * n * d),
                                   ("down", act, w2, None, 2 * p * d * n)):
        # up's operands serve up+act too.
        if gemm not in only and not (gemm == "up" and "up+act" in only):
            continue
        a_q, a_s = quantize_rows(a)        # the reference recipe, outside the timing
        b_q, b_s = quantize_blocks(w)

        def torch_fn(a=a, w=w, idx=idx):
            rows = a.index_select(0, gidx_long) if idx is not None else a
            return torch._grouped_mm(rows, w.transpose(1, 2), offs=ends)

        if gemm in only:
            _row(name, gemm, flops, lambda a=a, w=w, idx=idx: grouped_gemm(a, w, offsets,
                                                                            gather_idx=idx),
                 torch_fn)
            _row(name, gemm + "/fp8", flops,
                 lambda a_q=a_q, a_s=a_s, b_q=b_q, b_s=b_s, idx=idx: grouped_gemm_fp8(
                     a_q, a_s, b_q, b_s, offsets, gather_idx=idx), torch_fn)
            _torch_fp8_row(name, gemm, flops, a, w, ends, gather_idx=idx)
        if gemm == "up" and "up+act" in only:
            torch_act = lambda fn=torch_fn: torch_swiglu(fn(), "concat")  # noqa: E731
            _row(name, "up+act", flops,
                 lambda: grouped_gemm_swiglu(x, w1, offsets, gather_idx, "concat")[1],
                 torch_act)
            _row(name, "up+act/fp8", flops,
                 lambda a_q=a_q, a_s=a_s, b_q=b_q, b_s=b_s: grouped_gemm_fp8_swiglu(
                     a_q, a_s, b_q, b_s, offsets, gather_idx, gate_up="concat")[1], torch_act)
        del a_q, a_s, b_q, b_s
    do = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(p, 2 * n, device="cuda", dtype=torch.bfloat16)
    if "dA'" in only or "dA'+dH" in only:
        # bf16 reads W2 N-major, FP8 a K-major e4m3 copy of W2ᵀ.
        do_q, do_s = quantize_rows(do)
        w2t_q, w2t_s = quantize_blocks(w2.transpose(1, 2).contiguous())
        torch_da = lambda: torch._grouped_mm(  # noqa: E731
            do.index_select(0, gidx_long), w2, offs=ends)
    if "dA'" in only:
        # The default FP8 path's dA' GEMM (the dSwiGLU kernel follows it).
        _row(name, "dA'", 2 * p * d * n,
             lambda: grouped_gemm(do, w2.transpose(1, 2), offsets, gather_idx=gather_idx),
             torch_da)
        _row(name, "dA'/fp8", 2 * p * d * n,
             lambda: grouped_gemm_fp8(do_q, do_s, w2t_q, w2t_s, offsets, gather_idx=gather_idx),
             torch_da)
        _torch_fp8_row(name, "dA'", 2 * p * d * n, do, w2.transpose(1, 2), ends,
                       gather_idx=gather_idx)
    if "dA'+dH" in only:
        # The dH kernel: dA' with the dSwiGLU epilogue.
        scores = torch.rand(p, device="cuda")
        torch_dh = lambda: torch_dswiglu_epilogue(torch_da(), h, scores, "concat")[0]  # noqa: E731
        _row(name, "dA'+dH", 2 * p * d * n,
             lambda: grouped_gemm_dswiglu(do, w2, offsets, gather_idx, h, scores)[0], torch_dh)
        _row(name, "dA'+dH/fp8", 2 * p * d * n,
             lambda: grouped_gemm_fp8_dswiglu(do_q, do_s, w2t_q, w2t_s, offsets, gather_idx, h,
                                              scores)[0], torch_dh)
        del scores
    if "dA'" in only or "dA'+dH" in only:
        del w2t_q, w2t_s, do_q, do_s
    if "dX" in only:
        # dX on W1ᵀ's K-major copy (the layer's fp8_weights[4:6]); h stands in for dH.
        dh_q, dh_s = quantize_rows(h)
        w1t_q, w1t_s = quantize_blocks(w1.transpose(1, 2).contiguous())
        _row(name, "dX", 2 * p * 2 * n * d,
             lambda: grouped_gemm(h, w1.transpose(1, 2), offsets),
             lambda: torch._grouped_mm(h, w1, offs=ends))
        _row(name, "dX/fp8", 2 * p * 2 * n * d,
             lambda: grouped_gemm_fp8(dh_q, dh_s, w1t_q, w1t_s, offsets),
             lambda: torch._grouped_mm(h, w1, offs=ends))
        _torch_fp8_row(name, "dX", 2 * p * 2 * n * d, h, w1.transpose(1, 2), ends)
        del dh_q, dh_s, w1t_q, w1t_s
    # Weight gradients from the K-major 128 x 1-scaled copies.
    k_offsets = padded_offsets(offsets)
    for gemm, a, idx_a, b, idx_b, flops in (("dW1", h, None, x, gather_idx, 2 * p * 2 * n * d),
                                            ("dW2", do, gather_idx, act, None, 2 * p * d * n)):
        if gemm not in only:
            continue

        def torch_fn(a=a, idx_a=idx_a, b=b, idx_b=idx_b):
            rows_a = a.index_select(0, gidx_long) if idx_a is not None else a
            rows_b = b.index_select(0, gidx_long) if idx_b is not None else b
            return torch._grouped_mm(rows_a.t(), rows_b, offs=ends)

        _row(name, gemm, flops, lambda a=a, idx_a=idx_a, b=b, idx_b=idx_b: grouped_gemm_varlen_k(
            a, b, offsets, gather_idx_a=idx_a, gather_idx_b=idx_b), torch_fn)
        copies = (*quantize_cols_grouped(a, offsets, k_offsets, idx_a),
                  *quantize_cols_grouped(b, offsets, k_offsets, idx_b))
        _row(name, gemm + "/fp8", flops,
             lambda copies=copies: grouped_gemm_varlen_k_fp8(*copies, k_offsets), torch_fn)
        del copies
    del x, w1, act, w2, do, h
    torch.cuda.empty_cache()
    if ceiling:
        # (K, N) on P rows of up (dW1's work), down, dA' (dW2's work), dX.
        dense = {FP8_GEMMS[gemm] for gemm in only}
        for gemm, (kk, nn) in (("up", (d, 2 * n)), ("down", (n, d)), ("dA'", (d, n)),
                               ("dX", (2 * n, d))):
            if gemm in dense:
                _fp8_dense_ceiling(name, gemm, p, kk, nn)


def _torch_fp8_row(shape, gemm, flops, rows, w, ends, gather_idx=None):
    """PyTorch's own FP8 grouped GEMM on the same work: ``torch._scaled_grouped_mm`` with
    rowwise scales (one per row of ``rows`` ``(P, K)``, one per output column of each
    expert's ``w`` ``(E, N, K)``), quantized outside the timing. It has no gather: with
    ``gather_idx`` ``(P,)``, ``rows`` are the ``(T, K)`` source rows and it runs on rows
    gathered beforehand (``/torch-fp8``) and, as the same work as sonic's gathered call,
    after an ``index_select`` of the e4m3 rows and their scales in the timing
    (``/torch-fp8+gather``)."""
    def rowwise(t):
        scale = t.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448.0
        return (t.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)

    src_q, src_s = rowwise(rows)
    a_q, a_s = src_q, src_s
    if gather_idx is not None:
        idx = gather_idx.long()
        a_q, a_s = src_q.index_select(0, idx), src_s.index_select(0, idx)
    # Its B must be column-major (E, K, N): the transpose of a contiguous (E, N, K), which a
    # transposed view such as dX's W1 is not until copied.
    b_q, b_s = rowwise(w.contiguous())

    def gemm_fn(a_q, a_s):
        return torch._scaled_grouped_mm(a_q, b_q.transpose(1, 2), a_s, b_s, offs=ends,
                                        out_dtype=torch.bfloat16)

    timed = [("/torch-fp8", lambda: gemm_fn(a_q, a_s))]
    if gather_idx is not None:
        timed.append(("/torch-fp8+gather",
                      lambda: gemm_fn(src_q.index_select(0, idx), src_s.index_select(0, idx))))
    for suffix, fn in timed:
        try:
            _ceiling_row(shape, gemm + suffix, flops, fn)
        except (RuntimeError, ValueError, NotImplementedError, AttributeError) as exc:
            print(f"  {gemm}{suffix}: torch._scaled_grouped_mm failed: {exc}".splitlines()[0])
    del src_q, src_s, a_q, a_s, b_q, b_s, timed
    torch.cuda.empty_cache()


def _fp8_dense_ceiling(shape, gemm, m, k, n):
    """One dense ``(m, k) · (k, n)`` cuBLAS FP8 GEMM with ``1 x 128`` A and ``128 x 128`` B
    block scales (``torch._scaled_mm``'s blockwise layouts: A's scales M-major, B's
    ``(K/128, N/128)`` as the transpose of an ``(N/128, K/128)`` matrix)."""
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    scale_a = (torch.rand(k // 128, m, device="cuda") + 0.5).t()
    scale_b = (torch.rand(n // 128, k // 128, device="cuda") + 0.5).t()
    try:
        _ceiling_row(shape, gemm + "/dense-fp8", 2 * m * n * k,
                     lambda: torch._scaled_mm(a, b.t(), scale_a, scale_b,
                                              out_dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError) as exc:  # a build without blockwise scaling
        print(f"  {gemm}/dense-fp8: torch._scaled_mm failed: {exc}".splitlines()[0])
    del a, b
    torch.cuda.empty_cache()


# Candidate tile plans of the contiguous-A varlen-M GEMMs and of the bf16 weight gradients;
# None: the plan itself.
T = heuristic.TilePlan
PLAN_CANDIDATES = {
    False: (None, T(128, True, 1), T(192, True, 1), T(192, True, CLUSTER),
            T(192, True, CLUSTER, multicast_a=True), T(256, False, CLUSTER),
            T(128, False, 1, tile_m=256), T(128, False, CLUSTER, tile_m=256),
            T(128, False, CLUSTER, tile_m=256, multicast_a=True)),
    # 128 x 128 on a cluster: six ring stages instead of four, more loads in flight for the
    # few k-tiles per tile of many-expert weight gradients (DeepSeek-V3: ~8).
    True: (None, T(256, False, CLUSTER), T(128, False, CLUSTER), T(128, False, 1, tile_m=256),
           T(128, False, CLUSTER, tile_m=256), T(128, True, 1)),
}
# With --fp8: the FP8 mainloop runs cooperative 128-row tiles only, 256 or 128 wide (128: two
# partial accumulators where A is contiguous), on one CTA or a 2-CTA cluster sharing B.
FP8_PLAN_CANDIDATES = {
    varlen_k: (None, T(256, False, CLUSTER), T(256, False, 1), T(128, False, CLUSTER),
               T(128, False, 1))
    for varlen_k in (False, True)}
FP8_PLAN_GEMMS = ("up", "dA'", "down", "dX", "dW1", "dW2")


def _plan_label(tiles):
    if tiles is None:
        return "plan"
    return "{}x{} {} c{}{}".format(tiles.tile_m, tiles.tile_n,
                                   "pp" if tiles.pingpong else "coop", tiles.cluster,
                                   "A" if tiles.multicast_a else "")


@contextlib.contextmanager
def forced_plan(choice, varlen_k=False, ab_dtype="bf16"):
    """Within the block, ``heuristic.plan`` answers ``choice`` for the varlen-K GEMMs
    (``varlen_k``) or the varlen-M GEMMs of operand type ``ab_dtype``: bf16 varlen-M ones only
    with contiguous A (every other GEMM keeps its plan; a bf16 dW1 is then stored transposed
    and dW2 not swapped unless ``choice`` has 256-row tiles, as with the plan's own:
    ``heuristic.transpose_varlen_k``), e4m3 ones gathered or not (and without the plan's
    bands); ``None`` leaves the plan as it is. A varlen-K cluster that cannot pair M's
    m-tiles becomes one CTA. The compiled kernels are cached per configuration, so each
    candidate compiles once."""
    original = heuristic.plan
    forced_dtype = ab_dtype

    def plan(is_varlen_k, dim_n, gathered=False, dim_k=0, dim_m=0, arch="sm_90a",
             ab_dtype="bf16", gather_b=False, transpose_c=False, **device):
        if (choice is not None and is_varlen_k == varlen_k and ab_dtype == forced_dtype
                and (varlen_k or not gathered or ab_dtype == "e4m3")):
            if varlen_k and -(-dim_m // choice.tile_m) % choice.cluster:
                return choice._replace(cluster=1)
            return choice
        return original(is_varlen_k, dim_n, gathered, dim_k, dim_m, arch, ab_dtype, gather_b,
                        transpose_c, **device)

    heuristic.plan = plan
    try:
        yield
    finally:
        heuristic.plan = original


@contextlib.contextmanager
def forced_share(share_a):
    """Within the block, the gathered bf16 varlen-M GEMMs on a 2-CTA cluster share A
    (``multicast_a``) if ``share_a``, else B, whatever ``heuristic.plan`` picks."""
    original = heuristic.plan

    def plan(is_varlen_k, dim_n, gathered=False, *args, **kwargs):
        tiles = original(is_varlen_k, dim_n, gathered, *args, **kwargs)
        if (gathered and not is_varlen_k and tiles.cluster > 1
                and kwargs.get("ab_dtype", "bf16") == "bf16"):
            return tiles._replace(multicast_a=share_a)
        return tiles

    heuristic.plan = plan
    try:
        yield
    finally:
        heuristic.plan = original


@contextlib.contextmanager
def forced_transpose(gather_a, gather_b):
    """Within the block, a bf16 varlen-K GEMM with no gathered operand is stored transposed
    when the same GEMM gathering A (``gather_a``) or B (``gather_b``) would be
    (``heuristic.transpose_varlen_k``), and so runs that call's plan on contiguous rows."""
    original = heuristic.transpose_varlen_k

    def transpose(ga, gb, arch, dim_m, dim_n, **device):
        if not (ga or gb):
            ga, gb = gather_a, gather_b
        return original(ga, gb, arch, dim_m, dim_n, **device)

    heuristic.transpose_varlen_k = transpose
    try:
        yield
    finally:
        heuristic.transpose_varlen_k = original


def share_rows(name, t, d, n, e, k, only, rounds=2):
    """``--share both`` rows of one shape: the gathered GEMMs (``up``, ``up+act``, ``dA'``,
    ``dA'+dH`` in ``only``) with the cluster sharing A, then B, in ``rounds`` alternating
    rounds, each output compared bitwise with the first choice's."""
    gather_idx, offsets = _routing(t, e, k)
    p = t * k
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(e, 2 * n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5
    w2 = torch.randn(e, d, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5
    do = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(p, 2 * n, device="cuda", dtype=torch.bfloat16)
    scores = torch.rand(p, device="cuda")
    cases = {
        "up": (2 * p * 2 * n * d, lambda: grouped_gemm(x, w1, offsets, gather_idx=gather_idx)),
        "up+act": (2 * p * 2 * n * d,
                   lambda: grouped_gemm_swiglu(x, w1, offsets, gather_idx, "concat")[1]),
        "dA'": (2 * p * d * n,
                lambda: grouped_gemm(do, w2.transpose(1, 2), offsets, gather_idx=gather_idx)),
        "dA'+dH": (2 * p * d * n,
                   lambda: grouped_gemm_dswiglu(do, w2, offsets, gather_idx, h, scores)[0]),
    }
    first = {}
    for r in range(rounds):
        for share_a in (True, False):
            with forced_share(share_a):
                for gemm, (flops, fn) in cases.items():
                    if gemm not in only:
                        continue
                    out = fn()
                    same = torch.equal(first.setdefault(gemm, out), out)
                    us = bench(fn)
                    note, _ = _power(fn)
                    print(f"{name:<6} {gemm:<7} r{r} {'shares A' if share_a else 'shares B':<9} | "
                          f"{us:>9.1f} us {flops / us / 1e6:>7.0f} TF  "
                          f"{'bitwise equal' if same else 'DIFFERS'}{note}", flush=True)
    del x, w1, w2, do, h, scores
    torch.cuda.empty_cache()


def plan_rows(name, t, d, n, e, k, only, rounds=2, fp8=False):
    """``--plans`` rows of one shape: those of ``down``, ``dX``, ``dW1`` and ``dW2`` in
    ``only`` under every candidate plan of their mode; with ``fp8`` those of the FP8 GEMMs
    (the gathered ``up`` and ``dA'`` as well) under :data:`FP8_PLAN_CANDIDATES`, their error
    against torch's bf16 GEMM on the unquantized data."""
    gather_idx, offsets = _routing(t, e, k)
    p, ends, gidx_long = t * k, offsets[1:], gather_idx.long()
    w1 = torch.randn(e, 2 * n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5
    w2 = torch.randn(e, d, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5
    act = torch.randn(p, n, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(p, 2 * n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    refs = {"up": lambda: torch._grouped_mm(x.index_select(0, gidx_long), w1.transpose(1, 2),
                                            offs=ends),
            "dA'": lambda: torch._grouped_mm(do.index_select(0, gidx_long), w2, offs=ends),
            "down": lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=ends),
            "dX": lambda: torch._grouped_mm(dh, w1, offs=ends),
            "dW1": lambda: torch._grouped_mm(dh.t(), x.index_select(0, gidx_long), offs=ends),
            "dW2": lambda: torch._grouped_mm(do.index_select(0, gidx_long).t(), act, offs=ends)}
    flops = {"up": 2 * p * 2 * n * d, "dA'": 2 * p * d * n, "down": 2 * p * d * n,
             "dX": 2 * p * 2 * n * d,
             "dW1": 2 * p * 2 * n * d, "dW2": 2 * p * d * n}
    if fp8:
        kernels = _fp8_plan_kernels(x, w1, act, w2, dh, do, offsets, gather_idx,
                                    only & set(FP8_PLAN_GEMMS))
        modes = {False: ("up", "dA'", "down", "dX"), True: ("dW1", "dW2")}
        candidates_of = FP8_PLAN_CANDIDATES
    else:
        kernels = {"down": lambda: grouped_gemm(act, w2, offsets),
                   "dX": lambda: grouped_gemm(dh, w1.transpose(1, 2), offsets),
                   "dW1": lambda: grouped_gemm_varlen_k(dh, x, offsets, gather_idx_b=gather_idx),
                   "dW2": lambda: grouped_gemm_varlen_k(do, act, offsets,
                                                        gather_idx_a=gather_idx)}
        modes = {False: ("down", "dX"), True: ("dW1", "dW2")}
        candidates_of = PLAN_CANDIDATES
    cases = {varlen_k: {gemm: (flops[gemm], kernels[gemm], refs[gemm]())
                        for gemm in gemms if gemm in only}
             for varlen_k, gemms in modes.items()}
    for r in range(rounds):
        for varlen_k, candidates in candidates_of.items():
            if not cases[varlen_k]:
                continue
            for choice in candidates:
                with forced_plan(choice, varlen_k, "e4m3" if fp8 else "bf16"):
                    for gemm, (work, fn, ref) in cases[varlen_k].items():
                        label = gemm + ("/fp8" if fp8 else "")
                        head = f"{name:<6} {label:<9} r{r} {_plan_label(choice):<18} | "
                        try:
                            out = fn()
                        except ValueError as exc:
                            # A candidate the configuration rejects at this shape (an FP8
                            # 256-wide tile where N is not a multiple of 256); the plan's
                            # own errors propagate.
                            if choice is None:
                                raise
                            print(head + f"not a valid plan here: {exc}".splitlines()[0],
                                  flush=True)
                            continue
                        err = _rel_err(out, ref)
                        us = bench(fn)
                        note, _ = _power(fn)
                        print(head + f"{us:>9.1f} us {work / us / 1e6:>7.0f} TF  rel err "
                              f"{err:.1e}{note}", flush=True)
    del w1, w2, act, dh, x, do, cases, kernels
    torch.cuda.empty_cache()


def _fp8_plan_kernels(x, w1, act, w2, dh, do, offsets, gather_idx, gemms):
    """The FP8 GEMMs of ``--plans --fp8`` named in ``gemms``, each a call on e4m3 operands
    quantized here, outside the timing, as :func:`fp8_rows` quantizes them."""
    kernels = {}
    if "up" in gemms:
        x_q, x_s = quantize_rows(x)
        w1_q, w1_s = quantize_blocks(w1)
        kernels["up"] = lambda: grouped_gemm_fp8(x_q, x_s, w1_q, w1_s, offsets,
                                                 gather_idx=gather_idx)
    if "dA'" in gemms:
        do_q, do_s = quantize_rows(do)
        w2t_q, w2t_s = quantize_blocks(w2.transpose(1, 2).contiguous())
        kernels["dA'"] = lambda: grouped_gemm_fp8(do_q, do_s, w2t_q, w2t_s, offsets,
                                                  gather_idx=gather_idx)
    if "down" in gemms:
        a_q, a_s = quantize_rows(act)
        w2_q, w2_s = quantize_blocks(w2)
        kernels["down"] = lambda: grouped_gemm_fp8(a_q, a_s, w2_q, w2_s, offsets)
    if "dX" in gemms:
        dh_q, dh_s = quantize_rows(dh)
        w1t_q, w1t_s = quantize_blocks(w1.transpose(1, 2).contiguous())
        kernels["dX"] = lambda: grouped_gemm_fp8(dh_q, dh_s, w1t_q, w1t_s, offsets)
    k_offsets = padded_offsets(offsets)
    for gemm, a, idx_a, b, idx_b in (("dW1", dh, None, x, gather_idx),
                                     ("dW2", do, gather_idx, act, None)):
        if gemm in gemms:
            copies = (*quantize_cols_grouped(a, offsets, k_offsets, idx_a),
                      *quantize_cols_grouped(b, offsets, k_offsets, idx_b))
            kernels[gemm] = lambda copies=copies: grouped_gemm_varlen_k_fp8(*copies, k_offsets)
    return kernels


def _ceiling_row(shape, gemm, flops, fn):
    us = bench(fn)
    note, power = _power(fn)
    print(f"{shape:<6} {gemm:<7} | {'':>9} {us:>9.1f} | {'':>7} {flops / us / 1e6:>7.0f}"
          f"{note}", flush=True)
    return Timing(us, power.get("mj"))


def _step_summary(shape, kernel, bmm):
    """The step's six GEMMs summed: sonic's kernels (fused epilogues included) against cuBLAS
    ``bmm`` of the same work on balanced experts (no epilogue, gather or varlen) — what a
    layer built on the dense ceiling would spend in its GEMMs (``kernel``, ``bmm``: the
    :class:`Timing` of each GEMM)."""
    if not (set(STEP_GEMMS) <= kernel.keys() and set(STEP_GEMMS.values()) <= bmm.keys()):
        return
    sonic = [kernel[g] for g in STEP_GEMMS]
    dense = [bmm[g] for g in STEP_GEMMS.values()]
    sonic_us, dense_us = sum(t.us for t in sonic), sum(t.us for t in dense)
    line = (f"{shape:<6} step's six GEMMs: sonic {sonic_us / 1e3:.3f} ms, cuBLAS bmm on "
            f"balanced experts {dense_us / 1e3:.3f} ms (bmm / sonic {dense_us / sonic_us:.0%})")
    if all(t.mj is not None for t in sonic + dense):
        sonic_mj, dense_mj = sum(t.mj for t in sonic), sum(t.mj for t in dense)
        line += (f"; energy sonic {sonic_mj / 1e3:.2f} J, bmm {dense_mj / 1e3:.2f} J "
                 f"(bmm / sonic {dense_mj / sonic_mj:.0%})")
    print(line, flush=True)


def ceiling_rows(name, e, offsets, gather_idx, x, do, act, dh, w1, w2, only):
    """``--ceiling`` rows of one shape (see the module docstring); returns each GEMM's
    ``bmm`` :class:`Timing`."""
    p, d, n = gather_idx.numel(), x.shape[1], act.shape[1]
    rows = p // e
    gidx_long = gather_idx.long()
    xg, dog = x.index_select(0, gidx_long), do.index_select(0, gidx_long)

    def balanced(m, k, n_out, mn_major_a=False):
        # mn_major_a: A is the transpose of a token-major tensor, as the weight gradients read.
        shape = (e, k, m) if mn_major_a else (e, m, k)
        a = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        a = a.transpose(1, 2) if mn_major_a else a
        b = torch.randn(e, k, n_out, device="cuda", dtype=torch.bfloat16)
        return lambda: torch.bmm(a, b)

    # gemm: (flops, sonic on pre-gathered rows or None, balanced bmm (M, K, N[, mn_major_a]))
    cases = {
        "up": (2 * p * 2 * n * d, lambda: grouped_gemm(xg, w1, offsets), (rows, d, 2 * n)),
        "down": (2 * p * d * n, None, (rows, n, d)),
        "dA'": (2 * p * d * n, lambda: grouped_gemm(dog, w2.transpose(1, 2), offsets),
                (rows, d, n)),
        "dX": (2 * p * 2 * n * d, None, (rows, 2 * n, d)),
        "dW1": (2 * p * 2 * n * d, lambda: grouped_gemm_varlen_k(dh, xg, offsets),
                (2 * n, rows, d, True)),
        "dW2": (2 * p * d * n, lambda: grouped_gemm_varlen_k(dog, act, offsets),
                (d, rows, n, True)),
    }
    # Weight gradients: (the gathered call, which operand it gathers, its M and N).
    gathered = {
        "dW1": (lambda: grouped_gemm_varlen_k(dh, x, offsets, gather_idx_b=gather_idx),
                (False, True), (2 * n, d)),
        "dW2": (lambda: grouped_gemm_varlen_k(do, act, offsets, gather_idx_a=gather_idx),
                (True, False), (d, n)),
    }
    arch = runtime.device_arch(x.device)
    bmm = {}
    for gemm, (flops, pre_gathered, bmm_shape) in cases.items():
        if gemm not in only:
            continue
        if pre_gathered is not None:
            _ceiling_row(name, gemm + "/pre-gathered", flops, pre_gathered)
        if gemm in gathered:
            call, gathers, (dim_m, dim_n) = gathered[gemm]
            # Ungathered calls are never stored transposed.
            if heuristic.transpose_varlen_k(*gathers, arch, dim_m, dim_n, rows_per_expert=rows,
                                            memory=device_memory(torch.cuda.current_device())):
                def same_plan(fn=pre_gathered, gathers=gathers):
                    with forced_transpose(*gathers):
                        return fn()
                if not torch.equal(same_plan(), call()):
                    raise AssertionError(f"{name} {gemm}: the pre-gathered call on the "
                                         "gathered call's plan differs from it")
                _ceiling_row(name, gemm + "/pre-gathered-same-plan", flops, same_plan)
        bmm[gemm] = _ceiling_row(name, gemm + "/bmm", flops, balanced(*bmm_shape))
        torch.cuda.empty_cache()
    return bmm


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=parse_config, action="append",
                        help=f"{', '.join(CONFIGS)} or T,d,n,E,K (repeatable; default: "
                             f"{', '.join(PAPER_CONFIGS)})")
    parser.add_argument("--gemm", choices=GEMMS, action="append",
                        help="time only these GEMMs (repeatable; default: all)")
    parser.add_argument("--ceiling", action="store_true",
                        help="also time each GEMM on pre-gathered rows and cuBLAS bmm on "
                             "balanced experts (with --fp8: cuBLAS's dense block-scaled FP8 "
                             "GEMM of each shape)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--plans", action="store_true",
                        help="time the down, dX, dW1 and dW2 GEMMs under every candidate "
                             "tile plan instead")
    mode.add_argument("--share", choices=("both",),
                        help="time the gathered GEMMs (up, up+act, dA', dA'+dH) with the "
                             "cluster sharing A, then B, instead")
    parser.add_argument("--fp8", action="store_true",
                        help="time the block-scaled FP8 GEMMs (up, up+act, down, dA', dA'+dH, "
                             "dX, dW1, dW2) beside bf16 instead; with --plans, the FP8 up, dA', "
                             "down, dX, dW1 and dW2 under every FP8 candidate plan")
    parser.add_argument("--power", type=float, default=0.0, metavar="SECONDS",
                        help="also run each kernel back to back for SECONDS and print its SM "
                             "clock, board power and energy per call (needs pynvml)")
    parser.add_argument("--routing", choices=("topk", "balanced"), default="topk",
                        help="topk: random top-K routing (default); balanced: every expert "
                             "gets T*K/E rows")
    parser.add_argument("--json", metavar="FILE",
                        help="also append each GEMM row (not those of --plans, --share or the "
                             "--ceiling references) to FILE as a JSON line")
    parser.add_argument("--results", nargs="+", metavar="FILE",
                        help="measure nothing: print the rows of earlier runs' --json files "
                             "(this script's and bench_sonicmoe.py --gemm's) side by side")
    args = parser.parse_args(argv)
    if args.results:
        given = options_given(parser, args, ("results",))
        if given:
            parser.error("--results measures nothing: leave out " + ", ".join(given))
        results_table(args.results)
        return
    if args.json and (args.plans or args.share):
        parser.error("--json records the rows of the default mode and --fp8, not those of "
                     "--plans or --share")
    if args.ceiling and (args.plans or args.share):
        parser.error("--ceiling has no rows under --plans or --share: run it on its own or "
                     "with --fp8")
    if args.fp8 and args.share:
        parser.error("argument --fp8: not allowed with argument --share")
    if args.fp8 and args.plans and args.gemm and not set(args.gemm) <= set(FP8_PLAN_GEMMS):
        parser.error(f"--plans --fp8 times only the GEMMs {', '.join(FP8_PLAN_GEMMS)}; --gemm "
                     f"{', '.join(sorted(set(args.gemm) - set(FP8_PLAN_GEMMS)))} has no FP8 "
                     "plan row")
    if args.fp8 and args.gemm and not set(args.gemm) <= set(FP8_GEMMS):
        parser.error(f"--fp8 times only the GEMMs {', '.join(FP8_GEMMS)}; --gemm "
                     f"{', '.join(sorted(set(args.gemm) - set(FP8_GEMMS)))} has no FP8 row")
    if args.power < 0:
        parser.error(f"--power must be a non-negative number of seconds, got {args.power}")
    global POWER_SECONDS, ROUTING, JSON_PATH
    POWER_SECONDS = args.power
    ROUTING = args.routing
    JSON_PATH = args.json
    only = set(args.gemm or GEMMS)
    shapes = [(name, *sizes) for name, sizes in args.config] if args.config else SHAPES
    print(f"device: {device_name()}  {device_memory(torch.cuda.current_device())}")
    print(f"{'shape':<6} {'gemm':<7} | {'torch us':>9} {'kernel us':>9} | {'torch TF':>7} "
          f"{'kern TF':>7} {'speedup':>7} {'rel err':>8}")
    if args.share:
        for shape in shapes:
            share_rows(*shape, only)
        return
    if args.plans:
        for shape in shapes:
            plan_rows(*shape, only, fp8=args.fp8)
        return
    if args.fp8:
        for shape in shapes:
            if args.config or shape[0] in FP8_SHAPES:
                fp8_rows(*shape, ceiling=args.ceiling,
                         only=tuple(g for g in FP8_GEMMS if g in only))
        return
    for name, t, d, n, e, k in shapes:
        kernel = {}

        def row(gemm, *args, name=name, kernel=kernel):
            if gemm in only:
                kernel[gemm] = _row(name, gemm, *args)

        gather_idx, offsets = _routing(t, e, k)
        p = t * k
        ends = offsets[1:]
        gidx_long = gather_idx.long()
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        w1 = torch.randn(e, 2 * n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5
        w2 = torch.randn(e, d, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5
        act = torch.randn(p, n, device="cuda", dtype=torch.bfloat16)
        dh = torch.randn(p, 2 * n, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        row("up", 2 * p * 2 * n * d,
             lambda: grouped_gemm(x, w1, offsets, gather_idx=gather_idx),
             lambda: torch._grouped_mm(x.index_select(0, gidx_long), w1.transpose(1, 2),
                                       offs=ends))
        torch_up_act = lambda: torch_swiglu(torch._grouped_mm(  # noqa: E731
            x.index_select(0, gidx_long), w1.transpose(1, 2), offs=ends), "concat")
        row("up+act", 2 * p * 2 * n * d,
             lambda: grouped_gemm_swiglu(x, w1, offsets, gather_idx, "concat")[1], torch_up_act)
        row("up+act*", 2 * p * 2 * n * d,
             lambda: swiglu(grouped_gemm(x, w1, offsets, gather_idx=gather_idx), "concat"),
             torch_up_act)
        row("down", 2 * p * d * n,
             lambda: grouped_gemm(act, w2, offsets),
             lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=ends))
        row("dA'", 2 * p * d * n,
             lambda: grouped_gemm(do, w2.transpose(1, 2), offsets, gather_idx=gather_idx),
             lambda: torch._grouped_mm(do.index_select(0, gidx_long), w2, offs=ends))
        h = torch.randn(p, 2 * n, device="cuda", dtype=torch.bfloat16)
        scores = torch.rand(p, device="cuda")
        torch_dh = lambda: torch_dswiglu_epilogue(torch._grouped_mm(  # noqa: E731
            do.index_select(0, gidx_long), w2, offs=ends), h, scores, "concat")[0]
        row("dA'+dH", 2 * p * d * n,
             lambda: grouped_gemm_dswiglu(do, w2, offsets, gather_idx, h, scores)[0], torch_dh)
        row("dA'+dH*", 2 * p * d * n,
             lambda: dswiglu_epilogue(grouped_gemm(do, w2.transpose(1, 2), offsets,
                                                   gather_idx=gather_idx), h, scores)[0],
             torch_dh)
        del h, scores
        row("dX", 2 * p * 2 * n * d,
             lambda: grouped_gemm(dh, w1.transpose(1, 2), offsets),
             lambda: torch._grouped_mm(dh, w1, offs=ends))
        row("dW1", 2 * p * 2 * n * d,
             lambda: grouped_gemm_varlen_k(dh, x, offsets, gather_idx_b=gather_idx),
             lambda: torch._grouped_mm(dh.t(), x.index_select(0, gidx_long), offs=ends))
        row("dW2", 2 * p * d * n,
             lambda: grouped_gemm_varlen_k(do, act, offsets, gather_idx_a=gather_idx),
             lambda: torch._grouped_mm(do.index_select(0, gidx_long).t(), act, offs=ends))
        if args.ceiling:
            _step_summary(name, kernel,
                          ceiling_rows(name, e, offsets, gather_idx, x, do, act, dh, w1, w2,
                                       only))
        del x, w1, w2, act, dh, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
