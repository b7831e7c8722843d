"""Memory-minimal MoE expert computation with a hand-written backward (SonicMoE §3.2, App. C).

The computation is the custom op ``torch.ops.sonic.moe_experts`` (:mod:`sonic.ops`), whose
registered backward runs the backward kernels as ops too, so ``torch.compile`` and
``torch.export`` trace through it.

Forward: up-proj (gathered X · W1ᵀ) → SwiGLU → down-proj (A · W2ᵀ) → aggregation.
Saved for backward: the layer input X (by reference), H ``(P, 2n)`` (in the compute dtype, or
in e4m3 with 1×128 scales: ``activation_cache="fp8"``, :mod:`sonic.activation_cache`),
the scores and the routing metadata — nothing of size ``P·d`` and not A. Backward recomputes A from H and never forms Y or
dY: the score gradient is ``ds = ⟨dO_t·W2[e], a⟩ = ⟨dA', A⟩`` (docs/design.md §3).

``precision="fp8"`` (recipe of :mod:`sonic.reference.fp8`: e4m3, activations scaled
per 1×128, weights per 128×128, fp32 promotion per k-block) runs the op
``torch.ops.sonic.moe_experts_fp8``. Dataflow, and why:

* Forward. X is quantized once per layer (``quantize_rows``, one scale per token and
  k-block); the up-proj gathers rows of ``x_q`` and their scales (one index for both), which
  costs less than quantizing each token's K copies. Up-proj = FP8 GEMM → H in bf16 → SwiGLU
  → A quantized per row (one backend op, ``ExpertOps.up_proj_swiglu_fp8``: the FP8 store GEMM
  and the SwiGLU kernel writing A quantized itself; under
  :func:`sonic.backend.set_fp8_epilogues` a separate quantization of A, or the fused kernel
  ``grouped_gemm_fp8_swiglu``);
  the down-proj is an FP8 GEMM → Y bf16 → aggregation as in bf16. H stays bf16 so the
  backward recomputes exactly the A the forward used (before A's quantization).
* Backward. dO is quantized once per token; dA' = gather(dO)·W2 is an FP8 GEMM on W2ᵀ's FP8
  copy, followed by the one-pass dSwiGLU epilogue (dH, A', ds) on the saved H, which writes
  dH over H and A' over dA' where the bf16 path would (memory: H and dA' only, as the bf16
  dH kernel); dX = FP8 GEMM of dH (quantized per row) and W1ᵀ's FP8 copy, then aggregation. The transposed copies are the
  forward copies transposed, q and 128×128 block scales alike: a square block holds the same
  values in both orientations, so this *is* ``quantize_blocks(Wᵀ)``, with no re-quantization;
  they are made with the forward copies, once per optimizer step.
* Weight gradients dW1, dW2 reduce over tokens (rows), while the 1×128 row scales run along
  the reduction's other axis, so FP8 operands need a second, column-wise quantization of dO,
  A', dH and gathered X into K-major copies: no accuracy cost in the CPU emulation, and on
  the H200 faster than the bf16 varlen-K GEMMs only where the GEMMs are large against those
  four passes. :func:`sonic.backend.set_fp8_weight_grads` picks; its default ``"auto"``
  takes FP8 by the layer's ``d`` and ``n`` (:func:`sonic.backend.fp8_weight_grads_for`;
  benchmarks/RESULTS.md).
* Saved for backward: as in bf16 (X by reference, H ``(P, 2n)`` in bf16 or, with
  ``activation_cache="fp8"``, in e4m3 + 1×128 scales; scores, metadata; nothing ``P × d``)
  plus the caller's FP8 weight copies by reference.
* Weight copies: :class:`Fp8ExpertWeights` (``quantize_expert_weights``), made per forward by
  :class:`sonic.MoE` (once per weight update inside :func:`reuse_fp8_weights`), or per call by
  :func:`moe_experts` when none are passed.
* Inputs must be bf16 (or cast to it by ``torch.autocast(dtype=torch.bfloat16)``): the FP8
  GEMMs write bf16, and an fp32/fp64 layer would silently lose its precision.
* Backends: ``"cute"`` (and ``"auto"`` on CUDA) need Hopper (sm_90a); ``"torch"`` emulates
  the same quantized math (:func:`sonic.reference.ops.grouped_mm_fp8`) on any device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple, get_args

import torch

from sonic._custom_op import autocast_dtype
from sonic._validation import (check_choice, check_float, check_index, check_index_ranges,
                               check_same_device)
from sonic.activation_cache import check_activation_cache
from sonic.backend import BACKENDS, check_fp8_backend, fp8_weight_grads_for, resolve_backend
from sonic.types import (ACTIVATIONS, FP8_BLOCK, GATE_UP_LAYOUTS, GATED_ACTIVATIONS, Activation,
                         ActivationCache, Backend, GateUp, Precision, RoutingMetadata)

PRECISIONS: tuple[Precision, ...] = get_args(Precision)


def check_activation(activation: str, precision: str, activation_cache: str) -> None:
    """Raise ``ValueError`` unless ``activation`` is one of :data:`sonic.types.ACTIVATIONS`
    and, other than SwiGLU, comes without ``precision="fp8"`` or ``activation_cache="fp8"``
    (the FP8 paths compute SwiGLU only)."""
    check_choice("activation", activation, ACTIVATIONS)
    if activation != "swiglu":
        for name, value in (("precision", precision), ("activation_cache", activation_cache)):
            if value == "fp8":
                raise ValueError(f"{name}='fp8' runs SwiGLU experts only, got "
                                 f"activation={activation!r}")


class Fp8ExpertWeights(NamedTuple):
    """Block-scaled e4m3 copies of the expert weights (:func:`quantize_expert_weights`).

    Attributes:
        w1_q: ``(E, 2n, d)`` float8_e4m3fn; w1_scales: ``(E, 2n/128, d/128)`` fp32.
        w2_q: ``(E, d, n)`` float8_e4m3fn; w2_scales: ``(E, d/128, n/128)`` fp32.
        w1t_q, w1t_scales, w2t_q, w2t_scales: the same of ``W1ᵀ (E, d, 2n)`` and
            ``W2ᵀ (E, n, d)``, the K-major B operands of the dX and dA' GEMMs (FP8 WGMMA reads
            both operands K-major): made with the others, as transposing 1.5 GiB of e4m3 per
            backward cost more than the FP8 GEMMs saved (30B, H200).
    """

    w1_q: torch.Tensor
    w1_scales: torch.Tensor
    w2_q: torch.Tensor
    w2_scales: torch.Tensor
    w1t_q: torch.Tensor
    w1t_scales: torch.Tensor
    w2t_q: torch.Tensor
    w2t_scales: torch.Tensor


def quantize_expert_weights(w1: torch.Tensor, w2: torch.Tensor,
                            backend: Backend = "auto") -> Fp8ExpertWeights:
    """FP8 copies of ``w1 (E, 2n, d)`` and ``w2 (E, d, n)`` and of their transposes (the
    backward's K-major operands), one pass each: e4m3 per 128×128 block with fp32 scales
    (DeepSeek-V3 §3.3; :func:`sonic.reference.fp8.quantize_blocks_and_transpose`, the CuTe
    kernel on a supported GPU). Not differentiable (the weights are read detached); make them
    once per optimizer step and pass them to :func:`moe_experts` as ``fp8_weights``.

    Raises:
        TypeError: a weight is not bf16; ValueError: unknown ``backend``, a weight that is not
        3-D, or d (``w1.shape[2]``) or n (``w2.shape[2]``) not a multiple of 128.
    """
    check_choice("backend", backend, BACKENDS)
    for name, w in (("w1", w1), ("w2", w2)):
        check_float(name, w, ndim=3)
        if w.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16 for FP8 copies, got {w.dtype}")
    check_fp8_sizes(w1.shape[2], w2.shape[2])
    from sonic.ops import call

    with torch.no_grad():
        w1_q, w1_s, w1t_q, w1t_s = call.quantize_blocks(w1.detach(), backend)
        w2_q, w2_s, w2t_q, w2t_s = call.quantize_blocks(w2.detach(), backend)
    return Fp8ExpertWeights(w1_q, w1_s, w2_q, w2_s, w1t_q, w1t_s, w2t_q, w2t_s)


_REUSE_DEPTH = 0      # open reuse_fp8_weights() blocks


@contextlib.contextmanager
def reuse_fp8_weights() -> Iterator[None]:
    """Reuse each layer's FP8 weight copies across the forwards inside the block.

    Outside this block a :class:`sonic.MoE` (or Hugging Face experts module) with
    ``precision="fp8"`` quantizes its weights in every forward, which costs one pass over the
    weights per forward and is always the copy of the weights as they are now. Inside it, a
    layer quantizes once and reuses the copies while its parameters keep their data pointer,
    version counter, shape and device — for several forwards between two optimizer steps
    (gradient accumulation, activation checkpointing's recompute, evaluation, generation)::

        with sonic.reuse_fp8_weights():
            for micro_batch in micro_batches:
                loss_fn(model(micro_batch)).backward()
        optimizer.step()

    ``optimizer.step``, ``load_state_dict`` and ``param.copy_`` bump the version counter and so
    refresh the copies inside the block too; an in-place edit through ``param.data`` (or any
    other tensor that shares the storage but not the version counter) does not: edit weights
    that way only outside the block. Blocks nest; the copies are the module's own (not in its
    ``state_dict``, not copied by ``copy.deepcopy`` or pickling).
    """
    global _REUSE_DEPTH
    _REUSE_DEPTH += 1
    try:
        yield
    finally:
        _REUSE_DEPTH -= 1


class Fp8WeightCache:
    """The FP8 copies of a module's expert weights (:func:`quantize_expert_weights`).

    :meth:`get` quantizes this call's ``w1``, ``w2`` (possibly autocast or transposed views of
    the parameters) and keeps the copies, which :meth:`tensors` lists (they are the module's
    state for :func:`sonic.profile_activation_memory`). It reuses them only inside
    :func:`reuse_fp8_weights`, and only while the key is unchanged: each parameter's data
    pointer, version counter, shape and device, the dtype of the weights quantized and the
    backend. The version counter misses in-place edits through ``.data``, so outside that
    explicit block nothing is reused. Not part of any ``state_dict``; a copy of the owner
    starts from an empty cache (the copies are derived data).
    """

    def __init__(self):
        self._entry: tuple | None = None

    def get(self, w1: torch.Tensor, w2: torch.Tensor, params: tuple[torch.Tensor, ...],
            backend: Backend) -> Fp8ExpertWeights | None:
        """The copies of ``w1``, ``w2`` (derived from ``params``; any strides, e.g.
        transposed views): made now, or reused inside :func:`reuse_fp8_weights` when the key
        matches. None when a weight is not bf16 (:func:`moe_experts` then raises its
        TypeError) and under ``torch.compile`` (quantized per call there)."""
        if (w1.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16
                or torch.compiler.is_compiling()):
            return None
        key = (w1.dtype, backend) + tuple((p.data_ptr(), p._version, tuple(p.shape), p.device)
                                          for p in params)
        if not _REUSE_DEPTH or self._entry is None or self._entry[0] != key:
            self._entry = None      # drop the old copies before making new ones
            self._entry = (key, quantize_expert_weights(w1.contiguous(), w2.contiguous(),
                                                        backend))
        return self._entry[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The kept copies' tensors (empty when none)."""
        return () if self._entry is None else tuple(self._entry[1])

    def __deepcopy__(self, memo) -> "Fp8WeightCache":
        return Fp8WeightCache()

    def __reduce__(self):
        return (Fp8WeightCache, ())


