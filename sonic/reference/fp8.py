"""PyTorch reference of the block-scaled FP8 recipe: quantization, dequantization,
the promoted FP8 grouped GEMM, and the error an e4m3 GEMM may have.

Recipe (DeepSeek-V3 technical report, arXiv 2412.19437, §3.3 "fine-grained quantization"; the
DeepGEMM kernels): e4m3 operands (``torch.float8_e4m3fn``, largest finite value 448) with fp32
scales, one per 1×128 slice of an activation row and one per 128×128 block of a weight. The
GEMM multiplies fp8 operands per 128-wide k-block and promotes each k-block's partial sum into
an fp32 accumulator, scaled by the product of the two operands' scales.

Conventions (shared by every FP8 kernel of sonic; the kernels are tested bitwise against this
module):

* ``scale = amax / 448`` in fp32 (IEEE division, not rounded to a power of two), ``amax`` the
  largest ``|value|`` of the block taken in fp32; an all-zero block gets ``scale = 1.0`` (its
  ``q`` is 0 and its dequantization exact; nothing divides by zero).
* ``q = clamp(x / scale, -448, 448)`` rounded to the nearest e4m3 value, ties to even: an IEEE
  fp32 *division* by the scale, not a multiplication by its reciprocal (the two differ in the
  last fp32 bit, which can move an e4m3 rounding). The clamp only catches quotients that the
  division rounds a hair above 448.
* ``dequantize: q.float() * scale``.
* Activation scales of an ``(M, K)`` row-major operand: ``(ceil(K / 128), M)`` fp32,
  contiguous, k-block-major with rows contiguous, so a tile's 128 rows' scales for one k-block
  are 512 contiguous bytes. Weight scales of ``(E, N, K)``: ``(E, ceil(N / 128),
  ceil(K / 128))`` fp32, contiguous. A partial last block (``K`` or ``N`` not a multiple of the
  block) is scaled over the columns / rows it has.

Non-finite inputs are quantized, not rejected (no data-dependent check): an ``inf`` makes its
block's scale ``inf`` and the block's dequantized values NaN; a NaN makes the block's scale 1.0
(``NaN > 0`` is false), so the block is converted unscaled with its NaN kept. The GPU kernels
follow the same rules (NaN-propagating ``max``); the tests compare them on finite data.
"""

from __future__ import annotations

import math

import torch

from sonic.types import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
# The scale of an all-zero block (its values are 0 whatever the scale; 1.0 keeps it finite).
ZERO_BLOCK_SCALE = 1.0
# Largest finite e4m3 value (S.1111.110 = 1.75 · 2^8).
FP8_MAX = 448.0
# Unit roundoff of e4m3 round-to-nearest: 3 stored mantissa bits, so |q − x/s| ≤ 2^-4 |x/s| for
# quotients in the normal range (|x/s| ≥ 2^-6).
FP8_UNIT_ROUNDOFF = 2.0 ** -4
# Below the smallest normal 2^-6 the e4m3 spacing is the subnormal step 2^-9: an absolute error of
# at most half of it, 2^-10, in units of the scale.
FP8_SUBNORMAL_HALF_STEP = 2.0 ** -10
# Expected relative Frobenius error of an e4m3 GEMM of independent, zero-mean random operands
# against the fp32 product of the unquantized operands: each operand element carries a relative
# rounding error of rms at most u/√3 (uniform on [−u, u]), the errors of a and b add in each
# product term, and independent terms add in quadrature, so ‖Ĉ − C‖_F / ‖C‖_F ≈ √2 · u/√3
# ≈ 0.051. Measured on randn operands (K = 128 to 4096): 0.037, from an element rms of 0.0265
# (the relative error is not uniform on [−u, u]: it is smaller for mantissas near 2). A test on
# random data may assert it; adversarial data needs :func:`fp8_error_bound`.
FP8_RELATIVE_RMS_ERROR = math.sqrt(2.0) * FP8_UNIT_ROUNDOFF / math.sqrt(3.0)


