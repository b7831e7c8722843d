"""The checkpoint file of `sonic.train`: a ``torch.save`` payload behind a header holding its
SHA-256, read back with ``torch.load(weights_only=True)``.

A checkpoint that loads but is not what was saved — one flipped byte, a truncated copy, a field
edited by hand — would resume a different run without any sign; the checksum refuses the first
two, :func:`check_state` the structure of the state, and the training loop checks the state
against the model, the optimizer and the run's settings.

Layout: the line ``MAGIC``, the payload's SHA-256 as 64 hex digits and a newline, the payload.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import torch

MAGIC = b"sonic.train checkpoint 2\n"
KEYS = ("version", "step", "config", "world_size", "rank", "model", "optimizer",
        "train_generator", "rng", "val_history", "losses")
"""Keys of a checkpoint's state (see `sonic.train.loop`)."""


def write_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` atomically (a temporary file in the same folder, then a rename), so an
    interrupted save never leaves a truncated checkpoint behind.

    Raises:
        ValueError: ``state`` lacks one of :data:`KEYS`.
    """
    check_state(state, str(path))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    os.replace(tmp, path)


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The state :func:`write_checkpoint` wrote to ``path``, tensors on the CPU, verified
    against its checksum and :func:`check_state`.

    Raises:
        ValueError: unreadable, empty, not a checkpoint of this format, a checksum that does
            not match (a corrupted or edited file), or a state missing keys; the message names
            the file.
    """
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"resume: cannot read checkpoint {name!r}: {err}") from err
    if not data:
        raise ValueError(f"resume: checkpoint {name!r} is empty")
    if not data.startswith(MAGIC):
        raise ValueError(f"resume: {name!r} is not a sonic.train checkpoint (format 2, written "
                         f"by --save)")
    head = len(MAGIC) + 65
    digest, payload = data[len(MAGIC):head - 1], data[head:]
    if data[head - 1:head] != b"\n" or hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError(f"resume: checkpoint {name!r} is corrupted: its SHA-256 does not match "
                         f"the one written with it")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as err:   # noqa: BLE001 - unpickling errors have no common base class
        raise ValueError(f"resume: cannot load checkpoint {name!r}: {err}") from err
    check_state(state, name)
    return state


def check_state(state, name: str) -> None:
    """Raise ``ValueError`` unless ``state`` is a dict with every key of :data:`KEYS` and a
    consistent history: ``step`` a non-negative int, one loss per step, validation steps
    ascending within ``[0, step]``, and every AdamW parameter state at ``step`` steps."""
    if not isinstance(state, dict):
        raise ValueError(f"resume: checkpoint {name!r} holds a {type(state).__name__}, not a "
                         f"training state")
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise ValueError(f"resume: checkpoint {name!r} lacks {', '.join(missing)}")
    step = state["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"resume: checkpoint {name!r}: step must be an int >= 0, got {step!r}")
    if len(state["losses"]) != step:
        raise ValueError(f"resume: checkpoint {name!r} is at step {step} but holds "
                         f"{len(state['losses'])} step losses")
    val_steps = [v[0] for v in state["val_history"]]
    if not val_steps or val_steps != sorted(set(val_steps)) or not 0 == val_steps[0] \
            or val_steps[-1] > step:
        raise ValueError(f"resume: checkpoint {name!r}: validation steps {val_steps} do not fit "
                         f"step {step}")
    optimizer_steps = {int(s["step"]) for s in state["optimizer"].get("state", {}).values()
                       if "step" in s}
    if optimizer_steps and optimizer_steps != {step}:
        raise ValueError(f"resume: checkpoint {name!r} is at step {step} but its optimizer "
                         f"state has taken {sorted(optimizer_steps)} steps")
