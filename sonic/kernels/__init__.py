"""CuTe-DSL GPU kernels for Hopper (sm_90a) and Blackwell (sm_100a; compile- and self-checked).

Importing this package does not import ``cutlass`` (the ``gpu`` extra): kernel modules import it
lazily, so CPU-only installs can import ``sonic``. Check :func:`kernels_available` before
calling a kernel; :func:`sonic.kernels.runtime.device_arch` names a device's architecture, by
which the grouped GEMM picks its mainloop. This package imports nothing of sonic but itself and
the leaf :mod:`sonic.types`. Entry points:

* :func:`sonic.kernels.routing_metadata.routing_metadata_topk`,
  :func:`sonic.kernels.routing_metadata.routing_metadata_pairs` — routing metadata.
* :func:`sonic.kernels.aggregation.aggregate` — expert aggregation (per-token gather-sum).
* :func:`sonic.kernels.topk.topk_scores` — bitonic top-K with fused softmax or sigmoid scores
  (sigmoid: with a selection bias and group-limited selection).
* :func:`sonic.kernels.swiglu.swiglu`, :func:`sonic.kernels.swiglu.dswiglu_epilogue` — the
  SwiGLU forward and the dSwiGLU + dS + A' backward epilogue as one-pass kernels.
* :func:`sonic.kernels.grouped_gemm.grouped_gemm`,
  :func:`sonic.kernels.grouped_gemm.grouped_gemm_varlen_k` — varlen-M / varlen-K grouped GEMMs
  with optional row gather; :func:`sonic.kernels.grouped_gemm.grouped_gemm_swiglu` — the
  gathered up-proj with the SwiGLU epilogue; :func:`sonic.kernels.grouped_gemm.grouped_gemm_dswiglu`
  — the gathered dA' GEMM with the dSwiGLU epilogue. The package is split by concern (config,
  heuristic, tile scheduler, operand ring, TMA producers, base kernel, sm_90 WGMMA and sm_100
  tcgen05 mainloops, epilogues, self-check); see its docstring.
* :func:`sonic.kernels.padding.fill_padding_rows` — a padded routing's padding rows of an
  output filled (zeros, or an FP8 scale), reading ``expert_offsets[E]`` on the device.
* :mod:`sonic.kernels.activation` — the fp32 silu / SwiGLU / dSwiGLU maths shared by the
  one-pass kernels and the grouped-GEMM epilogues.

``python -m sonic.kernels --list`` lists the registered variants; ``--compile-check sm_90a``
and ``--compile-check sm_100a`` compile each architecture's on the CPU.
"""

from sonic.kernels.registry import KernelVariant, register, variants
from sonic.kernels.runtime import kernels_available

__all__ = ["KernelVariant", "register", "variants", "kernels_available"]
