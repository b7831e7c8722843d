"""`ExpertParallelMoE`: `sonic.MoE` with its experts spread over an expert-parallel group."""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

from sonic.distributed.comm import DTYPE_CODES, check_group, comm_device
from sonic.distributed.eplb import ExpertLoad, Placement, reduce_replica_grads, sum_over_replicas
from sonic._validation import check_choice, check_int
from sonic.distributed.experts import check_placement, ep_moe_experts
from sonic.distributed.plan import MAX_CHUNKS
from sonic.distributed.token_rounding import ep_token_rounding_routing
from sonic.nn.config import MoEConfig
from sonic.nn.moe import MoE
from sonic.reference.ops import GATE_UP_LAYOUTS, accumulate_dtype
from sonic.routing.topk import SCORES
from sonic.routing.types import Routing
from sonic.reference.activations import is_gated
from sonic.types import (ACTIVATIONS, TRANSPORTS, Activation, ActivationCache, Backend, GateUp,
                         Precision, Rounding, Router, Score, Transport)

# The options of sonic.MoE beyond the original ones that this layer carries: those that act
# before dispatch (routing on each rank's own tokens), and the experts' activation.
_CARRIED_OPTIONS = ("score", "routed_scaling_factor", "n_group", "expert_bias",
                    "bias_update_rate", "seq_aux_loss_coef", "z_loss_coef", "activation")
# The options of sonic.MoE this layer does not take (no shared experts).
_SINGLE_PROCESS_OPTIONS = ("num_shared_experts", "shared_expert_d", "shared_expert_gate")
_CONFIG = ("d_model", "d_expert", "num_experts", "top_k", "score", "renormalize", "gate_up",
           "dtype", "placement (fingerprint)", "activation")


