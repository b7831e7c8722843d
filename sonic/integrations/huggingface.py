"""sonic as an experts implementation of Hugging Face transformers MoE models.

transformers ≥ 5 stores the routed experts of its MoE models as two fused parameters,
``gate_up_proj (E, 2n, d)`` (rows ``[gate; up]``) and ``down_proj (E, d, n)`` — sonic's ``w1``
and ``w2`` layout — and dispatches the experts' forward through a registry of implementations
(``transformers.integrations.moe.ExpertsInterface``, selected by
``config._experts_implementation``; every implementation is called as
``fn(experts_module, hidden_states (T, d), top_k_index (T, K), top_k_weights (T, K))``).
This module registers :func:`sonic.moe_experts` there under the name ``"sonic"``:

    from sonic.integrations.huggingface import use_sonic_experts
    model = AutoModelForCausalLM.from_pretrained(...)
    use_sonic_experts(model)
    # or, at load: register(); from_pretrained(..., experts_implementation="sonic")

Only the experts change: the model's own router, its load-balancing loss
(``output_router_logits=True``), shared experts, and its parameters and checkpoints stay
Hugging Face's (``save_pretrained`` writes nothing sonic-specific; the experts implementation is
not serialised). Supported: gated SiLU experts (SwiGLU) without biases and without a
post-expert norm, weights stored ``(E, 2n, d)`` or transposed ``(E, d, 2n)``, any float dtype
sonic takes. ``use_sonic_experts(model, precision="fp8", activation_cache="fp8")`` runs the
experts with sonic's FP8 GEMMs and/or keeps their H in e4m3 (as :class:`sonic.MoE`), the FP8
weight copies made once per weight update per experts module. Token rounding is not available
here: the registry passes the router's top-K choice, not its logits.

Source: transformers 5.x ``integrations/moe.py`` (the registry and its call signature).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

import sonic
from sonic._validation import check_choice
from sonic.activation_cache import ACTIVATION_CACHES, check_fp8_d_expert
from sonic.experts.moe_experts import (PRECISIONS, Fp8WeightCache, autocast_experts,
                                        check_fp8_sizes)
from sonic.backend import BACKENDS
from sonic.nn.config import MoEConfig
from sonic.types import Activation, ActivationCache, Backend, GateUp, Precision

try:
    import transformers.integrations.moe as _hf_moe
    from transformers import activations as _hf_act
    from transformers.activations import SiLUActivation
    from transformers.modeling_utils import PreTrainedModel as _PreTrainedModel
except ImportError as err:  # transformers missing, or older than the experts registry (v5)
    raise ImportError("sonic.integrations.huggingface needs transformers >= 5 (the experts "
                      "implementation registry): pip install 'sonic-cute-moe[hf]'") from err

#: The name sonic is registered under in transformers' experts-implementation registry.
IMPLEMENTATION = "sonic"

# A transformers module read for its model-specific attributes (``experts``, ``gate``,
# ``down_proj``, ``act_fn``, ``is_transposed``, ...), which its class defines, not nn.Module.
_HFModule = Any

# transformers' activation modules by the function they compute (exact classes: a subclass or
# a clipped variant computes something else).
_ACT_FUNCTIONS = {nn.SiLU: "silu", SiLUActivation: "silu", nn.ReLU: "relu",
                  _hf_act.GELUTanh: "gelu_tanh", _hf_act.NewGELUActivation: "gelu_tanh",
                  _hf_act.ReLUSquaredActivation: "relu2"}
# sonic's activation of (gated, function).
_SONIC_ACTIVATIONS: dict[tuple[bool, str], Activation] = {
    (True, "silu"): "swiglu", (True, "gelu"): "geglu", (True, "gelu_tanh"): "geglu_tanh",
    (True, "relu"): "reglu", (False, "relu2"): "relu2", (False, "gelu"): "gelu"}


# What an activation of another form is compared with (:func:`_probe_function`).
_REFERENCE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu, "relu2": lambda x: F.relu(x).square()}


# What a probed act_fn computes, kept while it lives: it has no parameters, so its values
# cannot change, and the experts' forward asks on every call.
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _act_function(act_fn, what: str) -> str:
    """The function ``act_fn`` computes, by sonic's names: from the class of transformers'
    activation modules, else by probing it (:func:`_probe_function`, which raises)."""
    if type(act_fn) is _hf_act.GELUActivation:
        return "gelu"           # exact erf GELU (its python variant computes the same)
    known = _ACT_FUNCTIONS.get(type(act_fn))
    if known is not None:
        return known
    try:
        return _PROBED[act_fn]
    except (KeyError, TypeError):       # not probed yet, or not weakly referable
        pass
    name = _probe_function(act_fn, what)
    try:
        _PROBED[act_fn] = name
    except TypeError:                   # a builtin: probed on every call
        pass
    return name


def expert_activation(module: nn.Module) -> Activation:
    """sonic's ``activation`` for a transformers experts module: its ``act_fn`` (made from
    ``config.hidden_act``) on the gate of gated experts (``"swiglu"``, ``"geglu"``,
    ``"geglu_tanh"``, ``"reglu"``) or on the whole up-projection of ungated ones
    (``"relu2"``, ``"gelu"``); see :mod:`sonic.reference.activations`.

    Raises:
        ValueError: an activation sonic does not compute, naming it and ``config.hidden_act``.
    """
    act_fn = getattr(module, "act_fn", None)
    gated = bool(getattr(module, "has_gate", True))
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    what = (f"{type(module).__name__}.act_fn ({_describe(act_fn)}, "
            f"config.hidden_act={hidden_act!r})")
    activation = _SONIC_ACTIVATIONS.get((gated, _act_function(act_fn, what)))
    if activation is None:
        supported = ", ".join(repr(k[1]) for k in _SONIC_ACTIVATIONS if k[0] == gated)
        raise ValueError(f"{what}: sonic computes {'gated' if gated else 'ungated'} experts "
                         f"with {supported} only")
    return activation


_WEIGHT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def register() -> None:
    """Add ``"sonic"`` to transformers' experts-implementation registry (idempotent).

    Afterwards ``model.set_experts_implementation("sonic")`` and
    ``from_pretrained(..., experts_implementation="sonic")`` select :func:`sonic_experts_forward`
    (with ``backend="auto"`` unless :func:`use_sonic_experts` set another). A model whose
    experts sonic cannot compute is refused when it is built or loaded with
    ``experts_implementation="sonic"`` or switched to it, not at its first forward: this wraps,
    once, ``PreTrainedModel.post_init`` (the end of every model's ``__init__``, when its
    modules exist; ``from_pretrained`` builds the model so) and
    ``PreTrainedModel.get_correct_experts_implementation`` (which
    ``set_experts_implementation`` asks) to run :func:`check_model` when the implementation
    is ``"sonic"``. transformers has no hook of its own for this check.
    """
    _hf_moe.ExpertsInterface.register(IMPLEMENTATION, sonic_experts_forward)
    for method in ("post_init", "get_correct_experts_implementation"):
        current = getattr(_PreTrainedModel, method)
        if not getattr(current, "_sonic_checks_experts", False):
            setattr(_PreTrainedModel, method, _checking(current, method == "post_init"))


def _checking(method, at_build: bool):
    """``method`` of ``PreTrainedModel``, followed by :func:`check_model` when the model's
    (``at_build``) or the requested (otherwise) experts implementation is sonic's."""
    def checked(self, *args):
        result = method(self, *args)
        chosen = self.config._experts_implementation if at_build else result
        if chosen == IMPLEMENTATION:
            check_model(self)
        return result
    setattr(checked, "_sonic_checks_experts", True)
    return checked


