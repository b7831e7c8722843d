"""Expert parallelism, weak scaling: EP over all ranks against one GPU with the same tokens per
GPU, and how much of the all-to-all time the chunked pipeline hides.

    torchrun --nproc_per_node=2 benchmarks/bench_ep.py                  # 30B per GPU
    torchrun --nproc_per_node=2 benchmarks/bench_ep.py --config 8192,2048,1024,64,8 --chunks 1,2
    torchrun --nproc_per_node=2 benchmarks/bench_ep.py --smoke          # CPU, gloo, tiny

``--config T,d,n,E,K`` (default the 30B layer, docs/design.md §5): ``T`` tokens *per rank*, ``E``
experts over all ranks. Every rank builds the same single-process :class:`sonic.MoE` (all
``E`` experts) and the same ``(ep·T, d)`` batch from one seed, takes its share with
:meth:`ExpertParallelMoE.from_moe`, and in ONE run (``--precision fp8`` /
``--activation-cache fp8``: both layers run sonic's FP8 GEMMs / keep H in e4m3):

0. checks, for every chunk count: one forward + backward of the EP layer on its ``T`` tokens
   against the single-process layer on the whole batch (relative error of the output, dX, the
   router gradient summed over ranks, its dW1/dW2 slices; bf16, so 1e-3..1e-2 is expected);
   above ``--tol`` it exits 1.
1. ``1gpu``: the single-process layer (all ``E`` experts) on this rank's ``T`` tokens — the
   same tokens per GPU — timed on every rank at once, independently.
2. ``ep C=c``: the EP layer with ``num_chunks=c`` for each ``--chunks`` value.
3. ``compute-only C=c``: the same EP step with no data movement at all: every data
   all-to-all (rows, scores, their gradients) is skipped. A call that allocates its receive
   buffer gets a preallocated one of the right size holding the rows of a one-time real
   exchange (recorded per ``C``); a call that receives into a caller's buffer (``out=``) leaves
   it as it is — the caching allocator hands the same blocks every step, so it holds an earlier
   step's rows; the kernels' time does not depend on the values. The count and pair-index
   exchanges of the plan stay real (they are not what the pipeline hides).
   ``exposed = t_ep − t_compute_only`` is the communication time left on the critical path.
   ``--sm-margins`` (default 0,8,16) repeats ``ep`` and ``compute-only`` for ``C = 2`` with
   the grouped GEMMs leaving that many SMs free (``comm_sm_margin``); ``--recompute-dispatch``
   repeats them for every ``C`` with ``recompute_dispatch=True`` (``C=c rd``: the received
   rows sent again in backward instead of kept). Each run also reports the peak memory of one
   step above what was allocated before it (MiB).
4. ``a2a alone``: the data all-to-alls of one unchunked step (the sizes recorded from a real
   step: rows and scores out, partial outputs back; in backward dO rows out, dX rows and score
   gradients back), back to back, no compute; bus bandwidth = bytes sent per rank ×
   (ep−1)/ep / time (nccl-tests' all-to-all convention).

Derived: weak-scaling efficiency ``t_1gpu / t_ep`` and hidden fraction
``hidden = 1 − exposed / t_a2a_alone``: 0 when the step takes compute plus all the
communication, 1 when the communication costs nothing on top of the compute (negative: the
chunked schedule costs more than it hides), for the forward and the step (forward + backward).
It is meaningful because compute-only moves no data (a local copy of every message, the
previous definition, costs about as much as the NVLink all-to-all itself).

5. ``phases``: on rank 0, one EP step for ``C = 1`` and for the fastest ``C > 1``, timed per
   phase with CUDA events on the stream each phase runs on (comm or compute): the plan's
   exchanges, dispatch, local experts, combine, the per-token sum; in backward the dO rows
   (combine's backward), the chunked path's per-chunk activation gradients and its one
   weight-gradient step, the dX rows and score gradients (dispatch's backward). Printed as a
   timeline (start and duration from the step's start) and summed per phase; for ``C = 1``
   the expert backward is the gap between the dO and the dX all-to-alls.

Timing: a step is one forward + backward with a fixed random dO, all gradients set to None
before it; before every repetition the L2 is flushed and the ranks meet at a barrier; then
CUDA events around the step. Every rank runs the same number of repetitions (collectives:
adaptive counts could deadlock); the printed time is the median per rank, the slowest rank's.

``--comm-priorities normal,high`` repeats the chunked runs with sonic's comm stream (normal
priority) replaced by one of the highest priority (``... high-prio``), whose gathers and copies
then get the SMs first when compute CTAs end: the same-run A/B of that priority.
``--nccl-ctas`` repeats each run with an SM margin ``m`` (``C=2 m=m ctas=m``) over a second
NCCL group of the same ranks whose collectives take at most ``m`` CTAs
(``ncclConfig_t.maxCTAs``, through ``ProcessGroupNCCL.Options.config.max_ctas``): without it
NCCL may launch more CTAs than the margin leaves SMs, and the rest wait for the persistent GEMM
to end.

NCCL: NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``, set here before the process group starts). NCCL's stream is
created high-priority (``--nccl-priority high``, the default) so that its kernels get SMs as
soon as the expert kernels free them.

6. ``--zipf S``: skewed routing and EPLB instead of 1–5 (C = 1, the first transport): the
   step with the contiguous placement, with :func:`~sonic.distributed.plan_placement`'s
   placement of one redundant slot per rank for the routing's own load, and with the router's
   balanced routing, each placement's max/mean rank load of routed pairs, and EPLB's output
   and dX against one process on the whole batch.

7. ``--profile``: on every rank, one step of the one-GPU layer and one EP step (the first
   ``--chunks`` value and transport) under torch.profiler, timed as above (L2 flushed, ranks
   at a barrier, ``--host-ahead-ms`` honoured): each step's device time per kernel family
   (grouped GEMMs, all-to-alls, per-token sums, row gathers, the rest) and the GPU's idle time
   between its first and last kernel. An all-to-all's time includes its wait for the slowest
   peer. The profiler adds host time to every launch, so the idle time is an upper bound.
   Not with ``--zipf`` or ``--smoke``.

``--host-ahead-ms MS`` queues each timed step behind a device sleep of ``MS`` ms and times from
the sleep's end: the host then enters the step ahead of the device, as in a model whose
earlier layers keep the device busy, so what the step costs the host before its one host read
is hidden for the EP layer and the one-GPU layer alike.

Rank 0 prints a table and one JSON line. Importable without a GPU (nothing runs on import);
``--smoke`` runs it on CPU ranks (gloo) at tiny sizes.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sonic  # noqa: E402
from sonic.distributed import (ExpertParallelMoE, comm, experts, overlap,  # noqa: E402
                               plan, plan_placement)

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
THIRTY_B = "32768,4096,1024,128,8"
SMOKE = "24,16,8,8,2"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None,
                        help=f"T (per rank),d,n,E,K (default {THIRTY_B}; --smoke: {SMOKE})")
    parser.add_argument("--chunks", default="1,2,4", help="num_chunks values (default %(default)s)")
    parser.add_argument("--sm-margins", default="0,8,16",
                        help="comm_sm_margin values timed at C=2 (default %(default)s)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per measurement (default 20; --smoke: 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed repetitions first (default 3; --smoke: 1)")
    parser.add_argument("--recompute-dispatch", action="store_true",
                        help="also time every --chunks value with recompute_dispatch=True "
                             "(runs named 'C=c rd'); every run prints its peak MiB")
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                        help="the experts' GEMMs, of the EP layer and of the one-GPU layer it "
                             "is compared with (fp8: block-scaled e4m3; Hopper)")
    parser.add_argument("--activation-cache", choices=("bf16", "fp8"), default="bf16",
                        help="how both layers keep H for backward")
    parser.add_argument("--tol", type=float, default=2e-2)
    parser.add_argument("--nccl-priority", choices=("high", "normal"), default="high")
    parser.add_argument("--nccl-ctas", action="store_true",
                        help="repeat each run with an SM margin m over a second NCCL group "
                             "whose kernels take at most m CTAs (ncclConfig maxCTAs): "
                             "'C=2 m=m ctas=m'")
    parser.add_argument("--comm-priorities", default="normal",
                        help="priorities of the comm stream to time the chunked runs with "
                             "(normal: sonic's own; high: runs named '... high-prio')")
    parser.add_argument("--transports", default="nccl",
                        help="data all-to-all transports to time every run with: nccl, "
                             "copy_engine (runs named '... ce'; 'a2a alone ce' its own "
                             "all-to-alls); default %(default)s")
    parser.add_argument("--zipf", type=float, default=0.0, metavar="S",
                        help="instead of the runs above: EPLB under skewed routing. Every "
                             "token picks K distinct experts drawn from Zipf(S) over the "
                             "experts in a random order of popularity; times C=1 with the "
                             "contiguous placement, with an EPLB placement of one redundant "
                             "slot per rank (plan_placement of the routing's load), and with "
                             "the router's own (balanced) routing, and prints each "
                             "placement's max/mean rank load (module docstring, item 6)")
    parser.add_argument("--host-ahead-ms", type=float, default=0.0, metavar="MS",
                        help="queue each timed step behind a device sleep of MS ms (timed from "
                             "its end), so the host is ahead of the device when the step "
                             "starts, as inside a model; 0 (default): the host starts with the "
                             "device idle")
    parser.add_argument("--profile", action="store_true",
                        help="also break one one-GPU step and one EP step down by kernel "
                             "family and GPU idle time, per rank (torch.profiler; module "
                             "docstring, item 7)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU ranks over gloo, tiny sizes, fp32: checks that it runs")
    args = parser.parse_args(argv)
    if args.profile and (args.smoke or args.zipf):
        parser.error("--profile breaks down the CUDA kernels of the balanced runs: not with "
                     "--smoke or --zipf")
    if args.smoke and "fp8" in (args.precision, args.activation_cache):
        parser.error("--smoke runs fp32 on CPU ranks: --precision / --activation-cache fp8 "
                     "need bf16")
    args.config = args.config or (SMOKE if args.smoke else THIRTY_B)
    args.reps = args.reps or (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.chunks = [int(c) for c in args.chunks.split(",")]
    args.sm_margins = [int(m) for m in args.sm_margins.split(",")]
    args.comm_priorities = args.comm_priorities.split(",")
    args.transports = args.transports.split(",")
    if not set(args.transports) <= {"nccl", "copy_engine"}:
        parser.error("--transports: a comma-separated list of nccl, copy_engine")
    if not set(args.comm_priorities) <= {"high", "normal"}:
        parser.error("--comm-priorities: a comma-separated list of high, normal")
    return args


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class _Timer:
    """Median milliseconds of a callable, the same repetitions on every rank (module
    docstring)."""

    def __init__(self, device: torch.device, reps: int, warmup: int, host_ahead_ms: float = 0):
        self.cuda = device.type == "cuda"
        self.reps, self.warmup = reps, warmup
        # A one-thread device sleep; GPU clocks are ~2 GHz, and only "long enough" matters.
        self.ahead_cycles = int(host_ahead_ms * 2e6) if self.cuda else 0
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None

    def ready(self, params) -> None:
        """Before a timed call: gradients dropped, L2 flushed, the device idle, the ranks at a
        barrier."""
        _drop_grads(params)
        if self.cuda:
            self.flush.zero_()
            torch.cuda.synchronize()
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()

    def ahead(self) -> None:
        """Queue the device sleep that puts the host ahead (``--host-ahead-ms``), if any."""
        if self.ahead_cycles:
            torch.cuda._sleep(self.ahead_cycles)

    def __call__(self, fn, params) -> float:
        for _ in range(self.warmup):
            _drop_grads(params)
            fn()
        times = []
        for _ in range(self.reps):
            self.ready(params)
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                self.ahead()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _drop_grads(params) -> None:
    for p in params:
        p.grad = None


@contextlib.contextmanager
def _data_all_to_alls(record: list | None = None, replay: list | None = None):
    """Inside, the floating-point (data) all-to-alls are changed, the integer ones of the plan
    stay real. ``record``: each real data call appends its (bytes sent, send buffer, receive
    buffer, splits). ``replay`` (a ``record`` of the same configuration): no data moves (rows
    sent by index are still gathered, as the real call does); a call without ``out`` returns
    the recorded receive buffer of its splits, width and dtype, a call with ``out`` leaves it
    untouched (module docstring, item 3)."""
    real = plan.all_to_all

    def key(x, out_splits, in_splits):
        return tuple(out_splits), tuple(in_splits), tuple(x.shape[1:]), x.dtype

    received = {key(send, o, i): recv for _, send, recv, o, i in (replay or [])}

    def substitute(x, out_splits, in_splits, group, out=None, *, index=None, transport=None):
        if not x.is_floating_point():
            return real(x, out_splits, in_splits, group, out, index=index, transport=transport)
        if index is not None:
            x = x.index_select(0, index)
        if record is not None:
            out = real(x, out_splits, in_splits, group, out, transport=transport)
            record.append((x.numel() * x.element_size(), x.detach().clone(), out.detach().clone(),
                           list(out_splits), list(in_splits)))
            return out
        return received[key(x, out_splits, in_splits)] if out is None else out

    plan.all_to_all = substitute
    try:
        yield
    finally:
        plan.all_to_all = real


def _nccl_group(max_ctas: int, priority: str):
    """A NCCL group over every rank whose collectives take at most ``max_ctas`` CTAs (``None``:
    0, the default group)."""
    if not max_ctas:
        return None
    options = _nccl_options(priority)
    options.config.max_ctas = max_ctas
    return dist.new_group(backend="nccl", pg_options=options)


def _comm_stream(device, priority: str):
    """The stream sonic's chunked pipeline runs its all-to-alls on: its own (normal
    priority) or one of the highest priority (``None`` on the CPU)."""
    if device.type != "cuda":
        return None
    if priority == "normal":
        return overlap._Streams(device).comm
    return torch.cuda.Stream(device, priority=-64)    # clamped to the highest there is


def _nccl_options(priority: str):
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=priority == "high")


def _run_name(chunks: int, margin: int, recompute: bool = False, ctas: int = 0,
              comm_priority: str = "normal", transport: str = "nccl") -> str:
    return (f"C={chunks}" + (f" m={margin}" if margin else "") + (" rd" if recompute else "")
            + (f" ctas={ctas}" if ctas else "")
            + (f" {comm_priority}-prio" if comm_priority != "normal" else "")
            + _TRANSPORT_SUFFIX[transport])


# How a run's name shows its transport (and the key of its "a2a alone" time).
_TRANSPORT_SUFFIX = {"nccl": "", "copy_engine": " ce"}


# Phase of an all-to-all, by the function that calls it (for the chunked path's token-row
# sender, by the function that calls that: suffix " rows").
_A2A_PHASES = {
    "plan_dispatch": "plan exchanges (counts, pairs)",
    "_send_counts": "plan exchanges (counts, pairs)",
    "Dispatch.forward": "dispatch a2a",
    "ChunkedExperts.forward.<locals>.dispatch": "dispatch a2a",
    "ChunkedExperts.forward.<locals>.dispatch rows": "dispatch a2a",
    "Combine.forward": "combine a2a",
    "ChunkedExperts.forward": "combine a2a",
    "Combine.backward": "dO a2a (combine bwd)",
    "ChunkedExperts.backward.<locals>.send_grad_out rows": "dO a2a (combine bwd)",
    "Dispatch.backward": "dX/ds a2a (dispatch bwd)",
    "ChunkedExperts.backward": "dX/ds a2a (dispatch bwd)",
    "ChunkedExperts.backward rows": "x rows again (recompute_dispatch)",
}


def _a2a_phase() -> str:
    """The phase of the all-to-all whose timing wrapper calls this (see :data:`_A2A_PHASES`):
    the function calling it, past the plan's data all-to-all method."""
    frame = sys._getframe(2)
    if frame.f_code.co_qualname == "DispatchPlan.all_to_all":
        frame = frame.f_back
    caller = frame.f_code.co_qualname
    if caller == "_send_token_rows":
        caller = frame.f_back.f_code.co_qualname + " rows"
    return _A2A_PHASES.get(caller, "other a2a")


