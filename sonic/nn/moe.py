"""`MoE`: a drop-in Mixture-of-Experts feed-forward layer (router + SwiGLU experts)."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import asdict, fields, replace
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import nn

from sonic._custom_op import autocast_dtype
from sonic._validation import check_float, check_tensor
from sonic.experts.moe_experts import (Fp8ExpertWeights, Fp8WeightCache, autocast_experts,
                                        moe_experts)
from sonic.reference.activations import is_gated
from sonic.reference.ops import accumulate_dtype
from sonic.nn.config import ROUTERS, MoEConfig  # noqa: F401  (ROUTERS: re-exported)
from sonic.routing.gate import gate_logits
from sonic.routing.losses import expert_load, router_z_loss, sequence_balance_loss
from sonic.routing.metadata import routing_metadata
from sonic.routing.token_rounding import token_rounding_routing
from sonic.routing.topk import topk_routing
from sonic.routing.types import Routing
from sonic.types import (Activation, ActivationCache, Backend, GateUp, Precision, Rounding, Router,
                         Score)

# The settings kept behind a checked property (in "_<name>"), assignable after construction.
_CHECKED = ("top_k", "tile", "score", "renormalize", "rounding", "router", "backend",
            "precision", "activation_cache", "aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef")
_AUX_TERMS = ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef")
# MoEConfig fields the layer keeps in a resolved form or as parameters and buffers: its
# configuration takes them from the one it was built with.
_BUILT = ("topk_group", "expert_bias", "num_shared_experts", "shared_expert_d",
          "shared_expert_gate")
_KEPT = tuple(f.name for f in fields(MoEConfig) if f.name not in _BUILT)


def load_balancing_loss(logits: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Switch-Transformer auxiliary loss on Hugging Face's scale: ``E · Σ_e f_e · p_e``.

    ``f_e``: routed pairs that went to expert e divided by the number of tokens ``T`` (not
    differentiable); ``p_e``: mean router probability of expert e (softmax over all E). For
    top-K routing this is exactly ``transformers``' ``load_balancing_loss_func`` of the one
    layer's logits (Mixtral, Qwen-MoE, OLMoE): ``K`` for perfectly uniform routing. (Earlier
    development versions divided ``f_e`` by ``T·K``: HF's loss divided by K.) A padded routing's
    padding (:attr:`Routing.num_valid`) counts for no expert. HF's function given
    several layers pools their counts and probabilities; summing this loss over layers does
    not. 0 for an empty batch.

    Args:
        logits: ``(T, E)`` float router logits of the layer's tokens.
        routing: the :class:`Routing` of those tokens (``routing.num_tokens == T``,
            ``routing.num_experts == E``), e.g. ``layer.route(logits)``.

    Returns:
        A 0-d tensor in fp32 (fp64 for fp64 logits), differentiable with respect to
        ``logits``.

    Raises:
        TypeError: ``logits`` is not a floating-point tensor, or ``routing`` not a
            :class:`Routing`.
        ValueError: ``logits`` is not 2-D, or its ``(T, E)`` differ from the routing's
            (counts of another batch or layer would silently give a wrong loss).

    Source: Switch Transformer (Fedus et al., 2021) eq. 4, with Hugging Face's scaling.
    """
    check_float("logits", logits, ndim=2)
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a sonic.Routing, got {type(routing).__name__}")
    num_tokens, num_experts = logits.shape
    if (num_tokens, num_experts) != (routing.num_tokens, routing.num_experts):
        raise ValueError(f"logits has (T, E) = {(num_tokens, num_experts)} but the routing is "
                         f"of T={routing.num_tokens} tokens over E={routing.num_experts} experts")
    acc = accumulate_dtype(logits.dtype)
    probs = torch.softmax(logits.to(acc), dim=-1)
    # One bin more for the padding of a padded routing (expert E), left out of the loss.
    counts = torch.zeros(num_experts + 1, device=logits.device, dtype=acc)
    counts.scatter_add_(0, routing.expert_idx.long(),
                        counts.new_ones(1).expand(routing.expert_idx.shape[0]))
    counts = counts[:num_experts]
    # An empty batch has no imbalance: 0, still attached to the logits' graph (not 0/0 = NaN).
    denom = max(num_tokens, 1)
    fraction = counts / denom
    mean_probs = probs.sum(dim=0) / denom
    return num_experts * (fraction * mean_probs).sum()


