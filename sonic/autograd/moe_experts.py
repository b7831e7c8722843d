"""Memory-minimal MoE expert computation with a hand-written backward (SonicMoE §3.2, App. C).

The computation is the custom op ``torch.ops.sonic.moe_experts`` (:mod:`sonic.ops`), whose
registered backward runs the backward kernels as ops too, so ``torch.compile`` and
``torch.export`` trace through it.

Forward: up-proj (gathered X · W1ᵀ) → SwiGLU → down-proj (A · W2ᵀ) → aggregation.
Saved for backward: the layer input X (by reference), H ``(P, 2n)`` (in the compute dtype, or
in e4m3 with 1×128 scales: ``activation_cache="fp8"``, :mod:`sonic.autograd.activation_cache`),
the scores and the routing metadata — nothing of size ``P·d`` and not A. Backward recomputes A from H and never forms Y or
dY: the score gradient is ``ds = ⟨dO_t·W2[e], a⟩ = ⟨dA', A⟩`` (DESIGN §3).
"""

from __future__ import annotations

import torch

from sonic._validation import (check_choice, check_float, check_index, check_index_ranges,
                               check_same_device)
from sonic.autograd.activation_cache import check_activation_cache
from sonic.backend import BACKENDS, resolve_backend
from sonic.reference.ops import GATE_UP_LAYOUTS
from sonic.routing.metadata import RoutingMetadata


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``/``create_graph``), so
    saved tensors must survive it. Unknown (no such query in this PyTorch) counts as kept."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def moe_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, scores: torch.Tensor,
                token_idx: torch.Tensor, expert_idx: torch.Tensor, *, gate_up: str = "concat",
                backend: str = "auto", metadata: RoutingMetadata | None = None,
                activation_cache: str = "bf16") -> torch.Tensor:
    """Routed SwiGLU experts: ``o_t = Σ_{(t,e) routed} s · W2[e]·SwiGLU(W1[e]·x_t)``.

    Args:
        x: ``(T, d)`` layer input (bf16, fp16, fp32 or fp64).
        w1: ``(E, 2n, d)`` up-projection weights, ``x``'s dtype (under ``torch.autocast``
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
        activation_cache: how H is kept for backward: ``"bf16"`` (as computed, in the compute
            dtype, whatever it is) or ``"fp8"`` (e4m3 with an fp32 scale per 1×128 slice of
            each row, 51.6% of the bf16 bytes; issue 18). The forward, hence the output, is the
            same bit for bit; the gradients are those at ``dequantize(quantize(H))`` (see
            :mod:`sonic.autograd.activation_cache`). ``"fp8"`` needs ``2n`` a multiple of 128
            and a bf16 / fp16 compute dtype.

    Returns:
        ``(T, d)`` in ``x``'s dtype; fp32 accumulation. Differentiable in x, w1, w2 and scores.
        Saved for backward: x (by reference), H ``(P, 2n)`` (or its e4m3 form and scales),
        scores and the routing metadata.

    Raises:
        TypeError: a non-tensor argument or a wrong dtype (index tensors must be integer,
            weights in ``x``'s dtype); ``activation_cache="fp8"`` with an fp32 / fp64 compute
            dtype (such a layer keeps H exactly; see :mod:`sonic.autograd.activation_cache`).
        ValueError: mismatched shapes or devices, indices out of range (without ``metadata``;
            checked where values can be read without breaking graph capture), unknown
            ``gate_up``/``backend``/``activation_cache``; ``activation_cache="fp8"`` with
            ``2n`` not a multiple of 128 (the message names ``d_expert``).
        RuntimeError: ``backend="cute"`` where the kernels cannot run; in backward, a
            ``create_graph=True`` differentiation (the backward is hand-written and not twice
            differentiable, so it refuses rather than return a wrong second derivative).

    Source: SonicMoE (arXiv 2512.14080) §3.2 and Appendix C.
    """
    from sonic.ops import pack_metadata, routing_metadata_op

    check_float("x", x, ndim=2)
    check_float("w1", w1, ndim=3)
    check_float("w2", w2, ndim=3)
    check_float("scores", scores, ndim=1)
    check_index("token_idx", token_idx)
    check_index("expert_idx", expert_idx)
    check_choice("gate_up", gate_up, GATE_UP_LAYOUTS)
    check_choice("backend", backend, BACKENDS)
    check_same_device(x=x, w1=w1, w2=w2, scores=scores, token_idx=token_idx,
                      expert_idx=expert_idx)
    x, w1, w2 = autocast_experts(x, w1, w2)
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype} (outside "
                            "torch.autocast the experts do not cast; cast x or the weights)")
    num_tokens, d = x.shape
    num_experts, two_n, d_w1 = w1.shape
    if two_n % 2 or d_w1 != d:
        raise ValueError(f"w1 must have shape (E, 2n, d={d}), got {tuple(w1.shape)}")
    if tuple(w2.shape) != (num_experts, d, two_n // 2):
        raise ValueError(f"w2 must have shape (E={num_experts}, d={d}, n={two_n // 2}), "
                         f"got {tuple(w2.shape)}")
    check_activation_cache(activation_cache, x.dtype, two_n)
    num_pairs = scores.shape[0]
    for name, t in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if t.shape[0] != num_pairs:
            raise ValueError(f"{name} must have shape (P={num_pairs},) like scores, got {tuple(t.shape)}")
    if not torch.compiler.is_compiling():
        resolve_backend(backend, x.device)   # backend="cute" that cannot run fails here
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
    out, _cache, _scales = torch.ops.sonic.moe_experts(x, w1, w2, scores, packed, top_k, gate_up,
                                                       backend, activation_cache)
    return out


def autocast_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor):
    """Under ``torch.autocast`` on x's device, ``x``, ``w1`` and ``w2`` cast once to the
    autocast dtype, as ``nn.Linear`` does (gradients flow back to the original dtypes through
    the casts); unchanged otherwise, and fp64 tensors are never cast (autocast leaves fp64)."""
    device_type = x.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return x, w1, w2
    dtype = torch.get_autocast_dtype(device_type)
    castable = (torch.float32, torch.float16, torch.bfloat16)
    return tuple(t.to(dtype) if t.dtype in castable else t for t in (x, w1, w2))
