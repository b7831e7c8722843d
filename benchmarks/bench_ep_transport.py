"""Expert parallelism's data all-to-all, per transport: bandwidth alone, and whether it moves
while sonic's persistent grouped GEMMs hold the SMs.

    torchrun --nproc_per_node=2 benchmarks/bench_ep_transport.py
    torchrun --nproc_per_node=4 benchmarks/bench_ep_transport.py --rows 8192,32768 --d 7168

Transports (``--transports``, all timed in one run on the same buffers):

* ``nccl``: ``torch.distributed.all_to_all_single`` (NCCL kernels);
* ``copy_engine``: :class:`sonic.distributed.peer.PeerTransport` — peer memory, stream
  memory-op flags, copies batched with the hint to run on a copy engine;
* ``copy_engine/copy_``: the same transport with its copies made by ``Tensor.copy_`` (a
  plain ``cudaMemcpyAsync``), the A/B of the hint.

For each ``--rows`` value ``m`` every rank sends ``m`` rows of ``d`` bf16 to every rank:

1. ``alone``: median ms of one all-to-all; bus bandwidth = bytes sent per rank × (ep−1)/ep /
   time (nccl-tests' all-to-all convention).
2. ``under GEMM``: the expert forward of one GPU (:func:`sonic.moe_experts` of ``--gemm``'s
   layer: persistent grouped GEMMs) starts on the compute stream, the all-to-all on a second
   stream ~0.5 ms later (both queued in full before the device starts them); the times from
   the GEMMs' start at which each ends. An all-to-all that needs
   SMs ends only with the GEMMs (``a2a end`` ≈ ``gemm end``); one that does not ends after about
   its time alone. ``gemm alone``: the forward by itself (the slowdown it takes from sharing
   memory bandwidth with the copies).

Rank 0 prints a table and one JSON line. Needs CUDA GPUs of one host; importable without.
"""

