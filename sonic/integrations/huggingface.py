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

import torch
import torch.nn.functional as F
from torch import nn

import sonic
from sonic._validation import check_choice
from sonic.autograd.activation_cache import ACTIVATION_CACHES, check_fp8_d_expert
from sonic.autograd.moe_experts import (PRECISIONS, Fp8WeightCache, autocast_experts,
                                        check_fp8_sizes)
from sonic.backend import BACKENDS
from sonic.types import ActivationCache, Backend, Precision

try:
    import transformers.integrations.moe as _hf_moe
    from transformers.activations import SiLUActivation
except ImportError as err:  # transformers missing, or older than the experts registry (v5)
    raise ImportError("sonic.integrations.huggingface needs transformers >= 5 (the experts "
                      "implementation registry): pip install 'sonic-cute-moe[hf]'") from err

#: The name sonic is registered under in transformers' experts-implementation registry.
IMPLEMENTATION = "sonic"

_SILU = (nn.SiLU, SiLUActivation)
_WEIGHT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def register() -> None:
    """Add ``"sonic"`` to transformers' experts-implementation registry (idempotent).

    Afterwards ``model.set_experts_implementation("sonic")`` and
    ``from_pretrained(..., experts_implementation="sonic")`` select :func:`sonic_experts_forward`
    (with ``backend="auto"`` unless :func:`use_sonic_experts` set another).
    """
    _hf_moe.ExpertsInterface.register(IMPLEMENTATION, sonic_experts_forward)


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module that dispatches through the registry
    (its class is decorated with ``@use_experts_implementation``, which sets these flags)."""
    return all(hasattr(module, flag) for flag in
               ("has_gate", "has_bias", "is_transposed", "is_concatenated",
                "has_post_expert_norm"))


def check_experts(module: nn.Module) -> str:
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
        ValueError: experts sonic cannot compute, naming the cause — no gate
            (``has_gate=False``), biases (``gate_up_proj_bias``/``down_proj_bias``), a
            post-expert norm, a custom ``_apply_gate`` (e.g. GPT-OSS's clamped SwiGLU), an
            ``act_fn`` that is not SiLU (any form: ``nn.SiLU``, ``F.silu``, a function
            computing it; the message names the input where it differs), or weights that are not
            bf16/fp16/fp32/fp64 (quantized experts).
    """
    name = type(module).__name__
    if not is_experts_module(module):
        raise TypeError(f"module must be a transformers experts module (a class decorated with "
                        f"@use_experts_implementation), got {name}")
    if not module.has_gate:
        raise ValueError(f"{name} has no gate (has_gate=False: up_proj and an activation); "
                         f"sonic computes gated SwiGLU experts only")
    if module.has_bias:
        raise ValueError(f"{name} has expert biases (gate_up_proj_bias, down_proj_bias); sonic's "
                         f"experts have none")
    if module.has_post_expert_norm:
        raise ValueError(f"{name} applies a post-expert norm (has_post_expert_norm=True); "
                         f"sonic's experts have none")
    if type(module)._apply_gate is not _hf_moe._default_apply_gate:
        raise ValueError(f"{name} overrides _apply_gate (a custom gating function); sonic "
                         f"computes silu(gate) * up only")
    _check_silu(name, getattr(module, "act_fn", None),
                getattr(getattr(module, "config", None), "hidden_act", None))
    for param in ("gate_up_proj", "down_proj"):
        dtype = getattr(module, param).dtype
        if dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"{name}.{param} has dtype {dtype}; sonic takes bf16, fp16, fp32 "
                             f"or fp64 expert weights (not quantized ones)")
    return "concat"


def _check_silu(name: str, act_fn, hidden_act) -> None:
    """Raise ``ValueError`` unless ``act_fn`` computes SiLU: an ``nn.SiLU`` or transformers'
    ``SiLUActivation`` module, or a parameter-free callable (``F.silu``, as LFM2-MoE uses, or
    any other form) that matches ``F.silu`` in fp64 on probe points spanning its range."""
    if isinstance(act_fn, _SILU):
        return
    what = f"{name}.act_fn ({_describe(act_fn)}, config.hidden_act={hidden_act!r})"
    if not callable(act_fn):
        raise ValueError(f"{what} is not callable; sonic computes SwiGLU experts, "
                         f"silu(gate) * up")
    if isinstance(act_fn, nn.Module) and any(True for _ in act_fn.parameters()):
        raise ValueError(f"{what} has parameters (a learnable activation); sonic computes "
                         f"SwiGLU experts with the fixed silu(gate) * up")
    probe = torch.cat([torch.linspace(-30, 30, 121, dtype=torch.float64),
                       torch.tensor([-1e-3, 1e-3, 0.5, 1.5], dtype=torch.float64)])
    want = F.silu(probe)
    try:
        with torch.no_grad():
            got = act_fn(probe.clone())
    except Exception as err:    # any failure means it is not a SiLU sonic can stand in for
        raise ValueError(f"{what} failed on a float64 probe ({type(err).__name__}: {err}); "
                         f"sonic computes SwiGLU experts, silu(gate) * up") from err
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        raise ValueError(f"{what} does not map a tensor elementwise to one of its shape; sonic "
                         f"computes SwiGLU experts, silu(gate) * up")
    diff = (got.to(torch.float64) - want).abs()
    worst = int(diff.argmax())
    if not diff[worst] <= 1e-6 * (1 + want[worst].abs()):
        raise ValueError(f"{what} is not SiLU: at x={probe[worst].item():g} it gives "
                         f"{got[worst].item():.6g}, silu gives {want[worst].item():.6g}; sonic "
                         f"computes SwiGLU experts only (hidden_act 'silu' or 'swish')")


def _describe(act_fn) -> str:
    if isinstance(act_fn, nn.Module):
        return type(act_fn).__name__
    return getattr(act_fn, "__qualname__", type(act_fn).__name__)


def sonic_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
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
    backend = getattr(self, "_sonic_backend", "auto")
    precision = getattr(self, "_sonic_precision", "bf16")
    activation_cache = getattr(self, "_sonic_activation_cache", "bf16")
    params = (self.gate_up_proj, self.down_proj)
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
                            activation_cache=activation_cache)
    return out.to(hidden_states.dtype)


def _fp8_cache(module: nn.Module) -> Fp8WeightCache:
    """The experts module's FP8 weight copies (``module._sonic_fp8_cache``), made on first
    use. A plain attribute, not a buffer: not in the ``state_dict``; ``copy.deepcopy`` and
    pickling of the module give the copy an empty cache."""
    cache = getattr(module, "_sonic_fp8_cache", None)
    if cache is None:
        cache = module._sonic_fp8_cache = Fp8WeightCache()
    return cache


def _check_fp8_options(module: nn.Module, precision: str, activation_cache: str) -> None:
    """The size conditions of the FP8 options for ``module``'s weights (dtypes are checked
    per call: autocast may supply bf16)."""
    w2 = module.down_proj.transpose(1, 2) if module.is_transposed else module.down_proj
    d, n = w2.shape[1], w2.shape[2]
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
    if not callable(getattr(model, "set_experts_implementation", None)):
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
    model.set_experts_implementation(IMPLEMENTATION)
    left = [name for name, m in experts.items()
            if m.config._experts_implementation != IMPLEMENTATION]
    if left:
        raise RuntimeError(f"transformers did not switch these experts modules to sonic: "
                           f"{', '.join(left)}")
    return model
