"""Grouped-GEMM epilogues: what happens to a finished fp32 accumulator tile.

Each epilogue receives the accumulator through one hook, :meth:`Epilogue.visit`, as an
architecture-neutral view of fp32 sub-tiles of ``SLAB`` columns (on sm_90 read from WGMMA
registers, :class:`sonic.kernels.grouped_gemm.sm90.WgmmaAccumulator`), and declares what else it
needs: its shared-memory staging buffer, its own TMA copies (:meth:`Epilogue.make_tma`:
dSwiGLU's H loads, queued by the producer into the operand ring, and on bf16 sm_90 its dH and A'
stores), and constraints on the B load (SwiGLU "concat" halves, see
:attr:`sonic.kernels.grouped_gemm.config.GroupedGemmConfig.b_halves`). On sm_90 a warp holds
whole accumulator rows, so the epilogues stage and store warp by warp. An epilogue may instead
be *deferred* (:meth:`Epilogue.defers`; the plain store on cooperative bf16 varlen-M tiles):
the consumer holds the tile in bf16 registers and calls :meth:`Epilogue.store_part` for one
TMA-stored box per warp after each of its next tile's first k-tiles.

* :mod:`.base` — the hook contract and the plain masked bf16 store (C, or ``C[e]ᵀ``).
* :mod:`.swiglu` — up-proj: H and ``A = SwiGLU(H)``.
* :mod:`.dswiglu` — dH: dH, ``A' = s·A`` and ds partials from dA', H and the row scores.

This package file imports nothing; the modules import ``cutlass`` and are loaded by
:func:`make_epilogue` from the kernel modules only.
"""

import importlib


def make_epilogue(cfg, ring):
    """The epilogue object of ``cfg.epilogue`` (imports its module, hence ``cutlass``)."""
    module, name = {"store": ("base", "StoreEpilogue"), "swiglu": ("swiglu", "SwigluEpilogue"),
                    "dswiglu": ("dswiglu", "DswigluEpilogue")}[cfg.epilogue]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)(cfg, ring)
