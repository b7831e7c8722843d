"""sonic's operators as PyTorch custom ops: ``torch.ops.sonic.*``.

Every step of the MoE dataflow is registered with :func:`torch.library.custom_op` (one Python
implementation for every device: it resolves ``backend`` on the tensors' device and runs the
CuTe kernels on a supported GPU, the PyTorch reference elsewhere), a fake implementation that
gives output shapes only (so ``torch.compile``, ``torch.export`` and meta tensors see through the
ops without reading pointers or values), and, for the differentiable ops, an autograd formula
registered with :func:`torch.library.register_autograd`. sonic calls them as ``call.<name>``:
in plain eager execution that runs the same implementation and autograd formula without the
dispatcher's host time (:mod:`sonic._custom_op`), everywhere else ``torch.ops.sonic.<name>``.

Ops (``backend`` is ``"auto"``, ``"torch"`` or ``"cute"``, as in :func:`sonic.moe_experts`):

* ``sonic::topk_routing(logits, k, score, renormalize, backend, expert_bias, n_group,
  topk_group) -> (scores, idx)`` — top-K token choice (softmax or sigmoid scores, an optional
  selection bias and group-limited selection for sigmoid), differentiable in ``logits``
  (twice: the backward is made of torch ops; the bias is not differentiated).
* ``sonic::routing_metadata(token_idx, expert_idx, num_tokens, num_experts, top_k, backend)
  -> packed`` — the :class:`~sonic.RoutingMetadata` index vectors in one int32 buffer (see
  :func:`pack_metadata`); ``top_k = 0`` for pairs in any order.
* ``sonic::up_proj_swiglu``, ``sonic::grouped_mm``, ``sonic::grouped_mm_varlen_k``,
  ``sonic::dh_dswiglu``, ``sonic::aggregate`` — the kernels of docs/design.md §3, signatures as in
  :mod:`sonic.reference.ops` plus ``backend``.
* ``sonic::moe_experts(x, w1, w2, scores, meta, top_k, gate_up, backend, activation_cache,
  activation) -> (out, H, H_scales)`` — the expert forward (``activation``: one of
  :data:`sonic.types.ACTIVATIONS`, SwiGLU by default; H is ``(P, n)`` for a non-gated one);
  its registered backward runs ``dh_dswiglu``, ``grouped_mm_varlen_k``, ``grouped_mm`` and
  ``aggregate`` (docs/design.md §3). It saves x, w1, w2,
  the activation cache, scores and the packed metadata, nothing else. The cache is H in the
  form :mod:`sonic.activation_cache` keeps it: ``(H (P, 2n), empty)`` for ``"bf16"``,
  ``(e4m3 H (P, 2n), fp32 scales (2n/128, P))`` for ``"fp8"``; it is handed back only so
  autograd can save it: :func:`sonic.moe_experts` drops it at once. Eagerly, when the graph is
  not kept, the bf16 backward may write dH over H; a caller of the raw op must not read H after
  backward.

* FP8 (``precision="fp8"``; dataflow in :mod:`sonic.experts.moe_experts`):
  ``sonic::moe_experts_fp8(x, w1, w2, scores, meta, fp8_weights, top_k, gate_up, backend,
  activation_cache, weight_grads) -> (out, H, H_scales)`` with ``fp8_weights`` the eight
  tensors of ``sonic.Fp8ExpertWeights`` (saved by reference, like w1 and w2) and the
  activation cache as for ``sonic::moe_experts``; its backward runs ``sonic::quantize_rows``,
  ``sonic::dh_dswiglu_fp8``, ``sonic::grouped_mm_fp8``, ``grouped_mm_varlen_k`` (bf16 weight
  gradients; ``sonic::quantize_cols_grouped`` and ``sonic::grouped_mm_varlen_k_fp8`` where
  ``weight_grads`` is ``"fp8"``: ``sonic.backend.fp8_weight_grads_for`` at the call) and
  ``aggregate``, and may write dH over H as the bf16 one does; ``sonic::quantize_blocks``
  makes the weight copies. A separate op rather than a ``precision`` argument of
  ``sonic::moe_experts``: a list of tensors cannot have a default in an op schema, and the
  bf16 op's callers stay unchanged.

* ``sonic::token_rounding_select(probs, tc_scores, tc_experts, tile, rounding, capacity) ->
  (token_idx, expert_idx, source, scores, num_kept)`` — token rounding's selection kernel
  (:func:`sonic.kernels.token_rounding.token_rounding_select`, CUDA only), not differentiable:
  its callers attach the scores' gradient through ``source``.

Token rounding's routing is that op and torch ops around it. Its exact form reads the
data-dependent ``P`` back to the host (a graph break under ``torch.compile``, or fullgraph
with ``torch._dynamo.config.capture_scalar_outputs = True``); its padded form
(``padded=True``, what :class:`sonic.MoE` uses) has shapes fixed by ``(T, E, K, tile)`` and
keeps ``P`` on the device, so it makes no host read and can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Sequence

import torch

from sonic._custom_op import SonicOp, autocast_dtype, graph_kept
from sonic._validation import check_choice
from sonic.activation_cache import pack as activation_cache_pack
from sonic.activation_cache import pack_fake as activation_cache_fake
from sonic.activation_cache import unpack as activation_cache_unpack
from sonic.reference import fp8 as fp8_reference
from sonic.reference import ops as reference
from sonic.reference.activations import is_gated
from sonic.types import RoutingMetadata

_INT32 = torch.int32

# call.<name>(*args) runs torch.ops.sonic.<name>; in plain eager execution without the
# dispatcher (sonic._custom_op). Filled by @_op.
call = types.SimpleNamespace()


def _op(name: str):
    """Register the decorated implementation as ``torch.ops.sonic.<name>`` (no mutated
    arguments) and as ``call.<name>``; returns the :class:`~sonic._custom_op.SonicOp`."""
    def register(impl):
        op = SonicOp(name, impl)
        setattr(call, name, op)
        return op
    return register


def _acc(dtype: torch.dtype) -> torch.dtype:
    return reference.accumulate_dtype(dtype)


def _impl(backend: str, device: torch.device):
    from sonic.backend import expert_ops
    return expert_ops(backend, device)


def _fill_padding(backend: str, offsets: torch.Tensor, *rows: torch.Tensor, dim: int = 0,
                  value: float = 0.0):
    """The reference's values (zeros by default) in the rows past ``offsets[E]`` (along
    ``dim``) of each of an op's ``rows`` outputs: a padded routing's padding rows belong to no
    expert, and left as allocated they would make the op's result depend on memory rather
    than its inputs. Read on the device, no host synchronisation; with no padding, the CuTe
    backend's one small launch per output stores nothing."""
    fill = _impl(backend, offsets.device).fill_padding_rows
    if fill is not None:
        for t in rows:
            if t.numel():
                fill(t, offsets, dim, value)


