"""The MoE layer configurations sonic is measured at: the SonicMoE paper's (§6) and the
per-GPU shapes of today's large MoE models."""

from __future__ import annotations

import argparse

# (T, d, n, E, K): tokens per GPU, model width, expert width, experts, experts per token.
# The first three are the SonicMoE paper's configurations (§6); the others are the MoE layers
# of published models with the tokens one GPU sees in a training step.
CONFIGS = {
    "7B": (24576, 1536, 256, 128, 8),
    "OLMoE": (32768, 2048, 1024, 64, 8),
    "30B": (32768, 4096, 1024, 128, 8),
    "DeepSeek-V3": (16384, 7168, 2048, 256, 8),
    "Qwen3-235B": (16384, 4096, 1536, 128, 8),
    "GLM-4.5": (16384, 5120, 1536, 160, 8),
    "Mixtral-8x7B": (16384, 4096, 14336, 8, 2),
}
# What the benchmarks run when given no configuration.
PAPER_CONFIGS = ("7B", "OLMoE", "30B")
# Pairs and rows are indexed in int32; tensor sizes are int64.
MAX_SIZE = 2**31 - 1
MAX_NUMEL = 2**63 - 1
ACCEPTED = (f"{', '.join(CONFIGS)} or five positive integers T,d,n,E,K (e.g. 64,32,16,8,2), "
            f"each and T*K at most 2**31-1")


def parse_config(text: str) -> tuple[str, tuple[int, int, int, int, int]]:
    """``"7B"`` (any case) or ``"T,d,n,E,K"`` → ``(name, (T, d, n, E, K))``.

    Raises:
        argparse.ArgumentTypeError: any other text, ``K > E``, a size or ``P = T·K`` above
            ``2**31 - 1`` (int32 indices), or a tensor of the layer (``T·K·2n``, ``T·d``,
            ``E·2n·d`` elements) above ``2**63 - 1`` elements.
    """
    for name, sizes in CONFIGS.items():
        if text.strip().lower() == name.lower():
            return name, sizes
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 5 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected {ACCEPTED}, got {text!r}")
    T, d, n, E, K = values
    sizes = (T, d, n, E, K)
    if max(sizes) > MAX_SIZE or T * K > MAX_SIZE:
        raise argparse.ArgumentTypeError(
            f"each of T,d,n,E,K and T*K must be at most 2**31-1 = {MAX_SIZE} (int32 indices), "
            f"got {text!r}")
    if max(T * K * 2 * n, T * d, E * 2 * n * d) > MAX_NUMEL:
        raise argparse.ArgumentTypeError(
            f"T*K*2n, T*d and E*2n*d (tensor elements) must be at most 2**63-1, got {text!r}")
    if sizes[4] > sizes[3]:
        raise argparse.ArgumentTypeError(f"K must be <= E in T,d,n,E,K, got {text!r}")
    return ",".join(map(str, sizes)), sizes
