"""Validation loss of ``sonic.train`` over several seeds, per variant: is a precision's loss gap
larger than the seed-to-seed spread?

    python benchmarks/train_seeds.py                           # bf16, fp8, fp8-fused; seeds 0-2
    python benchmarks/train_seeds.py --variants bf16 fp8 --seeds 0 1 2 3 4 --steps 600
    python benchmarks/train_seeds.py --device cpu --backend torch --steps 100   # the emulation

The FP8 path's target is to end within 2% of bf16's validation loss "with the same seed and
steps". One pair of runs cannot say that: the 600-step default run ends anywhere in a band of
about ±1.5% from one seed to the next in bf16 alone (CPU emulation, RESULTS.md), so a single
2.6% gap may be noise and a single 0.5% gap luck. This trains every variant on every seed, same
config otherwise, and prints per variant the loss of each seed, the mean and standard
deviation, per seed the gap to bf16 (same seed, same data order and initialisation) with its
mean, and the gap of the variant's mean loss to bf16's with its standard error (Welch, from
the two variants' seed-to-seed spreads): a gap within about two standard errors is not told
apart from noise.

Pairing by seed narrows the comparison only where runs repeat. On a GPU they do not bit for
bit (PyTorch's attention backward; sonic's MoE layer itself repeats bitwise), and a short run
at a high learning rate carries a step's rounding differences into a different end: with the
``gpu`` preset's sizes (300 steps) identical bf16 runs of one seed ended up to 15% apart
(RESULTS.md). There the seeds' spread, and so the standard error, is the measure of noise;
the per-seed gaps are not tighter than it.

Variants: ``bf16``; ``fp8`` (``--precision fp8``, the store-GEMM path); ``fp8-quantizing`` and
``fp8-fused`` (``--precision fp8`` with :func:`sonic.backend.set_fp8_epilogues`
``("quantizing")`` / ``("fused")``: the SwiGLU kernel writing A quantized, bitwise ``fp8`` /
the fused FP8 epilogue kernels, whose dSwiGLU takes the fp32 dA', emulated so on the
``torch`` backend too);
``fp8-wgrad`` (``--precision fp8`` with :func:`sonic.backend.set_fp8_weight_grads`
``("fp8")``: FP8 weight gradients too); ``fp8c`` (bf16 GEMMs, H kept in e4m3:
``--activation-cache fp8``).
Every run is in this process, one after the other; prints a table and one JSON line.
"""

import argparse
import json
import math
import statistics
import sys
import time

from sonic.backend import set_fp8_epilogues, set_fp8_weight_grads
from sonic.train.loop import TrainConfig, train

# TrainConfig fields, set_fp8_epilogues and set_fp8_weight_grads choices of each variant.
VARIANTS = {
    "bf16": ({}, "store", "bf16"),
    "fp8": ({"precision": "fp8"}, "store", "bf16"),
    "fp8-quantizing": ({"precision": "fp8"}, "quantizing", "bf16"),
    "fp8-fused": ({"precision": "fp8"}, "fused", "bf16"),
    "fp8-wgrad": ({"precision": "fp8"}, "quantizing", "fp8"),
    "fp8c": ({"activation_cache": "fp8"}, "store", "bf16"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS),
                        default=["bf16", "fp8", "fp8-fused"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--device", default=None, help="as sonic.train (default: cuda if any)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "cute"))
    parser.add_argument("--config", default="{}",
                        help="JSON object of further TrainConfig fields, e.g. "
                             "'{\"d_model\": 256}'")
    args = parser.parse_args(argv)
    if "bf16" not in args.variants:
        parser.error("--variants must include bf16 (the gaps are to it)")
    return args


def run(args: argparse.Namespace) -> dict:
    """Train every (variant, seed); the losses, their statistics and the paired gaps."""
    extra = json.loads(args.config)
    losses, seconds = {}, {}
    for name in args.variants:
        fields, epilogues, weight_grads = VARIANTS[name]
        previous = (set_fp8_epilogues(epilogues), set_fp8_weight_grads(weight_grads))
        try:
            for seed in args.seeds:
                config = TrainConfig(**{"steps": args.steps, "seed": seed, "device": args.device,
                                        "backend": args.backend, "dtype": "bfloat16",
                                        **extra, **fields})
                start = time.perf_counter()
                result = train(config, progress=False)
                seconds[(name, seed)] = time.perf_counter() - start
                losses.setdefault(name, {})[seed] = result["val_loss"]
        finally:
            set_fp8_epilogues(previous[0])
            set_fp8_weight_grads(previous[1])
    summary = {"steps": args.steps, "seeds": args.seeds, "device": result["device"],
               "backend": result["backend"], "variants": {}}
    for name, by_seed in losses.items():
        values = [by_seed[s] for s in args.seeds]
        gaps = [by_seed[s] / losses["bf16"][s] - 1 for s in args.seeds]
        summary["variants"][name] = {
            "val_loss": by_seed, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else math.nan,
            "gap_to_bf16": dict(zip(args.seeds, gaps)), "mean_gap": statistics.fmean(gaps),
            "seconds": sum(seconds[(name, s)] for s in args.seeds)}
    bf16 = summary["variants"]["bf16"]
    for name, v in summary["variants"].items():
        if name != "bf16":
            v["gap_of_means"], v["gap_of_means_se"] = _gap_of_means(v, bf16, len(args.seeds))
    return summary


def _gap_of_means(variant: dict, bf16: dict, seeds: int) -> tuple[float, float]:
    """``variant``'s mean validation loss over bf16's, minus one, and its standard error
    (Welch: each mean's seed-to-seed variance over the seed count, relative to bf16's mean;
    NaN with one seed)."""
    gap = variant["mean"] / bf16["mean"] - 1
    se = math.sqrt(variant["std"] ** 2 / seeds + bf16["std"] ** 2 / seeds) / bf16["mean"]
    return gap, se


def _print(s: dict) -> None:
    print(f"sonic.train, {s['steps']} steps, device {s['device']}, backend {s['backend']}; "
          f"validation loss per seed (gap to bf16, same seed)")
    seeds = s["seeds"]
    print(f"{'variant':10s} " + " ".join(f"{f'seed {x}':>17s}" for x in seeds)
          + f" {'mean':>8s} {'std':>7s} {'mean gap':>9s} {'gap of means ± SE':>19s}")
    for name, v in s["variants"].items():
        cells = " ".join(f"{v['val_loss'][x]:8.4f} ({v['gap_to_bf16'][x]:+6.2%})" for x in seeds)
        unpaired = (f"{v['gap_of_means']:+9.2%} ± {v['gap_of_means_se']:6.2%}"
                    if "gap_of_means" in v else f"{'-':>19s}")
        print(f"{name:10s} {cells} {v['mean']:8.4f} {v['std']:7.4f} {v['mean_gap']:+9.2%} "
              f"{unpaired}")
    print(json.dumps(s))


def main(argv=None) -> int:
    summary = run(parse_args(argv))
    _print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