@contextlib.contextmanager
def collect_aux_losses(model: nn.Module | None = None) -> Iterator[list[torch.Tensor]]:
    """Collect the aux loss of every `sonic.MoE` forward run inside the block.

    ``with collect_aux_losses(model) as aux: out = model(x)`` leaves in the list ``aux`` one
    0-d tensor per MoE forward (``aux_loss_coef ·`` :func:`load_balancing_loss`, attached to the
    forward's graph; nothing in eval mode or with ``aux_loss_coef=0``), in call order — the way
    Hugging Face models collect router logits. Add ``sum(aux)`` to the loss. Nothing is kept
    on the modules, so copies, EMA and ``torch.compile`` see no graph there.

    Args:
        model: collect only from the `sonic.MoE` layers in ``model`` (itself included); ``None``
            collects from every layer.

    Reentrant activation checkpointing (``checkpoint(..., use_reentrant=True)``) runs the
    forward without grad and again during backward, so a loss collected there could train
    nothing: a layer whose parameters require grad raises ``RuntimeError`` when it would
    collect with gradients disabled. There, return the loss from the checkpointed function
    (``layer(x, return_aux_loss=True)``) or use non-reentrant checkpointing, which works
    eagerly. Under ``torch.compile`` a layer inside a checkpointed region cannot append to the
    list (Dynamo refuses side effects there): return the loss from the region instead.
    """
    sink: list[torch.Tensor] = []
    layers = None if model is None else [m for m in model.modules() if isinstance(m, MoE)]
    _COLLECTORS.append((sink, None if layers is None else {id(m) for m in layers}))
    try:
        yield sink
    finally:
        _COLLECTORS.pop()


_COLLECTORS: list[tuple[list, set | None]] = []


def _collector_for(layer: "MoE") -> list | None:
    for sink, ids in reversed(_COLLECTORS):
        if ids is None or id(layer) in ids:
            return sink
    return None


def _checked_setting(name: str) -> Any:
    """A property: the layer setting kept in ``_<name>``, checked on every assignment as the
    constructor checks it (by :class:`MoEConfig`, with the layer's other settings), so a bad
    value fails where it is set rather than in a forward. Typed ``Any`` so that the annotation
    of the class attribute it defines gives the setting's type."""
    private = "_" + name

    def fset(layer, value):
        replace(layer.config, **{name: value})
        setattr(layer, private, value)
        if name in _AUX_TERMS:
            layer._update_aux_terms()

    return property(lambda layer: getattr(layer, private), fset)


def update_expert_biases(model: nn.Module, group=None) -> None:
    """:meth:`MoE.update_expert_bias` of every :class:`MoE` in ``model`` (itself included)
    built with ``bias_update_rate > 0``: call it once per optimizer step, e.g. right after
    ``optimizer.step()`` (aux-loss-free balancing, DeepSeek-V3 §2.1.2). ``group``: as there."""
    for module in model.modules():
        if isinstance(module, MoE) and module.bias_update_rate:
            module.update_expert_bias(group)


