"""End-to-end MoE layer (router + experts): sonic vs torch-gmm in the same process.

    python benchmarks/bench_moe.py                       # 7B, OLMoE, 30B (the paper's)
    python benchmarks/bench_moe.py --sweep --json sweep.json   # every named configuration
    python benchmarks/bench_moe.py --config 8192,4096,1024,256,8 --router both
    python benchmarks/bench_moe.py --vs-sonicmoe sonicmoe.jsonl   # beside SonicMoE's own run
    python benchmarks/bench_moe.py --results sweep.json --vs-sonicmoe sonicmoe.jsonl --plot s.png

A step is timed as docs/design.md §5 describes: one forward + backward with a fixed random dO, every
gradient set to None before it (outside the timed region), medians of triton's ``do_bench``
with the L2 flushed. Per configuration it prints, for sonic (``backend="auto"``: CuTe kernels
where they exist) and torch-gmm: forward and forward+backward ms and TFLOPS (docs/design.md §3 counts:
forward ``6·P·d·n``, backward ``12·P·d·n``; router time included, its FLOPs not), the MiB kept
for backward ("saved", :func:`sonic.profile_activation_memory`), the peak extra MiB of one
forward+backward, and — where ``pynvml`` is installed — the median SM clock, mean board power
and energy per step over a further second of back-to-back steps; then the sonic / torch-gmm
ratios.

* ``--router token_rounding`` runs sonic with token rounding (paper §5.2) on the same data (the
  FLOP count then uses its own ``P``); ``--router both`` runs top-K and token rounding and
  prints their time ratio.
* ``--precision fp8`` times sonic with block-scaled FP8 expert GEMMs (the weights'
  FP8 copies made once, outside the timing, as ``sonic.MoE`` makes them once per optimizer
  step; their time is printed apart); ``--precision both`` runs bf16 and FP8 in the same
  process and prints fp8/bf16 ratios of forward and forward+backward time, saved and peak MiB.
* ``--vs-sonicmoe FILE`` reads the JSON lines of ``bench_sonicmoe.py`` (SonicMoE
  and its own torch-gmm, timed the same way in another process, e.g. on the second GPU of the
  same machine) and prints sonic / torch-gmm beside SonicMoE / torch-gmm, and the two step
  times themselves. Both torch-gmm programs take equal steps (sonic's split H with two
  slices before it used ``chunk``: 5–6% slower at OLMoE, RESULTS.md); the anchor's
  forward is 1–7% slower (its ``bincount`` reads a size on the host), so sonic's forward
  ratios come out that much lower than SonicMoE's would for equal times. Run at the same
  time on two GPUs of one machine the ratio of ratios compares sonic with SonicMoE; one after
  the other on one GPU, compare the step times as well.
* ``--results FILE --vs-sonicmoe FILE2 [--plot PNG]`` measures nothing: it sets an earlier
  run's ``--json`` beside SonicMoE's lines, for the two programs run at the same time on two
  GPUs (where neither file exists before the other run ends), on any machine.
* Router options as ``sonic.MoE`` takes them: ``--score sigmoid`` (DeepSeek-V3 §2.1.2; also
  ``topk_softmax``), ``--renormalize``, ``--routed-scaling-factor F``, ``--n-group N
  --topk-group M`` (group-limited routing) and ``--expert-bias`` (a fixed random ``(E,)`` fp32
  selection bias, as the aux-loss-free balancing keeps one); ``--shared-experts M`` adds one
  dense SwiGLU expert of size ``M·n`` to every token (sonic: a one-expert ``moe_experts`` call,
  as ``sonic.MoE`` runs it; torch-gmm: ``F.linear``), counted in the FLOPs as ``M·T`` more
  pairs. torch-gmm routes with the same options through
  :func:`sonic.reference.ops.scored_topk` (stock torch ops); sonic's top-K router selects
  in the fused top-K kernel (sigmoid with a bias and groups). Every run also times each sonic
  router's routing phase (selection + metadata, the router GEMM excluded) and prints its share
  of that router's step (``routing_us_<router>``, ``routing_share_<router>`` in the JSON),
  beside the time of its kernels alone (``routing_kernel_us_<router>``: without the host's
  launch time, which a step can hide under earlier GPU work) and its cost inside the step:
  the step less the same step with the routing made beforehand, the two alternated
  (``routing_in_step_us_<router>``, ``routing_in_step_share_<router>``; an upper bound, since
  that step also skips the router GEMM's backward). ``--routing-in-graph`` adds the same
  difference with both steps captured in CUDA graphs (``routing_in_graph_us_<router>``,
  ``routing_in_graph_share_<router>``): the routing's cost without the host's, which on a
  host-bound layer the eager difference mixes with host jitter.
  DeepSeek-V3's layer: ``--config DeepSeek-V3 --score sigmoid --renormalize
  --routed-scaling-factor 2.5 --n-group 8 --topk-group 4 --expert-bias --shared-experts 1``.
* ``--profile`` adds sonic's per-kernel CUDA time per step (``torch.profiler``, the mean of
  three back-to-back steps after three unrecorded ones, so the clocks are those of the timed
  step under a power cap), each of its grouped GEMMs by role (up-proj, down-proj, dH, dW2,
  dX, dW1, in launch order) and the per-kernel table of each routing phase; ``--trace
  DIR`` writes a Chrome trace (CPU and CUDA) of six consecutive steps per implementation and
  prints each step's GPU span, kernel time and idle time — time the GPU waited on the host.
* ``--fp8-epilogues store quantizing fused``: the first choice of
  :func:`sonic.backend.set_fp8_epilogues` for the ``sonic-fp8`` row, and one more FP8 row per
  further choice (``sonic-fp8-quantizing``, ``sonic-fp8-fused``): a same-run A/B of the FP8
  up-proj and dH kernels in the layer.
* ``--fp8-weight-grads bf16 fp8``: likewise for :func:`sonic.backend.set_fp8_weight_grads`
  (rows ``sonic-fp8-wgrad-<choice>``): the FP8 weight gradients against the bf16 ones (the
  default, ``auto``, picks one of them by the layer's sizes).
* ``--activation-cache fp8`` adds, per precision, a sonic row whose layer keeps H for backward
  in e4m3 with 1×128 fp32 scales (``sonic.moe_experts(..., activation_cache="fp8")``) and
  prints its saved MiB, peak MiB and step time relative to the same precision's bf16
  cache and to bf16 sonic (the FP8 cache's target: saved ≤ 55%).
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, captured, device_name, energy_per_call, trace_idle  # noqa: E402

import sonic  # noqa: E402
from sonic.backend import (FP8_WEIGHT_GRADS, set_fp8_epilogues,  # noqa: E402
                           set_fp8_weight_grads)
from sonic.baselines import torch_gmm_experts, torch_gmm_moe  # noqa: E402
from sonic.baselines.configs import CONFIGS, PAPER_CONFIGS, parse_config  # noqa: E402
from sonic.reference.ops import scored_topk  # noqa: E402
from sonic.routing.gate import router_logits  # noqa: E402

MiB = float(1 << 20)


def _sonic_layer(router: str, tile: int, precision: str = "bf16", fp8_weights=None,
                 activation_cache: str = "bf16", scoring=None, shared=None, routed=None):
    """sonic's layer; with ``precision="fp8"``, ``fp8_weights`` are the weights' FP8 copies,
    made once outside the timing, as :class:`sonic.MoE` makes them once per optimizer step.
    ``scoring``: the routing options (:func:`sonic.topk_routing`'s keywords); ``shared``:
    ``(shared_w1 (1, 2m, d), shared_w2 (1, d, m))`` of a shared expert, or None; ``routed``:
    a ``(Routing, RoutingMetadata)`` made beforehand that every call uses instead of routing
    its logits (the router GEMM still runs), or None."""
    def layer(x, router_weight, w1, w2, k, fp8_weights=fp8_weights):
        layer_input = x
        # As sonic.MoE: the experts read x through the gate's autograd node (one dX GEMM).
        logits, x = router_logits(x, router_weight)
        r, metadata = routed or (_route(router, tile, logits, k, scoring), None)
        # Token rounding's P stays on the device (a 0-d tensor), read after the timing.
        layer.pairs = r.num_pairs if r.num_valid is None else r.num_valid
        out = sonic.moe_experts(x, w1, w2, r.scores, r.token_idx, r.expert_idx,
                                metadata=metadata or sonic.routing_metadata(r),
                                precision=precision, fp8_weights=fp8_weights,
                                activation_cache=activation_cache)
        if shared is not None:
            # The layer input, not the gate's fused alias (only the routed experts may read it).
            out = out + _shared_expert(layer_input, *shared)
        return out
    layer.pairs = 0
    layer.fp8_weights = fp8_weights
    return layer


def _shared_expert(x, shared_w1, shared_w2):
    """A shared SwiGLU expert as :meth:`sonic.MoE.shared_experts` runs it: one expert that
    every token reaches with score 1."""
    T = x.shape[0]
    token_idx = torch.arange(T, dtype=torch.int32, device=x.device)
    return sonic.moe_experts(x, shared_w1, shared_w2,
                             torch.ones(T, dtype=torch.float32, device=x.device), token_idx,
                             torch.zeros_like(token_idx))


def _torch_gmm_layer(scoring, shared):
    """torch-gmm with sonic's routing options (selection by :func:`scored_topk`, stock torch
    ops) and a shared expert from ``F.linear``; plain :func:`torch_gmm_moe` without them."""
    if scoring is None and shared is None:
        return torch_gmm_moe

    def layer(x, router_weight, w1, w2, k):
        opts = dict(scoring or {})
        scaling = opts.pop("scaling_factor", 1.0)
        logits = x @ router_weight.t()
        n_group = opts.get("n_group", 1)
        scores, experts = scored_topk(logits, k, opts.get("score", "softmax_topk"),
                                      opts.get("renormalize", False), opts.get("expert_bias"),
                                      n_group, opts.get("topk_group") or n_group)
        out = torch_gmm_experts(x, w1, w2, scores * scaling, experts)
        if shared is not None:
            gate, up = torch.nn.functional.linear(x, shared[0][0]).chunk(2, dim=-1)
            out = out + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                                   shared[1][0])
        return out
    return layer


def _route(router: str, tile: int, logits, k, scoring=None):
    scoring = scoring or {}
    if router == "token_rounding":
        # Padded, as sonic.MoE routes: no host read of P.
        return sonic.token_rounding_routing(logits, k, tile=tile, padded=True, **scoring)
    return sonic.topk_routing(logits, k, **scoring)


def _routing_phase(router: str, tile: int, logits, k, scoring=None):
    """One routing phase as the layer runs it: selection and metadata (router GEMM excluded)."""
    def route():
        return sonic.routing_metadata(_route(router, tile, logits, k, scoring))
    return route


def _peak_mib(fn, grad):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn().backward(grad)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MiB


# Calls run before and inside a profile: a GPU under its power cap runs a lone call after an
# idle gap at higher clocks than the back-to-back calls of a timed step, so the per-kernel
# table is taken in the same steady state as the step time (and as SonicMoE's is).
PROFILE_WARMUP, PROFILE_CALLS = 3, 3


def _profiled(fn, grad_to_none=()):
    """torch.profiler's record of the CUDA kernels of :data:`PROFILE_CALLS` back-to-back
    ``fn()`` after :data:`PROFILE_WARMUP` unrecorded ones, the gradients of ``grad_to_none``
    dropped before each."""
    from torch.profiler import ProfilerActivity, profile

    def call():
        for t in grad_to_none:
            t.grad = None
        fn()

    for _ in range(PROFILE_WARMUP):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_CALLS):
            call()
        torch.cuda.synchronize()
    return prof


def _cuda_averages(prof) -> list:
    """The CUDA kernels of a record, per name (device time in µs summed over its
    :data:`PROFILE_CALLS` calls)."""
    return [e for e in prof.key_averages() if e.device_type.name == "CUDA"
            and e.self_device_time_total > 0]


def _kernel_us(fn) -> float:
    """Device µs of the CUDA kernels of one ``fn()``: the mean of :data:`PROFILE_CALLS`
    back-to-back calls (:func:`_profiled`)."""
    return sum(e.self_device_time_total for e in _cuda_averages(_profiled(fn))) / PROFILE_CALLS


# The grouped GEMMs of one bf16 step without shared experts, in launch order (sonic.ops: the
# forward's two, then the dH kernel, dW2, dX and dW1); every launch shares one kernel name.
STEP_GEMMS = ("up-proj + activation", "down-proj", "dH + activation grad", "dW2", "dX", "dW1")


def label_gemm_launches(launches: list[tuple[float, float]]) -> list[tuple[str, float]]:
    """``(label, µs)`` of a step's grouped-GEMM launches given as ``(start, µs)`` in any order:
    sorted by start and named by :data:`STEP_GEMMS` when there are as many, else numbered."""
    ordered = [us for _, us in sorted(launches)]
    names = STEP_GEMMS if len(ordered) == len(STEP_GEMMS) else [
        f"GEMM {i + 1}" for i in range(len(ordered))]
    return list(zip(names, ordered))


def _kernel_breakdown(fn, rows: int = 14, what: str = "sonic forward+backward",
                      grad_to_none=(), gemm_marker: str = "grouped_gemm"):
    """Print the CUDA time of each kernel of ``fn()`` per call (torch.profiler, the mean of
    :data:`PROFILE_CALLS` back-to-back calls after a warm-up), largest first, then each
    grouped-GEMM launch (a kernel whose name holds ``gemm_marker``) in launch order, the mean
    of each launch over the calls (the kernels share a name, so the table above sums them)."""
    prof = _profiled(fn, grad_to_none)
    events = _cuda_averages(prof)
    total = sum(e.self_device_time_total for e in events) / PROFILE_CALLS
    print(f"  per-kernel CUDA time of one {what} (mean of {PROFILE_CALLS} back-to-back calls "
          f"after {PROFILE_WARMUP}): {total / 1e3:.3f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        label = e.key.replace("kernel_cutlass_kernel_sonickernels", "sonic:")
        label = label if len(label) <= 72 else f"{label[:34]}...{label[-35:]}"
        us = e.self_device_time_total / PROFILE_CALLS
        print(f"    {us / 1e3:7.3f} ms {100 * us / total:5.1f}%"
              f"  x{e.count // PROFILE_CALLS:<3d} {label}")
    launches = sorted((e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                      if e.device_type.name == "CUDA" and gemm_marker in e.name)
    per_call = len(launches) // PROFILE_CALLS
    calls = [label_gemm_launches(launches[i * per_call:(i + 1) * per_call])
             for i in range(PROFILE_CALLS)]
    for i, (name, _) in enumerate(calls[0]):
        print(f"    {sum(c[i][1] for c in calls) / PROFILE_CALLS / 1e3:7.3f} ms  {name}")


def _steps(layer, x, params, k, grad):
    """The timed callables of one implementation: forward, and a training step's
    forward+backward (the caller drops the gradients before each, as ``grad_to_none``)."""
    def fwd():
        return layer(x, *params, k)

    def fwd_bwd():
        fwd().backward(grad)

    return fwd, fwd_bwd


def time_row(impl: str, layer, x, params, k, grad, leaves, trace_path: str | None = None):
    """One implementation's row, the same for every layer compared (sonic's, torch-gmm's, and
    SonicMoE's in ``bench_sonicmoe.py``): a first step (compiles kernels, warms the
    allocator), the forward and the step timed (:func:`_timing.bench`, the gradients of
    ``leaves`` dropped before each call), the clock, power and energy of a second of steps,
    with ``trace_path`` a Chrome trace of six steps and their GPU idle time (printed), then
    the MiB kept for backward (:func:`sonic.profile_activation_memory`; FP8 weight copies
    passed in count as the caller's) and the peak MiB of a step. ``layer(x, *params, k)`` is
    the forward. Returns ``(row, step)``: the row's dict (``fwd_us``, ``fwd_bwd_us``,
    ``saved_MiB``, ``peak_MiB``, ``sm_mhz``, ``watts``, ``J_per_step``, ``throttle``) and the
    step callable."""
    fwd, fwd_bwd = _steps(layer, x, params, k, grad)
    fwd_bwd()
    fwd_us = bench(fwd, grad_to_none=leaves)
    total_us = bench(fwd_bwd, grad_to_none=leaves)
    power = energy_per_call(fwd_bwd, grad_to_none=leaves)
    if trace_path:
        idle = trace_idle(fwd_bwd, trace_path, grad_to_none=leaves)
        print(f"  {impl} trace, per step: " + "; ".join(
            f"span {r['span_us'] / 1e3:.2f} ms busy {r['busy_us'] / 1e3:.2f} ms idle "
            f"{r['idle_us']:.0f} us" for r in idle))
    extra = {"fp8_weights": layer.fp8_weights} if getattr(layer, "fp8_weights", None) else {}
    saved = sonic.profile_activation_memory(layer, x, *params, k,
                                            **extra).activation_bytes / MiB
    for t in leaves:
        t.grad = None
    row = {"fwd_us": fwd_us, "fwd_bwd_us": total_us, "saved_MiB": saved,
           "peak_MiB": _peak_mib(fwd, grad), "sm_mhz": power["sm_mhz"],
           "watts": power["watts"], "J_per_step": power["J_per_call"],
           "throttle": power["throttle"]}
    for t in leaves:
        t.grad = None
    return row, fwd_bwd


def problem(sizes):
    """The timed layer's bf16 CUDA tensors for ``(T, d, n, E, K)``, seed 0: ``x (T, d)``,
    router weight ``(E, d)``, ``w1 (E, 2n, d)``, ``w2 (E, d, n)`` (all requiring grad) and the
    fixed random output gradient ``(T, d)``."""
    T, d, n, E, _ = sizes
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    x = torch.randn(T, d, **kw).requires_grad_()
    router_weight = (torch.randn(E, d, **kw) * d ** -0.5).requires_grad_()
    w1 = (torch.randn(E, 2 * n, d, **kw) * d ** -0.5).requires_grad_()
    w2 = (torch.randn(E, d, n, **kw) * n ** -0.5).requires_grad_()
    return x, router_weight, w1, w2, torch.randn(T, d, **kw)


def layer_options(sizes, scoring: dict, shared_experts: int, expert_bias: bool):
    """``(scoring, shared)`` of the timed layers, seed 1: the routing keywords (with a fixed
    ``(E,)`` fp32 selection bias, N(0, 0.01²), when ``expert_bias``), or None when all are
    defaults; the shared expert's ``(w1 (1, 2m, d), w2 (1, d, m))`` bf16 weights requiring grad
    for ``m = shared_experts·n``, or None."""
    T, d, n, E, _ = sizes
    g = torch.Generator(device="cuda").manual_seed(1)
    scoring = {key: value for key, value in scoring.items() if value != _SCORING_DEFAULTS[key]}
    if expert_bias:
        scoring["expert_bias"] = 0.01 * torch.randn(E, device="cuda", generator=g)
    shared = None
    if shared_experts:
        m = shared_experts * n
        kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
        shared = ((torch.randn(1, 2 * m, d, **kw) * d ** -0.5).requires_grad_(),
                  (torch.randn(1, d, m, **kw) * m ** -0.5).requires_grad_())
    return scoring or None, shared


# sonic.topk_routing's defaults of the options the command line sets.
_SCORING_DEFAULTS = {"score": "softmax_topk", "renormalize": False, "n_group": 1,
                     "topk_group": None, "scaling_factor": 1.0}


def measure(name, sizes, router, tile, profile_kernels=False, trace_dir=None,
            precision="bf16", activation_cache="bf16", fp8_epilogues=("store",),
            fp8_weight_grads=("auto",), scoring=None, shared=None, routing_in_graph=False):
    """Time one layer shape (see the module notes); ``scoring`` and ``shared`` are
    :func:`layer_options`'; ``routing_in_graph``: also :func:`_routing_in_graph`. Returns the
    JSON result of the shape."""
    T, d, n, E, K = sizes
    x, router_weight, w1, w2, grad = problem(sizes)
    params = (router_weight, w1, w2)
    opts = dict(scoring=scoring, shared=shared)
    rows, steps = {}, {}
    routers = ("topk", "token_rounding") if router == "both" else (router,)
    precisions = ("bf16", "fp8") if precision == "both" else (precision,)
    fp8_weights = None
    if "fp8" in precisions:
        quantize = lambda: sonic.quantize_expert_weights(w1, w2)  # noqa: E731
        fp8_weights = quantize()
        print(f"  FP8 weight copies (once per optimizer step): {bench(quantize):.1f} us")
    impls = {_impl_name(r, router, p): _sonic_layer(r, tile, p, fp8_weights if p == "fp8"
                                                    else None, **opts)
             for p in precisions for r in routers}
    first = next(iter(impls))   # the sonic row the ratios and the profile use
    if activation_cache == "fp8":   # one fp8-cache row per precision, first router
        for p in precisions:
            impls[f"{_impl_name(routers[0], router, p)}-fp8c"] = _sonic_layer(
                routers[0], tile, p, fp8_weights if p == "fp8" else None, activation_cache="fp8",
                **opts)
    # More sonic-fp8 rows, one per further set_fp8_epilogues / set_fp8_weight_grads choice
    # (first router).
    default_mode = (fp8_epilogues[0], fp8_weight_grads[0])
    modes = {}
    if "fp8" in precisions:
        extra = ([(f"-{m}", (m, fp8_weight_grads[0])) for m in fp8_epilogues[1:]]
                 + [(f"-wgrad-{w}", (fp8_epilogues[0], w)) for w in fp8_weight_grads[1:]])
        for suffix, mode in extra:
            impl = f"{_impl_name(routers[0], router, 'fp8')}{suffix}"
            impls[impl], modes[impl] = _sonic_layer(routers[0], tile, "fp8", fp8_weights,
                                                    **opts), mode
    # torch-gmm first, as the SonicMoE benchmark run times it: under the power cap a GPU
    # heated by the rows before runs slower, so the order must match for the ratios to compare.
    impls = {"torch-gmm": _torch_gmm_layer(scoring, shared), **impls}
    leaves = (x, *params) + (shared or ())
    shared_cols = 0 if shared is None else shared[1].shape[2]
    defaults = (set_fp8_epilogues(default_mode[0]), set_fp8_weight_grads(default_mode[1]))
    for impl, layer in impls.items():
        # Process-wide (the backward runs on autograd's threads): set for this row only.
        mode = modes.get(impl, default_mode)
        set_fp8_epilogues(mode[0])
        set_fp8_weight_grads(mode[1])
        trace = os.path.join(trace_dir, f"trace_{name}_{impl}.json") if trace_dir else None
        row, steps[impl] = time_row(impl, layer, x, params, K, grad, leaves, trace)
        pairs = T * K if impl == "torch-gmm" else int(layer.pairs)
        # A shared expert of m columns: T more pairs of m/n expert-widths each.
        flops = 6 * d * (pairs * n + T * shared_cols)
        fwd_us, total_us = row["fwd_us"], row["fwd_bwd_us"]
        rows[impl] = {**row, "P": pairs, "fwd_TFLOPS": flops / fwd_us / 1e6,
                      "bwd_TFLOPS": 2 * flops / max(total_us - fwd_us, 1e-9) / 1e6,
                      "fwd_bwd_TFLOPS": 3 * flops / total_us / 1e6}
    set_fp8_epilogues(defaults[0])
    set_fp8_weight_grads(defaults[1])
    s, t = rows[first], rows["torch-gmm"]
    print(f"\n{name}  T={T} d={d} n={n} E={E} K={K}  sonic router={router} "
          f"precision={precision}  routing: {_describe(scoring, shared)}")
    print(f"  {'impl':15s} {'fwd ms':>7s} {'f+b ms':>7s} {'fwd TF':>7s} {'f+b TF':>7s} "
          f"{'saved MiB':>9s} {'peak MiB':>8s} {'SM MHz':>6s} {'W':>4s} {'J/step':>6s}")
    for impl, r in rows.items():
        print(f"  {impl:15s} {r['fwd_us'] / 1e3:7.3f} {r['fwd_bwd_us'] / 1e3:7.3f} "
              f"{r['fwd_TFLOPS']:7.1f} {r['fwd_bwd_TFLOPS']:7.1f} {r['saved_MiB']:9.1f} "
              f"{r['peak_MiB']:8.1f} {_fmt(r['sm_mhz'], 6, 0)} {_fmt(r['watts'], 4, 0)} "
              f"{_fmt(r['J_per_step'], 6, 3)}")
    ratio = t["fwd_bwd_us"] / s["fwd_bwd_us"]
    fwd_ratio = t["fwd_us"] / s["fwd_us"]
    print(f"  sonic / torch-gmm: fwd {fwd_ratio:.3f}x, fwd+bwd {ratio:.3f}x (time), "
          f"saved {s['saved_MiB'] / t['saved_MiB']:.2f}x, peak {s['peak_MiB'] / t['peak_MiB']:.2f}x")
    result = {"config": name, "router": router, "precision": precision, "sonic": s,
              "torch_gmm": t, "fwd_bwd_speedup": ratio, "fwd_speedup": fwd_ratio,
              "routing": _describe(scoring, shared)}
    if precision == "both":
        bf, f8 = rows[_impl_name(routers[0], router, "bf16")], rows[_impl_name(routers[0],
                                                                                 router, "fp8")]
        result["sonic_fp8"] = f8
        result["fp8_over_bf16"] = {key: f8[key] / bf[key] for key in
                                   ("fwd_us", "fwd_bwd_us", "saved_MiB", "peak_MiB")}
        r8 = result["fp8_over_bf16"]
        print(f"  fp8 / bf16 ({routers[0]}): fwd {r8['fwd_us']:.3f}x time ({1 / r8['fwd_us']:.2f}x "
              f"faster), fwd+bwd {r8['fwd_bwd_us']:.3f}x time ({1 / r8['fwd_bwd_us']:.2f}x "
              f"faster), saved {r8['saved_MiB']:.2f}x, peak {r8['peak_MiB']:.2f}x")
    if activation_cache == "fp8":
        # Per precision: its fp8-cache row against the same precision's bf16 cache, and against
        # bf16 sonic (the first row).
        result["fp8_cache"] = {}
        for p in precisions:
            base = _impl_name(routers[0], router, p)
            b, c = rows[base], rows[f"{base}-fp8c"]
            result["fp8_cache"][p] = {"row": c, **{
                f"{key}_over_{ref}": c[key] / r[key] for ref, r in (("same", b), ("bf16", s))
                for key in ("saved_MiB", "peak_MiB", "fwd_bwd_us")}}
            same, bf16 = (f"saved {c['saved_MiB'] / r['saved_MiB']:.3f}x, peak "
                          f"{c['peak_MiB'] / r['peak_MiB']:.3f}x, fwd+bwd time "
                          f"{c['fwd_bwd_us'] / r['fwd_bwd_us']:.3f}x" for r in (b, s))
            print(f"  fp8 / bf16 activation cache ({base}): {same}; against {first}: {bf16}")
    if router == "both":
        tr = rows[_impl_name("token_rounding", router, precisions[0])]
        result["sonic_token_rounding"] = tr
        result["token_rounding_speedup"] = s["fwd_bwd_us"] / tr["fwd_bwd_us"]
        print(f"  token rounding / top-K, fwd+bwd (time): {result['token_rounding_speedup']:.3f}x "
              f"faster (P = {tr['P']} vs {s['P']})")
    logits = (x @ router_weight.t()).detach()
    for r in routers:
        impl = _impl_name(r, router, precisions[0])
        result.update(_routing_share(r, impl, tile, logits, K, scoring, rows[impl],
                                     profile_kernels))
        routed = _route(r, tile, logits, K, scoring)
        without = _sonic_layer(r, tile, precisions[0], fp8_weights if precisions[0] == "fp8"
                               else None, routed=(routed, sonic.routing_metadata(routed)),
                               **opts)
        step_without = _steps(without, x, params, K, grad)[1]
        result.update(_routing_in_step(r, impl, steps[impl], step_without, leaves))
        if routing_in_graph:
            result.update(_routing_in_graph(r, impl, steps[impl], step_without, leaves))
    if profile_kernels:
        # Under the first row's FP8 choices (the process defaults are back by now).
        restore = (set_fp8_epilogues(default_mode[0]), set_fp8_weight_grads(default_mode[1]))
        try:
            _kernel_breakdown(steps[first], grad_to_none=leaves)
        finally:
            set_fp8_epilogues(restore[0])
            set_fp8_weight_grads(restore[1])
    return result


def _routing_share(router: str, impl: str, tile: int, logits, k, scoring, row: dict,
                   profile_kernels: bool) -> dict:
    """Time the routing phase (selection + metadata, the router GEMM excluded) of ``router``
    on ``logits`` and print its share of the step of row ``impl``; returns the JSON keys."""
    route = _routing_phase(router, tile, logits, k, scoring)
    route()
    route_us = bench(route)
    share = route_us / row["fwd_bwd_us"]
    # Timed alone, the phase also shows the host's launch time, which inside a step can run
    # ahead under the previous GPU work; its kernels' own time is the lower bound.
    kernel_us = _kernel_us(route)
    print(f"  {impl} routing phase (selection + metadata): {route_us:.1f} us, "
          f"{100 * share:.2f}% of its step; its kernels {kernel_us:.1f} us, "
          f"{100 * kernel_us / row['fwd_bwd_us']:.2f}%")
    if profile_kernels:
        _kernel_breakdown(route, rows=40, what=f"{impl} routing phase")
    return {f"routing_us_{router}": route_us, f"routing_share_{router}": share,
            f"routing_kernel_us_{router}": kernel_us}


# Rounds of the in-step routing cost: the step and the step without its routing, alternated
# (under a power cap one round's medians can differ by several per cent; a median over
# rounds drops such a round).
IN_STEP_ROUNDS = 5


def _routing_in_step(router: str, impl: str, step, step_without, leaves) -> dict:
    """The routing phase's cost inside a step: row ``impl``'s step less the same step with
    its routing made beforehand (``step_without``), the two timed alternately
    :data:`IN_STEP_ROUNDS` times and the medians of each side's timings compared. Timed alone
    the phase shows the host's launches, which in a step run under the previous GPU work;
    this is what the step pays. The routing made beforehand has constant scores, so the router
    GEMM's backward drops out too: the difference is an upper bound. Prints it; returns the
    JSON keys."""
    step_without()
    out = _alternated(router, impl, "in_step", "(the step less the step with its routing "
                      "made beforehand)", "steps", lambda: bench(step, grad_to_none=leaves),
                      lambda: bench(step_without, grad_to_none=leaves))
    for t in leaves:
        t.grad = None
    return out


def _routing_in_graph(router: str, impl: str, step, step_without, leaves) -> dict:
    """The routing phase's cost inside a step with no host time in it: row ``impl``'s step
    and the same step with its routing made beforehand, each captured in a CUDA graph
    (gradients dropped before each, as in the timed steps) and their replays timed as
    :func:`_routing_in_step` times the steps. Where the eager step is host-bound this is what
    a faster host, or a step in a CUDA graph, pays for the routing; an upper bound as
    :func:`_routing_in_step` is. The two graphs hold their own memory at once. Prints it;
    returns the JSON keys."""
    def fresh(fn):
        def call():
            for t in leaves:
                t.grad = None
            fn()
        return call

    replay, replay_without = captured(fresh(step)), captured(fresh(step_without))
    return _alternated(router, impl, "in_graph", ", both captured in CUDA graphs",
                       "graphed steps", lambda: bench(replay), lambda: bench(replay_without))


def _alternated(router: str, impl: str, key: str, what: str, label: str, time_with,
                time_without) -> dict:
    """``time_with()`` and ``time_without()`` (µs) called alternately :data:`IN_STEP_ROUNDS`
    times; prints the difference of their medians as the routing phase's cost ``what`` and
    returns it as ``routing_<key>_us_<router>`` and ``routing_<key>_share_<router>``."""
    with_us, without_us = [], []
    for _ in range(IN_STEP_ROUNDS):
        with_us.append(time_with())
        without_us.append(time_without())
    step_us = statistics.median(with_us)
    cost = step_us - statistics.median(without_us)
    print(f"  {impl} routing phase in the step {what}: {cost:.1f} us, "
          f"{100 * cost / step_us:.2f}% ({label} "
          f"{' / '.join(f'{t / 1e3:.3f}' for t in with_us)} ms against "
          f"{' / '.join(f'{t / 1e3:.3f}' for t in without_us)} ms)")
    return {f"routing_{key}_us_{router}": cost, f"routing_{key}_share_{router}": cost / step_us}


def _describe(scoring, shared) -> dict:
    """The routing options and shared expert of a run, JSON-ready (the bias as a flag)."""
    out = {key: value for key, value in (scoring or {}).items() if key != "expert_bias"}
    out["expert_bias"] = bool(scoring and "expert_bias" in scoring)
    out["shared_expert_cols"] = 0 if shared is None else shared[1].shape[2]
    return out


def _fmt(value, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.{digits}f}"


def chosen_configs(given, sweep: bool) -> list:
    """The ``(name, sizes)`` shapes to time: those of ``--config`` (``given``, parsed), then with
    ``sweep`` every named shape not among them; the paper's shapes when neither is given."""
    configs = list(given or [])
    if sweep:
        configs += [(name, sizes) for name, sizes in CONFIGS.items() if (name, sizes) not in configs]
    return configs or [(name, CONFIGS[name]) for name in PAPER_CONFIGS]