def _no_autocast(device: torch.device):
    """Inside an op the inputs already have the dtypes the caller chose (``sonic.moe_experts``
    applies autocast itself, once, before the op); autocast must not re-cast the kernels'
    internal matmuls."""
    if autocast_dtype(device.type) is not None:
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------ metadata


def metadata_sizes(num_tokens, num_experts, num_pairs, top_k: int) -> list:
    """Lengths of the fields in the packed metadata buffer (see :func:`pack_metadata`)."""
    sizes = [num_experts, num_experts + 1, num_pairs, num_pairs, num_pairs, num_tokens + 1]
    if not top_k:
        sizes.append(num_pairs)
    return sizes


def pack_metadata(meta: RoutingMetadata, top_k: int) -> torch.Tensor:
    """The index vectors of ``meta`` in one int32 buffer, in field order; with ``top_k`` the
    buffer leaves out ``token_rows``, which equals ``pair_rows`` for token-major top-K pairs.

    Without a copy when the fields already lie back to back in one allocation (the CuTe
    metadata kernel allocates them so)."""
    parts = list(meta.tensors())
    if top_k:
        parts = parts[:-1]
    parts = [p.to(_INT32).reshape(-1) for p in parts]
    total = sum(p.numel() for p in parts)
    first = parts[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    contiguous = all(p.is_contiguous() for p in parts)
    expected = offset
    for p in parts:
        if (not contiguous or p.untyped_storage().data_ptr() != storage.data_ptr()
                or p.storage_offset() != expected):
            return torch.cat(parts)
        expected += p.numel()
    if storage.nbytes() < expected * 4:
        return torch.cat(parts)
    return first.new_empty(0).set_(storage, offset, (total,), (1,))


def unpack_metadata(packed: torch.Tensor, num_tokens, num_experts, num_pairs,
                    top_k: int) -> RoutingMetadata:
    """Inverse of :func:`pack_metadata`: views of ``packed``."""
    fields = list(packed.split(metadata_sizes(num_tokens, num_experts, num_pairs, top_k)))
    if top_k:
        fields.append(fields[4])          # token_rows = pair_rows
    return RoutingMetadata.from_tensors(fields, num_tokens, num_experts, packed=packed,
                                        top_k=top_k or None)


@_op("routing_metadata")
def _routing_metadata_op(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int,
                         num_experts: int, top_k: int, backend: str) -> torch.Tensor:
    ops = _impl(backend, expert_idx.device)
    meta = ops.metadata(token_idx, expert_idx, num_tokens, num_experts, top_k=top_k or None)
    packed = pack_metadata(meta, top_k)
    # Never return an input (e.g. an empty index tensor passed through).
    return packed.clone() if packed.untyped_storage().data_ptr() in (
        token_idx.untyped_storage().data_ptr(), expert_idx.untyped_storage().data_ptr()) \
        and packed.numel() else packed


@_routing_metadata_op.register_fake
def _(token_idx, expert_idx, num_tokens, num_experts, top_k, backend):
    total = sum(metadata_sizes(num_tokens, num_experts, expert_idx.shape[0], top_k))
    return expert_idx.new_empty(total, dtype=_INT32)


def routing_metadata_op(token_idx, expert_idx, num_tokens: int, num_experts: int,
                        top_k: int | None, backend: str) -> RoutingMetadata:
    """:func:`sonic.routing_metadata` through the op ``routing_metadata``."""
    k = top_k or 0
    packed = call.routing_metadata(token_idx, expert_idx, num_tokens, num_experts, k, backend)
    return unpack_metadata(packed, num_tokens, num_experts, expert_idx.shape[0], k)


# ------------------------------------------------------------------------------ top-K routing


def _topk_forward(logits, k, score, renormalize, expert_bias, n_group, topk_group, use_kernel):
    if use_kernel:
        from sonic.kernels.topk import topk_scores
        return topk_scores(logits, k, score=score, renormalize=renormalize,
                           expert_bias=expert_bias, n_group=n_group, topk_group=topk_group)
    if score == "sigmoid" or expert_bias is not None or n_group > 1:
        return reference.scored_topk(logits, k, score, renormalize, expert_bias, n_group,
                                     topk_group)
    return reference.topk_scores(logits.to(_acc(logits.dtype)), k, score, renormalize)


@_op("topk_routing")
def _topk_op(logits: torch.Tensor, k: int, score: str, renormalize: bool, backend: str,
             expert_bias: torch.Tensor | None = None, n_group: int = 1,
             topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    from sonic.backend import resolve_backend
    from sonic.kernels.topk import kernel_fits
    use_kernel = (resolve_backend(backend, logits.device) == "cute"
                  and kernel_fits(logits, k, score, n_group, topk_group))
    with _no_autocast(logits.device):
        scores, idx = _topk_forward(logits, k, score, renormalize, expert_bias, n_group,
                                    topk_group, use_kernel)
    return scores.to(_acc(logits.dtype)), idx.to(_INT32)


@_topk_op.register_fake
def _(logits, k, score, renormalize, backend, expert_bias=None, n_group=1, topk_group=1):
    t = logits.shape[0]
    return (logits.new_empty(t, k, dtype=_acc(logits.dtype)),
            logits.new_empty(t, k, dtype=_INT32))


def _topk_setup(ctx, inputs, output):
    logits, _k, score, renormalize = inputs[:4]
    scores, idx = output
    ctx.score, ctx.renormalize, ctx.num_experts = score, renormalize, logits.shape[1]
    ctx.logits_dtype = logits.dtype
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(scores, idx, logits if score != "softmax_topk" else None)
    ctx.mark_non_differentiable(idx)


def _topk_backward(ctx, grad_scores, _grad_idx):
    # Differentiable torch ops on the saved output and input: create_graph=True records them,
    # so second derivatives are exact. Softmax's backward, p ⊙ (G − ⟨G, p⟩), is the fused aten
    # op that autograd itself runs for softmax (twice differentiable), and the (T, E) gradient
    # is made by one in-place scatter into zeros of the logits' dtype: a quarter of the small
    # kernels and host calls of the elementwise form, which also copied and cast (T, E).
    scores, idx, logits = ctx.saved_tensors
    idx = idx.long()
    g = grad_scores.to(scores.dtype)
    rest = (None,) * (ctx.num_inputs - 1)   # k, score, ..., topk_group: not differentiable
    if ctx.score == "softmax_topk":
        grad = scores.new_zeros(idx.shape[0], ctx.num_experts, dtype=ctx.logits_dtype)
        grad_selected = torch._softmax_backward_data(g, scores, -1, scores.dtype)
        return (grad.scatter_(1, idx, grad_selected.to(ctx.logits_dtype)),) + rest
    if ctx.score == "sigmoid":
        return (_sigmoid_topk_grad(g, logits, idx, scores.dtype, ctx.renormalize),) + rest
    probs = torch.softmax(logits.to(scores.dtype), dim=-1)
    if ctx.renormalize:
        # r = s / Σs  ⇒  ∂L/∂s = (g − ⟨g, r⟩) / Σs.
        total = probs.gather(1, idx).sum(-1, keepdim=True)
        g = (g - (g * scores).sum(-1, keepdim=True)) / total
    # G: the selected entries' gradient scattered over all E experts.
    grad = torch.zeros_like(probs).scatter_(1, idx, g)
    return (torch._softmax_backward_data(grad, probs, -1, probs.dtype).to(ctx.logits_dtype),
            ) + rest


def _sigmoid_topk_grad(g: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor,
                       acc: torch.dtype, renormalize: bool) -> torch.Tensor:
    """``(T, E)`` gradient of the logits of sigmoid top-K scores ``s = sigmoid(x[idx])``
    (renormalised: ``s / Σs``) given ``g (T, k)``, the scores' gradient; zero outside ``idx``.

    The selection (bias, groups) is piecewise constant: no gradient flows through it. The
    sigmoids are recomputed from the saved logits, so that with ``create_graph`` the second
    derivative reaches the logits; ``sigmoid_backward`` is the op autograd runs for sigmoid.
    """
    s = torch.sigmoid(logits.gather(1, idx).to(acc))
    if renormalize:
        # r = s / Σs  ⇒  ∂L/∂s = (g − ⟨g, r⟩) / Σs.
        total = s.sum(-1, keepdim=True)
        g = (g - (g * s).sum(-1, keepdim=True) / total) / total
    grad_selected = torch.ops.aten.sigmoid_backward(g, s)
    grad = s.new_zeros(idx.shape[0], logits.shape[1], dtype=logits.dtype)
    return grad.scatter_(1, idx, grad_selected.to(logits.dtype))


_topk_op.register_autograd(_topk_backward, setup_context=_topk_setup)


# ------------------------------------------------------------------------------ token rounding


@_op("token_rounding_select")
def _token_rounding_select_op(probs: torch.Tensor, tc_scores: torch.Tensor,
                              tc_experts: torch.Tensor, tile: int, rounding: str, capacity: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor]:
    from sonic.kernels import token_rounding
    return token_rounding.token_rounding_select(probs, tc_scores, tc_experts, tile, rounding,
                                                capacity)


@_token_rounding_select_op.register_fake
def _(probs, tc_scores, tc_experts, tile, rounding, capacity):
    return (*(probs.new_empty(capacity, dtype=_INT32) for _ in range(3)),
            probs.new_empty(capacity), probs.new_empty((), dtype=_INT32))


# ------------------------------------------------------------------------------ expert kernels


@_op("grouped_mm")
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                   gather_idx: torch.Tensor | None, backend: str) -> torch.Tensor:
    with _no_autocast(a.device):
        out = _impl(backend, a.device).grouped_mm(a, b, offsets, gather_idx)
    _fill_padding(backend, offsets, out)
    return out


@_grouped_mm_op.register_fake
def _(a, b, offsets, gather_idx, backend):
    rows = a.shape[0] if gather_idx is None else gather_idx.shape[0]
    return a.new_empty(rows, b.shape[-1])


@_op("grouped_mm_varlen_k")
def _grouped_mm_varlen_k_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                            gather_idx_a: torch.Tensor | None, gather_idx_b: torch.Tensor | None,
                            backend: str) -> torch.Tensor:
    with _no_autocast(a.device):
        return _impl(backend, a.device).grouped_mm_varlen_k(a, b, offsets, gather_idx_a,
                                                            gather_idx_b)