def _phase_timeline(layer, x, dout, params, device) -> list:
    """One EP step with every phase timed on the stream it runs on (module docstring, item
    5): ``[(phase, stream, start ms, duration ms)]`` from the step's start, in issue order,
    and the ``forward``/``backward`` totals on the compute stream."""
    cuda = device.type == "cuda"
    compute = torch.cuda.current_stream(device) if cuda else None
    marks = []

    def now():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed(fn, label=None):
        def wrapper(*args, **kwargs):
            phase = label or _a2a_phase()
            stream = "comm" if cuda and torch.cuda.current_stream(device) != compute \
                else "compute"
            start = now()
            result = fn(*args, **kwargs)
            marks.append((phase, stream, start, now()))
            return result
        return wrapper

    real_ops = experts.expert_ops

    def expert_ops(*args):
        ops = real_ops(*args)
        return dataclasses.replace(ops, aggregate=timed(ops.aggregate, "per-token sum"))

    patches = [(plan, "all_to_all", timed(plan.all_to_all)),
               (experts, "moe_experts", timed(experts.moe_experts, "local experts fwd")),
               (overlap, "experts_forward", timed(overlap.experts_forward,
                                                  "local experts fwd")),
               (overlap, "_activation_grads", timed(overlap._activation_grads,
                                                    "activation grads (dH, dX, ds)")),
               (overlap, "_weight_grads", timed(overlap._weight_grads, "weight grads (dW1, dW2)")),
               (experts, "expert_ops", expert_ops)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    _drop_grads(params)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    try:
        for module, name, fn in patches:
            setattr(module, name, fn)
        start = now()
        out = layer(x)
        middle = now()
        out.backward(dout)
        end = now()
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    if cuda:
        torch.cuda.synchronize()

    def since(mark):
        return start.elapsed_time(mark) if cuda else (mark - start) * 1e3

    rows = [(phase, stream, since(a), since(b) - since(a)) for phase, stream, a, b in marks]
    return rows + [("forward", "compute", 0.0, since(middle)),
                   ("backward", "compute", since(middle), since(end) - since(middle))]


# Kernel families of --profile's breakdown: the first whose name fragment is in a kernel's
# name takes it; the others are "other kernels" (routing, the plan, casts, adds).
KERNEL_FAMILIES = (("grouped GEMMs", ("grouped_gemm",)),
                   ("all-to-alls", ("nccl", "PtoP")),
                   ("per-token sums", ("aggregation",)),
                   ("row gathers", ("vectorized_gather", "index_elementwise")))


def kernel_breakdown(kernels: list[tuple[float, float, str]]) -> dict:
    """``kernels``: ``(start µs, end µs, name)`` of one step's device work (any streams).
    Returns ms: the span from the first start to the last end, the idle time in it (no
    kernel running on any stream) and the summed time of each of :data:`KERNEL_FAMILIES`
    and of ``"other kernels"``."""
    families = {name: 0.0 for name, _ in KERNEL_FAMILIES}
    families["other kernels"] = 0.0
    if not kernels:
        return {"span": 0.0, "idle": 0.0, **families}
    busy, run_start, run_end = 0.0, None, None
    for start, end, name in sorted(kernels):
        family = next((f for f, parts in KERNEL_FAMILIES if any(p in name for p in parts)),
                      "other kernels")
        families[family] += (end - start) / 1e3
        if run_end is None or start > run_end:
            busy += 0.0 if run_end is None else run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    span = max(end for _, end, _ in kernels) - min(start for start, _, _ in kernels)
    return {"span": span / 1e3, "idle": (span - busy) / 1e3, **families}


def _profile_step(step, params, timer: "_Timer") -> dict:
    """:func:`kernel_breakdown` of one ``step()`` on the GPU, set up as :class:`_Timer` times
    it (gradients dropped, L2 flushed, ranks at a barrier, the host ahead when asked); the
    device sleep that puts the host ahead is left out."""
    from torch.profiler import ProfilerActivity, profile

    timer.ready(params)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timer.ahead()
        step()
        torch.cuda.synchronize()
    return kernel_breakdown([(e.time_range.start, e.time_range.end, e.name)
                             for e in prof.events() if e.device_type.name == "CUDA"
                             and "spin" not in e.name])


def _peak_mib(step, params, device) -> float:
    """Peak CUDA memory of one ``step`` above what was allocated before it, MiB (the slowest
    rank's is printed); 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    _drop_grads(params)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    _drop_grads(params)
    return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20


def _check(layer, full, x, dout, x_full, dout_full, mine, rank) -> dict:
    """Relative errors of one EP forward + backward against the single-process layer."""
    _drop_grads([*layer.parameters(), *full.parameters()])
    xe = x.detach().clone().requires_grad_()
    out = layer(xe)
    out.backward(dout)
    x_ref = x_full.detach().clone().requires_grad_()
    out_ref = full(x_ref)
    out_ref.backward(dout_full)
    gate_grad = layer.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    local = slice(rank * layer.num_local_experts, (rank + 1) * layer.num_local_experts)
    return {"out": _rel(out.detach(), out_ref.detach()[mine]),
            "dx": _rel(xe.grad, x_ref.grad[mine]),
            "dgate": _rel(gate_grad, full.gate.weight.grad),
            "dw1": _rel(layer.w1.grad, full.w1.grad[local]),
            "dw2": _rel(layer.w2.grad, full.w2.grad[local])}


def _problem(args: argparse.Namespace, device: torch.device):
    """``(full, x_full, dout_full, mine)``: the single-process layer (all ``E`` experts, the
    same on every rank), the whole batch's inputs and output gradients (``ep·T`` rows, from one
    seed) and this rank's slice of them."""
    tokens, d, n, num_experts, top_k = (int(v) for v in args.config.split(","))
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    full = sonic.MoE(d, n, num_experts, top_k, device=device, dtype=dtype,
                     backend="auto" if device.type == "cuda" else "torch",
                     precision=args.precision, activation_cache=args.activation_cache)
    g = torch.Generator(device).manual_seed(1)
    x_full = torch.randn(world * tokens, d, device=device, dtype=dtype, generator=g)
    dout_full = torch.randn(world * tokens, d, device=device, dtype=dtype, generator=g)
    return full, x_full, dout_full, slice(rank * tokens, (rank + 1) * tokens)


