"""The MoE layer configurations sonic is measured at (ANCHORS.md; SonicMoE paper §6)."""

from __future__ import annotations

import argparse

# (T, d, n, E, K) of the paper's configurations, as measured in ANCHORS.md.
CONFIGS = {
    "7B": (24576, 1536, 256, 128, 8),
    "OLMoE": (32768, 2048, 1024, 64, 8),
    "30B": (32768, 4096, 1024, 128, 8),
}
ACCEPTED = f"{', '.join(CONFIGS)} or five positive integers T,d,n,E,K (e.g. 64,32,16,8,2)"


def parse_config(text: str) -> tuple[str, tuple[int, int, int, int, int]]:
    """``"7B"`` (any case) or ``"T,d,n,E,K"`` → ``(name, (T, d, n, E, K))``.

    Raises:
        argparse.ArgumentTypeError: any other text, or ``K > E``.
    """
    for name, sizes in CONFIGS.items():
        if text.strip().lower() == name.lower():
            return name, sizes
    parts = text.split(",")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 5 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected {ACCEPTED}, got {text!r}")
    if sizes[4] > sizes[3]:
        raise argparse.ArgumentTypeError(f"K must be <= E in T,d,n,E,K, got {text!r}")
    return ",".join(map(str, sizes)), sizes