@_grouped_mm_varlen_k_op.register_fake
def _(a, b, offsets, gather_idx_a, gather_idx_b, backend):
    return a.new_empty(offsets.shape[0] - 1, a.shape[1], b.shape[1])


def _act_cols(h_cols: int, activation: str) -> int:
    """A's columns for H's: ``n`` of ``2n`` for a gated activation, ``n`` of ``n`` otherwise."""
    return h_cols // 2 if is_gated(activation) else h_cols


@_op("up_proj_swiglu")
def _up_proj_swiglu_op(x: torch.Tensor, w1: torch.Tensor, offsets: torch.Tensor,
                       gather_idx: torch.Tensor, gate_up: str, backend: str,
                       activation: str = "swiglu") -> tuple[torch.Tensor, torch.Tensor]:
    with _no_autocast(x.device):
        h, act = _impl(backend, x.device).up_proj_swiglu(x, w1, offsets, gather_idx, gate_up,
                                                         activation=activation)
    _fill_padding(backend, offsets, h, act)
    return h, act


@_up_proj_swiglu_op.register_fake
def _(x, w1, offsets, gather_idx, gate_up, backend, activation="swiglu"):
    p, rows = gather_idx.shape[0], w1.shape[1]
    return x.new_empty(p, rows), x.new_empty(p, _act_cols(rows, activation))


