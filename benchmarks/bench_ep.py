"""Expert parallelism on GPUs (NCCL): EP over all ranks against one GPU on the same batch.

    torchrun --nproc_per_node=2 benchmarks/bench_ep.py
    torchrun --nproc_per_node=2 benchmarks/bench_ep.py --config 8192,2048,1024,64,8 --steps 20

``--config T,d,n,E,K``: ``T`` tokens *per rank*. Every rank builds the same single-process
:class:`sonic.MoE` (all ``E`` experts) and the same ``(ep·T, d)`` batch from one seed, takes
its share with :meth:`sonic.distributed.ExpertParallelMoE.from_moe`, and

1. checks: one forward + backward of the EP layer on its ``T`` tokens against the single-GPU
   layer on the whole batch (each rank computes it): relative error of the output, dX, the
   router gradient (all-reduced over ranks) and its dW1/dW2 slices. bf16 on both sides, so
   errors of about 1e-3 to 1e-2 are expected (DESIGN §5); above ``--tol`` it exits 1.
2. times: ``--steps`` forward + backward steps of the EP layer (every rank the same count —
   the steps run collectives, so adaptive repetition counts could deadlock), and as many of
   the single-GPU layer on the whole ``ep·T`` batch on each rank; medians of CUDA events.

Rank 0 prints one line per measurement. Importable without a GPU (nothing runs on import).
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import sonic
from sonic.distributed import ExpertParallelMoE


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _time_steps(step, steps: int) -> float:
    """Median ms of ``step()`` over ``steps`` runs after 3 warm-up runs."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="4096,2048,1024,64,8",
                        help="T (per rank),d,n,E,K (default %(default)s)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tol", type=float, default=2e-2)
    args = parser.parse_args()
    tokens, d, n, experts, top_k = (int(v) for v in args.config.split(","))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device, dtype = torch.device("cuda", local_rank), torch.bfloat16

    torch.manual_seed(0)
    full = sonic.MoE(d, n, experts, top_k, device=device, dtype=dtype)
    layer = ExpertParallelMoE.from_moe(full)
    g = torch.Generator(device).manual_seed(1)
    x_full = torch.randn(world * tokens, d, device=device, dtype=dtype, generator=g)
    dout_full = torch.randn(world * tokens, d, device=device, dtype=dtype, generator=g)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x, dout = x_full[mine].clone().requires_grad_(), dout_full[mine]

    out = layer(x)
    out.backward(dout)
    x_ref = x_full.clone().requires_grad_()
    out_ref = full(x_ref)
    out_ref.backward(dout_full)
    gate_grad = layer.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    local = slice(rank * layer.num_local_experts, (rank + 1) * layer.num_local_experts)
    errors = {
        "out": _rel(out.detach(), out_ref.detach()[mine]),
        "dx": _rel(x.grad, x_ref.grad[mine]),
        "dgate": _rel(gate_grad, full.gate.weight.grad),
        "dw1": _rel(layer.w1.grad, full.w1.grad[local]),
        "dw2": _rel(layer.w2.grad, full.w2.grad[local]),
    }
    worst = torch.tensor(max(errors.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)

    def ep_step():
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(dout)

    def single_step():
        for p in full.parameters():
            p.grad = None
        full(x_full).backward(dout_full)

    ep_ms = _time_steps(ep_step, args.steps)
    single_ms = _time_steps(single_step, args.steps)
    if rank == 0:
        print(f"config T={tokens}/rank d={d} n={n} E={experts} K={top_k} bf16, EP={world}, "
              f"{torch.cuda.get_device_name(device)}")
        print("rank 0 rel. errors vs single GPU: "
              + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
              + f"; worst over ranks {worst.item():.2e} (tol {args.tol:g})")
        print(f"step (fwd+bwd) on {world * tokens} tokens: EP={world} {ep_ms:.3f} ms, "
              f"1 GPU {single_ms:.3f} ms, speed-up {single_ms / ep_ms:.2f}x")
    dist.destroy_process_group()
    return 0 if worst.item() <= args.tol else 1


if __name__ == "__main__":
    raise SystemExit(main())