def read_sonicmoe(path: str) -> dict:
    """The JSON lines of ``bench_sonicmoe.py`` in ``path`` by (config, implementation), read
    before anything is measured so that a wrong path fails at once.

    Raises:
        ValueError: ``path`` holds no SonicMoE line.
    """
    anchor = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                row = json.loads(line)
                anchor[(row["config"], row["impl"])] = row
    if not any(impl == "sonicmoe" for _, impl in anchor):
        raise ValueError(f"--vs-sonicmoe {path}: no JSON line of bench_sonicmoe.py with "
                         f"impl 'sonicmoe'")
    return anchor


def compare_with_sonicmoe(results, anchor: dict, path: str) -> None:
    """Print sonic's ratios to torch-gmm beside SonicMoE's (``anchor``: :func:`read_sonicmoe`
    of ``path``; ``fwd_ms``/``fwdbwd_ms``/``peak_MiB``/``saved_MiB`` per config and
    implementation). A config SonicMoE's run did not measure gets a line saying so."""
    print(f"\nsonic beside SonicMoE ({path}): each ratio is to the torch-gmm of its own process; "
          f"ms: the steps themselves")
    print(f"  {'config':8s} {'f+b: sonic':>10s} {'SonicMoE':>9s} {'rel':>6s} | {'fwd: sonic':>10s} "
          f"{'SonicMoE':>9s} {'rel':>6s} | {'f+b ms: sonic':>13s} {'SonicMoE':>9s} | "
          f"{'peak MiB: sonic':>15s} {'SonicMoE':>9s} | {'saved: sonic':>12s} {'SonicMoE':>9s}")
    for r in results:
        moe, gmm = anchor.get((r["config"], "sonicmoe")), anchor.get((r["config"], "torch-gmm"))
        if moe is None or gmm is None:
            print(f"  {r['config']:8s} not measured by SonicMoE's run (no sonicmoe and "
                  f"torch-gmm lines in {path})")
            continue
        theirs = gmm["fwdbwd_ms"] / moe["fwdbwd_ms"]
        theirs_fwd = gmm["fwd_ms"] / moe["fwd_ms"]
        print(f"  {r['config']:8s} {r['fwd_bwd_speedup']:9.3f}x {theirs:8.3f}x "
              f"{r['fwd_bwd_speedup'] / theirs:6.3f} | {r['fwd_speedup']:9.3f}x "
              f"{theirs_fwd:8.3f}x {r['fwd_speedup'] / theirs_fwd:6.3f} | "
              f"{r['sonic']['fwd_bwd_us'] / 1e3:13.3f} {moe['fwdbwd_ms']:9.3f} | "
              f"{r['sonic']['peak_MiB']:15.1f} {moe['peak_MiB']:9.1f} | "
              f"{r['sonic']['saved_MiB']:12.1f} {moe['saved_MiB']:9.1f}")