def _dh_dswiglu(dout, w2, offsets, gather_idx, h, row_scores, gate_up, backend, *,
                overwrite_h=False, a_out=None, activation="swiglu"):
    with _no_autocast(dout.device):
        return _impl(backend, dout.device).dh_dswiglu(dout, w2, offsets, gather_idx, h,
                                                      row_scores, gate_up,
                                                      overwrite_h=overwrite_h, a_out=a_out,
                                                      activation=activation)


@_op("dh_dswiglu")
def _dh_dswiglu_op(dout: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
                   gather_idx: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor,
                   gate_up: str, backend: str, activation: str = "swiglu"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # As an op, never in place: the op promises not to mutate h (see _experts_backward).
    step = _dh_dswiglu(dout, w2, offsets, gather_idx, h, row_scores, gate_up, backend,
                       activation=activation)
    _fill_padding(backend, offsets, *step)
    return step


@_dh_dswiglu_op.register_fake
def _(dout, w2, offsets, gather_idx, h, row_scores, gate_up, backend, activation="swiglu"):
    p, rows = h.shape
    return (h.new_empty(p, rows), h.new_empty(p, _act_cols(rows, activation)),
            h.new_empty(p, dtype=_acc(h.dtype)))


@_op("aggregate")
def _aggregate_op(y: torch.Tensor, token_rows: torch.Tensor, token_offsets: torch.Tensor,
                  row_scores: torch.Tensor | None, backend: str) -> torch.Tensor:
    with _no_autocast(y.device):
        return _impl(backend, y.device).aggregate(y, token_rows, token_offsets, row_scores)


@_aggregate_op.register_fake
def _(y, token_rows, token_offsets, row_scores, backend):
    return y.new_empty(token_offsets.shape[0] - 1, y.shape[1])


# ------------------------------------------------------------------------------ expert forward


@_op("moe_experts")
def _moe_experts_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, scores: torch.Tensor,
                    meta: torch.Tensor, top_k: int, gate_up: str, backend: str,
                    activation_cache: str = "bf16", activation: str = "swiglu"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = unpack_metadata(meta, x.shape[0], w1.shape[0], scores.shape[0], top_k)
    return experts_forward(x, w1, w2, scores, m, gate_up, backend,
                           activation_cache=activation_cache, activation=activation)


def experts_forward(x, w1, w2, scores, m: RoutingMetadata, gate_up: str, backend: str, *,
                    h_out: torch.Tensor | None = None, activation_cache: str = "bf16",
                    fp8_weights: Sequence[torch.Tensor] | None = None,
                    activation: str = "swiglu"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of ``sonic::moe_experts`` and ``sonic::moe_experts_fp8`` on unpacked metadata:
    ``(out (T, d), cache, scales)``, the activation cache of
    :func:`sonic.activation_cache.pack` (H itself and an empty tensor for
    ``"bf16"``). With ``fp8_weights`` (the eight tensors of ``Fp8ExpertWeights``) the FP8
    dataflow of :mod:`sonic.experts.moe_experts`: X quantized once per token (the up-proj
    gathers rows of ``x_q`` and their scales), A quantized per row for the down-proj. H is
    written into ``h_out`` when given (the chunked EP path keeps the H of all its chunks in one
    buffer; bf16 cache only). ``activation``: the experts' activation (SwiGLU with
    ``fp8_weights``). Not an op: no autograd, no fake; the caller has validated the
    inputs."""
    ops = _impl(backend, x.device)
    offsets = m.expert_offsets
    with _no_autocast(x.device):
        # The CuTe up-proj gathers X's rows while loading them (the reference: a transient
        # copy) and its epilogue stores both H and A (transient).
        packed = []
        if fp8_weights is None:
            h, act = ops.up_proj_swiglu(x, w1, offsets, m.gather_idx, gate_up, h_out=h_out,
                                        activation=activation)
        else:
            # A comes back quantized per row, as the down-proj reads it; the fp8 cache's H
            # too, from the same pass over H where the SwiGLU kernel makes both.
            x_q, x_scales = ops.quantize_rows(x)
            h, a_q, a_scales, *packed = ops.up_proj_swiglu_fp8(
                x_q, x_scales, *fp8_weights[:2], offsets, m.gather_idx, gate_up, h_out=h_out,
                quantize_h=activation_cache == "fp8")
            act = (a_q, a_scales)
            del x_q, x_scales, a_q, a_scales
        # With the fp8 cache, H is quantized and freed here, before the down-proj allocates
        # its output: the forward's peak then never holds H and Y together.
        cache, scales = packed or activation_cache_pack(h, activation_cache, ops.name == "cute")
        del h, packed
        if m.top_k is None:
            # A padded routing's cache rows past offsets[E] (an op output) as the reference
            # has them: zeros, and for the fp8 cache an all-zero block's scale.
            _fill_padding(backend, offsets, cache)
            _fill_padding(backend, offsets, scales, dim=1,
                          value=fp8_reference.ZERO_BLOCK_SCALE)
        if fp8_weights is None:
            y = ops.grouped_mm(act, w2.transpose(1, 2), offsets)
        else:
            y = ops.grouped_mm_fp8(*act, *fp8_weights[2:4], offsets)
        del act
        row_scores = scores.index_select(0, m.sorted_pairs).to(_acc(x.dtype))
        out = ops.aggregate(y, m.token_rows, m.token_offsets, row_scores)
    return out, cache, scales


@_moe_experts_op.register_fake
def _(x, w1, w2, scores, meta, top_k, gate_up, backend, activation_cache="bf16",
      activation="swiglu"):
    return (x.new_empty(x.shape),
            *activation_cache_fake((scores.shape[0], w1.shape[1]), x.dtype, activation_cache, x))


def _experts_setup(ctx, inputs, output):
    # The dispatcher leaves out trailing arguments equal to their schema defaults.
    x, w1, w2, scores, meta, top_k, gate_up, backend, *rest = inputs
    activation_cache = rest[0] if rest else "bf16"
    activation = rest[1] if len(rest) > 1 else "swiglu"
    ctx.num_inputs = len(inputs)
    _out, h, h_scales = output
    ctx.save_for_backward(x, w1, w2, h, h_scales if activation_cache == "fp8" else None,
                          scores, meta)
    ctx.top_k, ctx.gate_up, ctx.backend = top_k, gate_up, backend
    ctx.activation_cache, ctx.activation = activation_cache, activation
    ctx.mark_non_differentiable(h, h_scales)
    # H has no gradient; materialised, it would be a P x 2n buffer of zeros in every backward.
    ctx.set_materialize_grads(False)


def _first_order_error() -> RuntimeError:
    return RuntimeError(
        "sonic's MoE expert backward is not twice differentiable, so it cannot run "
        "with create_graph=True (gradient penalties, Hessian-vector products, "
        "double backward). Take first-order gradients with create_graph=False, or, where "
        "second derivatives are needed, write the experts with plain PyTorch ops "
        "(a per-expert loop) whose backward autograd records.")


def _traced(t: torch.Tensor) -> bool:
    """Whether backward is being traced (torch.compile / AOTAutograd / export) rather than run
    eagerly on real tensors."""
    return torch.compiler.is_compiling() or type(t) is not torch.Tensor


def pair_score_grads(ds_rows: torch.Tensor, m: RoutingMetadata, dtype: torch.dtype) -> torch.Tensor:
    """Per-pair score gradients from the dH kernel's per-row ``ds``: zero for the pairs on
    rows past ``expert_offsets[E]`` (a padded routing's padding, :attr:`sonic.Routing.num_valid`),
    which no GEMM writes, so their ``ds`` is whatever that memory held (NaN included). Those
    rows are never read: a padding pair gathers a routed row (or row 0) and is then zeroed.
    Top-K metadata (``m.top_k`` set) has no padding: its rows are taken as they are."""
    if m.top_k is None:
        routed = m.expert_offsets[-1]
        real = m.pair_rows < routed
        rows = m.pair_rows.clamp(max=routed - 1).clamp(min=0)
        return torch.where(real, ds_rows.index_select(0, rows), 0).to(dtype)
    return ds_rows.index_select(0, m.pair_rows).to(dtype)


def _grads_after_dh(ctx, step: list, grad_out, x, scores, m: RoutingMetadata,
                    dx_fn, fp8: bool = False) -> tuple:
    """``(dX, dW1, dW2, ds)`` of the expert backward once the dH step gave
    ``step = [dH, A', ds per row, *dx_operand]`` (docs/design.md §3, backward steps 2-4), for the
    inputs that need them: dW2 = varlen-K(gather(dO), A'), dX = aggregate(``dx_fn(dH,
    *dx_operand)``), dW1 = varlen-K(dH, gather(X)). ``dx_fn`` and the weight gradients'
    precision (:func:`weight_grad_fn` with ``fp8``) are what the bf16 and FP8 paths do
    differently. The caller hands over its only references in the list, which
    this empties, so A' is freed before the dX GEMM allocates (the memory-minimal peak) and
    the dX operand before dW1."""
    dh, a_scaled, ds_rows, *dx_operand = step
    step.clear()
    backend = ctx.backend
    weight_grad = weight_grad_fn(m.expert_offsets, backend, fp8)
    need_x, need_w1, need_w2, need_s = ctx.needs_input_grad[:4]
    grad_scores = pair_score_grads(ds_rows, m, scores.dtype) if need_s else None
    grad_w2 = grad_w1 = grad_x = None
    if need_w2:
        grad_w2 = weight_grad(grad_out, a_scaled, m.gather_idx, None)
    del a_scaled
    if need_x:
        rows = dx_fn(dh, *dx_operand)
        dx_operand.clear()
        grad_x = call.aggregate(rows, m.token_rows, m.token_offsets, None, backend)
        del rows
    if need_w1:
        grad_w1 = weight_grad(dh, x, None, m.gather_idx)
    return grad_x, grad_w1, grad_w2, grad_scores


def _experts_backward(ctx, grad_out, _grad_cache, _grad_scales):
    # Grad mode is on inside backward exactly when the caller asked for create_graph=True. The
    # saved H and metadata carry no graph, so a recorded backward would miss terms: refuse.
    if torch.is_grad_enabled() and not _traced(grad_out):
        raise _first_order_error()
    x, w1, w2, h, h_scales, scores, meta = ctx.saved_tensors
    if grad_out is None:     # the output took no part in the loss (grads are not materialised)
        return (None,) * ctx.num_inputs
    m = unpack_metadata(meta, x.shape[0], w1.shape[0], scores.shape[0], ctx.top_k)
    backend, gate_up = ctx.backend, ctx.gate_up
    offsets = m.expert_offsets
    grad_out = grad_out.contiguous().to(x.dtype)
    row_scores = scores.index_select(0, m.sorted_pairs).to(_acc(x.dtype))

    # dH kernel: dA' = gather(dO)·W2; its epilogue recomputes A from H and gives dH, A', ds.
    step = _dh_on_saved_h(
        ctx, h, h_scales, x.dtype,
        lambda h, overwrite_h: dh_step(grad_out, w2, None, m, h, row_scores, gate_up, backend,
                                       overwrite_h=overwrite_h, activation=ctx.activation),
        lambda h: call.dh_dswiglu(grad_out, w2, offsets, m.gather_idx, h, row_scores,
                                  gate_up, backend, ctx.activation))
    del h, h_scales
    grads = _grads_after_dh(ctx, step, grad_out, x, scores, m,
                            lambda dh: dx_rows(dh, w1, None, offsets, backend))
    return *grads, *(None,) * (ctx.num_inputs - len(grads))


def _dh_on_saved_h(ctx, h, h_scales, dtype: torch.dtype, eager, op, *,
                   eager_reads_fp8: bool = False) -> list:
    """``[dH, A', ds per row, *dx_operand]`` of the dH step on the saved activation cache
    ``(h, h_scales)``: ``eager(H, overwrite_h=True)`` where the step may write dH over H,
    ``op(H)`` (the custom op, never in place) where it may not.

    Eagerly, when the graph is not kept, H is dead after this step (this backward holds the
    only unpacked reference and nothing can unpack it again), so dH may go over it: the peak
    then holds one ``P x 2n`` buffer instead of two. The fp8 cache's H is dequantized into a
    buffer this backward owns, so it may be overwritten even when the graph is kept (the saved
    e4m3 H stays intact for the next backward); with ``eager_reads_fp8``, eagerly,
    ``eager(H_q, True, h_scales)`` takes the e4m3 cache as it is instead (the FP8 dH step
    dequantizes it itself, or in its one-pass kernel as it loads H). Traced (torch.compile,
    export), never in place: a compiled graph may reuse H, and the op says it does not mutate
    its inputs."""
    owned = ctx.activation_cache == "fp8"
    if owned and eager_reads_fp8 and not _traced(h):
        return list(eager(h, True, h_scales))
    if owned:
        # Traced, the dequantization stays torch ops (a kernel cannot read fake tensors;
        # inductor fuses the two passes into one).
        use_kernel = not _traced(h) and _impl(ctx.backend, h.device).name == "cute"
        h = activation_cache_unpack(h, h_scales, dtype, use_kernel)
    may_overwrite = not _traced(h) and (owned or not graph_kept())
    if not may_overwrite:
        return list(op(h))
    step = list(eager(h, True))
    if step[0].data_ptr() == h.data_ptr():
        # Anything that still unpacks the saved H must fail loudly, not read dH.
        torch.autograd.graph.increment_version(h)
    return step


_moe_experts_op.register_autograd(_experts_backward, setup_context=_experts_setup)


# ------------------------------------------------------------------------------ FP8
# precision="fp8": the dataflow is documented in sonic.experts.moe_experts. The steps are ops
# so the hand-written backward traces under torch.compile like the bf16 one.


def _fp8_scales_shape(rows: int, cols: int) -> tuple[int, int]:
    return -(-cols // 128), rows


@_op("quantize_rows")
def _quantize_rows_op(x: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(backend, x.device).quantize_rows(x)


@_quantize_rows_op.register_fake
def _(x, backend):
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(_fp8_scales_shape(*x.shape), dtype=torch.float32))


@_op("quantize_blocks")
def _quantize_blocks_op(w: torch.Tensor, backend: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 copies of ``w (E, N, K)`` and of ``wᵀ``: ``(q, scales, q_t, scales_t)``
    (:func:`sonic.reference.fp8.quantize_blocks_and_transpose`)."""
    return _impl(backend, w.device).quantize_blocks(w)


@_quantize_blocks_op.register_fake
def _(w, backend):
    e, n, k = w.shape
    fp8, f32 = torch.float8_e4m3fn, torch.float32
    return (w.new_empty(w.shape, dtype=fp8), w.new_empty(e, n // 128, k // 128, dtype=f32),
            w.new_empty(e, k, n, dtype=fp8), w.new_empty(e, k // 128, n // 128, dtype=f32))


@_op("grouped_mm_fp8")
def _grouped_mm_fp8_op(a_q: torch.Tensor, a_scales: torch.Tensor, b_q: torch.Tensor,
                       b_scales: torch.Tensor, offsets: torch.Tensor,
                       gather_idx: torch.Tensor | None, backend: str) -> torch.Tensor:
    out = _impl(backend, a_q.device).grouped_mm_fp8(a_q, a_scales, b_q, b_scales, offsets,
                                                    gather_idx)
    _fill_padding(backend, offsets, out)
    return out


@_grouped_mm_fp8_op.register_fake
def _(a_q, a_scales, b_q, b_scales, offsets, gather_idx, backend):
    rows = a_q.shape[0] if gather_idx is None else gather_idx.shape[0]
    return a_q.new_empty(rows, b_q.shape[1], dtype=torch.bfloat16)


def _dh_dswiglu_fp8(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx, h, row_scores,
                    gate_up, backend, *, overwrite_h=False, a_out=None, quantize_dh=False,
                    h_scales=None):
    with _no_autocast(h.device):
        return _impl(backend, h.device).dh_dswiglu_fp8(
            do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx, h, row_scores, gate_up,
            overwrite_h=overwrite_h, a_out=a_out, quantize_dh=quantize_dh, h_scales=h_scales)


def dh_step(grad_out, w2, fp8_weights, m: RoutingMetadata, h, row_scores, gate_up: str,
            backend: str, *, overwrite_h: bool = False, a_out=None, for_dx: bool = False,
            h_scales=None, activation: str = "swiglu"):
    """The dH step, eagerly (not an op): ``(dH, A', ds per row, *dx_operand)`` from the
    layer's output gradient ``grad_out (T, d)``, bf16 (``fp8_weights`` None: the dH kernel on
    W2) or FP8 (dO quantized once per token, the dA' GEMM on W2ᵀ's copy ``fp8_weights[6:8]``).
    ``dx_operand``: with ``for_dx`` in FP8, ``(dH_q, dH_scales)``, dH quantized per 1×128 for
    the dX GEMM (by the dSwiGLU kernel itself under the default ``set_fp8_epilogues``); empty
    otherwise. Pass it on to :func:`dx_rows`. ``h_scales`` (FP8 only): ``h`` is the fp8
    activation cache, e4m3 with these scales. ``overwrite_h`` / ``a_out``: as for the
    backends' dH step. ``activation``: the experts' activation (bf16 only)."""
    if fp8_weights is None:
        return _dh_dswiglu(grad_out, w2, m.expert_offsets, m.gather_idx, h, row_scores,
                           gate_up, backend, overwrite_h=overwrite_h, a_out=a_out,
                           activation=activation)
    do_q, do_scales = call.quantize_rows(grad_out, backend)
    # Indexed, not a starred slice: a slice of a sequence has no length a type checker knows.
    w2t_q, w2t_scales = fp8_weights[6], fp8_weights[7]
    return _dh_dswiglu_fp8(do_q, do_scales, w2t_q, w2t_scales, m.expert_offsets,
                           m.gather_idx, h, row_scores, gate_up, backend,
                           overwrite_h=overwrite_h, a_out=a_out, quantize_dh=for_dx,
                           h_scales=h_scales)


def dx_rows(dh, w1, fp8_weights, offsets, backend: str, *dx_operand):
    """``dH · W1`` per row ``(P, d)``: bf16 on W1, or FP8 (dH quantized per row, or the
    ``dx_operand`` :func:`dh_step` already made) on W1ᵀ's copy ``fp8_weights[4:6]``. Ops, so
    the traced backward sees them."""
    if fp8_weights is None:
        return call.grouped_mm(dh, w1, offsets, None, backend)
    dh_q, dh_scales = dx_operand or call.quantize_rows(dh, backend)
    return call.grouped_mm_fp8(dh_q, dh_scales, *fp8_weights[4:6], offsets, None,
                               backend)


@_op("quantize_cols_grouped")
def _quantize_cols_grouped_op(x: torch.Tensor, offsets: torch.Tensor, k_offsets: torch.Tensor,
                              gather_idx: torch.Tensor | None, backend: str
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(backend, x.device).quantize_cols_grouped(x, offsets, k_offsets, gather_idx)


@_quantize_cols_grouped_op.register_fake
def _(x, offsets, k_offsets, gather_idx, backend):
    rows = x.shape[0] if gather_idx is None else gather_idx.shape[0]
    k_rows = fp8_reference.padded_rows_bound(rows, offsets.shape[0] - 1)
    return (x.new_empty(x.shape[1], k_rows, dtype=torch.float8_e4m3fn),
            x.new_empty(k_rows // 128, x.shape[1], dtype=torch.float32))


@_op("grouped_mm_varlen_k_fp8")
def _grouped_mm_varlen_k_fp8_op(a_t_q: torch.Tensor, a_scales: torch.Tensor,
                                b_t_q: torch.Tensor, b_scales: torch.Tensor,
                                k_offsets: torch.Tensor, backend: str) -> torch.Tensor:
    return _impl(backend, a_t_q.device).grouped_mm_varlen_k_fp8(a_t_q, a_scales, b_t_q,
                                                                b_scales, k_offsets)


@_grouped_mm_varlen_k_fp8_op.register_fake
def _(a_t_q, a_scales, b_t_q, b_scales, k_offsets, backend):
    return a_t_q.new_empty(k_offsets.shape[0] - 1, a_t_q.shape[0], b_t_q.shape[0],
                           dtype=torch.bfloat16)


def weight_grad_fn(offsets: torch.Tensor, backend: str, fp8: bool):
    """``weight_grad(a, b, gather_idx_a, gather_idx_b) = C[e] = A_eᵀ·B_e`` over the experts
    of ``offsets``, for :func:`_grads_after_dh` and expert parallelism's backward: the bf16
    varlen-K op, or with ``fp8`` (:func:`sonic.backend.fp8_weight_grads_for` gave ``"fp8"``
    when the layer ran forward) both operands quantized per ``128 x 1`` block along the tokens
    into K-major copies, then the FP8 varlen-K GEMM (bf16 out; the padded offsets made once,
    on the device, for both weight gradients). Ops, so the traced backward sees them."""
    if not fp8:
        def weight_grad(a, b, gather_idx_a, gather_idx_b):
            return call.grouped_mm_varlen_k(a, b, offsets, gather_idx_a, gather_idx_b,
                                            backend)
        return weight_grad
    k_offsets = fp8_reference.padded_offsets(offsets)

    def weight_grad_fp8(a, b, gather_idx_a, gather_idx_b):
        a_t = call.quantize_cols_grouped(a, offsets, k_offsets, gather_idx_a, backend)
        b_t = call.quantize_cols_grouped(b, offsets, k_offsets, gather_idx_b, backend)
        return call.grouped_mm_varlen_k_fp8(*a_t, *b_t, k_offsets, backend)

    return weight_grad_fp8


@_op("dh_dswiglu_fp8")
def _dh_dswiglu_fp8_op(do_q: torch.Tensor, do_scales: torch.Tensor, w2t_q: torch.Tensor,
                       w2t_scales: torch.Tensor, offsets: torch.Tensor, gather_idx: torch.Tensor,
                       h: torch.Tensor, row_scores: torch.Tensor, gate_up: str,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # As an op, never in place (see _dh_on_saved_h).
    step = _dh_dswiglu_fp8(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx, h,
                           row_scores, gate_up, backend)
    _fill_padding(backend, offsets, *step)
    return step


@_dh_dswiglu_fp8_op.register_fake
def _(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx, h, row_scores, gate_up, backend):
    p, two_n = h.shape
    return h.new_empty(p, two_n), h.new_empty(p, two_n // 2), h.new_empty(p, dtype=_acc(h.dtype))


@_op("moe_experts_fp8")
def _moe_experts_fp8_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                        scores: torch.Tensor, meta: torch.Tensor,
                        fp8_weights: list[torch.Tensor], top_k: int, gate_up: str,
                        backend: str, activation_cache: str, weight_grads: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # weight_grads (sonic.backend.fp8_weight_grads_for at the call: "auto" already resolved)
    # serves the backward; an argument, so the choice travels with the graph and keys what
    # torch.compile caches.
    from sonic.backend import FP8_WEIGHT_GRAD_PRECISIONS

    check_choice("weight_grads", weight_grads, FP8_WEIGHT_GRAD_PRECISIONS)
    m = unpack_metadata(meta, x.shape[0], w1.shape[0], scores.shape[0], top_k)
    return experts_forward(x, w1, w2, scores, m, gate_up, backend,
                           activation_cache=activation_cache, fp8_weights=list(fp8_weights))


@_moe_experts_fp8_op.register_fake
def _(x, w1, w2, scores, meta, fp8_weights, top_k, gate_up, backend, activation_cache,
      weight_grads):
    return (x.new_empty(x.shape),
            *activation_cache_fake((scores.shape[0], w1.shape[1]), x.dtype, activation_cache, x))


def _experts_setup_fp8(ctx, inputs, output):
    (x, w1, w2, scores, meta, fp8_weights, top_k, gate_up, backend, activation_cache,
     weight_grads) = inputs
    _out, h, h_scales = output
    # The FP8 weight copies are the caller's (a per-step cache or made per call from w1, w2):
    # saved by reference, like w1 and w2.
    ctx.save_for_backward(x, w1, w2, h, h_scales if activation_cache == "fp8" else None,
                          scores, meta, *fp8_weights)
    ctx.top_k, ctx.gate_up, ctx.backend = top_k, gate_up, backend
    ctx.activation_cache, ctx.weight_grads = activation_cache, weight_grads
    ctx.mark_non_differentiable(h, h_scales)
    ctx.set_materialize_grads(False)


def _experts_backward_fp8(ctx, grad_out, _grad_cache, _grad_scales):
    if torch.is_grad_enabled() and not _traced(grad_out):
        raise _first_order_error()
    x, w1, w2, h, h_scales, scores, meta, *fp8_weights = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 5 + ([None] * len(fp8_weights), None, None, None, None, None)
    m = unpack_metadata(meta, x.shape[0], w1.shape[0], scores.shape[0], ctx.top_k)
    backend, gate_up = ctx.backend, ctx.gate_up
    offsets = m.expert_offsets
    grad_out = grad_out.contiguous().to(x.dtype)
    row_scores = scores.index_select(0, m.sorted_pairs).to(_acc(x.dtype))

    # dA' = gather(dO)·W2 in FP8 (dO quantized once per token, gathered with its scales),
    # then the dSwiGLU epilogue from the saved H (dequantized first with the fp8 cache).
    def traced(h):
        do_q, do_scales = call.quantize_rows(grad_out, backend)
        return call.dh_dswiglu_fp8(do_q, do_scales, *fp8_weights[6:8], offsets,
                                   m.gather_idx, h, row_scores, gate_up, backend)

    step = _dh_on_saved_h(
        ctx, h, h_scales, x.dtype,
        lambda h, overwrite_h, h_scales=None: dh_step(
            grad_out, w2, fp8_weights, m, h, row_scores, gate_up, backend,
            overwrite_h=overwrite_h, for_dx=ctx.needs_input_grad[0], h_scales=h_scales),
        traced, eager_reads_fp8=True)
    del h, h_scales
    grads = _grads_after_dh(ctx, step, grad_out, x, scores, m,
                            lambda dh, *dx_operand: dx_rows(dh, w1, fp8_weights, offsets,
                                                            backend, *dx_operand),
                            fp8=ctx.weight_grads == "fp8")
    # No schema defaults: with a list input, torch checks that the gradients mirror the
    # arguments as dispatched, and the dispatcher drops those equal to their defaults.
    return *grads, None, [None] * len(fp8_weights), None, None, None, None, None


_moe_experts_fp8_op.register_autograd(_experts_backward_fp8,
                                      setup_context=_experts_setup_fp8)
