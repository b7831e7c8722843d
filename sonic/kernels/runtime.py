"""Compiling, caching and launching the CuTe-DSL kernels from PyTorch.

Conventions every kernel module follows:

* A kernel is compiled once per *static configuration* — a hashable key of dtypes and
  compile-time sizes (``d``, ``E``, ``K``, tile shape...). Batch-dependent sizes (``T``, ``P``,
  counts) are runtime ``Int32`` arguments, so a new batch never recompiles (:func:`compiled`).
* Tensors cross the boundary as raw device addresses: Python ints (:func:`address`) received as
  ``cutlass.Int64`` by the ``@cute.jit`` entry, which turns them into typed, aligned global
  pointers (:func:`gmem_ptr`) and builds its own layouts from the runtime sizes. Only integers
  and the stream are marshalled per call.
* :func:`compile_launcher` compiles and returns a :class:`Launcher` that appends PyTorch's
  current CUDA stream to every call. When the ``apache-tvm-ffi`` wheel is importable (it is not a
  dependency of ``nvidia-cutlass-dsl`` 4.8.1) the kernel is compiled with ``--enable-tvm-ffi``,
  which cuts a launcher call's host time about fourfold (``benchmarks/bench_aggregation.py``).
  ``SONIC_TVM_FFI=0`` turns it off.
* The same ``build`` function compiles with placeholder arguments on the CPU (the compile check,
  ``CUTE_DSL_ARCH=sm_90a``) and on the GPU (first launch), so what CI compiles is what runs.

``cutlass`` is imported lazily, inside the functions, so ``import sonic`` works without it.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from typing import Any, Callable, Hashable, Iterable, TypeVar

import torch

_CACHE: dict[Hashable, Any] = {}
# What a cached build returns (a Launcher, or a kernel's own compiled entry).
_Built = TypeVar("_Built")
_CACHE_LOCK = threading.Lock()

# Placeholder address used when compiling: any 256-byte-aligned value; the kernel never sees it.
_FAKE_ADDRESS = 1 << 20


# Compute-capability major -> the CuTe DSL target the kernels are compiled for. Every kernel
# runs on these; the grouped GEMM dispatches its mainloop by the same name
# (sonic.kernels.grouped_gemm.config.MAINLOOPS). sm_100a (Blackwell, 10.x) is compile-checked
# in CI and its grouped GEMMs self-checked on the device before "auto" uses them
# (sonic.kernels.grouped_gemm.self_check).
SUPPORTED_ARCHS = {9: "sm_90a", 10: "sm_100a"}
# Target compiled for when no GPU says otherwise (the CPU compile check).
DEFAULT_ARCH = "sm_90a"


# Compute capability per CUDA device index: asked on every kernel call (backend resolution,
# tile plans), and torch.cuda.get_device_capability costs several µs of host time each time.
_CAPABILITY: dict[int, tuple[int, int]] = {}


def device_capability(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of a CUDA device (``None``: the current one)."""
    if isinstance(device, torch.device) and device.index is not None:
        index = device.index
    elif device is None:
        index = torch.cuda.current_device()
    else:
        index = torch.cuda._utils._get_device_index(device, optional=True)
    capability = _CAPABILITY.get(index)
    if capability is None:
        capability = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return capability


def device_arch(device: torch.device | str | int | None = None) -> str:
    """The CuTe DSL target of a CUDA device: ``"sm_90a"`` for compute capability 9.x,
    ``"sm_100a"`` for 10.x, else ``"sm_<major><minor>a"`` (which no kernel supports;
    :func:`kernels_available` says so)."""
    major, minor = device_capability(device)
    return SUPPORTED_ARCHS.get(major, f"sm_{major}{minor}a")


def compile_arch() -> str:
    """The target of a compile without a device: ``CUTE_DSL_ARCH``, else :data:`DEFAULT_ARCH`."""
    return os.environ.get("CUTE_DSL_ARCH") or DEFAULT_ARCH


