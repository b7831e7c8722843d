"""``python -m sonic.memory``: activation memory of one MoE layer, sonic vs torch-gmm.

Measures (not estimates) the bytes one layer — router and experts, bf16 — keeps for backward, by
running :class:`sonic.MoE` and the torch-gmm baseline under
:func:`sonic.memory.profile_activation_memory`. On the default ``meta`` device nothing is
allocated, so the paper's configurations (docs/design.md §5) run on a CPU in seconds. The floor of
SonicMoE §3.2 is ``H = T·K·2n·2`` bytes plus O(P) routing metadata (docs/memory.md).

    python -m sonic.memory --config 7B
    python -m sonic.memory --config 64,32,16,8,2 --json   # last line: one JSON object
    python -m sonic.memory --config 32768,2048,2048,8,1 --plot fig1.png   # SonicMoE Fig. 1
    python -m sonic.memory --config 30B --activation-cache fp8   # also sonic's FP8 H cache

``--activation-cache fp8`` adds a third row, ``sonic-fp8c``: sonic with H kept for backward in
e4m3 with 1×128 fp32 scales (:mod:`sonic.activation_cache`), and its bytes
relative to sonic's bf16 cache.

``--plot FILE`` (needs matplotlib, the ``plot`` extra) sweeps expert granularity at fixed FLOPs
(SonicMoE Fig. 1): each scale ``s`` of ``--scales`` measures ``(T, d, n/s, E·s, K·s)``, so
``K·n`` (the FLOPs) and ``K/E`` (the activation ratio) stay those of ``--config`` while the
granularity ``d/n`` grows ``s``-fold, and draws both implementations' bytes over ``d/n``.
``--plot`` and ``--scales`` are checked before anything is measured.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch

import sonic
from sonic._output import image_path
from sonic.baselines import torch_gmm_moe
from sonic.baselines.configs import ACCEPTED, CONFIGS, parse_config
from sonic.memory.profile import ActivationMemoryReport, profile_activation_memory

_MiB = float(1 << 20)


def measure(sizes: tuple[int, int, int, int, int], device: torch.device,
            activation_cache: str = "bf16") -> dict[str, ActivationMemoryReport]:
    """Profile one bf16 MoE layer of ``sizes = (T, d, n, E, K)`` with both implementations.

    Both use the same router and expert weights (those of a seeded :class:`sonic.MoE`) and the
    same input ``x (T, d)`` requiring grad; top-K routing with ``softmax_topk`` scores. sonic runs
    its PyTorch reference backend except on CUDA, where its default (kernels where they can
    run) is measured. The reports' outputs are dropped so the graphs are freed.
    ``activation_cache="fp8"`` also profiles the same layer keeping H as e4m3 + scales.

    Returns:
        ``{"sonic": report, "torch-gmm": report}``, and ``"sonic-fp8c"`` (the fp8 cache) with
        ``activation_cache="fp8"``.

    Raises:
        ValueError: on ``meta``, ``d`` or ``n`` not a multiple of 8 (the only way to run there
            is ``torch._grouped_mm``, which needs 16-byte aligned rows); with
            ``activation_cache="fp8"``, ``n`` not a multiple of 64.
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
    if activation_cache == "fp8":
        fp8_layer = copy.deepcopy(layer)
        fp8_layer.activation_cache = "fp8"
        runs["sonic-fp8c"] = lambda: profile_activation_memory(fp8_layer, x)
    return {name: dataclasses.replace(run(), output=None) for name, run in runs.items()}


