"""``python -m sonic.memory``: activation memory of one MoE layer, sonic vs torch-gmm.

Measures (not estimates) the bytes one layer — router and experts, bf16 — keeps for backward, by
running :class:`sonic.MoE` and the torch-gmm baseline under
:func:`sonic.memory.profile_activation_memory`. On the default ``meta`` device nothing is
allocated, so the paper's configurations (ANCHORS.md) run on a CPU in seconds. The floor of
DESIGN §3 / SonicMoE §3.2 is ``H = T·K·2n·2`` bytes plus O(P) routing metadata.

    python -m sonic.memory --config 7B
    python -m sonic.memory --config 64,32,16,8,2 --json   # last line: one JSON object
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

import sonic
from sonic.baselines import torch_gmm_moe
from sonic.baselines.configs import ACCEPTED, CONFIGS, parse_config
from sonic.memory.profile import ActivationMemoryReport, profile_activation_memory

_MiB = float(1 << 20)


def measure(sizes: tuple[int, int, int, int, int],
            device: torch.device) -> dict[str, ActivationMemoryReport]:
    """Profile one bf16 MoE layer of ``sizes = (T, d, n, E, K)`` with both implementations.

    Both use the same router and expert weights (those of a seeded :class:`sonic.MoE`) and the
    same input ``x (T, d)`` requiring grad; top-K routing with ``softmax_topk`` scores. sonic runs
    its PyTorch reference backend except on CUDA, where its default (kernels where they can
    run) is measured. The reports' outputs are dropped so the graphs are freed.

    Returns:
        ``{"sonic": report, "torch-gmm": report}``.

    Raises:
        ValueError: on ``meta``, ``d`` or ``n`` not a multiple of 8 (the only way to run there
            is ``torch._grouped_mm``, which needs 16-byte aligned rows).
    """
    T, d, n, E, K = sizes
    if device.type == "meta" and (d % 8 or n % 8):
        raise ValueError(f"on meta, d and n must be multiples of 8 (torch._grouped_mm needs "
                         f"16-byte bf16 rows), got d={d}, n={n}; use --device cpu")
    torch.manual_seed(0)
    layer = sonic.MoE(d, n, E, K, backend="auto" if device.type == "cuda" else "torch",
                      device=device, dtype=torch.bfloat16)
    x = torch.randn(T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    runs = {
        "sonic": lambda: profile_activation_memory(layer, x),
        "torch-gmm": lambda: profile_activation_memory(
            torch_gmm_moe, x, layer.gate.weight, layer.w1, layer.w2, K),
    }
    return {name: dataclasses.replace(run(), output=None) for name, run in runs.items()}


def _table(name: str, sizes: tuple, device: torch.device,
           reports: dict[str, ActivationMemoryReport], top: int) -> str:
    T, d, n, E, K = sizes
    floor = T * K * 2 * n * 2 / _MiB

    def mib(value):
        return "n/a" if value is None else f"{value / _MiB:.2f}"

    lines = [f"MoE layer activation memory, config {name}: T={T} d={d} n={n} E={E} K={K}, "
             f"bf16, device {device}",
             f"floor: H = T*K*2n*2 bytes = {floor:.2f} MiB, plus O(P) routing metadata",
             f"  {'impl':<10} {'activation MiB':>15} {'input MiB':>10} {'fwd peak MiB':>13}"]
    for impl, r in reports.items():
        lines.append(f"  {impl:<10} {r.activation_mib:>15.2f} {mib(r.input_bytes):>10} "
                     f"{mib(r.peak_bytes):>13}")
    ratio = reports["torch-gmm"].activation_bytes / max(reports["sonic"].activation_bytes, 1)
    lines.append(f"  torch-gmm / sonic: {ratio:.2f}x")
    for impl, r in reports.items():
        lines += ["", f"{impl}, largest saved storages:", r.format(max_rows=top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m sonic.memory",
        description="Activation memory kept for backward by one MoE layer: sonic vs torch-gmm "
                    "(bf16, measured with saved-tensor hooks).")
    parser.add_argument("--config", required=True, type=parse_config, metavar="CONFIG",
                        help=f"{ACCEPTED}")
    parser.add_argument("--device", choices=("meta", "cpu", "cuda"), default="meta",
                        help="where to run; meta (default) allocates nothing")
    parser.add_argument("--json", action="store_true",
                        help="end with one JSON line: config, T, d, n, E, K, sonic_MiB, torch_MiB")
    parser.add_argument("--top", type=int, default=6, help="saved storages listed per impl")
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error(f"--top must be >= 0, got {args.top}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    name, sizes = args.config
    device = torch.device(args.device)
    try:
        reports = measure(sizes, device)
    except ValueError as err:
        parser.error(f"--config {name}: {err}")
    print(_table(name, sizes, device, reports, args.top))
    if args.json:
        summary = {"config": name, **dict(zip("TdnEK", sizes)),
                   "sonic_MiB": round(reports["sonic"].activation_mib, 3),
                   "torch_MiB": round(reports["torch-gmm"].activation_mib, 3)}
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