def kernels_available(device: torch.device | str | int | None = None) -> tuple[bool, str]:
    """Whether the CuTe-DSL kernels can run on ``device``.

    True only for a CUDA device whose architecture is in :data:`SUPPORTED_ARCHS` (compute
    capability 9.x: Hopper, sm_90a; 10.x: Blackwell, sm_100a) when the CuTe DSL
    (``nvidia-cutlass-dsl``, the ``gpu`` extra) is importable. On sm_100a the grouped GEMMs
    are further gated per variant by an on-device self-check
    (:mod:`sonic.kernels.grouped_gemm.self_check`, applied by :mod:`sonic.backend`).

    Args:
        device: a CUDA device (``torch.device``, string or index); ``None`` means the current
            CUDA device.

    Returns:
        ``(ok, reason)``: ``reason`` is empty when ``ok`` and otherwise says, for users, why the
        kernels are unavailable.
    """
    if device is None:
        if not torch.cuda.is_available():
            return False, "no CUDA device is available (torch.cuda.is_available() is False)"
        device = torch.device("cuda", torch.cuda.current_device())
    elif not isinstance(device, torch.device):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return False, f"tensors are on {device}, the CuTe-DSL kernels need a CUDA device"
    # Asked before every kernel call: a device whose capability was read needs no second
    # torch.cuda.is_available() (an environment lookup and a driver call).
    if (device.index is None or device.index not in _CAPABILITY) and not torch.cuda.is_available():
        return False, "no CUDA device is available (torch.cuda.is_available() is False)"
    major, minor = device_capability(device)
    if major not in SUPPORTED_ARCHS:
        name = torch.cuda.get_device_name(device)
        return False, (f"{name} has compute capability {major}.{minor}; the CuTe-DSL kernels are "
                       "built for Hopper (sm_90a, compute capability 9.x) and Blackwell "
                       "(sm_100a, 10.x)")
    missing = _dsl_import_error()
    if missing:
        return False, (f"the CuTe DSL is not importable ({missing}); install the 'gpu' extra: "
                       "pip install 'sonic-cute-moe[gpu]'")
    return True, ""


