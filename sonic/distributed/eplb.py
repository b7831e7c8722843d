"""Expert-parallel load balancer (EPLB): load statistics, a replication/placement planner, and
the slot tables the expert-parallel dispatch uses to run with a placement.

The scheme is TensorRT-LLM wide-EP's *offline* balancer: collect per-expert load over some
steps, then choose a mapping from **slots** to experts — ``num_ranks × slots_per_rank ≥ E``
slots, the surplus holding redundant replicas of hot experts — so that every rank's expected
token count is close to the mean. A routed pair of a replicated expert goes to one of its
replicas (chosen deterministically on the device, :meth:`Placement.pair_slots`), so the
expert's load is split between them; the replicas' weight gradients are summed over the ranks
that hold them (:meth:`sonic.distributed.ExpertParallelMoE.reduce_replica_grads`).

* :class:`ExpertLoad` — per-expert routed-pair counts accumulated on the device (no host sync).
* :func:`plan_placement` — the planner: replicas for the hottest experts, then a greedy
  placement of replicas on ranks (heaviest first to the least-loaded rank).
* :class:`Placement` — the slot → expert map and its statistics (per-rank load, max/mean).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import torch

from sonic._validation import check_index, check_int
from sonic.routing.types import Routing


class ExpertLoad:
    """Per-expert routed-pair counts accumulated over steps, on the device.

    ``update`` adds the pairs of one routing with a ``scatter_add_`` into an ``(E,)`` int64
    buffer: no device→host synchronisation, so it can run every step. Read the totals with
    :meth:`counts` (optionally summed over a process group, one all-reduce) and start over with
    :meth:`reset`.

    Args:
        num_experts: ``E``.
        device: where the counts live (``None``: the device of the first update).

    Raises:
        ValueError: ``num_experts < 1``; ``update`` with a routing of another ``E``.
    """

    def __init__(self, num_experts: int, device=None):
        check_int("num_experts", num_experts, low=1)
        self.num_experts = num_experts
        self._counts = None if device is None else torch.zeros(
            num_experts + 1, dtype=torch.int64, device=device)
        self.steps = 0

    def update(self, routing) -> None:
        """Add one step's pairs: ``routing`` is a :class:`sonic.Routing` (a padded one, such as
        a token-rounding layer's ``last_routing``, counts its routed pairs only) or a ``(P,)``
        tensor of expert indices in ``[0, E)`` (added without checking, to stay free of host
        reads)."""
        if isinstance(routing, Routing):
            if routing.num_experts != self.num_experts:
                raise ValueError(f"routing has num_experts={routing.num_experts}, this "
                                 f"ExpertLoad counts {self.num_experts}")
            expert_idx = routing.expert_idx
        else:
            check_index("expert_idx", routing)
            expert_idx = routing
        if self._counts is None:
            self._counts = torch.zeros(self.num_experts + 1, dtype=torch.int64,
                                       device=expert_idx.device)
        # Bin E takes a padded routing's padding (expert E), on the device: no host read.
        idx = expert_idx.detach().to(device=self._counts.device, dtype=torch.int64)
        self._counts.scatter_add_(0, idx, torch.ones_like(idx))
        self.steps += 1

    def counts(self, group=None, *, all_reduce: bool = False) -> torch.Tensor:
        """``(E,)`` int64 pairs routed to each expert since the last reset (a copy). With
        ``all_reduce=True`` summed over ``group`` (collective: every rank of it must call)."""
        if self._counts is None:
            out = torch.zeros(self.num_experts, dtype=torch.int64)
        else:
            out = self._counts[:self.num_experts].clone()
        if all_reduce:
            import torch.distributed as dist

            from sonic.distributed.comm import check_group, comm_device
            check_group(group)
            device = comm_device(group, out.device)
            shared = out.to(device)
            dist.all_reduce(shared, group=group)
            out = shared.to(out.device)
        return out

    def reset(self) -> None:
        if self._counts is not None:
            self._counts.zero_()
        self.steps = 0


@dataclass(frozen=True, eq=False)
class Placement:
    """Which expert each slot holds; slots grouped by rank.

    Attributes:
        slot_expert: ``(num_ranks·slots_per_rank,)`` int64 (CPU) — the expert held in each
            slot; slot ``s`` is local slot ``s % slots_per_rank`` of rank
            ``s // slots_per_rank``. Every expert appears at least once.
        num_ranks: the EP group size.
        slots_per_rank: expert weights each rank holds.
        num_experts: ``E``.

    Raises:
        ValueError: a bad shape, too few slots, an expert index out of range or an expert
            without a slot.
    """

    slot_expert: torch.Tensor
    num_ranks: int
    slots_per_rank: int
    num_experts: int
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_int("num_ranks", self.num_ranks, low=1)
        check_int("slots_per_rank", self.slots_per_rank, low=1)
        check_int("num_experts", self.num_experts, low=1)
        if not isinstance(self.slot_expert, torch.Tensor):
            object.__setattr__(self, "slot_expert", torch.as_tensor(self.slot_expert))
        check_index("slot_expert", self.slot_expert)
        slots = self.num_ranks * self.slots_per_rank
        if tuple(self.slot_expert.shape) != (slots,):
            raise ValueError(f"slot_expert must have shape (num_ranks·slots_per_rank={slots},), "
                             f"got {tuple(self.slot_expert.shape)}")
        # A copy: the placement must not change when the caller edits its tensor.
        se = self.slot_expert.detach().to("cpu", torch.int64, copy=True).contiguous()
        object.__setattr__(self, "slot_expert", se)
        if slots < self.num_experts:
            raise ValueError(f"{slots} slots (num_ranks={self.num_ranks} × slots_per_rank="
                             f"{self.slots_per_rank}) cannot hold num_experts="
                             f"{self.num_experts} experts")
        if se.numel() and (se.min() < 0 or se.max() >= self.num_experts):
            raise ValueError(f"slot_expert must be in [0, num_experts={self.num_experts})")
        missing = (torch.bincount(se, minlength=self.num_experts) == 0).nonzero().flatten()
        if missing.numel():
            raise ValueError(f"experts without a slot: {missing.tolist()[:8]}"
                             f"{' ...' if missing.numel() > 8 else ''}")

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> "Placement":
        """The default layout: expert ``e`` on rank ``e // (E/num_ranks)``, no replicas."""
        check_int("num_experts", num_experts, low=1)
        check_int("num_ranks", num_ranks, low=1)
        if num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} must be divisible by num_ranks="
                             f"{num_ranks} for the contiguous placement")
        return cls(torch.arange(num_experts), num_ranks, num_experts // num_ranks, num_experts)

    # --- queries --------------------------------------------------------------------------

    def replicas(self, expert: int) -> list[int]:
        """Slots holding ``expert``, ascending."""
        return (self.slot_expert == expert).nonzero().flatten().tolist()

    def replica_counts(self) -> torch.Tensor:
        """``(E,)`` int64 replicas of each expert."""
        return torch.bincount(self.slot_expert, minlength=self.num_experts)

    def rank_experts(self, rank: int) -> torch.Tensor:
        """``(slots_per_rank,)`` experts in ``rank``'s slots."""
        return self.slot_expert[rank * self.slots_per_rank:(rank + 1) * self.slots_per_rank]

    def rank_load(self, load) -> torch.Tensor:
        """``(num_ranks,)`` float64 expected load per rank: each expert's load split evenly
        over its replicas."""
        load = _as_load(load, self.num_experts)
        per_slot = load[self.slot_expert] / self.replica_counts()[self.slot_expert]
        return per_slot.view(self.num_ranks, self.slots_per_rank).sum(1)

    def max_over_mean(self, load) -> float:
        """Max over mean of :meth:`rank_load` (1.0 = perfectly balanced; 1.0 for zero load)."""
        ranks = self.rank_load(load)
        mean = ranks.mean().item()
        return ranks.max().item() / mean if mean > 0 else 1.0

    def fingerprint(self) -> int:
        """An int that equal placements share (for the ranks' agreement check)."""
        return hash((self.num_ranks, self.slots_per_rank, self.num_experts,
                     tuple(self.slot_expert.tolist()))) % (2 ** 62)

    # --- the device side of the dispatch --------------------------------------------------

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(replica_count (E,), replica_slots (E, max replicas))`` int64 on ``device``
        (cached per device and content of :attr:`slot_expert`, so an in-place edit of it is
        seen): ``replica_slots[e, :replica_count[e]]`` are ``e``'s slots ascending, the rest
        padding."""
        device = torch.device(device)
        content = self.slot_expert.numpy().tobytes()
        cached = self._tables.get(str(device))
        if cached is None or cached[0] != content:
            counts = self.replica_counts()
            width = int(counts.max())
            table = torch.zeros(self.num_experts, width, dtype=torch.int64)
            order = torch.argsort(self.slot_expert, stable=True)      # slots grouped by expert
            start = torch.cumsum(counts, 0) - counts
            sorted_experts = self.slot_expert[order]
            col = torch.arange(order.numel()) - start[sorted_experts]
            table[sorted_experts, col] = order
            cached = self._tables[str(device)] = (content, (counts.to(device), table.to(device)))
        return cached[1]

    def pair_slots(self, token_idx: torch.Tensor, expert_idx: torch.Tensor,
                   source_rank: int) -> torch.Tensor:
        """``(P,)`` int64 slot each routed pair goes to, on the device without a host read.

        A pair of an expert with ``R`` replicas goes to its replica ``(token + source_rank) %
        R`` (replicas in slot order): deterministic, and it splits an expert's pairs evenly
        between its replicas up to rounding (a token picks an expert at most once, so tokens
        spread over the residues; the rank offset keeps ranks with few tokens from all picking
        replica 0). Indices must be in range (``expert_idx`` in ``[0, E)``, ``token_idx ≥ 0``).
        """
        counts, table = self.tables(expert_idx.device)
        experts = expert_idx.long()
        if table.shape[1] == 1:
            return table[experts, 0]
        replica = (token_idx.long() + source_rank) % counts[experts]
        return table[experts, replica]


def _as_load(load, num_experts: int | None = None) -> torch.Tensor:
    """``load`` as a 1-D float64 CPU tensor, checked."""
    t = torch.as_tensor(load).detach()
    if t.ndim != 1 or t.numel() == 0:
        raise ValueError(f"load must be a non-empty 1-D sequence of per-expert loads (E,), got "
                         f"shape {tuple(t.shape)}" + (" (sum the steps or ranks first)"
                                                      if t.ndim > 1 else ""))
    if num_experts is not None and t.numel() != num_experts:
        raise ValueError(f"load must have num_experts={num_experts} entries, got {t.numel()}")
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"load must be integer or real floating point, got {t.dtype}")
    t = t.to("cpu", torch.float64)
    bad = (~torch.isfinite(t)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"load must be finite: entry {bad[0].item()} is {t[bad[0]].item()}")
    negative = (t < 0).nonzero().flatten()
    if negative.numel():
        raise ValueError(f"load must be non-negative: entry {negative[0].item()} is "
                         f"{t[negative[0]].item()}")
    return t


def plan_placement(load: torch.Tensor | Sequence[float], num_ranks: int,
                   slots_per_rank: int) -> Placement:
    """The offline balancer: replicate hot experts into the redundant slots and place the
    replicas on ranks to even out the per-rank load.

    1. **Replication.** Every expert gets one replica; each of the
       ``num_ranks·slots_per_rank − E`` redundant slots goes to the expert with the highest
       load per replica (ties: lower expert index), never giving an expert more replicas than
       there are ranks while another expert can take the slot.
    2. **Placement.** Replicas, heaviest first (load per replica; ties: expert, then replica
       index), go to the rank with a free slot that has the least load so far (ties: fewer
       used slots, then lower rank), avoiding ranks that already hold that expert unless no
       other rank has a free slot. Within a rank slots are sorted by expert.

    Deterministic: a pure function of ``load`` (read once to the host; it is offline).

    Args:
        load: ``(E,)`` non-negative per-expert load (e.g. :meth:`ExpertLoad.counts`).
        num_ranks: EP group size.
        slots_per_rank: expert weights per rank; ``num_ranks·slots_per_rank ≥ E``.

    Raises:
        ValueError: too few slots, a load that is not a non-empty 1-D sequence (a 2-D load
            of steps × experts or ranks × experts is refused, not flattened), an entry that
            is not finite or negative (the message names it).
        TypeError: a bool or complex load.
    """
    check_int("num_ranks", num_ranks, low=1)
    check_int("slots_per_rank", slots_per_rank, low=1)
    weights = _as_load(load).tolist()
    num_experts = len(weights)
    total = num_ranks * slots_per_rank
    if total < num_experts:
        raise ValueError(f"{total} slots (num_ranks={num_ranks} × slots_per_rank="
                         f"{slots_per_rank}) cannot hold all {num_experts} experts")
    replicas = [1] * num_experts
    # Max-heap of (load per replica, expert). An expert with num_ranks replicas waits in
    # `capped` (a further replica would share a rank) until no other expert is left.
    heap = [(-w, e) for e, w in enumerate(weights)]
    heapq.heapify(heap)
    capped: list[tuple[float, int]] = []
    cap = True
    for _ in range(total - num_experts):
        if not heap:
            heap, capped, cap = capped, [], False
            heapq.heapify(heap)
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        entry = (-weights[e] / replicas[e], e)
        if cap and replicas[e] >= num_ranks:
            capped.append(entry)
        else:
            heapq.heappush(heap, entry)
    items = sorted(((weights[e] / replicas[e], e, r) for e in range(num_experts)
                    for r in range(replicas[e])), key=lambda t: (-t[0], t[1], t[2]))
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for w, e, _ in items:
        free = [r for r in range(num_ranks) if len(per_rank[r]) < slots_per_rank]
        fresh = [r for r in free if e not in per_rank[r]] or free
        r = min(fresh, key=lambda r: (rank_load[r], len(per_rank[r]), r))
        rank_load[r] += w
        per_rank[r].append(e)
    slot_expert = torch.tensor([e for experts in per_rank for e in sorted(experts)],
                               dtype=torch.int64)
    return Placement(slot_expert, num_ranks, slots_per_rank, num_experts)


def sum_over_replicas(tensors, placement: Placement, group=None, *,
                      primary_only: bool = False) -> None:
    """In place, for every expert with more than one replica: each of its slots in each of
    ``tensors`` (this rank's ``(slots_per_rank, ...)`` per-slot tensors, e.g. ``w1.grad``)
    becomes the sum over all its replicas on all ranks — or, with ``primary_only``, the value
    of its first replica (the lowest slot), which makes replicas equal (initialisation).

    One ``all_reduce`` per tensor over ``group`` of a buffer holding only the replicated
    experts (``(#replicated, ...)``; ranks without a replica of an expert add zeros), so a
    placement without replicas costs nothing. Collective: every rank of ``group`` must call it
    with the same placement and tensor shapes.
    """
    import torch.distributed as dist

    from sonic.distributed.comm import check_group
    _, rank = check_group(group)
    counts = placement.replica_counts()
    replicated = (counts > 1).nonzero().flatten()
    if replicated.numel() == 0:
        return
    index_of = torch.full((placement.num_experts,), -1, dtype=torch.int64)
    index_of[replicated] = torch.arange(replicated.numel())
    experts = placement.rank_experts(rank)
    local = (index_of[experts] >= 0).nonzero().flatten()            # this rank's replica slots
    global_slots = rank * placement.slots_per_rank + local
    if primary_only:
        primary = torch.tensor([placement.replicas(int(e))[0] for e in experts[local]],
                               dtype=torch.int64)
        sources = local[primary == global_slots]
    else:
        sources = local
    for t in tensors:
        with torch.no_grad():
            buf = t.new_zeros((replicated.numel(),) + tuple(t.shape[1:]))
            src = sources.to(t.device)
            buf.index_add_(0, index_of[experts[sources]].to(t.device), t.index_select(0, src))
            dist.all_reduce(buf, group=group)
            dst = local.to(t.device)
            t.index_copy_(0, dst, buf.index_select(0, index_of[experts[local]].to(t.device)))


def reduce_replica_grads(params, placement: Placement, group=None) -> None:
    """After backward: the gradient of every replica slot of ``params`` (this rank's expert
    weights, ``(slots_per_rank, ...)``, e.g. ``[w1, w2]``) becomes the gradient of the expert
    as a whole, the sum over its replicas on all ranks, so replicas stay equal under any
    optimizer. A parameter without a gradient gets a zero one first (every rank must join the
    all-reduce). Collective (see :func:`sum_over_replicas`)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    sum_over_replicas(grads, placement, group)