def _check_block(block: int) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")


def _check_float(name: str, t, ndims: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} must have dtype bfloat16, float16 or float32, got {t.dtype}")
    if t.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, "
                         f"got shape {tuple(t.shape)}")


def _check_q(name: str, q, ndims: tuple[int, ...]) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"{name} must have dtype float8_e4m3fn, got {q.dtype}")
    if q.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, "
                         f"got shape {tuple(q.shape)}")


def _check_scales(name: str, scales, shape: tuple[int, ...], of: str) -> None:
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{name} must have dtype float32, got {scales.dtype}")
    if tuple(scales.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} for {of}, got {tuple(scales.shape)}")


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales of fp32 block maxima: ``amax / 448``, 1.0 for an all-zero block."""
    # A tensor divisor, not the Python float: CUDA PyTorch divides by a scalar as a multiply by
    # its reciprocal, which differs from IEEE division in the last bit for some amax, so the
    # reference would not be the same function on CPU and GPU (nor equal to the kernels).
    divisor = torch.full_like(amax, FP8_MAX)
    return torch.where(amax > 0, amax / divisor, torch.full_like(amax, ZERO_BLOCK_SCALE))


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round_e4m3(clamp(x / scale))`` of fp32 ``x`` and a broadcastable fp32 ``scale``."""
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _pad_to(x: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to a multiple of ``block`` (zeros leave amax unchanged)."""
    extra = -x.shape[dim] % block
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return torch.nn.functional.pad(x, pad)


def quantize_rows(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an activation per 1×``block`` slice of each row (DeepSeek-V3 §3.3).

    Args:
        x: ``(M, K)`` bf16, fp16 or fp32, any strides and device; ``K`` need not be a multiple
            of ``block`` (the last slice of a row is scaled over its ``K mod block`` columns).
        block: slice width (128 in the recipe and the kernels).

    Returns:
        ``(q, scales)``: ``q (M, K)`` float8_e4m3fn, ``scales (ceil(K / block), M)`` fp32,
        contiguous, k-block-major (see the module conventions).

    Raises:
        TypeError: ``x`` is not a bf16 / fp16 / fp32 tensor.
        ValueError: ``x`` is not 2-D, or ``block`` is not a positive int.
    """
    _check_float("x", x, (2,))
    _check_block(block)
    m, k = x.shape
    nk = -(-k // block)
    xp = _pad_to(x.float(), 1, block).view(m, nk, block)
    scale = _scale_of(xp.abs().amax(dim=2)) if xp.numel() else xp.new_ones(m, nk)
    q = _to_fp8(xp, scale[:, :, None]).view(m, nk * block)[:, :k].contiguous()
    return q, scale.t().contiguous()


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` up to rounding: ``q.float() * scale`` per slice.

    Args:
        q: ``(M, K)`` float8_e4m3fn.
        scales: ``(ceil(K / 128), M)`` fp32 (the recipe's 128-wide slices).

    Returns:
        ``(M, K)`` fp32.

    Raises:
        TypeError: wrong dtypes; ValueError: wrong ranks or ``scales``'s shape does not fit
        ``q`` with the 128-wide blocks.
    """
    _check_q("q", q, (2,))
    m, k = q.shape
    nk = -(-k // FP8_BLOCK)
    _check_scales("scales", scales, (nk, m), f"q of shape {tuple(q.shape)} in 1x{FP8_BLOCK} slices")
    per_col = scales.t().repeat_interleave(FP8_BLOCK, dim=1)[:, :k]
    return q.float() * per_col


def quantize_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize per-expert weights per ``block``×``block`` block (DeepSeek-V3 §3.3).

    Square blocks serve both orientations of the weight: the forward reduces over ``K`` and the
    data-gradient GEMM over ``N``, and each sees one scale per 128×128 tile of its k-loop.

    Args:
        w: ``(E, N, K)`` or ``(N, K)`` bf16, fp16 or fp32, any strides and device; partial last
            blocks along ``N`` or ``K`` are scaled over the rows / columns they have.
        block: block side (128 in the recipe and the kernels).

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn of ``w``'s shape, ``scales`` fp32 contiguous of
        shape ``(E, ceil(N / block), ceil(K / block))`` (or without ``E`` for a 2-D ``w``).

    Raises:
        TypeError: ``w`` is not a bf16 / fp16 / fp32 tensor.
        ValueError: ``w`` is not 2-D or 3-D, or ``block`` is not a positive int.
    """
    _check_float("w", w, (2, 3))
    _check_block(block)
    if w.dim() == 2:
        q, scales = quantize_blocks(w[None], block)
        return q[0], scales[0]
    e, n, k = w.shape
    wp = _pad_to(_pad_to(w.float(), 1, block), 2, block)
    nb, kb = wp.shape[1] // block, wp.shape[2] // block
    tiles = wp.view(e, nb, block, kb, block)
    amax = tiles.abs().amax(dim=(2, 4)) if tiles.numel() else tiles.new_zeros(e, nb, kb)
    scale = _scale_of(amax)
    q = _to_fp8(tiles, scale[:, :, None, :, None]).view(e, nb * block, kb * block)
    return q[:, :n, :k].contiguous(), scale.contiguous()


def quantize_blocks_and_transpose(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`quantize_blocks` of ``w (E, N, K)`` and of ``wᵀ (E, K, N)``:
    ``(q, scales, q_t, scales_t)``. The second is the first transposed, q and block scales
    alike: a 128×128 block holds the same values in both orientations, so its amax, scale
    and every rounding are the same (no re-quantization). ``N`` and ``K`` multiples of 128.

    Raises:
        ValueError: as :func:`quantize_blocks`; ``N`` or ``K`` not a multiple of 128.
    """
    q, scales = quantize_blocks(w)
    if w.shape[-2] % FP8_BLOCK or w.shape[-1] % FP8_BLOCK:
        raise ValueError(f"w must have N and K multiples of {FP8_BLOCK} for its transposed copy, "
                         f"got shape {tuple(w.shape)}")
    # Copies even where the transpose is already contiguous (a 1 x 1 block grid): the copies
    # must not alias (custom ops may not return aliases of each other).
    return (q, scales, q.transpose(-1, -2).clone(memory_format=torch.contiguous_format),
            scales.transpose(-1, -2).clone(memory_format=torch.contiguous_format))


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks` up to rounding: ``q.float() * scale`` per block.

    Args:
        q: ``(E, N, K)`` or ``(N, K)`` float8_e4m3fn.
        scales: ``(E, ceil(N / 128), ceil(K / 128))`` (or ``(ceil(N / 128), ceil(K / 128))``)
            fp32.

    Returns:
        fp32 of ``q``'s shape.

    Raises:
        TypeError: wrong dtypes; ValueError: wrong ranks or ``scales``'s shape does not fit.
    """
    _check_q("q", q, (2, 3))
    if q.dim() == 2:
        _check_scales("scales", scales, (-(-q.shape[0] // FP8_BLOCK), -(-q.shape[1] // FP8_BLOCK)),
                      f"q of shape {tuple(q.shape)} in {FP8_BLOCK}x{FP8_BLOCK} blocks")
        return dequantize_blocks(q[None], scales[None])[0]
    e, n, k = q.shape
    _check_scales("scales", scales, (e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)),
                  f"q of shape {tuple(q.shape)} in {FP8_BLOCK}x{FP8_BLOCK} blocks")
    full = scales.repeat_interleave(FP8_BLOCK, dim=1).repeat_interleave(FP8_BLOCK, dim=2)[:, :n, :k]
    return q.float() * full


def padded_offsets(expert_offsets: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Expert row offsets with each expert's row count rounded up to a multiple of ``block``:
    where each expert's rows start in the K-major copies of :func:`quantize_cols_grouped`.

    Args:
        expert_offsets: ``(E + 1,)`` integer, non-decreasing from 0 (any device; no host
            synchronisation).
        block: the reduction block (128 in the recipe and the kernels).

    Returns:
        ``(E + 1,)`` int32 on ``expert_offsets``'s device, multiples of ``block``.
    """
    _check_block(block)
    counts = (expert_offsets[1:] - expert_offsets[:-1]).long()
    out = torch.zeros_like(expert_offsets, dtype=torch.int32)
    out[1:] = ((counts + block - 1) // block * block).cumsum(0)
    return out


def padded_rows_bound(num_rows: int, num_experts: int, block: int = FP8_BLOCK) -> int:
    """Rows the K-major copies are allocated with: the largest ``padded_offsets[E]`` that
    ``num_rows`` rows over ``num_experts`` experts can give (each expert adds at most
    ``block - 1`` rows of padding), known on the host without reading the offsets."""
    return (num_rows + (block - 1) * num_experts) // block * block


def quantize_cols_grouped(x: torch.Tensor, expert_offsets: torch.Tensor,
                          k_offsets: torch.Tensor, gather_idx: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight-gradient operand per ``128 x 1`` block of each column within each
    expert's rows, into a K-major copy (the FP8 varlen-K GEMM's operand layout).

    The weight gradients ``dW[e] = A_eᵀ·B_e`` reduce over the rows (tokens) of expert ``e``,
    so their scales run along the rows: one per 128 consecutive rows of the expert and per
    column (DeepSeek-V3 §3.3 quantizes every GEMM operand along its reduction axis; the
    forward's ``1 x 128`` row scales run across it). FP8 WGMMA reads both operands K-major, so
    the copy is transposed: row ``c`` holds column ``c`` of the expert-sorted rows, expert
    ``e``'s rows at ``k_offsets[e] ..`` followed by zeros up to the next multiple of 128, so
    no 128-row block straddles two experts.

    Args:
        x: ``(P, C)`` rows sorted by expert, or with ``gather_idx`` the ``(T, C)`` source rows
            (row ``r`` is ``x[gather_idx[r]]``); bf16, fp16 or fp32.
        expert_offsets: ``(E + 1,)`` integer expert row offsets (rows past
            ``expert_offsets[E]``, a padded routing's padding, are not read).
        k_offsets: ``(E + 1,)`` :func:`padded_offsets` of ``expert_offsets``.
        gather_idx: ``(P,)`` integer row indices into ``x``, or None.

    Returns:
        ``(q_t, scales)``: ``q_t (C, R)`` float8_e4m3fn and ``scales (R / 128, C)`` fp32,
        contiguous, with ``R = padded_rows_bound(P, E)``: column ``j`` of ``q_t`` and row
        ``j // 128`` of ``scales`` belong to the rows of the expert whose padded range holds
        ``j``. Columns from ``k_offsets[E]`` on are zeros with scale 1.

    Raises:
        TypeError: ``x`` is not a bf16 / fp16 / fp32 tensor.
        ValueError: ``x`` is not 2-D.
    """
    _check_float("x", x, (2,))
    rows = x.shape[0] if gather_idx is None else gather_idx.shape[0]
    num_experts = expert_offsets.shape[0] - 1
    bound = padded_rows_bound(rows, num_experts)
    bounds, starts = expert_offsets.tolist(), k_offsets.tolist()
    xp = x.new_zeros(bound, x.shape[1], dtype=torch.float32)
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        src = x[lo:hi] if gather_idx is None else x.index_select(0, gather_idx[lo:hi].long())
        xp[starts[e]:starts[e] + hi - lo] = src.float()
    blocks = xp.view(bound // FP8_BLOCK, FP8_BLOCK, x.shape[1])
    scale = _scale_of(blocks.abs().amax(dim=1)) if blocks.numel() else blocks.new_ones(
        bound // FP8_BLOCK, x.shape[1])
    q = _to_fp8(blocks, scale[:, None, :]).view(bound, x.shape[1])
    return q.t().contiguous(), scale.contiguous()


def grouped_mm_varlen_k_fp8_reference(a_t_q: torch.Tensor, a_scales: torch.Tensor,
                                      b_t_q: torch.Tensor, b_scales: torch.Tensor,
                                      k_offsets: torch.Tensor,
                                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """varlen-K grouped GEMM of the K-major FP8 copies of :func:`quantize_cols_grouped`, with
    fp32 promotion per 128-row block: ``C[e, i, j] = Σ_kb (Σ_{k∈kb} a_t_q[i, k]·b_t_q[j, k])
    · a_s[kb, i] · b_s[kb, j]`` over the blocks ``kb`` of expert ``e``'s padded range, in
    block order, then one cast to ``out_dtype`` (the math of
    :func:`sonic.kernels.grouped_gemm.grouped_gemm_varlen_k_fp8`, up to the order of the fp32
    sums inside a block).

    Args:
        a_t_q: ``(M, R)`` and b_t_q: ``(N, R)`` float8_e4m3fn; a_scales: ``(R / 128, M)`` and
            b_scales: ``(R / 128, N)`` fp32.
        k_offsets: ``(E + 1,)`` integer, multiples of 128, at most ``R``.
        out_dtype: bf16, fp16 or fp32.

    Returns:
        ``(E, M, N)`` in ``out_dtype``; an expert with no rows gets zeros.

    Raises:
        TypeError / ValueError: wrong dtypes or shapes.
    """
    _check_q("a_t_q", a_t_q, (2,))
    _check_q("b_t_q", b_t_q, (2,))
    (m, rows), n = a_t_q.shape, b_t_q.shape[0]
    if b_t_q.shape[1] != rows or rows % FP8_BLOCK:
        raise ValueError(f"a_t_q (M, R) and b_t_q (N, R) must share R, a multiple of {FP8_BLOCK}, "
                         f"got {tuple(a_t_q.shape)} and {tuple(b_t_q.shape)}")
    _check_scales("a_scales", a_scales, (rows // FP8_BLOCK, m), f"a_t_q of shape {(m, rows)}")
    _check_scales("b_scales", b_scales, (rows // FP8_BLOCK, n), f"b_t_q of shape {(n, rows)}")
    starts = k_offsets.tolist()
    out = torch.zeros(len(starts) - 1, m, n, dtype=torch.float32, device=a_t_q.device)
    for e in range(len(starts) - 1):
        for kb in range(starts[e] // FP8_BLOCK, starts[e + 1] // FP8_BLOCK):
            cols = slice(kb * FP8_BLOCK, (kb + 1) * FP8_BLOCK)
            partial = a_t_q[:, cols].float() @ b_t_q[:, cols].float().t()
            out[e] += partial * (a_scales[kb, :, None] * b_scales[kb, None, :])
    return out.to(out_dtype)


def grouped_mm_fp8_reference(a_q: torch.Tensor, a_scales: torch.Tensor, b_q: torch.Tensor,
                             b_scales: torch.Tensor, expert_offsets: torch.Tensor,
                             gather_idx: torch.Tensor | None = None,
                             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """varlen-M grouped GEMM of block-scaled FP8 operands with fp32 promotion per k-block.

    ``C[r, c] = Σ_kb (Σ_{k∈kb} a_q[r, k]·b_q[e, c, k]) · (a_s[kb, r]·b_s[e, c // 128, kb])``
    for the rows ``r`` of expert ``e``: each 128-wide k-block's partial product of the fp8
    values (exact in fp32: 4-bit significands) is summed in fp32, scaled by the product of the
    two scales and added to an fp32 accumulator in k-block order — the math of a promoted FP8
    WGMMA mainloop (DeepSeek-V3 §3.3 "increasing accumulation precision"; DeepGEMM), up to the
    order of the fp32 sums inside a k-block. Then one cast to ``out_dtype``.

    Args:
        a_q: ``(P, K)`` float8_e4m3fn rows grouped by expert, or with ``gather_idx`` the
            ``(T, K)`` source rows (``A[r] = a_q[gather_idx[r]]``, scales gathered alike).
        a_scales: ``(ceil(K / 128), P)`` (or ``(ceil(K / 128), T)``) fp32, from
            :func:`quantize_rows`.
        b_q: ``(E, N, K)`` float8_e4m3fn per-expert weights (K-major rows).
        b_scales: ``(E, ceil(N / 128), ceil(K / 128))`` fp32, from :func:`quantize_blocks`.
        expert_offsets: ``(E + 1,)`` integer, non-decreasing, ``expert_offsets[0] == 0`` and
            ``expert_offsets[E] == P``.
        gather_idx: ``(P,)`` integer row indices into ``a_q`` in ``[0, T)``, or None.
        out_dtype: dtype of the result (bf16, fp16 or fp32).

    Returns:
        ``(P, N)`` in ``out_dtype``; rows of empty experts do not exist, ``P = 0`` gives
        ``(0, N)``.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: ranks or shapes disagree, ``expert_offsets`` is not a valid partition of
            the ``P`` rows, or ``gather_idx`` holds an index outside ``[0, T)``.
    """
    _check_q("a_q", a_q, (2,))
    _check_q("b_q", b_q, (3,))
    rows, k = a_q.shape
    e, n, kb_ = b_q.shape
    if kb_ != k:
        raise ValueError(f"a_q has K = {k} columns but b_q (E, N, K) has K = {kb_}")
    nk, nn = -(-k // FP8_BLOCK), -(-n // FP8_BLOCK)
    _check_scales("a_scales", a_scales, (nk, rows), f"a_q of shape {tuple(a_q.shape)}")
    _check_scales("b_scales", b_scales, (e, nn, nk), f"b_q of shape {tuple(b_q.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if not isinstance(expert_offsets, torch.Tensor) or expert_offsets.dim() != 1 \
            or expert_offsets.dtype.is_floating_point or expert_offsets.shape[0] != e + 1:
        raise ValueError(f"expert_offsets must be an integer tensor of shape (E + 1,) = ({e + 1},)")
    bounds = expert_offsets.tolist()
    if gather_idx is not None:
        if not isinstance(gather_idx, torch.Tensor) or gather_idx.dim() != 1 \
                or gather_idx.dtype.is_floating_point:
            raise ValueError("gather_idx must be a 1-D integer tensor of row indices into a_q")
        if gather_idx.numel() and not (0 <= int(gather_idx.min()) and int(gather_idx.max()) < rows):
            raise ValueError(f"gather_idx must index rows of a_q in [0, {rows})")
        idx = gather_idx.to(device=a_q.device, dtype=torch.long)
        a_q, a_scales, rows = a_q.index_select(0, idx), a_scales.index_select(1, idx), idx.numel()
    if bounds[0] != 0 or bounds[-1] != rows or any(lo > hi for lo, hi in zip(bounds, bounds[1:])):
        raise ValueError(f"expert_offsets must rise from 0 to the {rows} rows of A, got {bounds}")
    out = torch.empty(rows, n, dtype=torch.float32, device=a_q.device)
    b_cols = b_scales.repeat_interleave(FP8_BLOCK, dim=1)[:, :n]          # (E, N, nk)
    for ex in range(e):
        lo, hi = bounds[ex], bounds[ex + 1]
        acc = out[lo:hi].zero_()
        for kb in range(nk):
            cols = slice(kb * FP8_BLOCK, min(k, (kb + 1) * FP8_BLOCK))
            partial = a_q[lo:hi, cols].float() @ b_q[ex, :, cols].float().t()
            acc += partial * (a_scales[kb, lo:hi, None] * b_cols[ex, None, :, kb])
    return out.to(out_dtype)


def fp8_error_bound(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor,
                    b_scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                    accum_roundoff: float = 2.0 ** -24) -> torch.Tensor:
    """Elementwise bound on ``|C_fp8 − a·bᵀ|`` for one expert's block-scaled e4m3 GEMM.

    Holds for any finite data (outliers, zeros, values in e4m3's subnormal range), derived
    per operand element: the quantized value ``x̂ = q·s`` of ``x`` satisfies
    ``|x̂ − x| ≤ ε_x = u·|x| + 2^-10·s`` with ``u = 2^-4`` (3 mantissa bits, round to nearest;
    the second term covers quotients below the smallest normal 2^-6, whose spacing is 2^-9).
    So each product term is off by ``|â b̂ − a b| ≤ ε_a|b| + |a|ε_b + ε_a ε_b`` and

        ``|Ĉ − C| ≤ B + ρ (|C| + B)``,
        ``B = (1 + γ) (ε_a·|b|ᵀ + |a|·ε_bᵀ + ε_a·ε_bᵀ) + γ |a|·|b|ᵀ``

    (matrix products of the elementwise bounds), where ``γ = 2·K·accum_roundoff`` covers the
    accumulation and the scale products (any order of the sums; fp32: ``2^-24``), and ``ρ`` is the unit roundoff
    of ``out_dtype`` (2^-8 bf16, 2^-11 fp16, 0 fp32) for the final cast, which rounds ``Ĉ``
    (within ``B`` of ``C``). A worst case, it is loose for random
    operands (measured on randn: the error reaches 17% of it at K = 128, 3% at K = 4096, as
    independent errors cancel); the typical error is :data:`FP8_RELATIVE_RMS_ERROR` (Frobenius
    norm).

    Args:
        a: ``(M, K)`` the unquantized left operand (any float dtype; math in fp64).
        b: ``(N, K)`` one expert's unquantized weight.
        a_scales: ``(ceil(K / 128), M)`` fp32, from :func:`quantize_rows` of ``a``.
        b_scales: ``(ceil(N / 128), ceil(K / 128))`` fp32, from :func:`quantize_blocks` of ``b``.
        out_dtype: dtype of the GEMM's output (bf16, fp16 or fp32).
        accum_roundoff: unit roundoff of the accumulation: ``2^-24`` for fp32 (the reference);
            a Hopper FP8 WGMMA keeps only about 14 bits inside one instruction before the
            promotion to fp32 (DeepSeek-V3 §3.3), so a test of that kernel passes ``2^-14``.

    Returns:
        ``(M, N)`` fp64 bound.

    Raises:
        ValueError: shapes disagree or ``accum_roundoff`` is not in ``[0, 1)``; TypeError:
            ``out_dtype`` is not bf16, fp16 or fp32.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a (M, K) and b (N, K) must be 2-D with equal K, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    rho = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}
    if out_dtype not in rho:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if not 0 <= accum_roundoff < 1:
        raise ValueError(f"accum_roundoff must be in [0, 1), got {accum_roundoff}")
    (m, k), n = a.shape, b.shape[0]
    nk = -(-k // FP8_BLOCK)
    _check_scales("a_scales", a_scales, (nk, m), f"a of shape {tuple(a.shape)}")
    _check_scales("b_scales", b_scales, (-(-n // FP8_BLOCK), nk), f"b of shape {tuple(b.shape)}")
    u, eta = FP8_UNIT_ROUNDOFF, FP8_SUBNORMAL_HALF_STEP
    a_abs, b_abs = a.double().abs(), b.double().abs()
    a_s = a_scales.double().t().repeat_interleave(FP8_BLOCK, dim=1)[:, :k]
    b_s = b_scales.double().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    err_a, err_b = u * a_abs + eta * a_s, u * b_abs + eta * b_s
    gamma = 2 * k * accum_roundoff
    magnitude = a_abs @ b_abs.t()
    bound = (1 + gamma) * (err_a @ b_abs.t() + a_abs @ err_b.t() + err_a @ err_b.t()) \
        + gamma * magnitude
    exact = a.double() @ b.double().t()
    return bound + rho[out_dtype] * (exact.abs() + bound)
