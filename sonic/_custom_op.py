"""sonic's custom ops, and the plain-eager call that skips PyTorch's dispatcher.

Each step of the MoE dataflow is a :func:`torch.library.custom_op` (``torch.ops.sonic.*``, see
:mod:`sonic.ops`), which is what ``torch.compile``, ``torch.export``, fake and meta tensors,
dispatch modes and functorch transforms need. In plain eager execution the dispatcher adds
host time and nothing else: going in and out of C++ twice per op (the autograd kernel, then
the device kernel), the dynamo-disable wrapper and the aliasing check: tens of microseconds
per op, a visible share of a small layer's forward (``benchmarks/bench_host.py``).
:class:`SonicOp` therefore runs the same Python implementation
directly there, and an ``autograd.Function`` built from the same ``setup_context`` and
backward where the op has a registered autograd formula, so both paths compute the same thing
with the same code (``tests/test_custom_op.py`` checks them bitwise equal).
"""

from __future__ import annotations

from typing import Callable

import torch

def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts to on ``device_type`` (``"cpu"``, ``"cuda"``), or
    None when autocast is off there (or the device type has no autocast that sonic follows).
    The one check behind every place sonic honours or suspends autocast."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``/``create_graph``), so
    saved tensors must survive it. Unknown (no such query in this PyTorch) counts as kept."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


# Tensor types run as they are: anything else (FakeTensor, FunctionalTensor, DTensor and
# other subclasses) goes through the dispatcher, where its own handling lives.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager(args: tuple) -> bool:
    """Whether a call with ``args`` may skip the dispatcher: eager execution (not traced by
    ``torch.compile`` / ``torch.export``), no ``TorchDispatchMode``, torch-function mode or
    functorch transform active, and every tensor argument (top level or in a list) a plain
    ``torch.Tensor`` or ``nn.Parameter`` that is not on the meta device."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return False
    return all(type(t) in _PLAIN and not t.is_meta for t in _tensors(args))


def _tensors(args: tuple):
    """The tensor arguments, top level and in lists (an op's ``Tensor[]`` arguments)."""
    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, torch.Tensor):
                yield t


def _needs_autograd(args: tuple) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(args))


class SonicOp:
    """``torch.ops.sonic.<name>`` registered from ``impl``; calling the object runs the op.

    In :func:`plain_eager` calls it runs ``impl`` directly (through an ``autograd.Function``
    once :meth:`register_autograd` has given it a backward); otherwise — and for an op without
    a backward whose inputs require grad, so that PyTorch reports the missing formula as it
    would — through the dispatcher. Positional arguments only, as the ops' callers pass them.
    """

    def __init__(self, name: str, impl: Callable):
        self.name = name
        self._impl = impl
        self._custom_op = torch.library.custom_op(f"sonic::{name}", impl, mutates_args=())
        self._overload = getattr(torch.ops.sonic, name).default
        self._function: type[torch.autograd.Function] | None = None

    def register_fake(self, fn: Callable) -> Callable:
        """As :meth:`torch.library.CustomOpDef.register_fake` (usable as a decorator)."""
        return self._custom_op.register_fake(fn)

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """Register the op's autograd formula (:func:`torch.library.register_autograd`) and
        build the ``autograd.Function`` of its plain-eager calls from the same functions."""
        torch.library.register_autograd(f"sonic::{self.name}", backward,
                                        setup_context=setup_context)

        impl = self._impl

        def forward(ctx, *args):
            # setup_context called from forward rather than declared: Function.apply binds
            # the arguments with inspect.signature on every call when it is declared.
            output = impl(*args)
            setup_context(ctx, args, output)
            return output

        def function_backward(ctx, *grads):
            # A custom op's backward returns a list of Nones for a list input; an
            # autograd.Function takes None for every non-tensor input.
            return tuple(None if isinstance(g, list) else g for g in backward(ctx, *grads))

        self._function = type(f"sonic_{self.name}", (torch.autograd.Function,), {
            "forward": staticmethod(forward),
            "backward": staticmethod(function_backward),
        })

    def __call__(self, *args):
        if torch._C._are_functorch_transforms_active():
            # PyTorch's error here names an autograd.Function sonic never wrote.
            raise RuntimeError(
                f"torch.ops.sonic.{self.name} (under sonic.MoE, sonic.moe_experts or sonic's "
                f"routers) does not support torch.func transforms (grad, vjp, jacrev, vmap, "
                f"jvp): its backward is a registered autograd formula that they cannot run. "
                f"Use torch.autograd.grad or loss.backward() instead")
        if plain_eager(args):
            if self._function is not None:
                return self._function.apply(*args)
            if not _needs_autograd(args):
                return self._impl(*args)
        return self._overload(*args)