class ExpertParallelMoE(MoE):
    """Mixture-of-Experts FFN whose ``E`` experts are split over the ranks of ``group``.

    Each rank holds ``E/ep`` consecutive experts (expert ``e`` on group rank ``e // (E/ep)``)
    and a replicated router; ``forward`` routes this rank's tokens and runs
    :func:`sonic.distributed.ep_moe_experts`. Every rank of ``group`` must call ``forward`` and
    ``backward`` together. With the same weights, each rank's output and gradients equal those
    of :class:`sonic.MoE` on the concatenated batch with the ranks' losses summed, once the
    router's gradient is summed over the ranks. A data-parallel wrapper such as
    `torch.nn.parallel.DistributedDataParallel` averages the router's gradient over the ranks
    instead (the gradient of their mean loss); the expert gradients come to the same scale
    divided by the EP size and averaged over any other EP groups holding the same experts
    (:mod:`sonic.train.parallel` does both).

    The layer's options are a :class:`sonic.MoEConfig` (which checks them; :attr:`config`
    gives it) without shared experts: :meth:`from_config`
    builds the layer from one, :meth:`from_moe` from a single-process layer.

    Args:
        d_model, d_expert, num_experts, top_k, score, renormalize, gate_up, aux_loss_coef,
        backend, precision, activation_cache, device, dtype: as in :class:`sonic.MoE`. ``num_experts`` must be divisible
            by the group size.
        routed_scaling_factor, n_group, topk_group, expert_bias: the routing options of
            :class:`sonic.MoE` that act before dispatch (each rank routes its own tokens, so it
            routes them as the single-process layer would). ``expert_bias`` is the buffer
            ``expert_bias (E,)``, the same on every rank. With ``n_group`` a multiple of the EP
            size and the contiguous placement, every group lies on one rank, so a token's
            pairs reach at most ``topk_group`` ranks (DeepSeek-V3 §2.1.2 node-limited
            routing). Token rounding (``router="token_rounding"`` in training mode) rounds
            the choice these options make, as the single-process layer does.
        bias_update_rate: aux-loss-free balancing as in :class:`sonic.MoE`: every training
            forward counts this rank's routed pairs per expert, and
            :meth:`update_expert_bias` sums the counts over the EP group before the sign rule,
            so every rank keeps the bias the single-process layer would have on the
            concatenated batch.
        seq_aux_loss_coef, z_loss_coef: as in :class:`sonic.MoE`, computed on this rank's
            tokens (like ``aux_loss_coef``): the loss of the rank's sequences and logits.
        group: the EP process group (``None``: the default group).
        router: ``"topk"`` or ``"token_rounding"``: in training mode
            :func:`sonic.distributed.ep_token_rounding_routing` rounds every expert's count of
            tokens from *all* ranks to a multiple of ``tile`` (the selection of single-process
            token rounding on the concatenated batch); eval mode routes by top-K.
        tile, rounding: token rounding's ``M_tile`` and mode, as in :class:`sonic.MoE`; all
            ranks must use the same.
        placement: an EPLB :class:`~sonic.distributed.Placement` (from
            :func:`~sonic.distributed.plan_placement`) for ``ep`` ranks and ``E`` experts, the
            same on every rank; ``None`` (default): the contiguous placement above.
        num_chunks: ``C`` in ``[1, 16]``, the same on every rank: split this rank's tokens
            into ``C`` chunks whose all-to-alls overlap the expert computation of the
            neighbouring chunks (:mod:`sonic.distributed.overlap`); ``1`` (default): no
            chunking. The attribute :attr:`num_chunks` may be changed between calls.
        comm_sm_margin: SMs the grouped GEMMs of the chunked pipeline leave free for the
            all-to-alls overlapping them (see :func:`ep_moe_experts`); ``0`` (default): all.
            The attribute :attr:`comm_sm_margin` may be changed between calls.
        recompute_dispatch: keep the layer input instead of the rows this rank received and
            send them again in backward (see :func:`ep_moe_experts`): less memory for one more
            all-to-all, the same gradients. The same on every rank; the attribute
            :attr:`recompute_dispatch` may be changed between calls.
        transport: what moves the data all-to-alls, the same on every rank: ``"nccl"``
            (default), ``"copy_engine"`` (NVLink peer memory and copy engines, no SMs; CUDA
            ranks of one host) or ``"auto"`` (see :func:`ep_moe_experts`). The attribute
            :attr:`transport` may be changed between calls.
        activation: the experts' activation, as in :class:`sonic.MoE` (``w1`` is
            ``(E/ep, n, d)`` for a non-gated one); the same on every rank.

    Parameters: ``gate.weight (E, d)`` (replicated), ``w1 (E/ep, 2n, d)``,
    ``w2 (E/ep, d, n)`` — this rank's experts ``ep_rank·E/ep …``; with a placement
    ``w1 (slots_per_rank, 2n, d)``, ``w2 (slots_per_rank, d, n)``, slot ``i`` holding expert
    ``placement.rank_experts(ep_rank)[i]``.

    **EPLB.** With a placement that replicates experts, a replicated expert's pairs are split
    between its replicas (:meth:`Placement.pair_slots`) and each replica's weight gradient
    covers only its share: call :meth:`reduce_replica_grads` after backward (and before the
    optimizer step, on every rank) to give each replica the expert's whole gradient. It is an
    explicit call, not a gradient hook, so that it runs once per optimizer step (not once per
    micro-batch under gradient accumulation: the sum is linear) and at a point every rank
    reaches together; a data-parallel reduction of the gradients (one that
    `torch.nn.parallel.DistributedDataParallel` finishes within backward) may come before or
    after it, both being linear. Set
    :attr:`expert_load` to an :class:`~sonic.distributed.ExpertLoad` to count the routed pairs
    of every forward on the device (the statistics for the next plan).

    ``forward(x, *, return_aux_loss=False)``: as :meth:`sonic.MoE.forward` (autocast, the aux
    loss returned or collected by :func:`sonic.collect_aux_losses`), with the experts run by
    :func:`ep_moe_experts`. The aux loss is the load-balancing loss of *this rank's* tokens
    (not of the whole batch, which would need an all-reduce of the router statistics);
    :attr:`last_routing` the local :class:`Routing` with global expert indices.

    Construction is collective: one all-gather checks that all ranks agree on the
    configuration, and the router weight is broadcast from group rank 0. The settings that may
    change between calls (``router``, training mode, ``top_k``, ``tile``, ``rounding``,
    ``score``, ``renormalize``, ``routed_scaling_factor``, ``n_group``, ``topk_group``, whether
    there is an ``expert_bias``) travel in every forward's first exchange: ranks that disagree
    on one raise on every rank, naming it and each rank's value.

    Raises:
        RuntimeError: ``torch.distributed`` not initialised.
        TypeError / ValueError: what :class:`sonic.MoEConfig` raises (a layer option out of
            range, naming it), an EP argument out of range, ``num_experts`` not divisible by
            the group size, this process not in ``group``, or ranks
            disagreeing on the configuration (raised on every rank).
    """

    def __init__(self, d_model: int, d_expert: int, num_experts: int, top_k: int, *,
                 group=None, router: Router = "topk", score: Score = "softmax_topk",
                 tile: int = 128, rounding: Rounding = "nearest",
                 renormalize: bool = False, gate_up: GateUp = "concat", aux_loss_coef: float = 0.0,
                 backend: Backend = "auto", device=None, dtype=None,
                 placement: Placement | None = None, num_chunks: int = 1,
                 comm_sm_margin: int = 0, recompute_dispatch: bool = False,
                 precision: Precision = "bf16", activation_cache: ActivationCache = "bf16",
                 routed_scaling_factor: float = 1.0, n_group: int = 1,
                 topk_group: int | None = None, expert_bias: bool = False,
                 bias_update_rate: float = 0.0, seq_aux_loss_coef: float = 0.0,
                 z_loss_coef: float = 0.0, transport: Transport = "nccl",
                 activation: Activation = "swiglu"):
        # Not MoE.__init__: it would allocate all E experts on every rank.
        nn.Module.__init__(self)
        self._configure(MoEConfig(d_model, d_expert, num_experts, top_k, router=router,
                                  tile=tile, score=score, renormalize=renormalize,
                                  rounding=rounding, gate_up=gate_up,
                                  aux_loss_coef=aux_loss_coef, backend=backend,
                                  precision=precision, activation_cache=activation_cache,
                                  routed_scaling_factor=routed_scaling_factor, n_group=n_group,
                                  topk_group=topk_group, expert_bias=expert_bias,
                                  bias_update_rate=bias_update_rate,
                                  seq_aux_loss_coef=seq_aux_loss_coef, z_loss_coef=z_loss_coef,
                                  activation=activation),
                        device)
        self.ep_size, self.ep_rank = check_group(group)
        if placement is not None:
            check_placement(placement, num_experts, self.ep_size)
        elif num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP size "
                             f"{self.ep_size} (the size of group)")
        check_int("num_chunks", num_chunks, low=1, high=MAX_CHUNKS)
        check_int("comm_sm_margin", comm_sm_margin, low=0)
        self.comm_sm_margin = comm_sm_margin
        self.recompute_dispatch = bool(recompute_dispatch)
        check_choice("transport", transport, TRANSPORTS)
        self.transport = transport
        self.group = group
        self.placement = placement
        self.num_chunks = num_chunks
        self.expert_load: ExpertLoad | None = None
        self.num_local_experts = (num_experts // self.ep_size if placement is None
                                  else placement.slots_per_rank)
        factory = {"device": device, "dtype": dtype}
        self.gate = nn.Linear(d_model, num_experts, bias=False, **factory)
        local = self.num_local_experts
        rows = 2 * d_expert if is_gated(activation) else d_expert
        self.w1 = nn.Parameter(torch.empty(local, rows, d_model, **factory))
        self.w2 = nn.Parameter(torch.empty(local, d_model, d_expert, **factory))
        self._check_config()
        self.reset_parameters()

    def _check_config(self) -> None:
        mine = [self.d_model, self.d_expert, self.num_experts, self.top_k,
                SCORES.index(self.score), int(self.renormalize),
                GATE_UP_LAYOUTS.index(self.gate_up), DTYPE_CODES.index(self.w1.dtype),
                0 if self.placement is None else self.placement.fingerprint(),
                ACTIVATIONS.index(self.activation)]
        device = comm_device(self.group, torch.device("cpu"))
        local = torch.tensor(mine, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(local) for _ in range(self.ep_size)]
        dist.all_gather(gathered, local, group=self.group)
        for source, theirs in enumerate(t.tolist() for t in gathered):
            for name, a, b in zip(_CONFIG, mine, theirs):
                if a != b:
                    raise ValueError(f"EP ranks disagree on {name}: EP rank {source} has "
                                     f"{_decode(name, b)}, this rank ({self.ep_rank}) has "
                                     f"{_decode(name, a)}")

    def reset_parameters(self) -> None:
        """Collective. Router N(0, 0.02²), broadcast from group rank 0 so it is replicated;
        experts U(±1/sqrt(fan_in)) as in :class:`sonic.MoE`, drawn from a generator seeded by
        ``torch.initial_seed()`` and the EP rank, so ranks hold different experts even when
        every rank seeds alike (as data-parallel training does). With a placement, the replicas
        of an expert then take the values of its first replica (one all-reduce per weight)."""
        nn.init.normal_(self.gate.weight, std=0.02)
        weight = self.gate.weight.data
        device = comm_device(self.group, weight.device)
        shared = weight.to(device)
        dist.broadcast(shared, group=self.group, group_src=0)
        weight.copy_(shared)
        generator = torch.Generator(self.w1.device).manual_seed(
            (torch.initial_seed() + 1 + self.ep_rank) % 2**63)
        nn.init.uniform_(self.w1, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model),
                         generator=generator)
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.d_expert), 1 / math.sqrt(self.d_expert),
                         generator=generator)
        if self.placement is not None:
            sum_over_replicas([self.w1.data, self.w2.data], self.placement, self.group,
                              primary_only=True)

    def reduce_replica_grads(self) -> None:
        """Collective, after backward on every rank: each replica's ``w1``/``w2`` gradient
        becomes the sum over all replicas of its expert (the expert's whole gradient), one
        all-reduce per weight of the replicated experts only. A no-op without a placement or
        without replicas. See the class docstring for why this is explicit."""
        if self.placement is not None:
            reduce_replica_grads([self.w1, self.w2], self.placement, self.group)

    @classmethod
    def from_config(cls, config: MoEConfig, *, group=None, placement: Placement | None = None,
                    num_chunks: int = 1, comm_sm_margin: int = 0,
                    recompute_dispatch: bool = False, transport: Transport = "nccl",
                    device=None, dtype=None) -> ExpertParallelMoE:
        """This rank's share of the layer of ``config`` (a :class:`sonic.MoEConfig`, the same
        on every rank), its parameters on ``device`` in ``dtype``; the other arguments as in
        the constructor. Collective, like the constructor.

        Raises:
            TypeError: ``config`` is not a :class:`sonic.MoEConfig`.
            ValueError: as the constructor, or ``config`` sets options the expert-parallel
                layer does not carry yet (:meth:`sonic.MoEConfig.options_beyond`:
                shared experts), naming them.
        """
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a sonic.MoEConfig, got {type(config).__name__}")
        unsupported = config.options_beyond(_CARRIED_OPTIONS)
        if unsupported:
            raise ValueError(f"ExpertParallelMoE cannot carry {', '.join(unsupported)} yet; "
                             "leave them at their defaults")
        # Past that check these are at their defaults, which the constructor does not take.
        carried = {name: value for name, value in asdict(config).items()
                   if name not in _SINGLE_PROCESS_OPTIONS}
        return cls(**carried, group=group, placement=placement, num_chunks=num_chunks,
                   comm_sm_margin=comm_sm_margin, recompute_dispatch=recompute_dispatch,
                   transport=transport, device=device, dtype=dtype)

    @classmethod
    def from_moe(cls, moe: MoE, *, group=None, placement: Placement | None = None,
                 num_chunks: int = 1, comm_sm_margin: int = 0,
                 recompute_dispatch: bool = False,
                 transport: Transport = "nccl") -> ExpertParallelMoE:
        """This rank's share of a single-process :class:`sonic.MoE` (the same on every rank):
        :meth:`from_config` of its :attr:`~sonic.MoE.config`, on its device in its dtype, with
        its router and experts ``ep_rank·E/ep …`` copied — or, with a ``placement``, the
        experts of this rank's slots. Collective, like the constructor; ``num_chunks``,
        ``comm_sm_margin``, ``recompute_dispatch`` and ``transport`` as there.

        Raises:
            ValueError: as :meth:`from_config`.
        """
        layer = cls.from_config(moe.config, group=group, placement=placement,
                                num_chunks=num_chunks, comm_sm_margin=comm_sm_margin,
                                recompute_dispatch=recompute_dispatch, transport=transport,
                                device=moe.w1.device, dtype=moe.w1.dtype)
        mine: slice | torch.Tensor = slice(layer.ep_rank * layer.num_local_experts,
                                           (layer.ep_rank + 1) * layer.num_local_experts)
        if placement is not None:
            mine = placement.rank_experts(layer.ep_rank).to(moe.w1.device)
        with torch.no_grad():
            layer.gate.weight.copy_(moe.gate.weight)
            layer.w1.copy_(moe.w1[mine])
            layer.w2.copy_(moe.w2[mine])
            if hasattr(moe, "expert_bias"):
                layer.expert_bias.copy_(moe.expert_bias)
        return layer

    def update_expert_bias(self, group=None) -> None:
        """:meth:`sonic.MoE.update_expert_bias` with the counts summed over ``group`` first:
        by default this layer's EP group, whose ranks route different tokens with one router
        and so must keep one bias; with several EP groups (EP × data parallelism) pass a
        group spanning all of them, e.g. the default group. Collective over that group.

        Raises:
            RuntimeError: the layer was built without ``bias_update_rate > 0``.
        """
        if group is None:
            group = self.group if self.group is not None else dist.group.WORLD
        super().update_expert_bias(group)

    def route(self, logits: torch.Tensor) -> Routing:
        """Top-K routing of this rank's tokens, or in training mode with
        ``router="token_rounding"`` token rounding across the group (collective)."""
        if self.training and self.router == "token_rounding":
            return ep_token_rounding_routing(
                logits, self.top_k, group=self.group, tile=self.tile, rounding=self.rounding,
                backend=self.backend, settings=self._settings(), score=self.score,
                renormalize=self.renormalize, expert_bias=getattr(self, "expert_bias", None),
                n_group=self.n_group, topk_group=self.topk_group,
                scaling_factor=self.routed_scaling_factor)
        return super().route(logits)

    def experts(self, tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                routing: Routing) -> torch.Tensor:
        """:func:`ep_moe_experts` on this rank's tokens and experts (scores in the accumulation
        dtype, as :class:`sonic.MoE` passes them), with this layer's precision (the FP8
        copies of its local experts cached as :class:`sonic.MoE` caches them) and activation
        cache; counts the pairs into :attr:`expert_load` when set."""
        if self.expert_load is not None:
            self.expert_load.update(routing)
        return ep_moe_experts(tokens, w1, w2, routing.scores.to(accumulate_dtype(tokens.dtype)),
                              routing.token_idx, routing.expert_idx, group=self.group,
                              num_experts=self.num_experts, gate_up=self.gate_up,
                              backend=self.backend, placement=self.placement,
                              num_chunks=self.num_chunks, comm_sm_margin=self.comm_sm_margin,
                              recompute_dispatch=self.recompute_dispatch,
                              precision=self.precision, activation_cache=self.activation_cache,
                              fp8_weights=self._fp8_weights(w1, w2), settings=self._settings(),
                              transport=self.transport, activation=self.activation)

    def _settings(self) -> dict:
        """The layer's settings every EP rank must share in each forward (they may be changed
        between calls, so :meth:`_check_config` at construction is not enough); they travel
        in the forward's first exchange."""
        return {"router": self.router, "training": self.training, "top_k": self.top_k,
                "tile": self.tile, "rounding": self.rounding, "score": self.score,
                "renormalize": self.renormalize,
                "routed_scaling_factor": self.routed_scaling_factor, "n_group": self.n_group,
                "topk_group": self.topk_group, "expert_bias": hasattr(self, "expert_bias"),
                "bias_update_rate": self.bias_update_rate,
                "seq_aux_loss_coef": self.seq_aux_loss_coef, "z_loss_coef": self.z_loss_coef}

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_expert={self.d_expert}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, ep_size={self.ep_size}, ep_rank={self.ep_rank}, "
                f"local_experts={self.num_local_experts}"
                + ("" if self.placement is None else ", placement=EPLB")
                + ("" if self.num_chunks == 1 else f", num_chunks={self.num_chunks}")
                + (", recompute_dispatch=True" if self.recompute_dispatch else "")
                + ("" if self.transport == "nccl" else f", transport={self.transport!r}"))


def _decode(name: str, code: int):
    tables = {"score": SCORES, "gate_up": GATE_UP_LAYOUTS, "dtype": DTYPE_CODES,
              "activation": ACTIVATIONS}
    return tables[name][code] if name in tables else code