def check_fp8_sizes(d: int, n: int) -> None:
    """Raise ``ValueError`` unless ``d_model`` and ``d_expert`` are multiples of 128."""
    for name, size in (("d_model (d)", d), ("d_expert (n)", n)):
        if size % FP8_BLOCK:
            raise ValueError(f"precision='fp8' needs {name} to be a multiple of {FP8_BLOCK} "
                             f"(one FP8 scale per 128-wide block), got {size}")


def moe_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, scores: torch.Tensor,
                token_idx: torch.Tensor, expert_idx: torch.Tensor, *, gate_up: GateUp = "concat",
                backend: Backend = "auto", metadata: RoutingMetadata | None = None,
                precision: Precision = "bf16", fp8_weights: Fp8ExpertWeights | None = None,
                activation_cache: ActivationCache = "bf16",
                activation: Activation = "swiglu") -> torch.Tensor:
    """Routed experts: ``o_t = Σ_{(t,e) routed} s · W2[e]·act(W1[e]·x_t)``, SwiGLU by default.

    Args:
        x: ``(T, d)`` layer input (bf16, fp16, fp32 or fp64).
        w1: ``(E, 2n, d)`` up-projection weights (``(E, n, d)`` for a non-gated
            ``activation``), ``x``'s dtype (under ``torch.autocast``
            x and both weights are cast once to the autocast dtype, and H is kept in it).
            Rows ``[gate; up]`` with ``gate_up="concat"`` (Hugging Face layout), alternating
            gate/up rows with ``"interleaved"``.
        w2: ``(E, d, n)`` down-projection weights, ``x``'s dtype.
        scores: ``(P,)`` float gate weight of each routed pair.
        token_idx: ``(P,)`` int32/int64 token of each pair, in ``[0, T)``.
        expert_idx: ``(P,)`` int32/int64 expert of each pair, in ``[0, E)``. Pairs may come in
            any order; a token may have 0..E pairs, an expert 0..T.
        gate_up: ``"concat"`` or ``"interleaved"``.
        backend: ``"auto"`` (CuTe kernels where they can run, see
            :func:`sonic.explain_backend`), ``"torch"`` (PyTorch reference) or ``"cute"``.
        metadata: the :func:`sonic.routing_metadata` of exactly these pairs, if the caller has
            it already (e.g. from the faster top-K path); built here otherwise. The kernels
            then read only the metadata, whose indices :func:`sonic.routing_metadata` has
            range-checked, so ``token_idx``/``expert_idx`` values are not read again: a call
            with metadata makes no device→host synchronisation.
        precision: ``"bf16"`` (GEMMs in x's dtype) or ``"fp8"`` (block-scaled e4m3 GEMMs for
            the up-proj, down-proj, dH and dX; bf16 weight gradients; see the module notes).
            ``"fp8"`` needs bf16 x and weights (after autocast) and d, n multiples of 128.
        fp8_weights: with ``precision="fp8"``, the :func:`quantize_expert_weights` of exactly
            ``w1`` and ``w2`` (made once per optimizer step; not checked against them); None
            quantizes them in this call.
        activation_cache: how H is kept for backward: ``"bf16"`` (as computed, in the compute
            dtype, whatever it is) or ``"fp8"`` (e4m3 with an fp32 scale per 1×128 slice of
            each row, 51.6% of the bf16 bytes), with either precision. The
            forward, hence the output, is the same bit for bit; the gradients are those at ``dequantize(quantize(H))`` (see
            :mod:`sonic.activation_cache`). ``"fp8"`` needs ``2n`` a multiple of 128
            and a bf16 / fp16 compute dtype.
        activation: the experts' activation, one of :data:`sonic.types.ACTIVATIONS`: the GLU
            variants ``"swiglu"``, ``"geglu"``, ``"geglu_tanh"``, ``"reglu"`` (Shazeer 2020),
            whose ``A = φ(gate) ⊙ up`` and its derivative the CuTe kernels' fused epilogues
            compute, or the non-gated ``"relu2"`` (So et al. 2021) and ``"gelu"``, computed
            by the reference between the CuTe GEMMs. Only SwiGLU takes ``precision="fp8"`` or
            ``activation_cache="fp8"``.

    Returns:
        ``(T, d)`` in ``x``'s dtype; fp32 accumulation. Differentiable in x, w1, w2 and scores.
        Saved for backward: x (by reference), H ``(P, 2n)`` or ``(P, n)`` (or its e4m3 form and
        scales),
        scores and the routing metadata.

    Raises:
        TypeError: a non-tensor argument or a wrong dtype (index tensors must be integer,
            weights in ``x``'s dtype); ``activation_cache="fp8"`` with an fp32 / fp64 compute
            dtype (such a layer keeps H exactly; see :mod:`sonic.activation_cache`).
        ValueError: mismatched shapes or devices, indices out of range (without ``metadata``;
            checked where values can be read without breaking graph capture), unknown
            ``gate_up``/``backend``/``precision``/``activation_cache``/``activation``;
            an ``activation`` other than SwiGLU with an FP8 option; ``activation_cache="fp8"``
            with ``2n`` not a multiple of 128; with ``precision="fp8"``, d or n not a
            multiple of 128, or ``fp8_weights`` of the wrong shapes.
        RuntimeError: ``backend="cute"`` where the kernels cannot run; ``precision="fp8"``
            with ``backend="cute"``/``"auto"`` on a CUDA GPU that is not Hopper (sm_90a); in
            backward, a
            ``create_graph=True`` differentiation (the backward is hand-written and not twice
            differentiable, so it refuses rather than return a wrong second derivative).

    Source: SonicMoE (arXiv 2512.14080) §3.2 and Appendix C.
    """
    from sonic.ops import call, pack_metadata, routing_metadata_op

    check_float("x", x, ndim=2)
    check_float("w1", w1, ndim=3)
    check_float("w2", w2, ndim=3)
    check_float("scores", scores, ndim=1)
    check_index("token_idx", token_idx)
    check_index("expert_idx", expert_idx)
    check_choice("gate_up", gate_up, GATE_UP_LAYOUTS)
    check_choice("backend", backend, BACKENDS)
    check_choice("precision", precision, PRECISIONS)
    check_activation(activation, precision, activation_cache)
    check_same_device(x=x, w1=w1, w2=w2, scores=scores, token_idx=token_idx,
                      expert_idx=expert_idx)
    x, w1, w2 = autocast_experts(x, w1, w2)
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype} (outside "
                            "torch.autocast the experts do not cast; cast x or the weights)")
    num_tokens, d = x.shape
    num_experts, two_n, d_w1 = w1.shape
    gated = activation in GATED_ACTIVATIONS
    if (gated and two_n % 2) or d_w1 != d:
        raise ValueError(f"w1 must have shape (E, {'2n' if gated else 'n'}, d={d}) for "
                         f"activation={activation!r}, got {tuple(w1.shape)}")
    n = two_n // 2 if gated else two_n
    if tuple(w2.shape) != (num_experts, d, n):
        raise ValueError(f"w2 must have shape (E={num_experts}, d={d}, n={n}), "
                         f"got {tuple(w2.shape)}")
    check_activation_cache(activation_cache, x.dtype, two_n)
    num_pairs = scores.shape[0]
    for name, t in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if t.shape[0] != num_pairs:
            raise ValueError(f"{name} must have shape (P={num_pairs},) like scores, got {tuple(t.shape)}")
    if precision == "fp8":
        check_fp8_call(x, num_experts, two_n // 2, fp8_weights)
    if not torch.compiler.is_compiling():
        resolve_backend(backend, x.device)   # backend="cute" that cannot run fails here
        if precision == "fp8":
            check_fp8_backend(backend, x.device)
    if metadata is not None and not isinstance(metadata, RoutingMetadata):
        raise TypeError(f"metadata must be a sonic.RoutingMetadata, the result of "
                        f"sonic.routing_metadata(routing), or None; got "
                        f"{type(metadata).__name__}"
                        + (" (pass sonic.routing_metadata(routing) instead of the routing)"
                           if type(metadata).__name__ == "Routing" else ""))
    if metadata is None:
        check_index_ranges(token_idx=(token_idx, num_tokens), expert_idx=(expert_idx, num_experts))
        metadata = routing_metadata_op(token_idx, expert_idx, num_tokens, num_experts, None,
                                       backend)
    elif (metadata.num_pairs, metadata.num_tokens, metadata.num_experts) != (
            num_pairs, num_tokens, num_experts):
        raise ValueError(f"metadata must describe P={num_pairs} pairs of T={num_tokens} tokens and "
                         f"E={num_experts} experts, got P={metadata.num_pairs}, "
                         f"T={metadata.num_tokens}, E={metadata.num_experts}")
    if metadata.packed is not None:
        packed, top_k = metadata.packed, metadata.top_k or 0
    else:   # built by hand or by a kernel function directly: pack it (a copy of O(P) ints)
        top_k = 0
        packed = pack_metadata(metadata, top_k)
    if precision == "fp8":
        if fp8_weights is None:
            fp8_weights = quantize_expert_weights(w1, w2, backend)
        out, _cache, _scales = call.moe_experts_fp8(
            x, w1, w2, scores, packed, list(fp8_weights), top_k, gate_up, backend,
            activation_cache, fp8_weight_grads_for(x.shape[1], w2.shape[2]))
        return out
    out, _cache, _scales = call.moe_experts(x, w1, w2, scores, packed, top_k, gate_up, backend,
                                            activation_cache, activation)
    return out


def check_fp8_call(x: torch.Tensor, e: int, n: int, fp8_weights: Fp8ExpertWeights | None) -> None:
    """The FP8-specific checks of :func:`moe_experts` (x and the weights already agree):
    bf16 ``x``, ``d`` and ``n`` multiples of 128, ``fp8_weights`` None or the copies of ``e``
    experts of these sizes on x's device. Raises ``TypeError`` / ``ValueError``."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"precision='fp8' needs bfloat16 x and weights (the FP8 GEMMs write "
                        f"bf16), got {x.dtype}; cast them, or run under "
                        "torch.autocast(dtype=torch.bfloat16)")
    d = x.shape[1]
    check_fp8_sizes(d, n)
    if fp8_weights is None:
        return
    if not isinstance(fp8_weights, Fp8ExpertWeights):
        raise TypeError(f"fp8_weights must be an Fp8ExpertWeights (quantize_expert_weights), "
                        f"got {type(fp8_weights).__name__}")
    shapes = {"w1": (e, 2 * n, d), "w2": (e, d, n)}
    expected = {}
    for name, (_, rows, cols) in shapes.items():
        expected[f"{name}_q"] = (e, rows, cols)
        expected[f"{name}_scales"] = (e, rows // FP8_BLOCK, cols // FP8_BLOCK)
        expected[f"{name}t_q"] = (e, cols, rows)
        expected[f"{name}t_scales"] = (e, cols // FP8_BLOCK, rows // FP8_BLOCK)
    for name, shape in expected.items():
        t = getattr(fp8_weights, name)
        dtype = torch.float32 if name.endswith("scales") else torch.float8_e4m3fn
        if t.dtype != dtype or tuple(t.shape) != shape or t.device != x.device:
            raise ValueError(f"fp8_weights.{name} must be {dtype} of shape {shape} on "
                             f"{x.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def autocast_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor):
    """Under ``torch.autocast`` on x's device, ``x``, ``w1`` and ``w2`` cast once to the
    autocast dtype, as ``nn.Linear`` does (gradients flow back to the original dtypes through
    the casts); unchanged otherwise, and fp64 tensors are never cast (autocast leaves fp64)."""
    dtype = autocast_dtype(x.device.type)
    if dtype is None:
        return x, w1, w2
    castable = (torch.float32, torch.float16, torch.bfloat16)
    return tuple(t.to(dtype) if t.dtype in castable else t for t in (x, w1, w2))
