"""Argument checks shared by the public entry points: every error names the argument."""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Real

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None) -> None:
    """Raise ``TypeError`` unless ``t`` is a tensor of one of ``dtypes`` with ``ndim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).removeprefix('torch.')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_float(name: str, t, ndim: int) -> None:
    check_tensor(name, t, ndim=ndim, dtypes=_FLOAT_DTYPES)


def check_index(name: str, t, ndim: int = 1) -> None:
    check_tensor(name, t, ndim=ndim, dtypes=_INDEX_DTYPES)


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` if the named tensors are not all on one device."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "all inputs must be on one device")


def check_choice(name: str, value, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_int(name: str, value, *, low: int, high: int | None = None) -> None:
    """Raise unless ``low <= value (<= high)``; ``bool`` is not accepted as an int, a symbolic
    ``torch.SymInt`` (a dynamic size under ``torch.compile``/``torch.export``) is."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def check_bool(name: str, value) -> None:
    """Raise ``TypeError`` unless ``value`` is a ``bool`` (a string such as ``"no"`` is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_non_negative(name: str, value) -> None:
    """Raise unless ``value`` is a finite real number ``>= 0`` (not a bool, NaN or inf)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and float(value) >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def can_read_values(t: torch.Tensor) -> bool:
    """Whether checking index values is possible and cheap enough here: not on meta/fake tensors,
    not while a CUDA graph is being captured, and not under ``torch.compile`` tracing."""
    if t.device.type == "meta" or t.numel() == 0:
        return False
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return False  # tensor subclasses such as FakeTensor carry no values
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return not torch.compiler.is_compiling()


def read_min_max(*tensors: torch.Tensor) -> list[tuple[int, int] | None]:
    """``(min, max)`` of each integer tensor, all in one host read (one synchronisation on CUDA);
    ``None`` for tensors whose values cannot be read (see :func:`can_read_values`)."""
    readable = [i for i, t in enumerate(tensors) if can_read_values(t)]
    bounds: list[tuple[int, int] | None] = [None] * len(tensors)
    if readable:
        values = torch.stack([torch.stack(torch.aminmax(tensors[i])).to(torch.int64)
                              for i in readable]).tolist()
        for i, (lo, hi) in zip(readable, values):
            bounds[i] = (lo, hi)
    return bounds


def check_index_ranges(**checks: tuple[torch.Tensor, int]) -> None:
    """Raise ``ValueError`` unless every value of each ``name=(t, upper)`` is in ``[0, upper)``.

    On CUDA the minima and maxima of all tensors come back in one host read (one
    synchronisation, however many tensors); tensors whose values cannot be read (see
    :func:`can_read_values`) are skipped.
    """
    bounds = read_min_max(*(t for t, _ in checks.values()))
    for (name, (_, upper)), bound in zip(checks.items(), bounds):
        check_range(name, bound, upper)


def check_range(name: str, bound: tuple[int, int] | None, upper: int) -> None:
    """Raise ``ValueError`` unless ``bound`` (from :func:`read_min_max`) lies in ``[0, upper)``."""
    if bound is not None and (bound[0] < 0 or bound[1] >= upper):
        raise ValueError(f"{name} values must be in [0, {upper}), got values in "
                         f"[{bound[0]}, {bound[1]}]")
