"""Expert parallelism, weak scaling: EP over all ranks against one GPU with the same tokens per
GPU, and how much of the all-to-all time the chunked pipeline hides.

    torchrun --nproc_per_node=2 benchmarks/bench_ep.py                  # 30B per GPU
    torchrun --nproc_per_node=2 benchmarks/bench_ep.py --config 8192,2048,1024,64,8 --chunks 1,2
    torchrun --nproc_per_node=2 benchmarks/bench_ep.py --smoke          # CPU, gloo, tiny

``--config T,d,n,E,K`` (default the 30B layer, ANCHORS.md): ``T`` tokens *per rank*, ``E``
experts over all ranks. Every rank builds the same single-process :class:`sonic.MoE` (all
``E`` experts) and the same ``(ep·T, d)`` batch from one seed, takes its share with
:meth:`ExpertParallelMoE.from_moe`, and in ONE run:

0. checks, for every chunk count: one forward + backward of the EP layer on its ``T`` tokens
   against the single-process layer on the whole batch (relative error of the output, dX, the
   router gradient summed over ranks, its dW1/dW2 slices; bf16, so 1e-3..1e-2 is expected);
   above ``--tol`` it exits 1.
1. ``1gpu``: the single-process layer (all ``E`` experts) on this rank's ``T`` tokens — the
   same tokens per GPU — timed on every rank at once, independently.
2. ``ep C=c``: the EP layer with ``num_chunks=c`` for each ``--chunks`` value.
3. ``compute-only C=c``: the same EP step with every data all-to-all (rows, scores, their
   gradients) replaced by a local copy of the same size; the count and pair-index exchanges of
   the plan stay real. ``exposed = t_ep − t_compute_only`` is the communication left on the
   critical path.
4. ``a2a alone``: the data all-to-alls of one unchunked step (the sizes recorded from a real
   step: rows and scores out, partial outputs back; in backward dO rows out, dX rows and score
   gradients back), back to back, no compute; bus bandwidth = bytes sent per rank ×
   (ep−1)/ep / time (nccl-tests' all-to-all convention).

Derived: weak-scaling efficiency ``t_1gpu / t_ep`` and hidden fraction
``1 − exposed / t_a2a_alone``, for the forward and for the step (forward + backward).

Timing: a step is one forward + backward with a fixed random dO, all gradients set to None
before it; before every repetition the L2 is flushed and the ranks meet at a barrier; then
CUDA events around the step. Every rank runs the same number of repetitions (collectives:
adaptive counts could deadlock); the printed time is the median per rank, the slowest rank's.

NCCL: NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``, set here before the process group starts). NCCL's stream is
created high-priority (``--nccl-priority high``, the default) so that its kernels get SMs as
soon as the expert kernels free them.

Rank 0 prints a table and one JSON line. Importable without a GPU (nothing runs on import);
``--smoke`` runs it on CPU ranks (gloo) at tiny sizes.
"""

