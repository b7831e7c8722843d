"""Process-group checks and the all-to-all primitive of expert parallelism.

Everything goes through ``torch.distributed`` (gloo on CPU, NCCL on GPU), except the data
all-to-alls of a layer that chose the copy-engine transport inside one node
(:mod:`sonic.distributed.peer`). A collective that a peer never joins waits until the process
group's timeout (``init_process_group(..., timeout=...)``) and then raises: gloo raises
``RuntimeError``, NCCL's watchdog aborts the communicator. That timeout bounds every wait in
this package.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Dtypes as small ints, for the configuration checks that travel in int64 tensors.
DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_group(group) -> tuple[int, int]:
    """``(ep_size, ep_rank)`` of ``group`` (``None``: the default group).

    Raises:
        RuntimeError: ``torch.distributed`` unavailable or not initialised.
        ValueError: this process is not a member of ``group``.
    """
    if not dist.is_available():
        raise RuntimeError("group: torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return dist.get_world_size(group), rank


def comm_device(group, fallback: torch.device) -> torch.device:
    """Where a small control tensor must live to travel over ``group``: NCCL moves CUDA
    tensors only, gloo any."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
               out: torch.Tensor | None = None, *, index: torch.Tensor | None = None,
               transport=None) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:j]) : ...]`` go to group rank ``j``; returns the
    ``sum(out_splits)`` rows received, grouped by source rank (``out_splits[j]`` from rank j),
    in ``out`` when given (contiguous, e.g. a row block of a larger buffer). ``index``: send
    the rows ``x[index]`` instead (the copy-engine transport gathers them straight into its
    send buffer). ``transport``: a :class:`~sonic.distributed.peer.PeerTransport` to move the
    rows with, or ``None`` for ``torch.distributed``.

    On NCCL it is queued behind the work of the current CUDA stream and that stream waits for
    it (``all_to_all_single``'s work is waited on the stream, not on the host), so under
    ``torch.cuda.stream(s)`` it overlaps with the kernels of other streams. On gloo the host
    waits. Not differentiable by itself: the autograd functions around it send gradients back.
    """
    if transport is not None:
        return transport.all_to_all(x, out_splits, in_splits, out, index)
    if index is not None:
        x = x.index_select(0, index)
    if out is None:
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out