def check_model(model: nn.Module) -> None:
    """:func:`check_experts` on every experts module of ``model``.

    Raises:
        ValueError: the first experts module sonic cannot compute, named by its path
            (``model.layers.0.mlp.experts: ...``).
    """
    for name, module in model.named_modules():
        if is_experts_module(module):
            try:
                check_experts(module)
            except ValueError as err:
                raise ValueError(f"model.{name}: {err}") from err


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module that dispatches through the registry
    (its class is decorated with ``@use_experts_implementation``, which sets these flags)."""
    return all(hasattr(module, flag) for flag in
               ("has_gate", "has_bias", "is_transposed", "is_concatenated",
                "has_post_expert_norm"))


def check_experts(module: nn.Module) -> GateUp:
    """Check that sonic computes exactly what ``module``'s own forward computes.

    Args:
        module: a transformers experts module (see :func:`is_experts_module`).

    Returns:
        The ``gate_up`` layout to pass to :func:`sonic.moe_experts`: ``"concat"``.
        transformers' default gate splits ``gate_up_proj``'s output with ``chunk(2)`` whatever
        the class's ``is_concatenated`` flag says; interleaved layouts only come with custom
        gates (GPT-OSS), which are refused below.

    Raises:
        TypeError: ``module`` is not such an experts module.
        ValueError: experts sonic cannot compute, naming the cause — biases
            (``gate_up_proj_bias``/``down_proj_bias``), a post-expert norm, a custom
            ``_apply_gate`` (e.g. GPT-OSS's clamped SwiGLU), an activation sonic lacks
            (:func:`expert_activation`; an ``act_fn`` of any form — module or function — is
            recognised by what it computes, and the message names the input where it differs
            from SiLU), or weights that are not bf16/fp16/fp32/fp64 (quantized experts).
    """
    name = type(module).__name__
    if not is_experts_module(module):
        raise TypeError(f"module must be a transformers experts module (a class decorated with "
                        f"@use_experts_implementation), got {name}")
    if module.has_bias:
        raise ValueError(f"{name} has expert biases (gate_up_proj_bias, down_proj_bias); sonic's "
                         f"experts have none")
    if module.has_post_expert_norm:
        raise ValueError(f"{name} applies a post-expert norm (has_post_expert_norm=True); "
                         f"sonic's experts have none")
    if getattr(type(module), "_apply_gate", None) is not _hf_moe._default_apply_gate:
        raise ValueError(f"{name} overrides _apply_gate (a custom gating function); sonic "
                         f"computes silu(gate) * up only")
    expert_activation(module)
    for param in (_up_name(module), "down_proj"):
        dtype = getattr(module, param).dtype
        if dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"{name}.{param} has dtype {dtype}; sonic takes bf16, fp16, fp32 "
                             f"or fp64 expert weights (not quantized ones)")
    return "concat"


def _probe_function(act_fn: Any, what: str) -> str:
    """The activation a parameter-free callable ``act_fn`` computes (a name of
    :data:`_REFERENCE_FUNCTIONS`), found by comparing it in fp64 with each on probe points
    spanning its range (``F.silu``, as LFM2-MoE passes it, or any other form).

    Raises:
        ValueError: ``act_fn`` not callable, with parameters, failing on the probe, not
            elementwise, or computing none of them (naming where it differs from SiLU).
    """
    if not callable(act_fn):
        raise ValueError(f"{what} is not callable")
    if isinstance(act_fn, nn.Module) and any(True for _ in act_fn.parameters()):
        raise ValueError(f"{what} has parameters (a learnable activation); sonic computes "
                         f"fixed activations only")
    # On the CPU whatever device context the model is being built in (meta, under
    # from_pretrained).
    probe = torch.cat([torch.linspace(-30, 30, 121, dtype=torch.float64, device="cpu"),
                       torch.tensor([-1e-3, 1e-3, 0.5, 1.5], dtype=torch.float64,
                                    device="cpu")])
    try:
        with torch.no_grad():
            got = act_fn(probe.clone())
    except Exception as err:    # any failure means it is no activation sonic can stand in for
        raise ValueError(f"{what} failed on a float64 probe ({type(err).__name__}: {err})") \
            from err
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        raise ValueError(f"{what} does not map a tensor elementwise to one of its shape")
    got = got.to(torch.float64)
    for name, reference in _REFERENCE_FUNCTIONS.items():
        want = reference(probe)
        if bool(((got - want).abs() <= 1e-6 * (1 + want.abs())).all()):
            return name
    want = F.silu(probe)
    worst = int((got - want).abs().argmax())
    raise ValueError(f"{what} computes none of sonic's activations "
                     f"({', '.join(_REFERENCE_FUNCTIONS)}); it is not SiLU: at "
                     f"x={probe[worst].item():g} it gives {got[worst].item():.6g}, silu gives "
                     f"{want[worst].item():.6g}")


def _describe(act_fn) -> str:
    if isinstance(act_fn, nn.Module):
        return type(act_fn).__name__
    return getattr(act_fn, "__qualname__", type(act_fn).__name__)


def _up_name(module: _HFModule) -> str:
    """The up-projection parameter: ``gate_up_proj`` of gated experts, ``up_proj`` otherwise."""
    return "gate_up_proj" if module.has_gate else "up_proj"


def sonic_experts_forward(self: _HFModule, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"sonic"`` experts implementation: HF routed experts by :func:`sonic.moe_experts`.

    Called by transformers in place of the experts module's own forward; the routed pairs are
    ``token_idx = arange(T).repeat_interleave(K)``, ``expert_idx = top_k_index.flatten()``,
    ``scores = top_k_weights.flatten()`` (token-major, so sonic's top-K metadata path applies).
    Every token passed is computed, padding tokens included, exactly as transformers' own
    implementations do (the MoE block routes all positions; masking happens in attention and
    the loss).

    Args:
        self: the experts module (``gate_up_proj (E, 2n, d)``, ``down_proj (E, d, n)``, or
            ``(E, d, 2n)``/``(E, n, d)`` when ``is_transposed``).
        hidden_states: ``(T, d)``; cast to the weights' dtype when it differs (as transformers'
            ``grouped_mm`` does under autocast).
        top_k_index: ``(T, K)`` integer expert of each token's choices, in ``[0, E)``. Under
            expert parallelism (``self._is_expert_parallel``) indices ``>= E`` mark choices
            owned by another rank: their weight is zeroed and they contribute nothing, and no
            gradient flows to their weight.
        top_k_weights: ``(T, K)`` float gate weights.

    Returns:
        ``(T, d)`` in ``hidden_states``' dtype. Differentiable in hidden_states, the weights
        and top_k_weights.

    Raises:
        ValueError: experts sonic cannot compute (see :func:`check_experts`), or an expert
            index out of range outside expert parallelism (from :func:`sonic.routing_metadata`).
    """
    gate_up = check_experts(self)
    activation = expert_activation(self)
    backend = cast(Backend, getattr(self, "_sonic_backend", "auto"))
    precision = cast(Precision, getattr(self, "_sonic_precision", "bf16"))
    activation_cache = cast(ActivationCache, getattr(self, "_sonic_activation_cache", "bf16"))
    params = (getattr(self, _up_name(self)), self.down_proj)
    w1, w2 = params
    if self.is_transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    num_experts = w1.shape[0]
    num_tokens, top_k = top_k_index.shape
    expert_idx = top_k_index.reshape(-1)
    scores = top_k_weights.reshape(-1)
    if getattr(self, "_is_expert_parallel", False):
        foreign = expert_idx >= num_experts
        # Clamped rather than dropped: dropping would make P data-dependent (a host sync); a
        # zero score makes the pair's output and weight gradients zero, and masked_fill stops
        # its score gradient.
        expert_idx = expert_idx.clamp(max=num_experts - 1)
        scores = scores.masked_fill(foreign, 0.0)
    token_idx = torch.arange(num_tokens, device=expert_idx.device,
                             dtype=torch.int32).repeat_interleave(top_k)
    routing = sonic.Routing(token_idx, expert_idx.to(torch.int32), scores, num_tokens,
                            num_experts, top_k=top_k)
    meta = sonic.routing_metadata(routing, backend=backend)
    # Autocast first, so that the cached FP8 copies are those of the weights the GEMMs use.
    x, w1, w2 = autocast_experts(hidden_states.to(w1.dtype), w1, w2)
    fp8_weights = None
    if precision == "fp8":
        fp8_weights = _fp8_cache(self).get(w1, w2, params, backend)
    out = sonic.moe_experts(x, w1, w2, scores, routing.token_idx, routing.expert_idx,
                            gate_up=gate_up, backend=backend, metadata=meta,
                            precision=precision, fp8_weights=fp8_weights,
                            activation_cache=activation_cache, activation=activation)
    return out.to(hidden_states.dtype)


def _fp8_cache(module: _HFModule) -> Fp8WeightCache:
    """The experts module's FP8 weight copies (``module._sonic_fp8_cache``), made on first
    use. A plain attribute, not a buffer: not in the ``state_dict``; ``copy.deepcopy`` and
    pickling of the module give the copy an empty cache."""
    cache = getattr(module, "_sonic_fp8_cache", None)
    if cache is None:
        cache = module._sonic_fp8_cache = Fp8WeightCache()
    return cache


def _check_fp8_options(module: _HFModule, precision: str, activation_cache: str) -> None:
    """The size conditions of the FP8 options for ``module``'s weights (dtypes are checked
    per call: autocast may supply bf16)."""
    w2 = module.down_proj.transpose(1, 2) if module.is_transposed else module.down_proj
    d, n = w2.shape[1], w2.shape[2]
    activation = expert_activation(module)
    if activation != "swiglu" and (precision, activation_cache) != ("bf16", "bf16"):
        raise ValueError(f"activation {activation!r} has no FP8 path: precision='fp8' and "
                         f"activation_cache='fp8' run SwiGLU experts only")
    if precision == "fp8":
        check_fp8_sizes(d, n)
    if activation_cache == "fp8":
        check_fp8_d_expert(n)


def use_sonic_experts(model: nn.Module, backend: Backend = "auto", *, precision: Precision = "bf16",
                      activation_cache: ActivationCache = "bf16") -> nn.Module:
    """Switch a transformers MoE model's routed experts to sonic, in place.

    Registers ``"sonic"`` (:func:`register`), checks every experts module
    (:func:`check_experts`) before changing anything, and calls
    ``model.set_experts_implementation("sonic")``. The router, the auxiliary loss, shared
    experts, parameters and ``save_pretrained`` output are untouched;
    ``model.set_experts_implementation("grouped_mm")`` (or ``"eager"``) switches back.

    Args:
        model: a ``transformers.PreTrainedModel`` with experts that dispatch through the
            registry (transformers ≥ 5 MoE models: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, …).
        backend: sonic's backend for these experts: ``"auto"``, ``"torch"`` or ``"cute"``
            (see :func:`sonic.explain_backend`).
        precision: ``"bf16"`` or ``"fp8"`` (block-scaled e4m3 expert GEMMs, bf16
            weight gradients; needs bf16 compute — bf16 weights or ``torch.autocast`` — and
            ``hidden_size`` and the experts' intermediate size multiples of 128). The FP8
            copies of each experts module's weights are made in every forward, and once per
            weight update inside :func:`sonic.reuse_fp8_weights`.
        activation_cache: ``"bf16"`` or ``"fp8"`` (H kept for backward in e4m3 + 1×128
            scales; bf16/fp16 compute, intermediate size a multiple of 64); see
            :func:`sonic.moe_experts`.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` has no ``set_experts_implementation`` (not a transformers model).
        ValueError: unknown ``backend``, ``precision`` or ``activation_cache``; no experts
            module in ``model``; an experts module sonic cannot compute, or whose sizes the
            FP8 options do not fit (the message names the module and the cause).
        RuntimeError: transformers left some experts module on another implementation.
    """
    check_choice("backend", backend, BACKENDS)
    check_choice("precision", precision, PRECISIONS)
    check_choice("activation_cache", activation_cache, ACTIVATION_CACHES)
    switch = getattr(model, "set_experts_implementation", None)
    if not callable(switch):
        raise TypeError(f"model must be a transformers PreTrainedModel (>= 5, with "
                        f"set_experts_implementation), got {type(model).__name__}")
    experts = {name: m for name, m in model.named_modules() if is_experts_module(m)}
    if not experts:
        raise ValueError(f"model ({type(model).__name__}) has no experts module that dispatches "
                         f"through transformers' experts-implementation registry")
    for name, module in experts.items():
        try:
            check_experts(module)
            _check_fp8_options(module, precision, activation_cache)
        except ValueError as err:
            raise ValueError(f"model.{name}: {err}") from err
    register()
    for module in experts.values():
        module._sonic_backend = backend
        module._sonic_precision = precision
        module._sonic_activation_cache = activation_cache
    switch(IMPLEMENTATION)
    left = [name for name, m in experts.items()
            if m.config._experts_implementation != IMPLEMENTATION]
    if left:
        raise RuntimeError(f"transformers did not switch these experts modules to sonic: "
                           f"{', '.join(left)}")
    return model


# ------------------------------------------------------------------ whole MoE blocks: moe_from_hf

# Router classes by the routing they compute: "softmax" — softmax over E in fp32, top-K of the
# probabilities, renormalised when ``norm_topk_prob`` (always for Mixtral); "sigmoid_groups" —
# DeepSeek-V3's sigmoid scores, selection bias ``e_score_correction_bias``, group-limited
# top-K, renormalisation and ``routed_scaling_factor``.
_ROUTERS = {"Qwen3MoeTopKRouter": "softmax", "Qwen2MoeTopKRouter": "softmax",
            "OlmoeTopKRouter": "softmax", "MixtralTopKRouter": "softmax",
            "DeepseekV3TopkRouter": "sigmoid_groups", "Glm4MoeTopkRouter": "sigmoid_groups"}
# MoE block classes: (router class, shared-expert attribute or None, shared gate attribute).
_BLOCKS = {"Qwen3MoeSparseMoeBlock": ("Qwen3MoeTopKRouter", None, None),
           "OlmoeSparseMoeBlock": ("OlmoeTopKRouter", None, None),
           "MixtralSparseMoeBlock": ("MixtralTopKRouter", None, None),
           "Qwen2MoeSparseMoeBlock": ("Qwen2MoeTopKRouter", "shared_expert",
                                      "shared_expert_gate"),
           "DeepseekV3MoE": ("DeepseekV3TopkRouter", "shared_experts", None),
           "Glm4MoeMoE": ("Glm4MoeTopkRouter", "shared_experts", None)}


def _check_block(block: _HFModule) -> tuple[str, str | None, str | None]:
    """``(routing kind, shared-expert attribute, shared-gate attribute)`` of a supported HF MoE
    block, or ``ValueError`` naming what differs."""
    name = type(block).__name__
    if name not in _BLOCKS:
        raise ValueError(f"moe_from_hf supports the MoE blocks {', '.join(sorted(_BLOCKS))}; "
                         f"got {name}")
    router_cls, shared, shared_gate = _BLOCKS[name]
    router = getattr(block, "gate", None)
    if type(router).__name__ != router_cls:
        raise ValueError(f"{name}.gate is {type(router).__name__}, expected {router_cls} (a "
                         f"replaced router computes something moe_from_hf cannot know)")
    check_experts(block.experts)
    if getattr(block, "jitter_noise", 0):
        raise ValueError(f"{name} has router_jitter_noise={block.jitter_noise}: its training "
                         f"forward scales the input by random noise, which sonic.MoE does not")
    if shared is not None:
        mlp = getattr(block, shared)
        if (_act_function(mlp.act_fn, f"{name}.{shared}.act_fn")
                != _act_function(block.experts.act_fn, f"{name}.experts.act_fn")):
            raise ValueError(f"{name}.{shared} uses {type(mlp.act_fn).__name__} but the routed "
                             f"experts {type(block.experts.act_fn).__name__}; sonic.MoE has one "
                             f"activation")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if getattr(mlp, proj).bias is not None:
                raise ValueError(f"{name}.{shared}.{proj} has a bias; sonic's experts have none")
    return _ROUTERS[router_cls], shared, shared_gate


def _weight_pairs(layer: "sonic.MoE", block: _HFModule, shared: str | None,
                  shared_gate: str | None) -> list[tuple[str, Callable, torch.Tensor]]:
    """``(sonic parameter name, view, HF tensor)``: ``view(getattr(layer, name))`` (or of its
    gradient) is the tensor laid out as the HF one. Used to copy either way and to compare."""
    experts = block.experts
    hf_w1, hf_w2 = getattr(experts, _up_name(experts)), experts.down_proj
    if experts.is_transposed:
        def flip(t):
            return t.transpose(1, 2)
    else:
        def flip(t):
            return t
    pairs = [("gate.weight", lambda t: t, block.gate.weight),
             ("w1", flip, hf_w1), ("w2", flip, hf_w2)]
    if hasattr(layer, "expert_bias"):
        pairs.append(("expert_bias", lambda t: t, block.gate.e_score_correction_bias))
    if shared is not None:
        mlp, n_s = getattr(block, shared), layer.shared_expert_d
        pairs += [("shared_w1", lambda t: t[0, :n_s], mlp.gate_proj.weight),
                  ("shared_w1", lambda t: t[0, n_s:], mlp.up_proj.weight),
                  ("shared_w2", lambda t: t[0], mlp.down_proj.weight)]
    if shared_gate is not None:
        pairs.append(("shared_gate.weight", lambda t: t, getattr(block, shared_gate).weight))
    return pairs


def moe_from_hf(block: nn.Module, *, backend: Backend = "auto") -> "sonic.MoE":
    """A :class:`sonic.MoE` computing what a Hugging Face MoE block computes, with its weights.

    Supported blocks (transformers ≥ 5): Qwen3-MoE, OLMoE and Mixtral (softmax top-K, renormalised
    per ``norm_topk_prob``, always for Mixtral), Qwen2-MoE (plus its shared expert and the
    sigmoid gate on it), DeepSeek-V3 and GLM4-MoE (sigmoid scores, ``e_score_correction_bias``
    as the selection bias ``expert_bias``, ``n_group``/``topk_group`` group-limited routing
    with DeepSeek-V3's top-2-sum group score, ``norm_topk_prob`` and ``routed_scaling_factor``;
    the shared experts MLP). The experts' activation comes from the model's ``hidden_act``
    (:func:`expert_activation`). The copy is independent of the block (weights copied, not
    shared); :func:`moe_to_hf` writes a layer's weights back.

    Differences that remain: the router runs in the layer's dtype (DeepSeek-V3/GLM4 keep an fp32
    router in a bf16 model), DeepSeek-V3's renormalisation adds 1e-20 to its denominator, and
    ties between equal scores may be broken otherwise (sonic: the lower expert; ``torch.topk``:
    unspecified). The layer's aux losses are off (HF computes its load-balancing loss at the
    model level from the router logits); bias updates are off (``bias_update_rate=0``).

    Args:
        block: the MoE block, e.g. ``model.model.layers[i].mlp``.
        backend: the new layer's backend.

    Returns:
        A :class:`sonic.MoE` on the block's device in its experts' dtype.

    Raises:
        ValueError: another block, a replaced router, experts sonic cannot compute
            (:func:`check_experts`), Mixtral's router jitter noise, a shared expert with
            another activation or with biases — the message names what differs.
    """
    kind, shared, shared_gate = _check_block(block)
    config = _layer_config(block, kind, shared, shared_gate, backend)
    experts: _HFModule = block.experts
    w2 = experts.down_proj
    layer = sonic.MoE.from_config(config, device=w2.device, dtype=w2.dtype)
    with torch.no_grad():
        for name, view, hf_tensor in _weight_pairs(layer, block, shared, shared_gate):
            view(layer.get_parameter(name) if name != "expert_bias"
                 else layer.expert_bias).copy_(hf_tensor)
    return layer


# The MoEConfig fields an HF block decides (moe_to_hf checks a layer against them); the
# others (router, losses, precision, ...) are the user's choice.
_BLOCK_FIELDS = ("d_model", "d_expert", "num_experts", "top_k", "activation", "score",
                 "renormalize", "routed_scaling_factor", "n_group", "resolved_topk_group",
                 "resolved_shared_expert_d", "shared_expert_gate")


def _layer_config(block: _HFModule, kind: str, shared: str | None, shared_gate: str | None,
                  backend: Backend = "auto") -> MoEConfig:
    """The configuration of the :class:`sonic.MoE` that mirrors ``block``."""
    router, experts = block.gate, block.experts
    w2 = experts.down_proj.transpose(1, 2) if experts.is_transposed else experts.down_proj
    num_experts, d_model, d_expert = w2.shape
    options: dict[str, Any] = dict(activation=expert_activation(experts), backend=backend)
    if kind == "softmax":
        options.update(score="topk_softmax",
                       renormalize=bool(getattr(router, "norm_topk_prob", True)))
    else:
        options.update(score="sigmoid", renormalize=bool(router.norm_topk_prob),
                       routed_scaling_factor=float(router.routed_scaling_factor),
                       n_group=router.num_group, topk_group=router.topk_group,
                       expert_bias=True)
    if shared is not None:
        options.update(shared_expert_d=getattr(block, shared).gate_proj.out_features,
                       shared_expert_gate=shared_gate is not None)
    return MoEConfig(d_model, d_expert, num_experts, router.top_k, **options)


def moe_to_hf(layer: "sonic.MoE", block: nn.Module) -> nn.Module:
    """Write ``layer``'s weights (router, experts, shared experts and gate, expert bias) into the
    HF MoE ``block`` it mirrors (the reverse of :func:`moe_from_hf`), in place; returns
    ``block``.

    Raises:
        ValueError: a block :func:`moe_from_hf` does not support, or a layer whose
            configuration differs from what ``moe_from_hf(block)`` would build (sizes,
            scoring, groups, activation, shared experts), naming the first difference.
    """
    kind, shared, shared_gate = _check_block(block)
    expected = _layer_config(block, kind, shared, shared_gate)
    have = layer.config
    # The bias buffer also exists where bias_update_rate > 0 asked for it.
    pairs = [(f.removeprefix("resolved_"), getattr(have, f), getattr(expected, f))
             for f in _BLOCK_FIELDS]
    pairs.append(("expert_bias", hasattr(layer, "expert_bias"), expected.expert_bias))
    for attr, actual, value in pairs:
        if actual != value:
            raise ValueError(f"layer has {attr}={actual!r} but the {type(block).__name__} "
                             f"needs {value!r}")
    with torch.no_grad():
        for name, view, hf_tensor in _weight_pairs(layer, block, shared, shared_gate):
            source = layer.get_parameter(name) if name != "expert_bias" else layer.expert_bias
            hf_tensor.copy_(view(source))
    return block
