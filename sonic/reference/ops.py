"""PyTorch reference of every GPU kernel of the MoE dataflow (docs/design.md §3).

Same inputs, outputs and numerics contract as the CuTe kernels (bf16/fp32 in, fp32 accumulation),
so it is both the test oracle and the fallback backend. Runs on any device PyTorch supports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sonic.types import GATE_UP_LAYOUTS  # noqa: F401  (re-exported: its former public path)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _grouped_mm_layout_ok(t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``t``'s layout: a 16-byte aligned base, one of the
    last two dims with stride 1 and the other's stride spanning the rows and a multiple of 16
    bytes (the checks it makes itself, with an error rather than a fallback)."""
    if t.data_ptr() % 16:
        return False
    align = 16 // t.element_size()
    (rows, cols), (row_stride, col_stride) = t.shape[-2:], t.stride()[-2:]
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride % align == 0
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride % align == 0
    return False


def _use_grouped_mm(out_cols: int, *operands: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` serves these operands; elsewhere (fp64/fp16, d or n such
    as 1 or 3 whose rows are not 16-byte multiples, strided views) a loop over experts runs."""
    a = operands[0]
    if not hasattr(torch, "_grouped_mm"):  # PyTorch < 2.8
        return False
    if a.device.type == "cuda":
        ok_dtype = a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device)[0] >= 9
    else:
        ok_dtype = a.dtype in (torch.float32, torch.bfloat16)
    # The output's rows are out_cols wide and must be 16-byte multiples too.
    return (ok_dtype and out_cols * a.element_size() % 16 == 0
            and all(_grouped_mm_layout_ok(t) for t in operands))


def _expert_bounds(offsets: torch.Tensor) -> list[int]:
    return offsets.tolist()  # the per-expert loop needs host offsets: one synchronisation


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
               gather_idx: torch.Tensor | None = None) -> torch.Tensor:
    """varlen-M grouped GEMM: ``C[rows of e] = A[rows of e] · B[e]``.

    Args:
        a: ``(P, k)`` rows grouped by expert, or with ``gather_idx`` the ``(T, k)`` source rows
            (``A[r] = a[gather_idx[r]]``; the reference gathers into a transient copy).
        b: ``(E, k, m)`` per-expert right operand (any strides, e.g. a transposed weight view).
        offsets: ``(E+1,)`` int32 expert row offsets; rows past ``offsets[E]`` (a padded
            routing's padding) are not computed: they hold zeros, so the result is a function
            of the inputs.
        gather_idx: ``(P,)`` integer row indices into ``a``, or None.

    Returns:
        ``(P, m)`` in ``a``'s dtype, fp32 accumulation.
    """
    if gather_idx is not None:
        a = a.index_select(0, gather_idx)
    if a.device.type == "meta":  # shapes only: nothing to compute, no offsets to read
        return a.new_empty(a.shape[0], b.shape[-1])
    if _use_grouped_mm(b.shape[-1], a, b):
        return fill_padding_rows(torch._grouped_mm(a, b, offs=offsets[1:]), offsets)
    out = a.new_empty(a.shape[0], b.shape[-1])
    bounds = _expert_bounds(offsets)
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        torch.matmul(a[lo:hi], b[e], out=out[lo:hi])
    out[bounds[-1]:].zero_()
    return out


def fill_padding_rows(t: torch.Tensor, offsets: torch.Tensor, dim: int = 0,
                      value: float = 0.0) -> torch.Tensor:
    """``value`` in ``t``'s rows ``offsets[E]:`` along ``dim`` (a padded routing's padding,
    which no GEMM computes), in place; ``offsets[E]`` is compared on the device, never read
    back (CUDA graphs, no host synchronisation). Returns ``t``."""
    padding = torch.arange(t.shape[dim], device=t.device) >= offsets[-1]
    return t.masked_fill_(padding.view(-1, *(1,) * (t.dim() - 1 - dim)), value)


def grouped_mm_varlen_k(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                        gather_idx_a: torch.Tensor | None = None,
                        gather_idx_b: torch.Tensor | None = None) -> torch.Tensor:
    """varlen-K grouped GEMM (weight gradients): ``C[e] = A_eᵀ · B_e`` over expert e's rows.

    Args:
        a: ``(P, m)``; b: ``(P, k)``, rows grouped by expert — or either one's source rows
            with ``gather_idx_a`` / ``gather_idx_b`` ``(P,)`` (gathered into a transient copy);
            offsets: ``(E+1,)`` int32.

    Returns:
        ``(E, m, k)`` in ``a``'s dtype; experts with no rows get zeros.
    """
    if gather_idx_a is not None:
        a = a.index_select(0, gather_idx_a)
    if gather_idx_b is not None:
        b = b.index_select(0, gather_idx_b)
    at = a.t()
    num_experts = offsets.shape[0] - 1
    if a.device.type == "meta":
        return a.new_empty(num_experts, a.shape[1], b.shape[1])
    if _use_grouped_mm(b.shape[1], at, b):
        return torch._grouped_mm(at, b, offs=offsets[1:])
    out = a.new_zeros(num_experts, a.shape[1], b.shape[1])
    bounds = _expert_bounds(offsets)
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.matmul(at[:, lo:hi], b[lo:hi], out=out[e])
    return out


def split_gate_up(h: torch.Tensor, gate_up: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(gate, up)`` of ``h (P, 2n)``: halves (``"concat"``) or alternate columns."""
    if gate_up == "concat":
        gate, up = h.chunk(2, dim=-1)
        return gate, up
    return h[:, 0::2], h[:, 1::2]


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor, gate_up: str) -> torch.Tensor:
    """Inverse of :func:`split_gate_up`."""
    if gate_up == "concat":
        return torch.cat([gate, up], dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def up_proj_swiglu(x: torch.Tensor, w1: torch.Tensor, offsets: torch.Tensor,
                   gather_idx: torch.Tensor, gate_up: str, *,
                   h_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward up-proj and its epilogue: ``H = gather(X)·W1ᵀ`` ``(P, 2n)`` and
    ``A = SwiGLU(H)`` ``(P, n)`` (:func:`grouped_mm` then :func:`swiglu`). With ``h_out``
    ``(P, 2n)``, H is written there and returned (the kernels store it in place; here a copy).
    """
    h = grouped_mm(x, w1.transpose(1, 2), offsets, gather_idx)
    return copy_into(h_out, h), swiglu(h, gate_up)


def copy_into(out: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """``t``, or ``out`` holding a copy of it."""
    return t if out is None else out.copy_(t)


def swiglu(h: torch.Tensor, gate_up: str) -> torch.Tensor:
    """Up-proj epilogue: ``A = silu(gate) ⊙ up`` of ``H (P, 2n)`` → ``(P, n)`` in ``h``'s dtype.

    fp32 math (fp64 for fp64 input), one rounding at the end.
    """
    gate, up = split_gate_up(h, gate_up)
    acc = accumulate_dtype(h.dtype)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(h.dtype)


def dh_dswiglu(dout: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
               gather_idx: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor,
               gate_up: str, *, overwrite_h: bool = False, a_out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward dH step: ``dA' = gather(dO)·W2`` ``(P, n)`` and its epilogue
    (:func:`grouped_mm` then :func:`dswiglu_epilogue`): ``(dH, A', ds)``.

    ``overwrite_h=True`` allows an implementation to write dH into ``h``'s buffer (``h`` is
    then dead); this one always allocates dH, the CuTe dH kernel takes the offer. With
    ``a_out`` ``(P, n)``, A' is written there and returned."""
    dh, a_scaled, ds = dswiglu_epilogue(grouped_mm(dout, w2, offsets, gather_idx), h,
                                        row_scores, gate_up)
    return dh, copy_into(a_out, a_scaled), ds


def dswiglu_epilogue(da_prime: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor,
                     gate_up: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Epilogue of the dH kernel (docs/design.md §3, backward step 1; SonicMoE App. C).

    From ``dA' = gather(dO)·W2 (P, n)``, the saved ``H (P, 2n)`` and the score of each row,
    recomputes ``A = silu(g) ⊙ u`` (never stored by the forward) and returns

    * ``dH (P, 2n)``: ``dSwiGLU(dA, H)`` with ``dA = s·dA'`` — ``d_up = dA ⊙ silu(g)``,
      ``d_gate = dA ⊙ u ⊙ σ(g)(1 + g(1 − σ(g)))``;
    * ``A' = s·A (P, n)``: the right operand of dW2;
    * ``ds (P,)``: ``⟨dA', A⟩``, the score gradient of each row (``⟨dO_t, y⟩`` without ``y``).

    ``dH`` and ``A'`` are in ``h``'s dtype, ``ds`` in the accumulation dtype (fp32; fp64 for fp64).
    Math in the accumulation dtype; neither ``A`` nor ``dA`` is rounded before it is used.
    """
    gate, up = split_gate_up(h, gate_up)
    acc = accumulate_dtype(h.dtype)
    g, u, dap = gate.to(acc), up.to(acc), da_prime.to(acc)
    s = row_scores.to(acc).unsqueeze(-1)
    sig = torch.sigmoid(g)
    silu = g * sig
    a = silu * u
    ds = (dap * a).sum(dim=-1)
    da = s * dap
    d_gate = da * u * sig * (1 + g * (1 - sig))
    d_up = da * silu
    return merge_gate_up(d_gate, d_up, gate_up).to(h.dtype), (s * a).to(h.dtype), ds


def aggregate(y: torch.Tensor, token_rows: torch.Tensor, token_offsets: torch.Tensor,
              row_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Expert aggregation, a per-token gather-sum: ``o_t = Σ_rows(t) s[row] · Y[row]``.

    Args:
        y: ``(P, d)`` rows grouped by expert.
        token_rows: ``(P,)`` rows of each token, grouped by token (``RoutingMetadata.token_rows``).
        token_offsets: ``(T+1,)`` int32.
        row_scores: ``(P,)`` fp32 score of each row, or ``None`` for a plain sum (backward dX).

    Returns:
        ``(T, d)`` in ``y``'s dtype, accumulated in fp32 without atomics (deterministic); tokens
        with no rows get zeros.
    """
    acc = accumulate_dtype(y.dtype)
    rows = y.index_select(0, token_rows).to(acc)
    if row_scores is not None:
        rows = rows * row_scores.index_select(0, token_rows).to(acc).unsqueeze(-1)
    # A padded routing's padding rows lie past token_offsets[T]: one more segment takes them
    # and is dropped, so the segments cover every row of `rows`, with no host read of T's end.
    bounds = torch.cat([token_offsets, token_offsets.new_full((1,), rows.shape[0])])
    out = torch.segment_reduce(rows, "sum", offsets=bounds, axis=0)[:-1]
    return out.to(y.dtype)


# ------------------------------------------------------------------------------ FP8
# The FP8 steps of the layer, emulating the CuTe kernels' quantized math on any device (see
# sonic.reference.fp8 for the recipe and its conventions).


def grouped_mm_fp8(a_q: torch.Tensor, a_scales: torch.Tensor, b_q: torch.Tensor,
                   b_scales: torch.Tensor, offsets: torch.Tensor,
                   gather_idx: torch.Tensor | None = None, *,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled FP8 varlen-M grouped GEMM: the math of
    :func:`sonic.kernels.grouped_gemm.grouped_gemm_fp8`
    (:func:`sonic.reference.fp8.grouped_mm_fp8_reference`), on rows grouped by expert.

    Args:
        a_q: ``(P, K)`` float8_e4m3fn, or the ``(T, K)`` source rows with ``gather_idx``.
        a_scales: ``(ceil(K / 128), rows of a_q)`` fp32 (:func:`sonic.reference.fp8.quantize_rows`).
        b_q: ``(E, N, K)`` float8_e4m3fn; b_scales: ``(E, ceil(N / 128), ceil(K / 128))`` fp32.
        offsets: ``(E + 1,)`` int32 expert row offsets; rows past ``offsets[E]`` (a padded
            routing's padding) are not computed: they hold zeros.
        gather_idx: ``(P,)`` integer row indices into ``a_q`` (and its scales), or None.
        out_dtype: bf16 (the kernel's store epilogue) or fp32 (the accumulator the fused
            epilogue kernels read).

    Returns:
        ``(P, N)`` of ``out_dtype``.
    """
    from sonic.reference.fp8 import grouped_mm_fp8_reference

    rows = a_q.shape[0] if gather_idx is None else gather_idx.shape[0]
    valid = int(offsets[-1])
    if gather_idx is None:
        a_q, a_scales, gather_idx = a_q[:valid], a_scales[:, :valid], None
    else:
        gather_idx = gather_idx[:valid]
    result = grouped_mm_fp8_reference(a_q, a_scales.contiguous(), b_q, b_scales, offsets,
                                      gather_idx, out_dtype=out_dtype)
    out = result.new_zeros(rows, b_q.shape[1])
    out[:valid].copy_(result)
    return out


def up_proj_swiglu_fp8(x_q: torch.Tensor, x_scales: torch.Tensor, w1_q: torch.Tensor,
                       w1_scales: torch.Tensor, offsets: torch.Tensor, gather_idx: torch.Tensor,
                       gate_up: str, *, h_out: torch.Tensor | None = None,
                       quantize_h: bool = False) -> tuple[torch.Tensor, ...]:
    """FP8 forward up-proj and its epilogue: ``H = gather(X̂)·Ŵ1ᵀ`` ``(P, 2n)`` bf16 (X̂, Ŵ1
    the block-scaled e4m3 operands, fp32 promotion per k-block) and ``A = SwiGLU(H)`` computed
    from the bf16-rounded H (what the backward recomputes it from), rounded to bf16 and
    quantized per 1×128 for the down-proj: ``(H, A_q (P, n) e4m3, A_scales (n/128, P) fp32)``.

    Args:
        x_q, x_scales: ``(T, d)`` e4m3 and ``(d / 128, T)`` fp32, X quantized per 1×128.
        w1_q, w1_scales: ``(E, 2n, d)`` e4m3 and ``(E, 2n / 128, d / 128)`` fp32.
        offsets: ``(E + 1,)`` int32; gather_idx: ``(P,)`` token of each row.
        gate_up: ``"concat"`` or ``"interleaved"``.
        h_out: ``(P, 2n)`` bf16: where H is written (as :func:`up_proj_swiglu`).
        quantize_h: also return H quantized per 1×128, ``(H_q (P, 2n) e4m3, (2n/128, P)
            fp32)``: the FP8 activation cache.
    """
    from sonic.reference.fp8 import quantize_rows

    h = grouped_mm_fp8(x_q, x_scales, w1_q, w1_scales, offsets, gather_idx)
    return (copy_into(h_out, h), *quantize_rows(swiglu(h, gate_up))) + (
        quantize_rows(h) if quantize_h else ())


def dh_dswiglu_fp8(do_q: torch.Tensor, do_scales: torch.Tensor, w2t_q: torch.Tensor,
                   w2t_scales: torch.Tensor, offsets: torch.Tensor, gather_idx: torch.Tensor,
                   h: torch.Tensor, row_scores: torch.Tensor, gate_up: str, *,
                   overwrite_h: bool = False, a_out: torch.Tensor | None = None,
                   quantize_dh: bool = False, da_prime_fp32: bool = False,
                   h_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """FP8 backward dH step: ``dA' = gather(dÔ)·Ŵ2`` ``(P, n)`` bf16 (dO quantized per 1×128,
    ``w2t_q (E, n, d)`` the FP8 copy of W2ᵀ) then :func:`dswiglu_epilogue`: ``(dH, A', ds)``,
    with ``quantize_dh`` followed by dH quantized per 1×128 for the dX GEMM
    (:func:`sonic.reference.fp8.quantize_rows`: ``dH_q (P, 2n)`` e4m3, ``(2n/128, P)`` fp32).
    ``da_prime_fp32``: dSwiGLU on the fp32 dA' instead of its bf16 rounding, the math of the
    fused kernel :func:`sonic.kernels.grouped_gemm.grouped_gemm_fp8_dswiglu`.
    ``h_scales``: ``h`` is the FP8 activation cache (e4m3, these ``(2n/128, P)`` scales),
    dequantized to bf16 first. ``overwrite_h``, ``a_out``: as for :func:`dh_dswiglu` (this one
    always allocates dH)."""
    from sonic.reference.fp8 import dequantize_rows, quantize_rows

    if h_scales is not None:
        h = dequantize_rows(h, h_scales).to(torch.bfloat16)
    da_prime = grouped_mm_fp8(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx,
                              out_dtype=torch.float32 if da_prime_fp32 else torch.bfloat16)
    dh, a_scaled, ds = dswiglu_epilogue(da_prime, h, row_scores, gate_up)
    return (dh, copy_into(a_out, a_scaled), ds) + (quantize_rows(dh) if quantize_dh else ())


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``(T, k)`` int64 indices of each row's ``k`` largest logits, in descending order.

    A stable descending sort, so among equal logits the lower expert index comes first — the
    order the bitonic top-K kernel produces (SonicMoE arXiv 2512.14080 §4.3) — and results are
    deterministic.
    """
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def topk_scores(logits: torch.Tensor, k: int, score: str,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`sonic.kernels.topk.topk_scores`: each row's top-``k`` experts and
    their routing scores, in ``logits``' dtype.

    Args:
        logits: ``(T, E)`` float logits (the caller picks the accumulation dtype).
        k: experts per row, ``1 <= k <= E``.
        score: ``"softmax_topk"`` (softmax over the ``k`` selected logits) or
            ``"topk_softmax"`` (the ``k`` largest entries of the softmax over all ``E``).
        renormalize: with ``"topk_softmax"``, divide the ``k`` scores by their sum.

    Returns:
        ``(scores (T, k), indices (T, k) int32)``, experts by descending logit, the lower index
        first among equal logits.
    """
    idx = topk_indices(logits, k)
    if score == "softmax_topk":
        scores = torch.softmax(logits.gather(1, idx), dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1).gather(1, idx)
        if renormalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores, idx.to(torch.int32)


def affinity_scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """``(T, E)`` token-to-expert affinities ``s`` in the accumulation dtype: ``sigmoid(logits)``
    for ``score="sigmoid"`` (DeepSeek-V3 §2.1.2), ``softmax(logits)`` over E otherwise.
    Differentiable with respect to ``logits``."""
    acc = accumulate_dtype(logits.dtype)
    if score == "sigmoid":
        return torch.sigmoid(logits.to(acc))
    return torch.softmax(logits.to(acc), dim=-1)


def group_limited_choice(choice: torch.Tensor, n_group: int, topk_group: int,
                         score: str) -> torch.Tensor:
    """``choice (T, E)`` with every expert outside each token's ``topk_group`` best groups set
    to ``-inf`` (``E`` experts in ``n_group`` consecutive groups).

    A group's score is the sum of its two highest choice scores for ``score="sigmoid"``
    (DeepSeek-V3's node-limited routing, §2.1.2; the sum of one score for groups of one expert)
    and its highest choice score for softmax scoring (DeepSeek-V2's device-limited routing,
    §2.1.2). Best groups by a stable descending sort: the lower group first on ties.
    """
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, n_group, num_experts // n_group)
    if score == "sigmoid":
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    else:
        group_scores = grouped.amax(dim=-1)
    keep = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, topk_indices(group_scores, topk_group), True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


def scored_topk(logits: torch.Tensor, k: int, score: str, renormalize: bool,
                expert_bias: torch.Tensor | None, n_group: int, topk_group: int):
    """``(scores (T, k), idx (T, k) int32)`` in torch with no host read: selection on the
    detached affinities plus the bias, within the best groups; weights from the unbiased
    affinities (or, ``"softmax_topk"``, a softmax over the selected logits), differentiable
    with respect to ``logits`` by autograd. The reference of the fused top-K op's sigmoid,
    bias and group options, and their path where that op does not run."""
    affinity = affinity_scores(logits, score)
    choice = affinity.detach()
    if expert_bias is not None:
        choice = choice + expert_bias.to(choice.dtype)
    if n_group > 1:
        choice = group_limited_choice(choice, n_group, topk_group, score)
    idx = topk_indices(choice, k)
    if score == "softmax_topk":
        acc = accumulate_dtype(logits.dtype)
        scores = torch.softmax(logits.to(acc).gather(1, idx), dim=-1)
    else:
        scores = affinity.gather(1, idx)
        if renormalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores, idx.to(torch.int32)
