"""Expert + data parallelism of `sonic.train` under ``torchrun``.

``W`` ranks (``WORLD_SIZE``) are split into ``W/ep`` EP groups of ``ep`` consecutive ranks
(``[g·ep, (g+1)·ep)``), each holding all ``E`` experts of every MoE layer (``E/ep`` per rank),
and ``ep`` data-parallel (DP) groups ``{j, j+ep, j+2·ep, …}`` of the ranks that hold the same
experts. Every rank trains on its own ``B`` windows of a global batch of ``W·B``.

Gradients (plain all-reduces after backward; no DDP, so no overlap with backward):

* replicated parameters (embeddings, attention, norms, routers): rank ``r``'s gradient is that
  of its own loss ``L_r``; summed over **all** ranks and divided by ``W`` it is the gradient of
  the global loss ``(1/W)·Σ_r L_r``.
* expert weights: the EP backward already brings every token of the EP group to the rank that
  holds its experts, so a rank's expert gradient is ``Σ_{r in its EP group} ∂L_r/∂w``; summed
  over the **DP group** (the other EP groups' copies of the same experts) and divided by ``W``
  (not by the DP size, which would scale them by ``ep``) it is the same global-loss gradient.

Gradient clipping uses the norm of the whole model: replicated gradients counted once, expert
gradients summed over the EP group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Parallel:
    """This process's place in the run: ``world`` ranks, ``ep`` ranks per EP group.

    ``ep_group``/``dp_group`` are process groups (``None`` when the run is one process).
    ``owns_process_group``: :func:`setup` initialised ``torch.distributed`` and
    :meth:`close` destroys it.
    """

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    ep: int = 1
    ep_group: object = None
    dp_group: object = None
    owns_process_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False


def world_from_env() -> tuple[int, int, int]:
    """``(WORLD_SIZE, RANK, LOCAL_RANK)`` as ``torchrun`` sets them; ``(1, 0, 0)`` without."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as err:
        raise ValueError(f"ep: cannot read WORLD_SIZE/RANK/LOCAL_RANK from the environment: "
                         f"{err}") from err
    return world, rank, local_rank


def check_ep(ep: int, world: int, num_experts: int) -> None:
    """Raises ``ValueError`` unless ``ep`` divides both the world size and ``num_experts``."""
    if world % ep:
        hint = (" (run under torchrun --nproc_per_node=N with N a multiple of --ep)"
                if world == 1 else "")
        raise ValueError(f"--ep {ep} must divide the world size {world}{hint}")
    if num_experts % ep:
        raise ValueError(f"--ep {ep} must divide --experts {num_experts} (each rank holds "
                         f"experts/ep experts of every layer)")


def resolve_device(device: torch.device, local_rank: int, world: int) -> torch.device:
    """One CUDA device per process under ``torchrun``: ``cuda:LOCAL_RANK``."""
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def setup(ep: int, num_experts: int, device: torch.device) -> tuple[Parallel, torch.device]:
    """Read the ``torchrun`` environment, check ``ep``, initialise ``torch.distributed`` (NCCL
    on CUDA, gloo on the CPU) unless it already is, and build the EP and DP groups.

    One process (no ``torchrun``) with ``ep == 1``: ``Parallel()``, nothing initialised.

    Raises:
        ValueError: ``ep`` does not divide the world size or ``num_experts``.
    """
    world, rank, local_rank = world_from_env()
    check_ep(ep, world, num_experts)
    if world == 1:
        return Parallel(), device
    device = resolve_device(device, local_rank, world)
    owns = not dist.is_initialized()
    if owns:
        timeout = datetime.timedelta(seconds=float(os.environ.get("SONIC_TRAIN_PG_TIMEOUT",
                                                                  "600")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    if dist.get_world_size() != world or dist.get_rank() != rank:
        raise ValueError("ep: torch.distributed is initialised with another world size or "
                         "rank than WORLD_SIZE/RANK say")
    ep_group = dp_group = None
    # new_group is collective over the whole world: every rank creates every group, in order.
    for g in range(world // ep):
        ranks = list(range(g * ep, (g + 1) * ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            ep_group = group
    for j in range(ep):
        ranks = list(range(j, world, ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return Parallel(world=world, rank=rank, local_rank=local_rank, ep=ep, ep_group=ep_group,
                    dp_group=dp_group, owns_process_group=owns), device


def split_parameters(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter],
                                                      list[torch.nn.Parameter]]:
    """``(replicated, sharded)``: the experts' ``w1``/``w2`` of every
    `sonic.distributed.ExpertParallelMoE` are sharded, every other parameter replicated."""
    from sonic.distributed import ExpertParallelMoE

    sharded = [p for m in model.modules() if isinstance(m, ExpertParallelMoE)
               for p in (m.w1, m.w2)]
    ids = {id(p) for p in sharded}
    return [p for p in model.parameters() if id(p) not in ids], sharded


def broadcast_replicated(model: torch.nn.Module, par: Parallel) -> None:
    """Make the replicated parameters bit-identical on all ranks (rank 0's). Every rank seeds
    alike, so they already are; this guards against a nondeterministic initialisation."""
    if not par.distributed:
        return
    replicated, _ = split_parameters(model)
    with torch.no_grad():
        for p in replicated:
            dist.broadcast(p.data, src=0)


def _all_reduce_sum(tensors: list[torch.Tensor], group) -> None:
    """In-place sum over ``group`` of ``tensors`` (same shapes and dtype on every rank), as one
    flat buffer per dtype: one collective instead of one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def reduce_gradients(model: torch.nn.Module, par: Parallel) -> None:
    """Turn every rank's gradients of its own loss into the gradient of the mean loss over all
    ranks: replicated ones summed over the world, expert ones over the DP group, all divided by
    the world size (see the module docstring). Collective over the world."""
    if not par.distributed:
        return
    replicated, sharded = (_gradients(params) for params in split_parameters(model))
    _all_reduce_sum(replicated, None)
    if sharded and par.world // par.ep > 1:
        _all_reduce_sum(sharded, par.dp_group)
    for g in replicated + sharded:
        g.div_(par.world)


def _gradients(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient; a missing one is made a zero one, so that every rank's
    all-reduce buffers line up."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def clip_grad_norm(model: torch.nn.Module, max_norm: float, par: Parallel) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients (after
    :func:`reduce_gradients`): each replicated gradient counted once, the expert gradients of
    all ranks of the EP group. Returns the total norm."""
    if not par.distributed:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    replicated, sharded = (_gradients(params) for params in split_parameters(model))
    squares = torch.zeros((), dtype=torch.float32, device=replicated[0].device)
    experts = torch.zeros_like(squares)
    for g in replicated:
        squares += g.float().pow(2).sum()
    for g in sharded:
        experts += g.float().pow(2).sum()
    if sharded and par.ep > 1:
        dist.all_reduce(experts, group=par.ep_group)
    total = (squares + experts).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in replicated + sharded:
        g.mul_(coef.to(g.dtype))
    return total


def mean_over_world(values: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Mean of ``values`` (a detached float tensor) over all ranks; collective."""
    if not par.distributed:
        return values
    values = values.detach().float().clone()
    dist.all_reduce(values)
    return values / par.world
