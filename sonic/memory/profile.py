"""Measure the memory a forward pass keeps alive for its backward pass (activation memory).

The call runs once under :func:`torch.autograd.graph.saved_tensors_hooks`, so every tensor that
autograd saves — by built-in ops and by custom ``autograd.Function``\\ s alike — passes through a
hook. Bytes are counted per storage (several views of one buffer count once) from the storage
size, so the measurement works on ``meta`` tensors: paper-scale layers are measured on a CPU in
seconds without allocating anything. docs/design.md §3 states the budget this checks (SonicMoE §3.2):
a memory-minimal MoE layer keeps ``X`` (referenced), ``H (P, 2n)`` and O(P) metadata.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_MiB = float(1 << 20)


@dataclass(frozen=True)
class SavedTensor:
    """One storage kept alive for backward.

    Attributes:
        shape: shape of the first saved view of the storage.
        dtype: element type of that view.
        nbytes: bytes of the whole storage (what stays allocated, even if only a view is saved).
        kind: ``"input"`` when the storage belongs to a caller's tensor (an argument, or a
            parameter/buffer of the profiled module), ``"activation"`` when the call created it.
        nodes: names of the autograd nodes that saved it (e.g. ``"GroupedMmBackward0"``); empty
            when no node reachable from the output exposes it.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    kind: str
    nodes: tuple[str, ...]

    def to_dict(self) -> dict:
        """JSON-ready form: dtype as its short name (``"bfloat16"``), shape as a list."""
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "nbytes": self.nbytes, "kind": self.kind, "nodes": list(self.nodes)}