@functools.cache
def _dsl_import_error() -> str:
    """Why the CuTe DSL cannot be imported, or ``""`` when it can (asked once per process)."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except ImportError as err:
        return str(err)
    return ""


def compiled(key: Hashable, build: Callable[[], _Built]) -> _Built:
    """The compiled kernel for static configuration ``key``, built by ``build()`` on first use.

    ``key`` must hold every compile-time choice (kernel name, dtypes, static sizes) and nothing
    batch-dependent. Thread-safe: concurrent first calls compile once.
    """
    fn = _CACHE.get(key)
    if fn is None:
        with _CACHE_LOCK:
            fn = _CACHE.get(key)
            if fn is None:
                fn = build()
                _CACHE[key] = fn
    return fn


def cute_dtype(dtype: torch.dtype):
    """The CuTe-DSL numeric type of a torch dtype (bf16, fp16, fp32, int32, int64).

    Raises:
        TypeError: no CuTe-DSL type is mapped for ``dtype``.
    """
    import cutlass

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
             torch.float32: cutlass.Float32, torch.int32: cutlass.Int32,
             torch.int64: cutlass.Int64}
    if dtype not in table:
        raise TypeError(f"no CuTe-DSL type for torch dtype {dtype}")
    return table[dtype]


def check_tensor(name: str, t, *, dtypes: Iterable[torch.dtype], ndim: int,
                 device: torch.device | None = None) -> None:
    """Validate a kernel argument: a contiguous CUDA tensor of ``ndim`` dims and allowed dtype.

    Raises:
        TypeError: ``t`` is not a tensor, or its dtype is not in ``dtypes``.
        ValueError: ``t`` has another number of dimensions, is not contiguous, or is not on a
            CUDA device (or not on ``device``).
    """
    dtypes = tuple(dtypes)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of two contiguous tensors intersect (in-place outputs)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def set_compile_arch(arch: str) -> None:
    """Make CuTe DSL compile for ``arch`` (e.g. ``"sm_90a"``) without a GPU.

    Must run before ``cutlass`` is first imported in the process; afterwards it has no effect.

    Raises:
        RuntimeError: ``cutlass`` is already imported with another target.
    """
    import sys

    current = os.environ.get("CUTE_DSL_ARCH")
    if "cutlass" in sys.modules and current != arch:
        raise RuntimeError(f"cutlass is already imported (CUTE_DSL_ARCH={current!r}); set "
                           f"CUTE_DSL_ARCH={arch} before importing it")
    os.environ["CUTE_DSL_ARCH"] = arch


def tvm_ffi_enabled() -> bool:
    """Whether :func:`compile_launcher` compiles for TVM-FFI calls (faster host launch).

    True when ``apache-tvm-ffi`` is importable and ``SONIC_TVM_FFI`` is not ``"0"``.
    """
    global _TVM_FFI
    if _TVM_FFI is None:
        import importlib.util

        _TVM_FFI = (os.environ.get("SONIC_TVM_FFI", "1") != "0"
                    and importlib.util.find_spec("tvm_ffi") is not None)
    return _TVM_FFI


_TVM_FFI: bool | None = None


class Launcher:
    """A compiled kernel entry that runs on PyTorch's current CUDA stream.

    Call it with the ``@cute.jit`` entry's arguments minus the trailing stream; ``artifacts``
    is the compiled object's (``artifacts.PTX`` and ``artifacts.CUBIN`` when compiled with
    ``keep_ptx``).
    """

    __slots__ = ("fn", "tvm_ffi")

    def __init__(self, fn, tvm_ffi: bool):
        self.fn = fn
        self.tvm_ffi = tvm_ffi

    @property
    def artifacts(self):
        return self.fn.artifacts

    def __call__(self, *args):
        # The raw handle, without building a torch.cuda.Stream object (µs of host time).
        handle = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        if self.tvm_ffi:
            return self.fn(*args, handle)
        from cuda.bindings import driver

        return self.fn(*args, driver.CUstream(handle))


def compile_launcher(fn, *args, keep_ptx: bool = False) -> Launcher:
    """Compile ``fn(*args, stream)`` (``args`` without the stream) into a :class:`Launcher`.

    ``args`` are placeholders: :func:`fake_address` for addresses, ``cutlass.Int32(...)`` for
    sizes. Uses TVM-FFI when :func:`tvm_ffi_enabled`. ``keep_ptx`` keeps the PTX and the cubin
    in the compiled object (the compile check reads both).
    """
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_stream

    tvm_ffi = tvm_ffi_enabled()
    options = " ".join(o for o, on in (("--keep-ptx --keep-cubin", keep_ptx),
                                        ("--enable-tvm-ffi", tvm_ffi)) if on)
    if not keep_ptx:
        return Launcher(cute.compile(fn, *args, make_fake_stream(), options=options), tvm_ffi)
    # The DSL writes the kept PTX and cubin to <dump dir>/<function name>.<arch>.* (the working
    # directory by default) and reads them back; function names do not tell configurations
    # apart, so two processes compiling at once could read each other's files. A private
    # directory per compile keeps them apart; both stay in the compiled object.
    with tempfile.TemporaryDirectory(prefix="sonic-ptx-") as dump_dir:
        compiled = cute.compile(fn, *args, make_fake_stream(),
                                options=f"{options} --dump-dir={dump_dir}")
    return Launcher(compiled, tvm_ffi)


def address(t: torch.Tensor, align: int = 16, name: str = "tensor") -> int:
    """Device address of ``t``'s data, checked to be ``align``-byte aligned.

    The alignment must match the one the kernel assumes (:func:`gmem_ptr`); ``name`` is the
    argument the error message names.

    Raises:
        ValueError: the address is not ``align``-byte aligned.
    """
    a = t.data_ptr()
    if a % align:
        raise ValueError(f"{name} data at {a:#x} is not {align}-byte aligned; pass a tensor "
                         "that owns its storage (e.g. .clone())")
    return a


def fake_address():
    """Placeholder address argument (``cutlass.Int64``) for compiling."""
    import cutlass

    return cutlass.Int64(_FAKE_ADDRESS)


def gmem_ptr(dtype, addr, align: int):
    """Inside ``@cute.jit``: the global-memory ``cute.Pointer`` of element type ``dtype`` at
    ``addr`` (an ``Int64`` argument), assumed ``align``-byte aligned."""
    from cutlass import cute

    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)
