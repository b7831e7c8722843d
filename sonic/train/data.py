"""Byte-level text corpus: load UTF-8 text, split train/validation, sample random windows."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 256
"""Byte-level vocabulary: every token is one byte of the UTF-8 encoding."""


def load_text(path: str | Path | None = None) -> str:
    """Text to train on.

    Args:
        path: a UTF-8 text file, or ``None`` for the CPython documentation topics shipped with
            every Python (``pydoc_data.topics.topics``, the values joined in key order, ~0.46 MB).

    Raises:
        ValueError: the file cannot be read, is not valid UTF-8, or is empty.
    """
    if path is None:
        from pydoc_data.topics import topics

        return "".join(topics[key] for key in sorted(topics))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--data: cannot read {str(path)!r} as UTF-8 text: {err}") from err
    if not text:
        raise ValueError(f"--data: {str(path)!r} is empty; expected a non-empty UTF-8 text file")
    return text


class ByteCorpus:
    """A byte sequence split into a training head and a validation tail.

    Args:
        text: the corpus; encoded as UTF-8 bytes, one token per byte (vocab 256).
        val_fraction: share of the bytes, taken from the end, held out for validation.
        seq_len: window length the corpus will be sampled at; both splits must hold at least
            one window of ``seq_len + 1`` bytes (inputs plus the shifted targets).

    Attributes:
        train: ``(N_train,)`` uint8 bytes.
        val: ``(N_val,)`` uint8 bytes.

    Raises:
        ValueError: ``val_fraction`` outside ``(0, 1)``, or a split shorter than ``seq_len + 1``.
    """

    def __init__(self, text: str, *, val_fraction: float = 0.1, seq_len: int):
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction: expected a value in (0, 1), got {val_fraction}")
        data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        split = int(len(data) * (1.0 - val_fraction))
        self.train, self.val = data[:split], data[split:]
        for name, part in (("training", self.train), ("validation", self.val)):
            if len(part) < seq_len + 1:
                raise ValueError(
                    f"data: the {name} split has {len(part)} bytes, fewer than seq_len + 1 = "
                    f"{seq_len + 1}; use more text or a smaller --seq-len")

    def batch(self, split: str, batch_size: int, seq_len: int,
              generator: torch.Generator, *, shard: int = 0,
              num_shards: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Random contiguous windows of one split.

        With ``num_shards > 1`` the generator draws a global batch of
        ``num_shards·batch_size`` windows and this returns shard ``shard`` of it (rows
        ``shard·batch_size …``): ranks that share the generator's seed read different windows,
        and together exactly the windows one process reads with ``num_shards·batch_size``.

        Args:
            split: ``"train"`` or ``"val"``.
            batch_size: ``B``, windows per batch.
            seq_len: ``S``, bytes per window.
            generator: CPU generator that picks the window starts (seeded → reproducible).
            shard, num_shards: which part of the global batch to return, and how many parts.

        Returns:
            ``(inputs, targets)``, both ``(B, S)`` int64 on the CPU; ``targets`` is ``inputs``
            shifted left by one byte.

        Raises:
            ValueError: unknown ``split``.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard: expected 0 <= shard < num_shards={num_shards}, got {shard}")
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - seq_len, (num_shards * batch_size,),
                               generator=generator)[shard * batch_size:(shard + 1) * batch_size]
        windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]