def parse_scales(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` → ``(1, 2, 4)``: distinct positive integers for :func:`granularity_sweep`.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        scales = tuple(int(p) for p in text.split(","))
    except ValueError:
        scales = ()
    if not scales or min(scales) < 1 or len(set(scales)) != len(scales):
        raise argparse.ArgumentTypeError(f"expected distinct positive integers like 1,2,4,8,16, "
                                         f"got {text!r}")
    return scales


def granularity_sweep(sizes: tuple[int, int, int, int, int], scales: tuple[int, ...],
                      device: torch.device) -> list[dict]:
    """Activation memory over expert granularity at fixed FLOPs (SonicMoE Fig. 1).

    Scale ``s`` measures ``(T, d, n/s, E·s, K·s)`` with :func:`measure`: ``K·n`` — hence the
    forward FLOPs ``6·T·K·d·n`` — and the activation ratio ``K/E`` stay those of ``sizes``
    while the granularity ``d/n`` grows ``s``-fold.

    Args:
        sizes: ``(T, d, n, E, K)`` at scale 1.
        scales: the scales, each dividing ``n``.
        device: as for :func:`measure`.

    Returns:
        One dict per scale, in order: ``scale``, ``granularity`` (``d/n``), ``T, d, n, E, K``,
        ``sonic_MiB``, ``torch_MiB`` (activation bytes kept for backward, MiB).

    Raises:
        ValueError: a scale that does not divide ``n``, or what :func:`measure` raises.
    """
    T, d, n, E, K = sizes
    rows = []
    for s in scales:
        if n % s:
            raise ValueError(f"scale {s} does not divide n={n}")
        point = (T, d, n // s, E * s, K * s)
        reports = measure(point, device)
        rows.append({"scale": s, "granularity": d / (n // s), **dict(zip("TdnEK", point)),
                     "sonic_MiB": round(reports["sonic"].activation_mib, 3),
                     "torch_MiB": round(reports["torch-gmm"].activation_mib, 3)})
    return rows


DEFAULT_SCALES = (1, 2, 4, 8, 16)


def check_scales(sizes: tuple[int, int, int, int, int], scales: tuple[int, ...],
                 device: torch.device) -> None:
    """Raise ``ValueError`` unless every scale ``s`` gives a point :func:`measure` can run:
    ``s`` divides ``n``, and on ``meta`` ``n/s`` is a multiple of 8. Checked before measuring."""
    n = sizes[2]
    for s in scales:
        if n % s:
            raise ValueError(f"scale {s} does not divide n={n}")
        if device.type == "meta" and (n // s) % 8:
            raise ValueError(f"scale {s} gives n/s={n // s}, not a multiple of 8 as meta "
                             f"needs (use smaller scales or --device cpu)")


def default_scales(sizes: tuple[int, int, int, int, int], device: torch.device
                   ) -> tuple[int, ...]:
    """The scales of :data:`DEFAULT_SCALES` that :func:`check_scales` accepts for ``sizes``."""
    usable = []
    for s in DEFAULT_SCALES:
        try:
            check_scales(sizes, (s,), device)
        except ValueError:
            continue
        usable.append(s)
    return tuple(usable)


def plot_sweep(rows: list[dict], path: str) -> None:
    """Draw :func:`granularity_sweep`'s rows — MiB kept for backward over ``d/n``, sonic and
    torch-gmm — into the image file ``path`` (format from its suffix, e.g. ``.png``, ``.pdf``).

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
    """
    from matplotlib.figure import Figure

    first = rows[0]
    # A bare Figure (no pyplot) leaves matplotlib's global backend and figure list alone.
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    x = [r["granularity"] for r in rows]
    for key, label, marker in (("torch_MiB", "torch-gmm (plain PyTorch MoE)", "s"),
                               ("sonic_MiB", "sonic", "o")):
        ax.plot(x, [r[key] for r in rows], marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{g:g}" for g in x])
    ax.set_xlabel("expert granularity d/n (E and K scaled: K·n and K/E fixed)")
    ax.set_ylabel("activation memory kept for backward (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"one MoE layer, bf16: T={first['T']} d={first['d']} "
                 f"K·n={first['K'] * first['n']} K/E={first['K']}/{first['E']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)


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
    if "sonic-fp8c" in reports:
        lines.append(f"  sonic-fp8c / sonic (fp8 / bf16 activation cache): "
                     f"{fp8_cache_ratio(reports):.3f}")
    for impl, r in reports.items():
        lines += ["", f"{impl}, largest saved storages:", r.format(max_rows=top)]
    return "\n".join(lines)


def fp8_cache_ratio(reports: dict[str, ActivationMemoryReport]) -> float:
    """Activation bytes of sonic with the fp8 cache over sonic's with the bf16 cache."""
    return reports["sonic-fp8c"].activation_bytes / max(reports["sonic"].activation_bytes, 1)


def _plot_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, sizes: tuple,
                    device: torch.device) -> tuple[Path, tuple[int, ...]]:
    """``--plot`` and ``--scales`` checked before anything is measured: the file matplotlib
    will write and the scales of the sweep; bad ones end in ``parser.error``."""
    try:
        path = image_path("--plot", args.plot)
    except (ImportError, ValueError) as err:
        parser.error(str(err))
    if args.scales is None:
        scales = default_scales(sizes, device)
        if len(scales) < 2:
            parser.error(f"--plot: --config {args.config[0]} leaves fewer than two of the "
                         f"default scales {','.join(map(str, DEFAULT_SCALES))} usable on "
                         f"{device} (n={sizes[2]}); pass --scales")
        return path, scales
    try:
        check_scales(sizes, args.scales, device)
    except ValueError as err:
        parser.error(f"--scales {','.join(map(str, args.scales))} with --config "
                     f"{args.config[0]}: {err}")
    return path, args.scales


def _plot(path: Path, scales: tuple[int, ...], sizes: tuple, device: torch.device
          ) -> list[dict]:
    """``--plot``: run the sweep, draw it into ``path``, print it."""
    rows = granularity_sweep(sizes, scales, device)
    plot_sweep(rows, str(path))
    lines = ["", f"granularity sweep at fixed FLOPs (K*n = {sizes[4] * sizes[2]}), "
             f"plotted to {path}",
             f"  {'d/n':>6} {'n':>6} {'E':>6} {'K':>4} {'sonic MiB':>10} {'torch MiB':>10}"]
    lines += [f"  {r['granularity']:>6g} {r['n']:>6} {r['E']:>6} {r['K']:>4} "
              f"{r['sonic_MiB']:>10.2f} {r['torch_MiB']:>10.2f}" for r in rows]
    print("\n".join(lines))
    return rows


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
                        help="end with one JSON line: config, T, d, n, E, K, sonic_MiB, "
                             "torch_MiB (with --activation-cache fp8 also sonic_fp8_cache_MiB, "
                             "fp8_cache_ratio)")
    parser.add_argument("--activation-cache", choices=("bf16", "fp8"), default="bf16",
                        help="fp8: also measure sonic keeping H as e4m3 + 1x128 scales "
                             "(row sonic-fp8c) and its ratio to the bf16 cache")
    parser.add_argument("--top", type=int, default=6, help="saved storages listed per impl")
    parser.add_argument("--plot", metavar="FILE",
                        help="also sweep granularity at fixed FLOPs (SonicMoE Fig. 1) from "
                             "--config and draw it into FILE (.png, .pdf, ...; no suffix: .png "
                             "is added; needs matplotlib)")
    parser.add_argument("--scales", type=parse_scales, metavar="S,S,...",
                        help="--plot: scale s measures (T, d, n/s, E*s, K*s); default: those "
                             "of 1,2,4,8,16 that divide n (on meta: with n/s a multiple of 8)")
    args = parser.parse_args(argv)
    if args.scales is not None and not args.plot:
        parser.error("--scales only applies with --plot FILE")
    if args.top < 0:
        parser.error(f"--top must be >= 0, got {args.top}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    name, sizes = args.config
    device = torch.device(args.device)
    plot = _plot_arguments(parser, args, sizes, device) if args.plot else None
    try:
        reports = measure(sizes, device, args.activation_cache)
    except ValueError as err:
        parser.error(f"--config {name}: {err}")
    print(_table(name, sizes, device, reports, args.top))
    sweep = _plot(*plot, sizes, device) if plot else None
    if args.json:
        summary = {"config": name, **dict(zip("TdnEK", sizes)),
                   "sonic_MiB": round(reports["sonic"].activation_mib, 3),
                   "torch_MiB": round(reports["torch-gmm"].activation_mib, 3)}
        if "sonic-fp8c" in reports:
            summary["sonic_fp8_cache_MiB"] = round(reports["sonic-fp8c"].activation_mib, 3)
            summary["fp8_cache_ratio"] = round(fp8_cache_ratio(reports), 4)
        if sweep is not None:
            summary["sweep"] = sweep
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