def run(args: argparse.Namespace, device: torch.device) -> dict:
    """The benchmark on an initialised process group; every rank returns its own numbers
    and rank 0 prints the table and the JSON line."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full, x_full, dout_full, mine = _problem(args, device)
    layer = ExpertParallelMoE.from_moe(full)
    x = x_full[mine].clone().requires_grad_()
    dout = dout_full[mine].clone()

    recomputes = (False, True) if args.recompute_dispatch else (False,)
    errors = {}
    for t in args.transports:
        layer.transport = t
        for c in args.chunks:
            for r in recomputes:
                layer.num_chunks, layer.recompute_dispatch = c, r
                errors[_run_name(c, 0, r, transport=t)] = _check(layer, full, x, dout, x_full,
                                                                 dout_full, mine, rank)
    worst = torch.tensor(max(max(e.values()) for e in errors.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)

    timer = _Timer(device, args.reps, args.warmup, args.host_ahead_ms)
    single_params = [*full.parameters(), x]
    ep_params = [*layer.parameters(), x]
    ms = {"1gpu": {"fwd": timer(lambda: full(x), single_params),
                   "step": timer(lambda: full(x).backward(dout), single_params)}}
    margins = [m for m in args.sm_margins if m and 2 in args.chunks]
    limits = (0, 1) if args.nccl_ctas and device.type == "cuda" else (0,)
    # The comm stream's priority matters only to the chunked pipeline (C > 1); the NCCL CTA
    # limit only to the NCCL transport.
    runs = [run for t in args.transports for run in
            [(c, 0, r, 0, p, t) for p in args.comm_priorities for r in recomputes
             for c in args.chunks if c > 1 or p == "normal"]
            + [(2, m, False, m * k, p, t) for p in args.comm_priorities for m in margins
               for k in limits if t == "nccl" or not k]]
    calls, peak = {}, {}
    groups = {ctas: _nccl_group(ctas, args.nccl_priority) for *_, ctas, _, _ in runs}
    comm_streams = {p: _comm_stream(device, p) for p in ("normal", *args.comm_priorities)}
    for c, margin, r, ctas, priority, t in runs:
        layer.num_chunks, layer.comm_sm_margin, layer.recompute_dispatch = c, margin, r
        layer.group, layer.transport = groups[ctas], t
        if device.type == "cuda":
            overlap._COMM_STREAMS[device.index] = comm_streams[priority]
        if (c, r, t) not in calls:     # one real step: the messages compute-only replays
            calls[(c, r, t)] = {"fwd": [], "bwd": []}
            with _data_all_to_alls(record=calls[(c, r, t)]["fwd"]):
                out = layer(x)
            with _data_all_to_alls(record=calls[(c, r, t)]["bwd"]):
                out.backward(dout)
            del out
        name = _run_name(c, margin, r, ctas, priority, t)
        peak[name] = _peak_mib(lambda: layer(x).backward(dout), ep_params, device)
        ms[f"ep {name}"] = {"fwd": timer(lambda: layer(x), ep_params),
                            "step": timer(lambda: layer(x).backward(dout), ep_params)}
        with _data_all_to_alls(replay=calls[(c, r, t)]["fwd"] + calls[(c, r, t)]["bwd"]):
            ms[f"compute {name}"] = {"fwd": timer(lambda: layer(x), ep_params),
                                     "step": timer(lambda: layer(x).backward(dout), ep_params)}
    layer.recompute_dispatch, layer.group = False, None
    if device.type == "cuda":
        overlap._COMM_STREAMS[device.index] = comm_streams["normal"]

    # The data all-to-alls of one unchunked step, replayed back to back, per transport.
    first = args.chunks[0]
    for t in args.transports:
        mover = experts._resolve_transport(t, None, device)

        def replay(phases):
            for phase in phases:
                for _, send, recv, out_splits, in_splits in calls[(first, False, t)][phase]:
                    comm.all_to_all(send, out_splits, in_splits, None, out=recv,
                                    transport=mover)

        ms["a2a" + _TRANSPORT_SUFFIX[t]] = {"fwd": timer(lambda: replay(["fwd"]), []),
                                             "step": timer(lambda: replay(["fwd", "bwd"]), [])}
    record = calls[(first, False, args.transports[0])]
    sent = {"fwd": sum(c[0] for c in record["fwd"])}
    sent["step"] = sent["fwd"] + sum(c[0] for c in record["bwd"])
    del calls, record

    # Per-phase timelines of one step, per transport: C = 1 and the fastest C > 1 (the same on
    # every rank: the slowest rank's medians decide).
    phases = {}
    for t in args.transports:
        layer.transport = t
        step_ms = torch.tensor([ms[f"ep {_run_name(c, 0, transport=t)}"]["step"]
                                for c in args.chunks], dtype=torch.float64, device=device)
        dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)
        chunked = [(ms_c, c) for ms_c, c in zip(step_ms.tolist(), args.chunks) if c > 1]
        for c in sorted({args.chunks[0], *([min(chunked)[1]] if chunked else [])}):
            layer.num_chunks, layer.comm_sm_margin = c, 0
            phases[_run_name(c, 0, transport=t)] = _phase_timeline(layer, x, dout, ep_params,
                                                                   device)

    breakdown = {}
    if args.profile:
        layer.num_chunks, layer.comm_sm_margin = args.chunks[0], 0
        layer.transport = args.transports[0]
        breakdown = {"1gpu": _profile_step(lambda: full(x).backward(dout), single_params, timer),
                     _run_name(args.chunks[0], 0, transport=args.transports[0]):
                         _profile_step(lambda: layer(x).backward(dout), ep_params, timer)}

    mine_result = {"ms": ms, "peak_MiB": peak, "sent_bytes": sent, "errors": errors,
                   "phases": phases, "breakdown": breakdown}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine_result)
    summary = _summarise(gathered, args, world)
    if rank == 0:
        _print(summary, args, device, world, worst.item())
    summary["ok"] = worst.item() <= args.tol
    return summary


def _zipf_route(exponent: float, tokens: int, world: int, num_experts: int, top_k: int,
                device: torch.device):
    """A ``route(logits)`` for :class:`sonic.MoE` layers giving Zipf-skewed routing: each of
    the ``world·tokens`` tokens of the whole batch picks ``top_k`` distinct experts drawn
    (without replacement) from Zipf(``exponent``) over the experts in a random popularity
    order, the same on every rank; its scores are the softmax of the layer's logits at the
    picked experts (so the router still gets gradients). Called with ``tokens`` rows it routes
    this rank's share of the batch, with ``world·tokens`` the whole batch. Returns
    ``(route, load)``, ``load (E,)`` the whole batch's pairs per expert."""
    g = torch.Generator().manual_seed(2)
    popularity = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -exponent
    weights = popularity[torch.randperm(num_experts, generator=g)]
    experts = torch.multinomial(weights.expand(world * tokens, -1), top_k, generator=g)
    experts = experts.to(device=device, dtype=torch.int32)
    rank = dist.get_rank()
    load = torch.bincount(experts.flatten().long(), minlength=num_experts)

    def route(logits):
        count = logits.shape[0]
        chosen = experts if count == world * tokens else experts[rank * tokens:
                                                                 (rank + 1) * tokens]
        token_idx = torch.arange(count, device=device, dtype=torch.int32).repeat_interleave(
            top_k)
        expert_idx = chosen.flatten()
        scores = logits.float().softmax(-1)[token_idx.long(), expert_idx.long()]
        return sonic.Routing(token_idx, expert_idx, scores, count, num_experts, top_k=top_k,
                             validated=True)

    return route, load