class MoE(nn.Module):
    """Mixture-of-Experts FFN: a linear router and ``E`` SwiGLU experts run by :func:`moe_experts`.

    The keyword arguments but ``device`` and ``dtype`` are the fields of a :class:`MoEConfig`,
    which checks them: :meth:`from_config` builds a layer from one, :attr:`config` gives a
    layer's.

    Args:
        d_model: ``d``, the model dimension.
        d_expert: ``n``, each expert's intermediate dimension.
        num_experts: ``E``.
        top_k: ``K``, experts per token (``1 <= K <= E``).
        router: ``"topk"`` (token choice) or ``"token_rounding"`` (SonicMoE §5.2, training only);
            settable later: ``layer.router = "token_rounding"``. In ``eval()`` mode the layer
            always routes by top-K, as the paper evaluates token-rounding models.
        tile: ``M_tile`` that token rounding rounds expert counts to.
        score: top-K score function, ``"softmax_topk"``, ``"topk_softmax"`` or ``"sigmoid"``
            (see :func:`sonic.topk_routing`); token rounding rounds the token choice made with
            it and the layer's other scoring options.
        renormalize: renormalise ``"topk_softmax"`` / ``"sigmoid"`` scores to sum to 1 (a
            ``bool``).
        routed_scaling_factor: finite ``> 0``, multiplies every routed score after
            renormalisation (DeepSeek-V3's ``routed_scaling_factor``); default 1.
        n_group, topk_group: group-limited routing (DeepSeek-V3 §2.1.2 node-limited routing;
            DeepSeek-V2 device-limited routing): the experts form ``n_group`` groups of
            consecutive experts and a token chooses among its ``topk_group`` best groups
            (:func:`sonic.reference.ops.group_limited_choice`); ``n_group=1`` disables it.
        expert_bias: keep a per-expert selection bias, the fp32 buffer ``expert_bias (E,)`` in
            the ``state_dict``, added to the affinities for the choice of experts only
            (DeepSeek-V3 §2.1.2, aux-loss-free balancing; transformers' DeepSeek-V3 and
            GLM4-MoE call it ``e_score_correction_bias``). Implied by ``bias_update_rate > 0``.
        bias_update_rate: ``γ >= 0`` of aux-loss-free balancing. When ``> 0``, every forward
            in training mode adds the experts' routed pair counts to the non-persistent
            buffer ``tokens_per_expert (E,)`` (on the device, no host read), and
            :meth:`update_expert_bias` — call it once per optimizer step, e.g. right after
            ``optimizer.step()``, or :func:`update_expert_biases` for a whole model — applies
            DeepSeek-V3's rule ``b_i += γ·sign(mean_j c_j − c_i)`` to those counts ``c`` and
            resets them. The bias is never differentiated.
        seq_aux_loss_coef: weight ``α`` of DeepSeek-V3's sequence-wise balance loss
            (:func:`sonic.routing.losses.sequence_balance_loss`; a sequence is the
            second-to-last dim of ``x``: ``x (B, S, d)`` has B sequences of S tokens, a 2-D
            ``x`` is one sequence); finite ``>= 0``, settable later.
        z_loss_coef: weight of ST-MoE's router z-loss
            (:func:`sonic.routing.losses.router_z_loss`); finite ``>= 0``, settable later.
        activation: the experts' activation (:mod:`sonic.reference.activations`):
            ``"swiglu"`` (default), ``"geglu"``, ``"geglu_tanh"``, ``"reglu"`` (gated: ``w1``
            is ``(E, 2n, d)``) or ``"relu2"``, ``"gelu"`` (not gated: ``w1`` is ``(E, n, d)``).
            The gated ones run the CuTe kernels' fused up-proj and dH epilogues with their
            gate function; the non-gated ones the reference activation between the CuTe GEMMs
            (see :func:`moe_experts`). Only SwiGLU takes ``precision="fp8"`` and
            ``activation_cache="fp8"``.
        num_shared_experts: shared experts (DeepSeekMoE, Dai et al. 2024, §3.2; Qwen2-MoE):
            dense experts with the layer's ``activation`` that every token passes through,
            their output added to the routed output. ``m`` shared experts of size ``n`` are one
            dense expert of size ``m·n`` (the sum of their outputs is that expert's output), so
            the layer holds one: ``shared_w1 (1, 2·m·n, d)`` (``(1, m·n, d)`` not gated),
            ``shared_w2 (1, d, m·n)``. It runs as a one-expert :func:`moe_experts` call with
            every token routed to it — memory-minimal like the routed experts (keeps the input
            by reference, its ``H (T, 2·m·n)``, the scores and the metadata), in bf16
            precision whatever ``precision`` says.
        shared_expert_d: the shared expert's size instead of ``num_shared_experts·d_expert``
            (Qwen2-MoE's ``shared_expert_intermediate_size``); ``None``: that product.
        shared_expert_gate: scale the shared expert's output per token by
            ``sigmoid(x · shared_gate.weightᵀ)`` (Qwen2-MoE; ``shared_gate`` an
            ``nn.Linear(d, 1, bias=False)``), as its score: differentiated like a routed score.
        rounding: token-rounding mode, ``"nearest"``, ``"up"`` or ``"down"``.
        ``top_k``, ``tile``, ``score``, ``renormalize`` and ``rounding`` are settable later
        (``layer.top_k = 4``) and checked on assignment, with the errors of the constructor.
        gate_up: layout of ``w1``'s rows, ``"concat"`` or ``"interleaved"``.
        aux_loss_coef: weight of the load-balancing loss (:func:`load_balancing_loss`, HF's
            scale); a finite number ``>= 0``, settable later (checked again then).
        backend: see :func:`moe_experts`; settable later (checked again then).
        precision: ``"bf16"`` or ``"fp8"`` (block-scaled e4m3 GEMMs, see :func:`moe_experts`;
            needs ``d_model`` and ``d_expert`` multiples of 128, bf16 compute — a bf16 layer or
            ``torch.autocast(dtype=torch.bfloat16)`` — and Hopper for the CuTe backend);
            settable later. The FP8 copies of ``w1``/``w2`` are made in every forward, and
            once per weight update inside :func:`sonic.reuse_fp8_weights` (gradient
            accumulation, evaluation); they are not part of the ``state_dict`` and are
            dropped by copies and pickling.
        activation_cache: how H is kept for backward, ``"bf16"`` (as computed) or ``"fp8"``
            (e4m3 + 1×128 fp32 scales, about half the bytes; needs ``d_expert`` a multiple of 64
            and bf16/fp16 compute, i.e. bf16/fp16 parameters or ``torch.autocast``); see
            :func:`moe_experts`. Settable later (checked again then).

    Parameters: ``gate.weight (E, d)``, ``w1 (E, 2n, d)`` (``(E, n, d)`` for a non-gated
    ``activation``), ``w2 (E, d, n)``; see
    :meth:`reset_parameters` for their initialisation.

    ``forward(x, *, return_aux_loss=False)``: ``x (..., d)`` in the layer's dtype → same shape
    and dtype; with ``return_aux_loss=True``, ``(out, aux_loss)`` where ``aux_loss`` is
    ``aux_loss_coef ·`` :func:`load_balancing_loss` ``+ seq_aux_loss_coef ·``
    :func:`~sonic.routing.losses.sequence_balance_loss` ``+ z_loss_coef ·``
    :func:`~sonic.routing.losses.router_z_loss` in training mode (a zero tensor when every
    coefficient is 0 or in eval mode), attached to the forward's graph so that adding it to the
    loss trains the router. :func:`collect_aux_losses` collects it from every layer of a model
    instead. Under ``torch.autocast`` the layer accepts any float input and computes in the
    autocast dtype, as ``nn.Linear`` does. :attr:`last_routing` holds the :class:`Routing`
    of the last eager forward with detached scores (for inspection). A forward traced by
    ``torch.compile`` or ``torch.export`` writes nothing to the module (a write would break
    the graph under activation checkpointing): there it is left as the last eager forward
    set it (``None`` if none ran);
    token rounding leaves a padded one there (``last_routing.trim()`` gives the exact pairs).
    Router scores are fp32 (fp64 in an fp64 layer, so ``gradcheck`` works).

    Deprecated: when the aux loss is neither returned nor collected, the forward still leaves
    it in :attr:`aux_loss` (attached to the graph, as it used to); reading it warns
    (``DeprecationWarning``) and the attribute goes away in the next release.

    Copies: ``copy.deepcopy`` and pickling (``torch.save(layer)``, EMA copies,
    ``torch.optim.swa_utils.AveragedModel``) work after a forward; a copy's deprecated
    :attr:`aux_loss` is a detached value.

    Raises:
        TypeError / ValueError: at construction, what :class:`MoEConfig` raises (a bad size,
            option or coefficient, naming it); on assignment of a setting, the same; in
            forward, ``x`` not a tensor, not in the layer's dtype, or without last dim ``d``.
    """

    # The configuration kept as plain attributes (set by _configure), buffers and submodules
    # some layers register: for the type checker, as nn.Module's attribute lookup is untyped.
    d_model: int
    d_expert: int
    num_experts: int
    gate_up: GateUp
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    bias_update_rate: float
    activation: Activation
    shared_expert_d: int
    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor
    shared_gate: nn.Linear | None

    def __init__(self, d_model: int, d_expert: int, num_experts: int, top_k: int, *,
                 router: Router = "topk", tile: int = 128, score: Score = "softmax_topk",
                 renormalize: bool = False, rounding: Rounding = "nearest",
                 gate_up: GateUp = "concat", aux_loss_coef: float = 0.0,
                 backend: Backend = "auto", precision: Precision = "bf16",
                 activation_cache: ActivationCache = "bf16", routed_scaling_factor: float = 1.0,
                 n_group: int = 1, topk_group: int | None = None, expert_bias: bool = False,
                 bias_update_rate: float = 0.0, seq_aux_loss_coef: float = 0.0,
                 z_loss_coef: float = 0.0, activation: Activation = "swiglu",
                 num_shared_experts: int = 0, shared_expert_d: int | None = None,
                 shared_expert_gate: bool = False, device=None, dtype=None):
        super().__init__()
        config = MoEConfig(d_model, d_expert, num_experts, top_k, router=router, tile=tile,
                           score=score, renormalize=renormalize, rounding=rounding,
                           gate_up=gate_up, aux_loss_coef=aux_loss_coef, backend=backend,
                           precision=precision, activation_cache=activation_cache,
                           routed_scaling_factor=routed_scaling_factor, n_group=n_group,
                           topk_group=topk_group, expert_bias=expert_bias,
                           bias_update_rate=bias_update_rate,
                           seq_aux_loss_coef=seq_aux_loss_coef, z_loss_coef=z_loss_coef,
                           activation=activation, num_shared_experts=num_shared_experts,
                           shared_expert_d=shared_expert_d,
                           shared_expert_gate=shared_expert_gate)
        self._configure(config, device)
        factory = {"device": device, "dtype": dtype}
        self.gate = nn.Linear(d_model, num_experts, bias=False, **factory)
        rows = 2 * d_expert if is_gated(activation) else d_expert
        self.w1 = nn.Parameter(torch.empty(num_experts, rows, d_model, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, d_expert, **factory))
        shared = self.shared_expert_d
        if shared:
            shared_rows = 2 * shared if is_gated(activation) else shared
            self.shared_w1 = nn.Parameter(torch.empty(1, shared_rows, d_model, **factory))
            self.shared_w2 = nn.Parameter(torch.empty(1, d_model, shared, **factory))
        self.shared_gate = (nn.Linear(d_model, 1, bias=False, **factory)
                            if shared_expert_gate else None)
        self.reset_parameters()

    @classmethod
    def from_config(cls, config: MoEConfig, *, device=None, dtype=None) -> MoE:
        """The layer of ``config`` (a :class:`MoEConfig`), its parameters on ``device`` in
        ``dtype``: ``MoE.from_config(config).config == config``.

        Raises:
            TypeError: ``config`` is not a :class:`MoEConfig`.
        """
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a sonic.MoEConfig, got {type(config).__name__}")
        return cls(**asdict(config), device=device, dtype=dtype)

    @property
    def config(self) -> MoEConfig:
        """This layer's :class:`MoEConfig`: the one it was built with, holding the current
        value of every setting assigned since (``layer.top_k = 4``)."""
        built = self._config
        current = {name: getattr(self, name) for name in _KEPT}
        # topk_group is kept resolved (None: n_group); None stays None while it resolves alike.
        if built.topk_group is not None or self.topk_group != self.n_group:
            current["topk_group"] = self.topk_group
        # Nothing assigned since (every forward of a token-rounding EP layer asks): no rebuild,
        # whose checks the assignments already ran.
        if all(getattr(built, name) == value for name, value in current.items()):
            return built
        return replace(built, **current)

    def _configure(self, config: MoEConfig, device) -> None:
        """Set the configuration, the balancing buffers and the per-forward state (everything
        but the parameters) from ``config``, which checked it; shared with subclasses that
        hold their experts differently."""
        self._config = config
        for name in _KEPT:
            setattr(self, "_" + name if name in _CHECKED else name, getattr(config, name))
        self.topk_group = config.resolved_topk_group
        self.shared_expert_d, self.shared_gate = config.resolved_shared_expert_d, None
        self._update_aux_terms()
        self._register_bias_buffers(config.expert_bias, device)
        self._aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None
        self._fp8_cache = Fp8WeightCache()      # see _fp8_weights

    top_k: int = _checked_setting("top_k")
    tile: int = _checked_setting("tile")
    score: Score = _checked_setting("score")
    renormalize: bool = _checked_setting("renormalize")
    rounding: Rounding = _checked_setting("rounding")
    router: Router = _checked_setting("router")
    backend: Backend = _checked_setting("backend")
    precision: Precision = _checked_setting("precision")
    activation_cache: ActivationCache = _checked_setting("activation_cache")
    aux_loss_coef: float = _checked_setting("aux_loss_coef")
    seq_aux_loss_coef: float = _checked_setting("seq_aux_loss_coef")
    z_loss_coef: float = _checked_setting("z_loss_coef")

    def _update_aux_terms(self) -> None:
        # Names of the nonzero coefficients: a tuple of strings, which torch.compile treats as
        # a constant, so that no coefficient is read in a Python condition (a traced float
        # that only a condition reads gets specialised by a second trace of the forward).
        self._aux_terms = tuple(name for name in _AUX_TERMS if getattr(self, "_" + name, 0.0))

    def _has_aux_loss(self) -> bool:
        return self.training and bool(self._aux_terms)

    def _aux_losses(self, logits: torch.Tensor, routing: Routing, seq_len: int) -> torch.Tensor:
        """The weighted sum of the enabled auxiliary losses (:meth:`_has_aux_loss`)."""
        losses = {"aux_loss_coef": lambda: load_balancing_loss(logits, routing),
                  "seq_aux_loss_coef": lambda: sequence_balance_loss(
                      logits, routing, seq_len, score=self.score, top_k=self.top_k),
                  "z_loss_coef": lambda: router_z_loss(logits)}
        terms = [getattr(self, name) * losses[name]() for name in self._aux_terms]
        return sum(terms[1:], terms[0])

    def _register_bias_buffers(self, expert_bias: bool, device) -> None:
        """The buffers of aux-loss-free balancing: ``expert_bias (E,)`` with ``expert_bias`` or
        ``bias_update_rate > 0``, and with the latter the per-expert counts
        ``tokens_per_expert (E,)`` (not saved in ``state_dict``)."""
        if expert_bias or self.bias_update_rate:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, device=device,
                                                            dtype=torch.float32))
        if self.bias_update_rate:
            self.register_buffer("tokens_per_expert", torch.zeros(
                self.num_experts, device=device, dtype=torch.float32), persistent=False)

    def options_beyond(self, supported: tuple[str, ...] = ()) -> list[str]:
        """:meth:`MoEConfig.options_beyond` of this layer's :attr:`config`: the options set
        away from their defaults that a consumer carrying only the original options (e.g.
        an expert-parallel copy) must refuse, less those in ``supported``."""
        return self.config.options_beyond(supported)

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """Aux-loss-free balancing's bias update (DeepSeek-V3 §2.1.2): with ``c`` the routed
        pairs per expert counted by the training forwards since the last update (buffer
        ``tokens_per_expert``), ``expert_bias += bias_update_rate · sign(mean(c) − c)`` —
        an overloaded expert's bias drops by γ, an underloaded one's rises by γ, one at the
        mean keeps it — then ``c`` is reset. Call it once per optimizer step (all micro-batches
        counted), outside autograd; no host read.

        Args:
            group: a ``torch.distributed`` process group whose ranks' counts are summed first
                (all-reduce), so that data-parallel replicas of the layer keep equal biases;
                ``None`` uses this process's counts.

        Raises:
            RuntimeError: the layer was built without ``bias_update_rate > 0``.
        """
        if not self.bias_update_rate:
            raise RuntimeError("update_expert_bias needs a layer built with "
                               "bias_update_rate > 0 (aux-loss-free balancing)")
        counts = self.tokens_per_expert
        if group is not None:
            import torch.distributed as dist
            dist.all_reduce(counts, group=group)
        self.expert_bias.add_(torch.sign(counts.mean() - counts), alpha=self.bias_update_rate)
        counts.zero_()

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """Deprecated: the last forward's aux loss, when it was neither returned nor collected.
        Use ``layer(x, return_aux_loss=True)`` or :func:`collect_aux_losses`."""
        warnings.warn("sonic.MoE.aux_loss is deprecated and will be removed in the next "
                      "release: use layer(x, return_aux_loss=True) or "
                      "sonic.nn.collect_aux_losses(model)", DeprecationWarning, stacklevel=2)
        return self._aux_loss

    def __getstate__(self):
        # A graph cannot be deep-copied; a copy gets the deprecated aux loss's value.
        state = super().__getstate__()
        state["_fp8_cache"] = Fp8WeightCache()      # derived from the weights; rebuilt on use
        if state.get("_aux_loss") is not None:
            state["_aux_loss"] = state["_aux_loss"].detach()
        return state

    def __setstate__(self, state):
        if "aux_loss" in state:     # pickled by an earlier development version
            state["_aux_loss"] = state.pop("aux_loss")
        state.setdefault("_precision", "bf16")      # pickled before precision existed
        if state.get("_fp8_cache") is None:     # pickled before the cache was an object
            state["_fp8_cache"] = Fp8WeightCache()
        state.setdefault("_activation_cache", "bf16")     # pickled before the option existed
        for name in ("top_k", "tile", "score", "rounding", "renormalize", "backend"):
            if name in state:       # pickled when these were plain attributes
                state["_" + name] = state.pop(name)
        state.setdefault("activation", "swiglu")
        state.setdefault("shared_expert_d", 0)
        for name, default in (("routed_scaling_factor", 1.0), ("n_group", 1),
                              ("topk_group", 1), ("bias_update_rate", 0.0),
                              ("_seq_aux_loss_coef", 0.0), ("_z_loss_coef", 0.0)):
            state.setdefault(name, default)     # pickled before the routing options existed
        state.setdefault("_aux_terms", ("aux_loss_coef",) if state.get("_aux_loss_coef") else ())
        super().__setstate__(state)
        if "_config" not in state:      # pickled before the layer kept its configuration
            self._config = MoEConfig(
                **{name: getattr(self, name) for name in _KEPT}, topk_group=self.topk_group,
                expert_bias=hasattr(self, "expert_bias"),
                shared_expert_d=self.shared_expert_d or None,
                shared_expert_gate=getattr(self, "shared_gate", None) is not None)

    def reset_parameters(self) -> None:
        """Experts (routed and shared) like ``nn.Linear`` (U(±1/sqrt(fan_in))); router
        N(0, 0.02²) so that routing starts near uniform; the shared gate as ``nn.Linear``."""
        nn.init.uniform_(self.w1, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.d_expert), 1 / math.sqrt(self.d_expert))
        nn.init.normal_(self.gate.weight, std=0.02)
        if getattr(self, "shared_expert_d", 0):
            bound = 1 / math.sqrt(self.shared_expert_d)
            nn.init.uniform_(self.shared_w1, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model))
            nn.init.uniform_(self.shared_w2, -bound, bound)
        if self.shared_gate is not None:
            self.shared_gate.reset_parameters()

    def route(self, logits: torch.Tensor) -> Routing:
        """Routing for ``logits (T, E)`` under the current router, mode and scoring options."""
        scoring: dict[str, Any] = dict(
            score=self.score, renormalize=self.renormalize,
            expert_bias=getattr(self, "expert_bias", None), n_group=self.n_group,
            topk_group=self.topk_group, scaling_factor=self.routed_scaling_factor)
        if self.training and self.router == "token_rounding":
            # Padded: no host read of P, so a training step can be captured in a CUDA graph.
            return token_rounding_routing(logits, self.top_k, tile=self.tile, rounding=self.rounding,
                                          backend=self.backend, padded=True, **scoring)
        return topk_routing(logits, self.top_k, backend=self.backend, **scoring)

    def experts(self, tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                routing: Routing) -> torch.Tensor:
        """The expert computation of :meth:`forward`: ``tokens (T, d)``, the (possibly autocast)
        expert weights and the routing → ``(T, d)``. Subclasses that place experts elsewhere
        (:class:`sonic.distributed.ExpertParallelMoE`) override it."""
        return self._run_experts(tokens, w1, w2, routing, self.precision)

    def _run_experts(self, tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     routing: Routing, precision: Precision) -> torch.Tensor:
        """This process's experts ``w1``, ``w2`` on the routing, with the layer's activation."""
        scores = routing.scores.to(accumulate_dtype(tokens.dtype))
        return moe_experts(tokens, w1, w2, scores, routing.token_idx, routing.expert_idx,
                           gate_up=self.gate_up, backend=self.backend,
                           metadata=routing_metadata(routing, backend=self.backend),
                           precision=precision, activation_cache=self.activation_cache,
                           fp8_weights=self._fp8_weights(w1, w2) if precision == "fp8" else None,
                           activation=self.activation)

    def shared_experts(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared expert's output ``(T, d)`` for ``tokens (T, d)`` (see
        ``num_shared_experts``), gated per token when ``shared_expert_gate``; under autocast
        in the autocast dtype."""
        tokens, w1, w2 = autocast_experts(tokens, self.shared_w1, self.shared_w2)
        num_tokens = tokens.shape[0]
        if self.shared_gate is None:
            scores = tokens.new_ones(num_tokens, dtype=accumulate_dtype(tokens.dtype))
        else:
            scores = torch.sigmoid(self.shared_gate(tokens).squeeze(-1))
        token_idx = torch.arange(num_tokens, dtype=torch.int32, device=tokens.device)
        routing = Routing(token_idx, torch.zeros_like(token_idx), scores, num_tokens, 1,
                          top_k=1, validated=True)
        return self._run_experts(tokens, w1, w2, routing, "bf16")

    def weight_copies(self) -> tuple[torch.Tensor, ...]:
        """The tensors this layer derived from its weights and keeps across forwards: the
        cached FP8 copies (empty when none). :func:`sonic.profile_activation_memory` counts
        them as the layer's state, not as activation memory."""
        return self._fp8_cache.tensors()

    def _fp8_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> Fp8ExpertWeights | None:
        """FP8 copies of this forward's (possibly autocast) ``w1``, ``w2`` from the layer's
        :class:`~sonic.experts.moe_experts.Fp8WeightCache` (see
        :func:`sonic.reuse_fp8_weights`); None for bf16 layers."""
        if self.precision != "fp8":
            return None
        return self._fp8_cache.get(w1, w2, (self.w1, self.w2), self.backend)

    if TYPE_CHECKING:
        # What `layer(x)` returns, for type checkers (nn.Module's __call__ is untyped).
        @overload
        def __call__(self, x: torch.Tensor, *,
                     return_aux_loss: Literal[False] = False) -> torch.Tensor: ...

        @overload
        def __call__(self, x: torch.Tensor, *,
                     return_aux_loss: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

        def __call__(self, x: torch.Tensor, *, return_aux_loss: bool = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, *, return_aux_loss: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        check_tensor("x", x)
        dtype = self.w1.dtype
        autocast = autocast_dtype(x.device.type) is not None
        if x.dtype != dtype and not autocast:
            raise TypeError(f"x has dtype {x.dtype} but this MoE layer's parameters are {dtype}; "
                            f"cast the input (x.to({dtype})) or the layer (layer.to({x.dtype})), "
                            "or run under torch.autocast")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have last dimension d_model={self.d_model}, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.d_model)
        layer_input = tokens
        if autocast:
            # Cast once per forward to the autocast dtype (as nn.Linear does): H is kept in it.
            tokens, w1, w2 = autocast_experts(tokens, self.w1, self.w2)
        else:
            w1, w2 = self.w1, self.w2
        if type(self).experts is MoE.experts:
            # sonic.moe_experts makes a fresh dX, which the gate's backward adds into.
            logits, tokens = gate_logits(self.gate, tokens)
        else:
            logits = self.gate(tokens)
        routing = self.route(logits)
        counts = getattr(self, "tokens_per_expert", None)    # present iff bias_update_rate > 0
        if counts is not None and self.training:
            with torch.no_grad():
                counts.add_(expert_load(routing))
        out = self.experts(tokens, w1, w2, routing)
        if self.shared_expert_d:
            # The layer input itself, not the gate's fused alias, which only the routed
            # experts may consume.
            out = out + self.shared_experts(layer_input)
        if self._has_aux_loss():
            seq_len = x.shape[-2] if x.dim() >= 3 else tokens.shape[0]
            aux_loss = self._aux_losses(logits, routing, seq_len)
        else:
            aux_loss = logits.new_zeros((), dtype=accumulate_dtype(logits.dtype))
        out = out.reshape(*x.shape[:-1], self.d_model)
        # Traced code writes nothing to the module: under activation checkpointing a write is a
        # side effect that torch.compile cannot keep in one graph (and export drops it).
        traced = torch.compiler.is_compiling()
        if not traced:
            self.last_routing = Routing(routing.token_idx, routing.expert_idx,
                                        routing.scores.detach(), routing.num_tokens,
                                        routing.num_experts, routing.top_k, routing.validated,
                                        routing.num_valid)
            self._aux_loss = None
        if return_aux_loss:
            return out, aux_loss
        sink = _collector_for(self)
        if sink is not None:
            if self._has_aux_loss():
                if not torch.is_grad_enabled() and any(p.requires_grad
                                                       for p in self.parameters()):
                    raise RuntimeError(
                        "collect_aux_losses: this MoE layer ran with gradients disabled while "
                        "its aux loss is collected, so the collected loss could not train the "
                        "router (reentrant activation checkpointing, checkpoint(..., "
                        "use_reentrant=True), runs the forward this way). Use "
                        "use_reentrant=False, or return the loss from the checkpointed "
                        "function: layer(x, return_aux_loss=True); under torch.no_grad, call "
                        "layer.eval() or collect nothing")
                sink.append(aux_loss)
        elif not traced:
            self._aux_loss = aux_loss     # deprecated path
        return out

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_expert={self.d_expert}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, router={self.router!r}, tile={self.tile}, "
                f"precision={self.precision!r}"
                + (f", activation_cache={self.activation_cache!r}"
                   if self.activation_cache != "bf16" else "")
                + (f", score={self.score!r}" if self.score != "softmax_topk" else "")
                + (f", activation={self.activation!r}" if self.activation != "swiglu" else "")
                + (f", shared_expert_d={self.shared_expert_d}" if self.shared_expert_d else "")
                + (f", n_group={self.n_group}, topk_group={self.topk_group}"
                   if self.n_group > 1 else "")
                + (f", bias_update_rate={self.bias_update_rate}"
                   if self.bias_update_rate else ""))