def plot_results(results, anchor: dict | None, path: str) -> None:
    """Bar chart of forward + backward TFLOPS per configuration: sonic, torch-gmm and, with
    ``anchor`` (:func:`read_sonicmoe`), SonicMoE's, scaled to sonic's process through the
    ratio to its own torch-gmm (the two processes' torch-gmm times differ by machine noise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in results]
    bars = {"sonic": [r["sonic"]["fwd_bwd_TFLOPS"] for r in results],
            "torch-gmm": [r["torch_gmm"]["fwd_bwd_TFLOPS"] for r in results]}
    if anchor is not None:
        bars["SonicMoE"] = []
        for r in results:
            moe, gmm = anchor.get((r["config"], "sonicmoe")), anchor.get((r["config"], "torch-gmm"))
            bars["SonicMoE"].append(r["torch_gmm"]["fwd_bwd_TFLOPS"] * gmm["fwdbwd_ms"]
                                    / moe["fwdbwd_ms"] if moe and gmm else 0.0)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    width = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars.items()):
        ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
    ax.set_xticks([x + width * (len(bars) - 1) / 2 for x in range(len(names))], names)
    ax.set_ylabel("forward + backward TFLOPS")
    ax.set_title(f"MoE layer step on {results[0]['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def options_given(parser, args, keep) -> list[str]:
    """The options of ``args`` (as ``--name``) set to other than their defaults, but those
    whose argparse destinations are in ``keep``: what a mode that measures nothing refuses."""
    return ["--" + name.replace("_", "-") for name, value in vars(args).items()
            if name not in keep and value != parser.get_default(name)]


def report_saved(path: str, sonicmoe: str | None, plot: str | None) -> None:
    """``--results``: the SonicMoE comparison (:func:`compare_with_sonicmoe`) and the plot
    (:func:`plot_results`) of the results an earlier run wrote with ``--json`` to ``path``, so
    that two runs made at the same time on two GPUs (sonic's, and ``bench_sonicmoe.py``'s)
    are set side by side afterwards, on any machine.

    Raises:
        ValueError: ``path`` is not JSON or not a list of ``bench_moe.py`` results (the message
            names it), or ``sonicmoe`` holds no SonicMoE line (:func:`read_sonicmoe`).
        OSError: ``path`` cannot be read.
    """
    anchor = read_sonicmoe(sonicmoe) if sonicmoe else None
    with open(path) as f:
        try:
            results = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"--results {path}: not JSON ({err})") from err
    keys = ("config", "sonic", "torch_gmm", "fwd_bwd_speedup", "fwd_speedup", "device")
    if (not isinstance(results, list) or not results
            or not all(isinstance(r, dict) and all(k in r for k in keys) for r in results)):
        raise ValueError(f"--results {path}: expected the JSON list that bench_moe.py --json "
                         f"writes (each result with {', '.join(keys)})")
    if anchor is not None:
        compare_with_sonicmoe(results, anchor, sonicmoe)
    if plot:
        plot_results(results, anchor, plot)


def _impl_name(router: str, requested: str, precision: str = "bf16") -> str:
    name = "sonic" if requested != "both" else ("sonic-topK" if router == "topk" else "sonic-TR")
    return name if precision == "bf16" else f"{name}-fp8"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=parse_config, action="append",
                        help=f"{', '.join(CONFIGS)} or T,d,n,E,K (repeatable; default: "
                             f"{', '.join(PAPER_CONFIGS)})")
    parser.add_argument("--sweep", action="store_true",
                        help="every named configuration (after any --config)")
    parser.add_argument("--router", choices=("topk", "token_rounding", "both"), default="topk")
    parser.add_argument("--tile", type=int, default=None,
                        help="token-rounding tile (default 128; needs --router token_rounding "
                             "or both)")
    parser.add_argument("--precision", choices=("bf16", "fp8", "both"), default="bf16",
                        help="sonic's expert GEMMs: bf16, block-scaled FP8 (Hopper; weight "
                             "copies made once outside the timing), or both in this process "
                             "with their fp8/bf16 ratios")
    parser.add_argument("--fp8-epilogues", nargs="+", default=None,
                        choices=("store", "quantizing", "fused"),
                        help="sonic.backend.set_fp8_epilogues choices for the FP8 rows: the "
                             "first for sonic-fp8, each further one a row sonic-fp8-<choice> "
                             "(same-run A/B of the FP8 up-proj / dH kernels; default "
                             "quantizing; needs --precision fp8 or both)")
    parser.add_argument("--fp8-weight-grads", nargs="+", default=None,
                        choices=FP8_WEIGHT_GRADS,
                        help="sonic.backend.set_fp8_weight_grads choices for the FP8 rows: "
                             "the first for sonic-fp8, each further one a row "
                             "sonic-fp8-wgrad-<choice> (default auto; needs --precision fp8 "
                             "or both)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--results", metavar="FILE",
                        help="measure nothing: read an earlier run's --json and print its "
                             "comparison with --vs-sonicmoe and/or draw --plot (any machine)")
    parser.add_argument("--plot", metavar="PNG",
                        help="also draw forward + backward TFLOPS per configuration (sonic, "
                             "torch-gmm, and SonicMoE with --vs-sonicmoe; needs matplotlib)")
    parser.add_argument("--profile", action="store_true",
                        help="also print sonic's forward+backward time per GPU kernel")
    parser.add_argument("--trace", metavar="DIR",
                        help="write Chrome traces of six consecutive steps per implementation "
                             "and print each step's GPU idle time")
    parser.add_argument("--activation-cache", choices=("bf16", "fp8"), default="bf16",
                        help="fp8: also run sonic with the FP8 activation cache and compare")
    parser.add_argument("--vs-sonicmoe", metavar="FILE",
                        help="JSON lines of a SonicMoE benchmark run to compare with")
    parser.add_argument("--score", choices=("softmax_topk", "topk_softmax", "sigmoid"),
                        default="softmax_topk", help="router scores (sigmoid: DeepSeek-V3)")
    parser.add_argument("--renormalize", action="store_true",
                        help="renormalise topk_softmax / sigmoid scores to sum to 1")
    parser.add_argument("--routed-scaling-factor", type=float, default=1.0,
                        help="multiply every routing score (DeepSeek-V3: 2.5)")
    parser.add_argument("--n-group", type=int, default=1,
                        help="group-limited routing: experts in this many groups")
    parser.add_argument("--topk-group", type=int, default=None,
                        help="groups each token may choose from (default: --n-group)")
    parser.add_argument("--expert-bias", action="store_true",
                        help="a fixed random (E,) selection bias (aux-loss-free balancing)")
    parser.add_argument("--shared-experts", type=int, default=0, metavar="M",
                        help="add one dense SwiGLU expert of size M*n")
    parser.add_argument("--routing-in-graph", action="store_true",
                        help="also the routing phase's cost inside the step with both steps "
                             "captured in CUDA graphs (no host time; two graphs' memory)")
    args = parser.parse_args(argv)
    if args.results:
        # Every other option shapes a measurement that --results does not make.
        given = options_given(parser, args, ("results", "vs_sonicmoe", "plot"))
        if given:
            parser.error("--results reads an earlier run and measures nothing: leave out "
                         + ", ".join(given))
        if not (args.vs_sonicmoe or args.plot):
            parser.error("--results needs --vs-sonicmoe FILE and/or --plot PNG")
        report_saved(args.results, args.vs_sonicmoe, args.plot)
        return
    # Options that only shape rows the run would not have are refused, not ignored.
    if args.tile is not None and args.router == "topk":
        parser.error("--tile sets the token-rounding tile: add --router token_rounding or both")
    for option, value in (("--fp8-epilogues", args.fp8_epilogues),
                          ("--fp8-weight-grads", args.fp8_weight_grads)):
        if value is not None and args.precision == "bf16":
            parser.error(f"{option} chooses among the FP8 rows: add --precision fp8 or both")
    args.tile = 128 if args.tile is None else args.tile
    args.fp8_epilogues = args.fp8_epilogues or ["quantizing"]
    args.fp8_weight_grads = args.fp8_weight_grads or ["auto"]
    scoring = {"score": args.score, "renormalize": args.renormalize,
               "n_group": args.n_group, "topk_group": args.topk_group,
               "scaling_factor": args.routed_scaling_factor}
    configs = chosen_configs(args.config, args.sweep)
    anchor = read_sonicmoe(args.vs_sonicmoe) if args.vs_sonicmoe else None
    print(f"device: {device_name()}  torch {torch.__version__}  backend: "
          f"{sonic.explain_backend('auto', 'cuda')}")
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    results = [measure(name, sizes, args.router, args.tile, args.profile, args.trace,
                       args.precision, args.activation_cache, args.fp8_epilogues,
                       args.fp8_weight_grads,
                       *layer_options(sizes, scoring, args.shared_experts, args.expert_bias),
                       routing_in_graph=args.routing_in_graph)
               for name, sizes in configs]
    if args.vs_sonicmoe:
        compare_with_sonicmoe(results, anchor, args.vs_sonicmoe)
    for r in results:
        r["device"] = device_name()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot_results(results, anchor, args.plot)


if __name__ == "__main__":
    main()