import argparse
import contextlib
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
from sonic.distributed import ExpertParallelMoE, experts, overlap  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
THIRTY_B = "32768,4096,1024,128,8"
SMOKE = "24,16,8,8,2"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None,
                        help=f"T (per rank),d,n,E,K (default {THIRTY_B}; --smoke: {SMOKE})")
    parser.add_argument("--chunks", default="1,2,4", help="num_chunks values (default %(default)s)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per measurement (default 20; --smoke: 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed repetitions first (default 3; --smoke: 1)")
    parser.add_argument("--tol", type=float, default=2e-2)
    parser.add_argument("--nccl-priority", choices=("high", "normal"), default="high")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU ranks over gloo, tiny sizes, fp32: checks that it runs")
    args = parser.parse_args(argv)
    args.config = args.config or (SMOKE if args.smoke else THIRTY_B)
    args.reps = args.reps or (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.chunks = [int(c) for c in args.chunks.split(",")]
    return args


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class _Timer:
    """Median milliseconds of a callable, the same repetitions on every rank (module
    docstring)."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.cuda = device.type == "cuda"
        self.reps, self.warmup = reps, warmup
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None

    def __call__(self, fn, params) -> float:
        for _ in range(self.warmup):
            _drop_grads(params)
            fn()
        times = []
        for _ in range(self.reps):
            _drop_grads(params)
            if self.cuda:
                self.flush.zero_()
                torch.cuda.synchronize()
            dist.barrier()
            if self.cuda:
                torch.cuda.synchronize()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
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
def _local_copies(record: list | None = None):
    """Inside: every all-to-all of floating-point data (rows, scores, their gradients) is a
    local copy of the same size, the integer ones of the plan stay real; with ``record``, the
    real calls go through and each data call's (bytes sent, send buffer, receive buffer,
    splits) is appended instead."""
    real = experts.all_to_all

    def substitute(x, out_splits, in_splits, group, out=None):
        if not x.is_floating_point():
            return real(x, out_splits, in_splits, group, out)
        if record is not None:
            out = real(x, out_splits, in_splits, group, out)
            record.append((x.numel() * x.element_size(), x.detach().clone(), out.detach().clone(),
                           list(out_splits), list(in_splits)))
            return out
        rows = sum(out_splits)
        if out is None:
            out = x.new_empty((rows,) + tuple(x.shape[1:]))
        m = min(rows, x.shape[0])
        out[:m].copy_(x[:m])
        out[m:].zero_()
        return out

    experts.all_to_all = overlap.all_to_all = substitute
    try:
        yield
    finally:
        experts.all_to_all = overlap.all_to_all = real


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


def run(args: argparse.Namespace, device: torch.device) -> dict:
    """The benchmark on an initialised process group; every rank returns its own numbers
    and rank 0 prints the table and the JSON line."""
    tokens, d, n, num_experts, top_k = (int(v) for v in args.config.split(","))
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "auto" if device.type == "cuda" else "torch"

    torch.manual_seed(0)
    full = sonic.MoE(d, n, num_experts, top_k, backend=backend, device=device, dtype=dtype)
    layer = ExpertParallelMoE.from_moe(full)
    g = torch.Generator(device).manual_seed(1)
    x_full = torch.randn(world * tokens, d, device=device, dtype=dtype, generator=g)
    dout_full = torch.randn(world * tokens, d, device=device, dtype=dtype, generator=g)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x = x_full[mine].clone().requires_grad_()
    dout = dout_full[mine].clone()

    errors = {}
    for c in args.chunks:
        layer.num_chunks = c
        errors[c] = _check(layer, full, x, dout, x_full, dout_full, mine, rank)
    worst = torch.tensor(max(max(e.values()) for e in errors.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)

    timer = _Timer(device, args.reps, args.warmup)
    single_params = [*full.parameters(), x]
    ep_params = [*layer.parameters(), x]
    ms = {"1gpu": {"fwd": timer(lambda: full(x), single_params),
                   "step": timer(lambda: full(x).backward(dout), single_params)}}
    for c in args.chunks:
        layer.num_chunks = c
        ms[f"ep{c}"] = {"fwd": timer(lambda: layer(x), ep_params),
                        "step": timer(lambda: layer(x).backward(dout), ep_params)}
        with _local_copies():
            ms[f"compute{c}"] = {"fwd": timer(lambda: layer(x), ep_params),
                                 "step": timer(lambda: layer(x).backward(dout), ep_params)}

    # The data all-to-alls of one unchunked step, replayed back to back.
    layer.num_chunks = 1
    calls = {"fwd": [], "bwd": []}
    with _local_copies(calls["fwd"]):
        out = layer(x)
    with _local_copies(calls["bwd"]):
        out.backward(dout)
    del out

    def replay(phases):
        for phase in phases:
            for _, send, recv, out_splits, in_splits in calls[phase]:
                dist.all_to_all_single(recv, send, out_splits, in_splits)

    ms["a2a"] = {"fwd": timer(lambda: replay(["fwd"]), []),
                 "step": timer(lambda: replay(["fwd", "bwd"]), [])}
    sent = {"fwd": sum(c[0] for c in calls["fwd"])}
    sent["step"] = sent["fwd"] + sum(c[0] for c in calls["bwd"])

    mine_result = {"ms": ms, "sent_bytes": sent, "errors": errors}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine_result)
    summary = _summarise(gathered, args, world)
    if rank == 0:
        _print(summary, args, device, world, worst.item())
    summary["ok"] = worst.item() <= args.tol
    return summary


def _summarise(per_rank: list[dict], args, world: int) -> dict:
    """The slowest rank's median of every measurement, and the derived ratios."""
    names = per_rank[0]["ms"].keys()
    ms = {k: {p: max(r["ms"][k][p] for r in per_rank) for p in ("fwd", "step")} for k in names}
    result = {"config": args.config, "ep": world, "ms": ms,
              "ms_1gpu_per_rank": [r["ms"]["1gpu"]["step"] for r in per_rank],
              "a2a_busbw_GBps": {}, "efficiency": {}, "exposed_ms": {}, "hidden": {},
              "max_rel_error": max(max(e.values()) for r in per_rank
                                   for e in r["errors"].values())}
    for p in ("fwd", "step"):
        sent = max(r["sent_bytes"][p] for r in per_rank)
        result["a2a_busbw_GBps"][p] = sent * (world - 1) / world / (ms["a2a"][p] * 1e-3) / 1e9
    for c in args.chunks:
        for p in ("fwd", "step"):
            key = f"C={c} {p}"
            exposed = ms[f"ep{c}"][p] - ms[f"compute{c}"][p]
            result["efficiency"][key] = ms["1gpu"][p] / ms[f"ep{c}"][p]
            result["exposed_ms"][key] = exposed
            result["hidden"][key] = 1 - exposed / ms["a2a"][p]
    return result


