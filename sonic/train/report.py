"""What `python -m sonic.train` prints and draws: one run's summary, two runs side by side,
and loss and throughput over steps."""

from __future__ import annotations

from pathlib import Path


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_lines(result: dict) -> list[str]:
    """The human summary of one :func:`sonic.train.train` result."""
    lines = []
    if result["world_size"] > 1:
        lines.append(f"world size {result['world_size']}  ep {result['ep']}  "
                     f"(tokens/s: all ranks)")
    lines += [
        f"router {result['router']}  steps {result['steps']}  device {result['device']} "
        f"({result['dtype']}, {result['precision']} experts by {result['experts_impl']})  "
        f"params {result['params']:,}",
        f"val loss {result['val_loss_initial']:.4f} -> {result['val_loss']:.4f} nats/byte  "
        f"train loss {result['train_loss']:.4f}",
        f"tokens/s {result['tokens_per_s']:.0f}  MFU {_fmt(result['mfu'], '.1%')} "
        f"(MoE layers {result['moe_flops_share']:.0%} of the FLOPs; peak "
        f"{_fmt(result['peak_tflops'], '.0f')} TFLOPS)  peak memory "
        f"{_fmt(result['peak_memory_MiB'], '.0f')} MiB",
        f"activation memory per MoE layer {result['activation_MiB_per_layer']:.3f} MiB",
    ]
    return lines


def comparison_lines(results: dict[str, dict]) -> list[str]:
    """Two or more results of the same config, one column each: tokens/s (and the ratio to
    the last column), MFU, peak and activation memory, and the losses at the steps all
    evaluated."""
    names = list(results)
    width = max(12, *(len(n) + 2 for n in names))

    def row(label: str, values) -> str:
        return f"{label:<28}" + "".join(f"{v:>{width}}" for v in values)

    runs = [results[n] for n in names]
    base = runs[-1]["tokens_per_s"]
    lines = [row("", names),
             row("tokens/s", [f"{r['tokens_per_s']:.0f}" for r in runs]),
             row(f"speed vs {names[-1]}",
                 [f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a" for r in runs]),
             row("MFU", [_fmt(r["mfu"], ".1%") for r in runs]),
             row("peak memory MiB", [_fmt(r["peak_memory_MiB"], ".0f") for r in runs]),
             row("activation MiB per MoE layer",
                 [f"{r['activation_MiB_per_layer']:.2f}" for r in runs])]
    common = sorted(set.intersection(*({s for s, _ in r["val_history"]} for r in runs)))
    for step in common:
        lines.append(row(f"val loss at step {step}",
                         [f"{dict(map(tuple, r['val_history']))[step]:.4f}" for r in runs]))
    steps = min(len(r["losses"]) for r in runs)
    if steps:
        lines.append(row(f"train loss at step {steps}",
                         [f"{r['losses'][steps - 1]:.4f}" for r in runs]))
    return lines


def plot_runs(results: dict[str, dict], path: str | Path) -> None:
    """Draw the training loss (and validation points) and tokens/s over steps of each named
    result into the image file ``path`` (format from its suffix; see
    `sonic._output.image_path`). Needs matplotlib (the ``plot`` extra)."""
    from matplotlib.figure import Figure

    # A bare Figure (no pyplot) leaves matplotlib's global backend and figure list alone.
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    loss_ax, rate_ax = fig.subplots(1, 2)
    for name, r in results.items():
        first = r["steps"] - len(r["tokens_per_s_history"])   # a resumed run's first step
        line, = loss_ax.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=1,
                             label=f"{name} train")
        loss_ax.plot([s for s, _ in r["val_history"]], [v for _, v in r["val_history"]], "o--",
                     color=line.get_color(), ms=3, label=f"{name} val")
        points = [(first + i + 1, v) for i, v in enumerate(r["tokens_per_s_history"])
                  if v is not None]
        rate_ax.plot([s for s, _ in points], [v for _, v in points], color=line.get_color(),
                     label=name)
    loss_ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="loss")
    rate_ax.set(xlabel="step", ylabel="tokens/s (running mean)", title="throughput")
    rate_ax.set_ylim(bottom=0)
    for ax in (loss_ax, rate_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path)
