"""The activation cache of the MoE experts: in which form H ``(P, 2n)`` is kept for backward.

``"bf16"`` (the default) keeps H as the up-projection wrote it, in the layer's compute dtype
(bf16, fp16, or fp32/fp64 for exact layers): ``P·2n·2`` bytes in bf16. ``"fp8"`` (the
optional FP8 activation cache, independent of FP8 GEMMs) keeps H in e4m3 with one fp32 scale
per 1×128 slice of each row — the recipe of :mod:`sonic.reference.fp8` (DeepSeek-V3,
arXiv 2412.19437 §3.3): ``P·2n·(1 + 4/128)`` bytes, 51.6% of bf16's.

The forward computes with the exact H (the up-projection writes it in the compute dtype as
always, so the layer's output is unchanged bit for bit); only the copy kept for backward is
rounded. Backward dequantizes it (one pass of a CuTe kernel on the cute backend) into a fresh
buffer of the compute dtype and runs the unchanged dSwiGLU path on that, so the gradients are
those of the bf16 path evaluated at
``dequantize(quantize(H))``: each element of H moves by at most 2^-4 of its magnitude (e4m3's
3 mantissa bits, round to nearest) or, below 2^-6 of its slice's scale, by at most 2^-10 scale
(half the subnormal step), plus the compute dtype's rounding of the dequantized product.

Rule for the dtypes: the fp8 cache replaces a 16-bit H (bf16, fp16). An fp32 / fp64 layer is
asked for exactness (gradcheck, reference runs), so ``activation_cache="fp8"`` there raises a
``TypeError`` rather than silently rounding or silently keeping the full H; run under
``torch.autocast`` (H is then kept in the autocast dtype) or keep ``"bf16"``.
"""

from __future__ import annotations

from typing import get_args

import torch

from sonic.reference import fp8 as reference_fp8
from sonic.types import FP8_BLOCK, ActivationCache

ACTIVATION_CACHES: tuple[ActivationCache, ...] = get_args(ActivationCache)
# Compute dtypes whose H the fp8 cache may stand in for.
FP8_CACHE_DTYPES = (torch.bfloat16, torch.float16)


def check_activation_cache(activation_cache: str, dtype: torch.dtype, two_n: int) -> None:
    """Whether H ``(P, two_n)`` in ``dtype`` can be kept as ``activation_cache``.

    Raises:
        ValueError: ``activation_cache`` not in :data:`ACTIVATION_CACHES`; ``"fp8"`` with
            ``2n`` not a multiple of 128 (``d_expert`` not a multiple of 64: the 1×128 slices
            tile each row of H exactly, as the quantization kernel requires).
        TypeError: ``"fp8"`` with a compute dtype other than bf16 / fp16 (see the module's
            rule).
    """
    if activation_cache not in ACTIVATION_CACHES:
        raise ValueError(f"activation_cache must be one of {ACTIVATION_CACHES}, "
                         f"got {activation_cache!r}")
    if activation_cache != "fp8":
        return
    check_fp8_d_expert(two_n // 2)
    if dtype not in FP8_CACHE_DTYPES:
        raise TypeError(f"activation_cache='fp8' keeps a bf16/fp16 H in e4m3; this layer "
                        f"computes in {dtype}, which is kept exactly: use "
                        "activation_cache='bf16' (H in the compute dtype), or run under "
                        "torch.autocast so H is bf16/fp16")


def check_fp8_d_expert(d_expert: int) -> None:
    """Raises ``ValueError`` unless ``2·d_expert`` is a multiple of 128 (fp8 cache's slices)."""
    if (2 * d_expert) % FP8_BLOCK:
        raise ValueError(f"activation_cache='fp8' needs 2*d_expert (the width 2n of H) to be "
                         f"a multiple of {FP8_BLOCK}, i.e. d_expert a multiple of {FP8_BLOCK // 2}; "
                         f"got d_expert={d_expert}")


def pack(h: torch.Tensor, activation_cache: str, use_kernel: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """H ``(P, 2n)`` in the form kept for backward: ``(cache, scales)``.

    ``"bf16"``: ``(h, empty (0,) fp32)`` — H itself. ``"fp8"``: ``(q (P, 2n) float8_e4m3fn,
    scales (2n/128, P) fp32)``, :func:`sonic.reference.fp8.quantize_rows`'s layout; by the CuTe
    kernel :func:`sonic.kernels.fp8_quant.quantize_rows` (bitwise equal to the reference) when
    ``use_kernel`` and H is a contiguous bf16 CUDA tensor, by the reference otherwise (fp16,
    the CPU, meta).
    """
    if activation_cache == "bf16":
        return h, h.new_empty(0, dtype=torch.float32)
    if use_kernel and h.is_cuda and h.dtype == torch.bfloat16 and h.is_contiguous():
        from sonic.kernels.fp8_quant import quantize_rows
        return quantize_rows(h)
    return reference_fp8.quantize_rows(h)


def pack_fake(h_shape: tuple[int, int], dtype: torch.dtype, activation_cache: str,
              like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty tensors shaped as :func:`pack`'s result, on ``like``'s device (fake kernels)."""
    p, two_n = h_shape
    if activation_cache == "bf16":
        return like.new_empty(p, two_n, dtype=dtype), like.new_empty(0, dtype=torch.float32)
    return (like.new_empty(p, two_n, dtype=reference_fp8.FP8_DTYPE),
            like.new_empty(two_n // FP8_BLOCK, p, dtype=torch.float32))


def unpack(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
           use_kernel: bool) -> torch.Tensor:
    """``dequantize(q, scales)`` rounded to ``dtype``, in a new ``(P, 2n)`` buffer that the
    caller owns (the dH step may overwrite it with dH).

    Equal bit for bit to ``sonic.reference.fp8.dequantize_rows(q, scales).to(dtype)``: the
    product with the fp32 scale is formed in fp32 and rounded once to ``dtype``. With
    ``use_kernel`` and a bf16 ``dtype`` on CUDA, one pass of the CuTe kernel
    :func:`sonic.kernels.fp8_quant.dequantize_rows`; elsewhere (fp16, the CPU) two elementwise
    torch passes over one buffer (torch does not promote float8 in arithmetic, so the exact
    e4m3 → bf16/fp16 upcast is its own pass), no fp32 temporary.

    Args:
        q: ``(P, 2n)`` float8_e4m3fn, ``2n`` a multiple of 128.
        scales: ``(2n/128, P)`` fp32.
        dtype: bf16 or fp16.
        use_kernel: whether the CuTe kernel may run (the resolved backend is ``"cute"``).
    """
    if use_kernel and q.is_cuda and dtype == torch.bfloat16 and q.is_contiguous():
        from sonic.kernels.fp8_quant import dequantize_rows
        return dequantize_rows(q, scales.contiguous())
    p, two_n = q.shape
    h = q.to(dtype)
    slices = h.view(p, two_n // FP8_BLOCK, FP8_BLOCK)
    torch.mul(slices, scales.t().unsqueeze(-1), out=slices)
    return h