def run_skew(args: argparse.Namespace, device: torch.device) -> dict:
    """``--zipf``: the EP step under skewed routing, contiguous against EPLB, and with the
    router's balanced routing (module docstring, item 6); rank 0 prints the table."""
    tokens, d, n, num_experts, top_k = (int(v) for v in args.config.split(","))
    rank, world = dist.get_rank(), dist.get_world_size()
    full, x_full, dout_full, mine = _problem(args, device)
    x = x_full[mine].clone().requires_grad_()
    dout = dout_full[mine].clone()
    route, load = _zipf_route(args.zipf, tokens, world, num_experts, top_k, device)
    placement = plan_placement(load, world, num_experts // world + 1)
    layers = {"balanced": ExpertParallelMoE.from_moe(full),
              "zipf contiguous": ExpertParallelMoE.from_moe(full),
              "zipf EPLB": ExpertParallelMoE.from_moe(full, placement=placement)}
    for name, layer in layers.items():
        layer.transport, layer.num_chunks = args.transports[0], 1
        if name != "balanced":
            layer.route = route
    # Max/mean rank load of each placement for the routing it runs.
    with torch.no_grad():
        layers["balanced"](x)
    balanced = torch.bincount(layers["balanced"].last_routing.expert_idx.long(),
                              minlength=num_experts)
    dist.all_reduce(balanced)

    def spread(per_expert):
        ranks = per_expert.view(world, -1).sum(1).double()
        return (ranks.max() / ranks.mean()).item()

    balance = {"balanced": spread(balanced), "zipf contiguous": spread(load),
               "zipf EPLB": placement.max_over_mean(load)}
    # EPLB against one process on the whole batch (output and dX: exact up to bf16 sums).
    full.route = route
    x_ref = x_full.clone().requires_grad_()
    out_ref = full(x_ref)
    out_ref.backward(dout_full)
    xe = x.detach().clone().requires_grad_()
    out = layers["zipf EPLB"](xe)
    out.backward(dout)
    errors = {"out": _rel(out.detach(), out_ref.detach()[mine]), "dx": _rel(xe.grad,
                                                                           x_ref.grad[mine])}
    worst = torch.tensor(max(errors.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)

    timer = _Timer(device, args.reps, args.warmup, args.host_ahead_ms)
    ms = {"1gpu zipf": {"fwd": timer(lambda: full(x), [*full.parameters(), x]),
                        "step": timer(lambda: full(x).backward(dout), [*full.parameters(), x])}}
    for name, layer in layers.items():
        params = [*layer.parameters(), x]
        ms[name] = {"fwd": timer(lambda: layer(x), params),
                    "step": timer(lambda: layer(x).backward(dout), params)}
    gathered = [None] * world
    dist.all_gather_object(gathered, ms)
    ms = {k: {p: max(r[k][p] for r in gathered) for p in ("fwd", "step")} for k in ms}
    summary = {"config": args.config, "ep": world, "zipf": args.zipf, "ms": ms,
               "max_over_mean": balance, "eplb_rel_error": worst.item()}
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
        print(f"config T={tokens}/rank d={d} n={n} E={num_experts} K={top_k}, EP={world}, "
              f"{name}, Zipf({args.zipf:g}) routing, transport {args.transports[0]}, C=1, "
              f"{args.reps} reps (median per rank, slowest rank)")
        print(f"EPLB vs one process on the whole batch: max rel. error {worst.item():.2e} "
              f"(out, dX; tol {args.tol:g})")
        print(f"{'':24s} {'max/mean rank load':>19s} {'fwd ms':>9s} {'step ms':>9s} "
              f"{'step vs balanced':>17s}")
        for key in ("balanced", "zipf contiguous", "zipf EPLB", "1gpu zipf"):
            load_text = f"{balance[key]:19.3f}" if key in balance else f"{'':19s}"
            print(f"{key:24s} {load_text} {ms[key]['fwd']:9.3f} {ms[key]['step']:9.3f} "
                  f"{ms[key]['step'] / ms['balanced']['step']:17.3f}")
        print(json.dumps(summary))
    summary["ok"] = worst.item() <= args.tol
    return summary


def _summarise(per_rank: list[dict], args, world: int) -> dict:
    """The slowest rank's median of every measurement, and the derived ratios."""
    names = per_rank[0]["ms"].keys()
    ms = {k: {p: max(r["ms"][k][p] for r in per_rank) for p in ("fwd", "step")} for k in names}
    result = {"config": args.config, "ep": world, "ms": ms,
              "peak_MiB": {k: max(r["peak_MiB"][k] for r in per_rank)
                           for k in per_rank[0]["peak_MiB"]},
              "ms_1gpu_per_rank": [r["ms"]["1gpu"]["step"] for r in per_rank],
              "a2a_busbw_GBps": {}, "efficiency": {}, "exposed_ms": {}, "hidden": {},
              "max_rel_error": max(max(e.values()) for r in per_rank
                                   for e in r["errors"].values())}
    for t in args.transports:
        a2a = "a2a" + _TRANSPORT_SUFFIX[t]
        result["a2a_busbw_GBps"][a2a] = {}
        for p in ("fwd", "step"):
            sent = max(r["sent_bytes"][p] for r in per_rank)
            result["a2a_busbw_GBps"][a2a][p] = sent * (world - 1) / world / (ms[a2a][p] * 1e-3) \
                / 1e9
    for name in (k[3:] for k in names if k.startswith("ep ")):
        a2a = "a2a" + (" ce" if name.endswith(" ce") else "")
        for p in ("fwd", "step"):
            key = f"{name} {p}"
            exposed = ms[f"ep {name}"][p] - ms[f"compute {name}"][p]
            result["efficiency"][key] = ms["1gpu"][p] / ms[f"ep {name}"][p]
            result["exposed_ms"][key] = exposed
            result["hidden"][key] = 1 - exposed / ms[a2a][p]
    result["phases_rank0"] = per_rank[0]["phases"]
    result["breakdown_per_rank"] = [r["breakdown"] for r in per_rank]
    return result


def _print(s: dict, args, device, world: int, worst: float) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    tokens, d, n, num_experts, top_k = args.config.split(",")
    print(f"config T={tokens}/rank d={d} n={n} E={num_experts} K={top_k}, EP={world}, {name}, "
          f"{args.reps} reps (median per rank, slowest rank), precision {args.precision}, "
          f"activation cache {args.activation_cache}")
    print(f"max rel. error vs one process on the whole batch: {worst:.2e} (tol {args.tol:g})")
    ms = s["ms"]
    print(f"{'':30s} {'fwd ms':>9s} {'step ms':>9s}")
    print(f"{'1 GPU (same T/GPU)':30s} {ms['1gpu']['fwd']:9.3f} {ms['1gpu']['step']:9.3f}   "
          f"per rank: " + ", ".join(f"{t:.3f}" for t in s["ms_1gpu_per_rank"]))
    for a2a, bw in s["a2a_busbw_GBps"].items():
        print(f"{a2a + ' alone':30s} {ms[a2a]['fwd']:9.3f} {ms[a2a]['step']:9.3f}   bus bw "
              f"{bw['fwd']:.0f} / {bw['step']:.0f} GB/s")
    print(f"{'':30s} {'ms':>9s} {'compute-only':>13s} {'exposed':>8s} {'hidden':>7s} "
          f"{'efficiency':>11s} {'peak MiB':>9s}")
    for name in (k[3:] for k in ms if k.startswith("ep ")):
        for p in ("fwd", "step"):
            key = f"{name} {p}"
            peak = f"{s['peak_MiB'][name]:9.1f}" if p == "step" else ""
            print(f"{f'EP={world} {key}':30s} {ms[f'ep {name}'][p]:9.3f} "
                  f"{ms[f'compute {name}'][p]:13.3f} {s['exposed_ms'][key]:8.3f} "
                  f"{s['hidden'][key]:7.1%} {s['efficiency'][key]:11.1%} {peak}")
    print("exposed = ep - compute-only (no data moved); hidden = 1 - exposed / a2a alone "
          "(of the run's transport)")
    for name, rows in s["phases_rank0"].items():
        print(f"phases of one step, rank 0, {name} (ms from the step's start, per stream):")
        for phase, stream, start, dur in rows:
            print(f"  {phase:32s} {stream:8s} {start:9.3f} {dur:9.3f}")
        totals = {}
        for phase, stream, _, dur in rows:
            totals[(phase, stream)] = totals.get((phase, stream), 0.0) + dur
        print("  summed: " + "; ".join(f"{phase} [{stream}] {t:.3f}"
                                       for (phase, stream), t in totals.items()))
    for rank, steps in enumerate(s["breakdown_per_rank"]):
        if steps:
            print(f"one step by kernel family, rank {rank} (ms; torch.profiler):")
            columns = list(next(iter(steps.values())))
            print(f"  {'':12s}" + "".join(f"{c:>15s}" for c in columns))
            for run_name, row in steps.items():
                print(f"  {run_name:12s}" + "".join(f"{row[c]:15.3f}" for c in columns))
    print(json.dumps(s))


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(MULTICAST_OFF)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device,
                                pg_options=_nccl_options(args.nccl_priority))
    try:
        summary = (run_skew if args.zipf else run)(args, device)
    finally:
        dist.destroy_process_group()
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
