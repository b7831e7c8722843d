"""Registry of the CuTe-DSL kernel variants that the compile check builds.

Each kernel module registers a few representative static configurations (dtype, E, K, tile...)
at import time, for the architectures it compiles for. ``python -m sonic.kernels
--compile-check sm_90a`` (or ``sm_100a``) and ``tests/test_kernels_compile.py`` compile every
variant of that architecture on the CPU with placeholder arguments and check that the PTX
holds the instructions the kernel is meant to use.

Importing this module does not import ``cutlass``: kernel modules import it lazily, inside
``compile_fake`` and their launch functions.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

# Kernel modules that register variants, in listing order.
KERNEL_MODULES = ("topk", "routing_metadata", "aggregation", "grouped_gemm", "swiglu",
                  "token_rounding", "fp8_quant", "padding")
# Compile targets of the compile check: Hopper and Blackwell (datacenter).
ARCHS = ("sm_90a", "sm_100a")

_REGISTRY: dict[tuple[str, str, tuple[str, ...]], "KernelVariant"] = {}


@dataclass(frozen=True)
class KernelVariant:
    """One static configuration of one kernel, compilable without a GPU.

    Attributes:
        kernel: kernel name, e.g. ``"topk"``, ``"routing_metadata"``, ``"aggregation"``.
        variant: short name of the static configuration, e.g. ``"bf16_d4096_scored"``.
        compile_fake: compiles this variant for the architecture in ``CUTE_DSL_ARCH`` with
            placeholder (fake) arguments and returns the compiled object, whose
            ``artifacts.PTX`` holds the PTX when compiled with ``--keep-ptx``.
        ptx_markers: what must appear in the compiled PTX: each entry a substring, or a
            tuple of alternative substrings of which at least one must appear (an access
            the back end may emit in more than one form).
        archs: the targets this variant compiles for (the CUDA-core kernels: every one of
            :data:`ARCHS`; a tensor-core mainloop: its own).
    """

    kernel: str
    variant: str
    compile_fake: Callable[[], Any]
    ptx_markers: tuple[str | tuple[str, ...], ...]
    archs: tuple[str, ...] = ARCHS

    def marker_counts(self, ptx: str) -> dict[str, int]:
        """``{marker: occurrences in ptx}``, alternatives named ``a|b`` and counted together."""
        return {"|".join(m) if isinstance(m, tuple) else m:
                sum(ptx.count(x) for x in m) if isinstance(m, tuple) else ptx.count(m)
                for m in self.ptx_markers}


def register(v: KernelVariant) -> KernelVariant:
    """Add ``v`` to the registry and return it.

    Registering the same (kernel, variant, archs) twice replaces the earlier entry, so
    re-importing a module is harmless.

    Raises:
        TypeError: ``v`` is not a :class:`KernelVariant`.
    """
    if not isinstance(v, KernelVariant):
        raise TypeError(f"register() expects a KernelVariant, got {type(v).__name__}")
    _REGISTRY[(v.kernel, v.variant, v.archs)] = v
    return v


def variants(arch: str | None = None) -> list[KernelVariant]:
    """Every registered variant (of ``arch``, when given), after importing each module of
    :data:`KERNEL_MODULES`."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    return [v for v in _REGISTRY.values() if arch is None or arch in v.archs]