@dataclass(frozen=True)
class ActivationMemoryReport:
    """What :func:`profile_activation_memory` measured.

    Attributes:
        saved: distinct storages kept for backward, largest first.
        input_bytes: bytes of saved storages that belong to the caller (not extra memory).
        activation_bytes: bytes of saved storages created by the call — the activation memory.
        peak_bytes: on CUDA, peak allocated bytes during the call above what was allocated
            before it (forward only, output included); ``None`` on devices that do not report it.
        output: the call's return value, still attached to the graph so the caller can run
            backward.
    """

    saved: tuple[SavedTensor, ...]
    input_bytes: int
    activation_bytes: int
    peak_bytes: int | None
    output: Any

    @property
    def activation_mib(self) -> float:
        """``activation_bytes`` in MiB (2**20 bytes)."""
        return self.activation_bytes / _MiB

    def to_dict(self) -> dict:
        """JSON-ready summary (the output is left out)."""
        return {"activation_bytes": self.activation_bytes, "input_bytes": self.input_bytes,
                "activation_MiB": self.activation_mib, "input_MiB": self.input_bytes / _MiB,
                "peak_bytes": self.peak_bytes,
                "saved": [s.to_dict() for s in self.saved]}

    def format(self, max_rows: int | None = None) -> str:
        """Human table in MiB; ``max_rows`` keeps only the largest storages."""
        peak = "n/a" if self.peak_bytes is None else f"{self.peak_bytes / _MiB:.2f} MiB"
        lines = [f"saved for backward: activation {self.activation_mib:.2f} MiB, "
                 f"input {self.input_bytes / _MiB:.2f} MiB, {len(self.saved)} storages; "
                 f"forward peak {peak}",
                 f"  {'kind':<10} {'MiB':>10}  {'dtype':<9} {'shape':<22} saved by"]
        shown = self.saved if max_rows is None else self.saved[:max_rows]
        for s in shown:
            dtype = str(s.dtype).removeprefix("torch.")
            shape = "(" + ", ".join(map(str, s.shape)) + ")"
            lines.append(f"  {s.kind:<10} {s.nbytes / _MiB:>10.3f}  {dtype:<9} {shape:<22} "
                         f"{', '.join(s.nodes) or '?'}")
        if len(shown) < len(self.saved):
            rest = sum(s.nbytes for s in self.saved[len(shown):])
            lines.append(f"  ... {len(self.saved) - len(shown)} more, {rest / _MiB:.3f} MiB")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def profile_activation_memory(fn_or_module: Callable[..., Any], *inputs: Any,
                              **kwargs: Any) -> ActivationMemoryReport:
    """Run ``fn_or_module(*inputs, **kwargs)`` once and report the bytes it keeps for backward.

    Every tensor autograd saves during the call is recorded; those still referenced by the graph
    when the call returns are grouped by storage and classified as ``"input"`` (shares storage
    with a tensor in ``inputs``/``kwargs`` — searched through lists, tuples, dicts and
    dataclasses — or with a parameter or buffer when ``fn_or_module`` is an ``nn.Module``, or
    with a tensor its submodules' ``weight_copies()`` return, such as :class:`sonic.MoE`'s FP8
    weight copies) or
    ``"activation"`` (new memory). Bytes are ``storage size`` — so a saved slice of a large
    buffer charges the whole buffer, which is what stays allocated — and work for ``meta``
    tensors. Nothing is saved unless some input or parameter requires grad and grad mode is on.

    Args:
        fn_or_module: any callable; an ``nn.Module``'s parameters and buffers count as inputs.
        *inputs, **kwargs: passed to the call unchanged.

    Returns:
        An :class:`ActivationMemoryReport`; its ``output`` is the call's result with its graph,
        so ``report.output.sum().backward()`` works (double backward too).

    Raises:
        TypeError: if ``fn_or_module`` is not callable.
    """
    if not callable(fn_or_module):
        raise TypeError(f"fn_or_module must be a callable or nn.Module, got "
                        f"{type(fn_or_module).__name__}")
    caller_tensors = list(_tensors_in((inputs, kwargs)))
    if isinstance(fn_or_module, torch.nn.Module):
        caller_tensors += list(fn_or_module.parameters()) + list(fn_or_module.buffers())
    input_keys = {_storage_key(t) for t in caller_tensors}

    # Weak references only: a saved tensor that the graph drops before the call returns is not
    # kept for backward and must not be counted (nor kept alive by the profiler).
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        # A detached alias avoids the reference cycle output -> grad_fn -> output that packing
        # the tensor itself creates; autograd re-attaches the graph edge when it unpacks.
        alias = t.detach()
        packed.append(weakref.ref(alias))
        return alias

    device = next((t.device for t in caller_tensors if t.device.type == "cuda"), None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda alias: alias):
        if device is None:
            output, peak = fn_or_module(*inputs, **kwargs), None
        else:
            output, peak = _call_with_cuda_peak(device, fn_or_module, inputs, kwargs)

    if isinstance(fn_or_module, torch.nn.Module):
        # Copies a module derives from its weights and keeps across calls (sonic.MoE's FP8
        # weight copies, made once per weight update) are its state, like its parameters;
        # read after the call, which may have made them.
        copies = (getattr(m, "weight_copies", None) for m in fn_or_module.modules())
        input_keys |= {_storage_key(t) for get in copies if callable(get) for t in get()}
    alive = [t for t in (ref() for ref in packed) if t is not None]
    savers = _saving_nodes(output)
    by_key: dict[int, SavedTensor] = {}
    for t in alive:
        key = _storage_key(t)
        if key not in by_key:
            by_key[key] = SavedTensor(
                shape=tuple(t.shape), dtype=t.dtype, nbytes=_storage_nbytes(t),
                kind="input" if key in input_keys else "activation",
                nodes=tuple(sorted(savers.get(key, ()))))
    saved = tuple(sorted(by_key.values(), key=lambda s: -s.nbytes))
    return ActivationMemoryReport(
        saved=saved,
        input_bytes=sum(s.nbytes for s in saved if s.kind == "input"),
        activation_bytes=sum(s.nbytes for s in saved if s.kind == "activation"),
        peak_bytes=peak, output=output)


def _call_with_cuda_peak(device: torch.device, fn: Callable[..., Any], inputs: tuple,
                         kwargs: dict) -> tuple[Any, int]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    output = fn(*inputs, **kwargs)
    torch.cuda.synchronize(device)
    return output, torch.cuda.max_memory_allocated(device) - before


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside nested lists, tuples, dicts and dataclass instances."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, field.name))


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl address: shared by all views, distinct for live storages, and defined for
    # meta tensors (whose data_ptr is 0 for every storage).
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # no plain storage (sparse, nested tensors)
        return id(t)


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return t.numel() * t.element_size()


def _saving_nodes(output: Any) -> dict[int, set[str]]:
    """Storage key -> names of the autograd nodes (reachable from ``output``) that saved it."""
    savers: dict[int, set[str]] = {}
    stack: list[Any] = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
        for t in _node_saved_tensors(node):
            savers.setdefault(_storage_key(t), set()).add(node.name())
    return savers


def _node_saved_tensors(node: torch.autograd.graph.Node) -> Iterator[torch.Tensor]:
    # Built-in nodes expose each saved value as `_saved_<arg>`; custom Functions as
    # `saved_tensors`. Reading a value released by an earlier backward raises RuntimeError.
    names = [a for a in dir(node) if a.startswith("_saved_")]
    if hasattr(type(node), "saved_tensors"):
        names.append("saved_tensors")
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue
        yield from _tensors_in(value)