import argparse
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sonic  # noqa: E402
from sonic.distributed import comm  # noqa: E402
from sonic.distributed.peer import peer_transport  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
TRANSPORTS = ("nccl", "copy_engine", "copy_engine/copy_")
# GPU clock cycles (about 2 GHz): the sleep that holds the device while the host queues a
# measurement (~25 ms), and the all-to-all's start after the GEMMs' (~0.5 ms).
HOLD_CYCLES, LEAD_CYCLES = 50_000_000, 1_000_000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4096,16384,32768",
                        help="rows each rank sends each rank (default %(default)s)")
    parser.add_argument("--d", type=int, default=4096, help="row width, bf16 (default 4096)")
    parser.add_argument("--gemm", default="32768,4096,1024,128,8",
                        help="T,d,n,E,K of the one-GPU expert forward run beside the "
                             "all-to-all (default the 30B layer)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.transports = args.transports.split(",")
    if not set(args.transports) <= set(TRANSPORTS):
        parser.error(f"--transports: a comma-separated list of {', '.join(TRANSPORTS)}")
    return args


def _experts_forward(config: str, device: torch.device):
    """A callable running sonic's expert forward of one GPU for ``T,d,n,E,K``."""
    tokens, d, n, num_experts, top_k = (int(v) for v in config.split(","))
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(num_experts, 2 * n, d, device=device, dtype=torch.bfloat16,
                     generator=g) / d ** 0.5
    w2 = torch.randn(num_experts, d, n, device=device, dtype=torch.bfloat16,
                     generator=g) / n ** 0.5
    routing = sonic.topk_routing(torch.randn(tokens, num_experts, device=device, generator=g),
                                 top_k)
    return lambda: sonic.moe_experts(x, w1, w2, routing.scores, routing.token_idx,
                                     routing.expert_idx)


def _mover(name: str, device: torch.device):
    """The transport object of ``name`` (``None``: torch.distributed); both copy-engine
    variants share one, whose copy method is switched before each is timed."""
    return None if name == "nccl" else peer_transport(None, device)


def run(args: argparse.Namespace, device: torch.device) -> dict:
    world = dist.get_world_size()
    gemm = _experts_forward(args.gemm, device)
    compute = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    movers = {name: _mover(name, device) for name in args.transports}
    for mover in movers.values():
        if mover is not None:
            mover.reserve(max(args.rows) * args.d * 2)

    def timed(fn, reps=args.reps):
        """Median ms from a start event on the compute stream to each event ``fn`` returns."""
        fn()
        samples = []
        for _ in range(reps):
            torch.cuda.synchronize(device)
            dist.barrier()
            start = torch.cuda.Event(enable_timing=True)
            start.record(compute)
            ends = fn()
            torch.cuda.synchronize(device)
            samples.append([start.elapsed_time(e) for e in ends])
        return [statistics.median(column) for column in zip(*samples)]

    def event(stream):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    (gemm_alone,) = timed(lambda: (gemm(), event(compute))[1:])
    (hold,) = timed(lambda: (torch.cuda._sleep(HOLD_CYCLES), event(compute))[1:])
    rows = {}
    for m in args.rows:
        x = torch.randn(world * m, args.d, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        splits = [m] * world
        sent = x.numel() * x.element_size()
        for name, mover in movers.items():
            if mover is not None:
                mover.prefer_copy_engine = name == "copy_engine"

            def a2a():
                comm.all_to_all(x, splits, splits, None, out=out, transport=mover)
                return [event(compute)]

            def both():
                # Everything is queued behind a one-thread sleep before the device starts, so
                # the timings are the device's, not the host's launch order: the GEMMs start
                # when the sleep ends, the all-to-all LEAD_MS later.
                torch.cuda._sleep(HOLD_CYCLES)
                begin = start_of(compute)
                side.wait_event(begin)
                with torch.cuda.stream(side):
                    torch.cuda._sleep(LEAD_CYCLES)
                    comm.all_to_all(x, splits, splits, None, out=out, transport=mover)
                gemm()
                return [event(side), event(compute)]

            (alone,) = timed(a2a)
            a2a_end, gemm_end = (t - hold for t in timed(both))
            rows[f"{name} m={m}"] = {
                "alone_ms": alone, "busbw_GBps": sent * (world - 1) / world / alone / 1e6,
                "a2a_end_ms": a2a_end, "gemm_end_ms": gemm_end}
    hinted = any(m is not None and m._copy_attributes is not None for m in movers.values())
    return {"gemm_alone_ms": gemm_alone, "runs": rows, "copy_engine_hint": hinted}


def start_of(stream):
    """An event at ``stream``'s current end: the side stream starts its all-to-all where the
    compute stream stands, so both begin together."""
    e = torch.cuda.Event()
    e.record(stream)
    return e


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(MULTICAST_OFF)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=300))
    try:
        result = run(args, device)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
    finally:
        dist.destroy_process_group()
    if local_rank == 0:
        worst = {k: {f: max(r["runs"][k][f] for r in gathered) for f in gathered[0]["runs"][k]}
                 for k in gathered[0]["runs"]}
        gemm_alone = max(r["gemm_alone_ms"] for r in gathered)
        print(f"{torch.cuda.get_device_name(device)}, EP={len(gathered)}, rows of d={args.d} "
              f"bf16, expert forward {args.gemm}: {gemm_alone:.3f} ms alone "
              f"(slowest rank's medians); copy-engine hint taken: "
              f"{all(r['copy_engine_hint'] for r in gathered)}")
        print(f"{'transport, rows per rank pair':34s} {'alone ms':>9s} {'bus GB/s':>9s} "
              f"{'| under GEMM: a2a end':>21s} {'gemm end':>9s}")
        for k, r in worst.items():
            print(f"{k:34s} {r['alone_ms']:9.3f} {r['busbw_GBps']:9.0f} "
                  f"{r['a2a_end_ms']:21.3f} {r['gemm_end_ms']:9.3f}")
        print(json.dumps({"gemm_alone_ms": gemm_alone, "runs": worst}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
