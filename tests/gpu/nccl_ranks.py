"""Helpers of the multi-GPU tests: spawn NCCL ranks (NVLink multicast off) and run one EP
layer step."""

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def spawn(target, world: int, tmp_path) -> None:
    """Run ``target(rank, world, port, tmp)`` on ``world`` spawned processes, one GPU each,
    ``port`` a free local port for :func:`init_rank`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(target, args=(world, port, str(tmp_path)), nprocs=world,
                       start_method="spawn")


def init_rank(rank: int, world: int, port: int) -> torch.device:
    """This rank's CUDA device, with the default process group (NCCL) initialised on it."""
    os.environ.update(MULTICAST_OFF)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device,
                            timeout=datetime.timedelta(seconds=120))
    return device


def step(layer, x, dout) -> list:
    """One forward and backward of ``layer`` on a copy of ``x``: the output, dX, and the
    gradients of the gate, ``w1`` and ``w2``."""
    for p in layer.parameters():
        p.grad = None
    xg = x.clone().requires_grad_()
    out = layer(xg)
    out.backward(dout)
    return [out.detach(), xg.grad, layer.gate.weight.grad, layer.w1.grad, layer.w2.grad]
