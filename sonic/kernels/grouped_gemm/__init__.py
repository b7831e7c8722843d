"""Grouped GEMMs over expert-sorted rows: varlen-M and varlen-K, one persistent launch each.

docs/design.md §3–4; SonicMoE (arXiv 2512.14080) §4.1. Public entry points (torch tensors in and out):
:func:`grouped_gemm` (varlen-M, optional row gather), :func:`grouped_gemm_swiglu` (gathered
up-proj with the SwiGLU epilogue), :func:`grouped_gemm_dswiglu` (gathered dA' GEMM with the
dSwiGLU + ds + A' epilogue), :func:`grouped_gemm_varlen_k` (weight gradients) and
:func:`grouped_gemm_fp8` (block-scaled e4m3 varlen-M, Hopper) and
:func:`grouped_gemm_fp8_swiglu` / :func:`grouped_gemm_fp8_dswiglu` (its gathered up-proj
with the SwiGLU epilogue and dH kernel with the dSwiGLU epilogue), and
:func:`grouped_gemm_varlen_k_fp8` (block-scaled e4m3 weight gradients on K-major copies).

Layout of the package, one concern per module (only the modules marked *kernel* import
``cutlass``; importing this package does not):

* :mod:`.config` — constants, the frozen :class:`GroupedGemmConfig` (compile-cache key), the
  pipeline's barrier contract, and :data:`MAINLOOPS`, the architecture -> kernel-class table.
* :mod:`.heuristic` — the tile plan, each choice citing its measurement.
* :mod:`.interface` — validation, allocation, architecture dispatch, launch; variants.
* :mod:`.protocols` — the interfaces of the tile schedulers and of the accumulator views.
* :mod:`.args` — the named argument bundles the launch and the kernel's roles pass (operands,
  sizes, TMA copies, scheduler arguments, ring memory, epilogue threads and outputs).
* :mod:`.tile_scheduler` (kernel) — varlen-M / varlen-K persistent schedulers.
* :mod:`.pipeline` (kernel) — the operand ring (stages, phases, cluster release).
* :mod:`.load` (kernel) — TMA producers: contiguous tiles, gathered rows, multicast.
* :mod:`.base` (kernel) — warp roles, shared storage, launch, the pipeline contract.
* :mod:`.sm90` (kernel) — the Hopper WGMMA mainloop and its accumulator view.
* :mod:`.sm90_fp8` (kernel) — the Hopper block-scaled FP8 mainloop (per-k-tile promotion).
* :mod:`.sm100` (kernel) — the Blackwell tcgen05 UMMA mainloop, TMEM accumulator and its view
  (compile-checked, self-checked on the device, never benchmarked).
* :mod:`.self_check` — the on-device check a variant passes before "auto" uses it on sm_100a.
* :mod:`.epilogue` (kernel) — store, SwiGLU, dSwiGLU + ds + A', all fed fp32 accumulator
  sub-tiles through one hook.
"""

from sonic.kernels.grouped_gemm.config import MAX_EXPERTS, VEC, GroupedGemmConfig
from sonic.kernels.grouped_gemm.interface import (grouped_gemm, grouped_gemm_dswiglu,
                                                  grouped_gemm_fp8, grouped_gemm_fp8_dswiglu,
                                                  grouped_gemm_fp8_swiglu, grouped_gemm_swiglu,
                                                  grouped_gemm_varlen_k,
                                                  grouped_gemm_varlen_k_fp8)

# MAX_EXPERTS (largest E) and VEC (K, N multiples) are the limits the backend checks.
__all__ = ["MAX_EXPERTS", "VEC", "GroupedGemmConfig", "grouped_gemm", "grouped_gemm_dswiglu",
           "grouped_gemm_fp8", "grouped_gemm_fp8_dswiglu", "grouped_gemm_fp8_swiglu",
           "grouped_gemm_swiglu",
           "grouped_gemm_varlen_k", "grouped_gemm_varlen_k_fp8"]