def _print(s: dict, args, device, world: int, worst: float) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    tokens, d, n, num_experts, top_k = args.config.split(",")
    print(f"config T={tokens}/rank d={d} n={n} E={num_experts} K={top_k}, EP={world}, {name}, "
          f"{args.reps} reps (median per rank, slowest rank)")
    print(f"max rel. error vs one process on the whole batch: {worst:.2e} (tol {args.tol:g})")
    ms = s["ms"]
    print(f"{'':22s} {'fwd ms':>9s} {'step ms':>9s}")
    print(f"{'1 GPU (same T/GPU)':22s} {ms['1gpu']['fwd']:9.3f} {ms['1gpu']['step']:9.3f}   "
          f"per rank: " + ", ".join(f"{t:.3f}" for t in s["ms_1gpu_per_rank"]))
    print(f"{'a2a alone':22s} {ms['a2a']['fwd']:9.3f} {ms['a2a']['step']:9.3f}   bus bw "
          f"{s['a2a_busbw_GBps']['fwd']:.0f} / {s['a2a_busbw_GBps']['step']:.0f} GB/s")
    print(f"{'':22s} {'ms':>9s} {'compute-only':>13s} {'exposed':>8s} {'hidden':>7s} "
          f"{'efficiency':>11s}")
    for c in args.chunks:
        for p in ("fwd", "step"):
            key = f"C={c} {p}"
            print(f"{f'EP={world} C={c} {p}':22s} {ms[f'ep{c}'][p]:9.3f} "
                  f"{ms[f'compute{c}'][p]:13.3f} {s['exposed_ms'][key]:8.3f} "
                  f"{s['hidden'][key]:7.1%} {s['efficiency'][key]:11.1%}")
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
        options = dist.ProcessGroupNCCL.Options(
            is_high_priority_stream=args.nccl_priority == "high")
        dist.init_process_group("nccl", device_id=device, pg_options=options)
    try:
        summary = run(args, device)
    finally:
        dist.destroy_process_group()
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
