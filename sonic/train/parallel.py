"""Expert + data parallelism of `sonic.train` under ``torchrun``.

``W`` ranks (``WORLD_SIZE``) form a `torch.distributed.device_mesh.DeviceMesh` of shape
``(W/ep, ep)`` with dimensions ``("dp", "ep")``: row ``g``, the ranks ``[g·ep, (g+1)·ep)``, is an
EP group holding all ``E`` experts of every MoE layer (``E/ep`` per rank); column ``j``, the
ranks ``{j, j+ep, j+2·ep, …}``, the DP group of the ranks that hold the same experts. A
dimension of size 1 is left out: the mesh is ``("ep",)`` when ``ep = W`` and ``("dp",)`` when
``ep = 1``. Every rank trains on its own ``B`` windows of a global batch of ``W·B``; its loss
``L_r`` is the mean over its windows, the run's loss ``(1/W)·Σ_r L_r``.

Gradients go through `torch.nn.parallel.DistributedDataParallel` (:func:`data_parallel`):

* replicated parameters (embeddings, attention, norms, routers): one DDP over all ``W`` ranks
  averages every rank's ``∂L_r/∂θ`` into the gradient of the run's loss. The experts are
  excluded from it: their copies along ``"ep"`` are different experts.
* expert weights: the EP backward already brings every token of the EP group to the rank that
  holds its experts, so a rank's expert gradient is ``Σ_{r in its EP group} ∂L_r/∂w``. A
  gradient hook divides it by ``ep`` (the gradient of the EP group's mean loss), and a second
  DDP, over the ``"dp"`` dimension, averages that over the EP groups: ``(1/W)·Σ_r ∂L_r/∂w``,
  the same global-loss gradient. With one EP group (``ep = W``) there is no ``"dp"`` and the
  hook alone gives it.

Why DDP and not FSDP2's ``fully_shard`` (which also runs on gloo): the replicated parameters are
the small part of the model (the experts, the large one, are already split by EP), and
sharding them would make every parameter and optimizer moment a DTensor shard, changing what
``model.state_dict()`` and the per-rank checkpoints hold, for parameter all-gathers in every
forward and backward; DDP keeps plain tensors, so checkpoints are those of one process, and
its bucketed all-reduces overlap backward.

Gradient clipping (:func:`clip_grad_norm`) uses the norm of the whole model: replicated
gradients counted once, expert gradients summed over the EP group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel


@dataclass
class Parallel:
    """This process's place in the run: ``world`` ranks, ``ep`` ranks per EP group, laid out
    on ``mesh`` (``None`` when the run is one process; see the module docstring).
    ``owns_process_group``: :func:`setup` initialised ``torch.distributed`` and :meth:`close`
    destroys it.
    """

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    ep: int = 1
    mesh: DeviceMesh | None = None
    owns_process_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's EP group (the mesh's ``"ep"`` dimension);
        ``None`` without expert parallelism."""
        return self._group("ep")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of the ranks holding this rank's experts (the mesh's ``"dp"``
        dimension); ``None`` with one EP group or one process."""
        return self._group("dp")

    def _group(self, name: str) -> dist.ProcessGroup | None:
        if self.mesh is None or name not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh.get_group(name)

    def close(self, *, together: bool = False) -> None:
        """Destroy the process group if :func:`setup` initialised it. ``together``: meet the
        other ranks at a barrier first, so that no rank tears its connections down while a
        peer still uses them (gloo aborts a process caught so); only where every rank gets
        there, as at the end of a run that succeeded."""
        if self.owns_process_group and dist.is_initialized():
            if together:
                dist.barrier()
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
    on CUDA, gloo on the CPU) unless it already is, and build the device mesh (collective).

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
    dims = [(name, size) for name, size in (("dp", world // ep), ("ep", ep)) if size > 1]
    mesh = init_device_mesh(device.type, tuple(size for _, size in dims),
                            mesh_dim_names=tuple(name for name, _ in dims))
    return Parallel(world=world, rank=rank, local_rank=local_rank, ep=ep, mesh=mesh,
                    owns_process_group=owns), device


def split_parameters(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter],
                                                      list[torch.nn.Parameter]]:
    """``(replicated, sharded)``: the experts' ``w1``/``w2`` of every
    `sonic.distributed.ExpertParallelMoE` are sharded, every other parameter replicated."""
    from sonic.distributed import ExpertParallelMoE

    sharded = [p for m in model.modules() if isinstance(m, ExpertParallelMoE)
               for p in (m.w1, m.w2)]
    ids = {id(p) for p in sharded}
    return [p for p in model.parameters() if id(p) not in ids], sharded


def data_parallel(model: torch.nn.Module, par: Parallel) -> torch.nn.Module:
    """The module to run ``model``'s training forwards through, whose backward leaves every
    rank the gradients of the run's mean loss (see the module docstring): ``model`` itself in
    one process, else `DistributedDataParallel` over all ranks for the replicated parameters,
    around a second one over the mesh's ``"dp"`` dimension for the experts when there are
    several EP groups. ``model`` keeps its parameters and its ``state_dict`` keys; use it for
    evaluation and checkpoints.

    Collective over the world: the wrappers make the replicated parameters rank 0's, and each
    expert those of its first DP rank (every rank seeds alike, so they already are; this
    guards against a nondeterministic initialisation). Also registers the gradient hooks
    that divide the expert gradients by ``ep``; wrap a model once.
    """
    if not par.distributed:
        return model
    replicated, experts = split_parameters(model)
    names = {id(p): name for name, p in model.named_parameters()}
    # A tensor hook, not a DDP communication hook: it also serves ep = W, where no "dp" DDP
    # runs, and being linear it stays right under gradient accumulation.
    for p in experts:
        p.register_hook(lambda grad: grad / par.ep)
    # One DDP per process group, nested: a DDP reduces only after a forward through it, so
    # the one forward must pass through both.
    inner = model
    if experts and par.dp_group is not None:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [names[id(p)] for p in replicated])
        # The "dp" sub-mesh goes in as its process group: DDP given a mesh sliced from a
        # larger one applies tensor parallelism's DTensor transform to the module.
        inner = DistributedDataParallel(model, process_group=par.dp_group)
    if experts:
        prefix = "" if inner is model else "module."
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            inner, [prefix + names[id(p)] for p in experts])
    # Over the default group, which is the whole mesh: DDP takes a 1-D mesh only, and
    # flattening ("dp", "ep") would open a second communicator over the same ranks.
    return DistributedDataParallel(inner)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, par: Parallel) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients (after the
    backward of :func:`data_parallel`'s module): each replicated gradient counted once, the
    expert gradients of all ranks of the EP group. Returns the total norm."""
    if not par.distributed:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    replicated, sharded = ([p.grad for p in params if p.grad is not None]
                           for params in split_parameters(model))
    squares = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    experts = torch.zeros_like(squares)
    for g in replicated:
        squares += g.float().pow(2).sum()
    for g in sharded:
        experts += g.float().pow(2).sum()
    if par.ep_group is not None:
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
