"""`MoEConfig`: the settings of a `sonic.MoE` layer, checked in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from sonic._validation import check_bool, check_choice, check_int, check_non_negative
from sonic.activation_cache import ACTIVATION_CACHES, check_fp8_d_expert
from sonic.backend import BACKENDS
from sonic.experts.moe_experts import PRECISIONS, check_fp8_sizes
from sonic.reference.activations import ACTIVATIONS
from sonic.reference.ops import GATE_UP_LAYOUTS
from sonic.routing.token_rounding import ROUNDINGS
from sonic.routing.topk import SCORES, check_group_args, check_positive
from sonic.types import (Activation, ActivationCache, Backend, GateUp, Precision, Rounding, Router,
                         Score)

ROUTERS: tuple[Router, ...] = get_args(Router)

# Options added after the first release, with the values that leave them off: what
# MoEConfig.options_beyond reports when set otherwise.
_LATER_OPTIONS: dict[str, tuple] = {
    "score": SCORES[:2], "activation": ("swiglu",), "routed_scaling_factor": (1.0,),
    "n_group": (1,), "bias_update_rate": (0.0,), "seq_aux_loss_coef": (0.0,),
    "z_loss_coef": (0.0,)}


@dataclass(frozen=True)
class MoEConfig:
    """The configuration of a :class:`sonic.MoE` layer: its sizes and options, without the
    device and dtype of its parameters.

    ``MoE.from_config(config, device=..., dtype=...)`` builds a layer and ``layer.config``
    reads a layer's; :meth:`sonic.distributed.ExpertParallelMoE.from_config` builds the
    layer's expert-parallel share, and ``sonic.train.TrainConfig.moe_config()`` is the config
    of every layer of the training job's model. The field names and defaults are
    ``sonic.MoE``'s keyword arguments, which build this object and so raise the same errors.
    Every field is checked on construction (also by ``dataclasses.replace``); a value is kept
    as given (``None`` stays ``None``).

    Fields:
        d_model: ``d``, the model dimension (``int >= 1``).
        d_expert: ``n``, each expert's intermediate dimension (``int >= 1``).
        num_experts: ``E``, routed experts (``int >= 1``).
        top_k: ``K``, experts per token (``int`` in ``[1, E]``).
        router: ``"topk"`` (token choice) or ``"token_rounding"`` (SonicMoE §5.2; training
            mode only, ``eval()`` routes by top-K).
        tile: ``M_tile`` that token rounding rounds expert counts to (``int >= 1``).
        score: ``"softmax_topk"``, ``"topk_softmax"`` or ``"sigmoid"`` (see
            :func:`sonic.topk_routing`).
        renormalize: renormalise ``"topk_softmax"`` / ``"sigmoid"`` scores to sum to 1
            (``bool``).
        rounding: token rounding's mode, ``"nearest"``, ``"up"`` or ``"down"``.
        gate_up: layout of ``w1``'s rows, ``"concat"`` or ``"interleaved"``.
        aux_loss_coef: weight of the load-balancing loss (finite real ``>= 0``).
        backend: ``"auto"``, ``"torch"`` or ``"cute"`` (see :func:`sonic.moe_experts`).
        precision: the expert GEMMs', ``"bf16"`` or ``"fp8"`` (needs ``d_model`` and
            ``d_expert`` multiples of 128).
        activation_cache: how H is kept for backward, ``"bf16"`` or ``"fp8"`` (needs
            ``d_expert`` a multiple of 64).
        routed_scaling_factor: multiplies every routed score (finite real ``> 0``).
        n_group: expert groups of group-limited routing (``int`` dividing ``E``; 1: off).
        topk_group: groups a token chooses among (``int`` in ``[1, n_group]``, with
            ``top_k <= topk_group·E/n_group``); ``None``: ``n_group``.
        expert_bias: keep a per-expert selection bias buffer (``bool``; implied by
            ``bias_update_rate > 0``).
        bias_update_rate: ``γ`` of aux-loss-free balancing (finite real ``>= 0``).
        seq_aux_loss_coef: weight of the sequence-wise balance loss (finite real ``>= 0``).
        z_loss_coef: weight of the router z-loss (finite real ``>= 0``).
        activation: the experts' activation, one of :data:`sonic.types.ACTIVATIONS`
            (``"swiglu"``, ``"geglu"``, ``"geglu_tanh"``, ``"reglu"``, ``"relu2"``,
            ``"gelu"``); other than ``"swiglu"`` not with ``precision="fp8"`` or
            ``activation_cache="fp8"``.
        num_shared_experts: shared experts every token passes through (``int >= 0``).
        shared_expert_d: the shared expert's size (``int >= 1``) instead of
            ``num_shared_experts·d_expert``; ``None``: that product.
        shared_expert_gate: scale the shared expert's output by a sigmoid gate per token
            (``bool``; needs shared experts).

    :class:`sonic.MoE` documents what each option does in the layer.

    Raises:
        TypeError: a field of the wrong type (an ``int`` field given a ``float`` or ``bool``,
            a ``bool`` field given anything but a ``bool``, a coefficient not a real number);
            the message names the field.
        ValueError: a field out of range or not among its choices, ``top_k`` above what the
            groups allow, ``n_group`` not dividing ``num_experts``, FP8 sizes that are not
            multiples of the FP8 blocks, an activation other than SwiGLU with an FP8 option,
            or ``shared_expert_gate`` without shared experts; the message names the field.
    """

    d_model: int
    d_expert: int
    num_experts: int
    top_k: int
    router: Router = "topk"
    tile: int = 128
    score: Score = "softmax_topk"
    renormalize: bool = False
    rounding: Rounding = "nearest"
    gate_up: GateUp = "concat"
    aux_loss_coef: float = 0.0
    backend: Backend = "auto"
    precision: Precision = "bf16"
    activation_cache: ActivationCache = "bf16"
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int | None = None
    expert_bias: bool = False
    bias_update_rate: float = 0.0
    seq_aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    activation: Activation = "swiglu"
    num_shared_experts: int = 0
    shared_expert_d: int | None = None
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        check_int("d_model", self.d_model, low=1)
        check_int("d_expert", self.d_expert, low=1)
        check_int("num_experts", self.num_experts, low=1)
        check_int("top_k", self.top_k, low=1, high=self.num_experts)
        check_group_args(self.num_experts, self.top_k, self.n_group, self.topk_group)
        check_choice("router", self.router, ROUTERS)
        check_int("tile", self.tile, low=1)
        check_choice("score", self.score, SCORES)
        check_bool("renormalize", self.renormalize)
        check_choice("rounding", self.rounding, ROUNDINGS)
        check_choice("gate_up", self.gate_up, GATE_UP_LAYOUTS)
        check_choice("backend", self.backend, BACKENDS)
        check_choice("precision", self.precision, PRECISIONS)
        if self.precision == "fp8":
            check_fp8_sizes(self.d_model, self.d_expert)
        check_choice("activation_cache", self.activation_cache, ACTIVATION_CACHES)
        if self.activation_cache == "fp8":
            check_fp8_d_expert(self.d_expert)
        check_positive("routed_scaling_factor", self.routed_scaling_factor)
        for name in ("aux_loss_coef", "bias_update_rate", "seq_aux_loss_coef", "z_loss_coef"):
            check_non_negative(name, getattr(self, name))
        check_bool("expert_bias", self.expert_bias)
        check_choice("activation", self.activation, ACTIVATIONS)
        self._check_activation_support()
        check_int("num_shared_experts", self.num_shared_experts, low=0)
        if self.shared_expert_d is not None:
            check_int("shared_expert_d", self.shared_expert_d, low=1)
        check_bool("shared_expert_gate", self.shared_expert_gate)
        if self.shared_expert_gate and not self.resolved_shared_expert_d:
            raise ValueError("shared_expert_gate=True needs shared experts "
                             "(num_shared_experts >= 1 or shared_expert_d)")

    def _check_activation_support(self) -> None:
        """Raise ``ValueError`` where an activation other than SwiGLU meets an option only the
        SwiGLU path has (FP8 GEMMs or the FP8 activation cache)."""
        if self.activation == "swiglu":
            return
        for name in ("precision", "activation_cache"):
            if getattr(self, name) == "fp8":
                raise ValueError(
                    f"activation={self.activation!r} has no FP8 path: {name}='fp8' runs "
                    f"SwiGLU experts only (use {name}='bf16')")

    @property
    def resolved_topk_group(self) -> int:
        """``topk_group``, or ``n_group`` when it is ``None``."""
        return self.n_group if self.topk_group is None else self.topk_group

    @property
    def resolved_shared_expert_d(self) -> int:
        """The shared expert's size: ``shared_expert_d``, or ``num_shared_experts·d_expert``
        when it is ``None`` (0: no shared expert)."""
        if self.shared_expert_d is None:
            return self.num_shared_experts * self.d_expert
        return self.shared_expert_d

    def options_beyond(self, supported: tuple[str, ...] = ()) -> list[str]:
        """The options set away from their defaults (``"score='sigmoid'"``, ``"n_group=4"``,
        ...) among the routing, loss, activation and shared-expert options added after the
        first release, less those in ``supported``: what a consumer that carries only the
        original options (e.g. an expert-parallel layer) must refuse."""
        found = [f"{name}={getattr(self, name)!r}" for name, allowed in _LATER_OPTIONS.items()
                 if name not in supported and getattr(self, name) not in allowed]
        if "expert_bias" not in supported and (self.expert_bias or self.bias_update_rate):
            found.append("expert_bias=True")
        if "shared_expert_d" not in supported and self.resolved_shared_expert_d:
            found.append(f"shared_expert_d={self.resolved_shared_expert_d}")
        return found
