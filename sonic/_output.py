"""Checks of output files named on a command line, made before any work starts: a run that
trains for minutes must not end in a traceback because its log or plot cannot be written."""

from __future__ import annotations

import os
from pathlib import Path


def check_writable(option: str, path: str | os.PathLike) -> Path:
    """Raise ``ValueError`` naming ``option`` unless a file can be created or replaced at
    ``path``: its folder must exist and be writable, and ``path`` must not be a folder.
    Nothing is created. Returns ``path`` as a `Path`."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"{option}: {str(path)!r} is a folder; expected a file path")
    if not folder.is_dir():
        raise ValueError(f"{option}: the folder {str(folder)!r} of {str(path)!r} does not "
                         f"exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists()
                                                    and not os.access(path, os.W_OK)):
        raise ValueError(f"{option}: {str(path)!r} is not writable")
    return path


def image_path(option: str, path: str | os.PathLike) -> Path:
    """The file matplotlib's ``savefig`` writes for ``path``, checked before any work: a path
    without a suffix gets ``.png`` (matplotlib's default format, appended by ``savefig``), a
    suffix must name a format matplotlib can write, and the file must be writable
    (:func:`check_writable`).

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
        ValueError: unknown image format or unwritable path; the message names ``option``.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"{option} needs matplotlib: pip install 'sonic-cute-moe[plot]'") \
            from err
    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise ValueError(f"{option}: cannot write {path.suffix!r} images; expected one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return check_writable(option, path)
