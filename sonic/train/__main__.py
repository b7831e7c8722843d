"""Command line of `sonic.train`: ``python -m sonic.train --help``."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
from dataclasses import replace

import torch

from sonic._output import image_path
from sonic.train.loop import PRESETS, TrainConfig, preset_config, train
from sonic.train.report import comparison_lines, plot_runs, summary_lines
from sonic.train.parallel import world_from_env
from sonic.types import TRANSPORTS


def _bounded(cast, low: int, strict: bool):
    """An argparse ``type``: ``cast(text)``, finite, and ``> low`` (``strict``) or ``>= low``;
    otherwise an error naming what was expected."""
    expected = (f"{'an integer' if cast is int else 'a finite number'} "
                f"{'>' if strict else '>='} {low}")

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _bounded(int, 0, strict=True)
_non_negative_int = _bounded(int, 0, strict=False)
_positive_float = _bounded(float, 0, strict=True)
_non_negative_float = _bounded(float, 0, strict=False)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default once: the default of each `--preset` for the sizes, none
    where the help already states it, or for options without a value (``None``) or flags."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if action.dest in PRESETS["gpu"]:
            return help_text + _preset_default(action.dest)
        if "default" in help_text or action.default in (None, False, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action)


def _preset_default(field: str) -> str:
    values = {name: PRESETS[name].get(field, getattr(TrainConfig(), field)) for name in PRESETS}
    return " (default: " + ", ".join(f"{v} with --preset {n}" for n, v in values.items()) + ")"


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser; its defaults are `TrainConfig`'s, the sizes those of
    `--preset`."""
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m sonic.train",
        description="Train a byte-level transformer LM whose FFNs are sonic.MoE layers. "
                    "Default corpus: the CPython documentation topics (pydoc_data); the last "
                    "10% of the bytes are held out for validation, which always routes by "
                    "top-K (also after a token-rounding run). The cpu preset finishes in under "
                    "3 minutes on a 2-core CPU.",
        formatter_class=_HelpFormatter)
    p.add_argument("--preset", choices=("auto",) + tuple(PRESETS), default="auto",
                   help="sizes of the model and batch: cpu = a 0.97 M-parameter model that "
                        "trains in minutes on a laptop; gpu = MoE layers at a size where they "
                        "dominate the step (d_model 1024, 8 layers, 64 experts of d_expert "
                        "1024, top-8, 32 x 1024 tokens per step; fits one 80 GB GPU); auto = "
                        "gpu on a CUDA device, else cpu. Size options override it")
    p.add_argument("--compare", choices=("torch-gmm",), default=None,
                   help="after the run, train the same model (same seed, data and steps) "
                        "with its MoE layers run by the torch-gmm baseline (torch._grouped_mm "
                        "and PyTorch autograd) and print both side by side: tokens/s, MFU, "
                        "peak memory, losses at equal steps")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="draw the loss and tokens/s over steps (of both runs with --compare) "
                        "into FILE (.png, .pdf, .svg ...; needs matplotlib)")
    p.add_argument("--peak-tflops", type=_positive_float, default=None, metavar="TFLOPS",
                   help="the GPU's dense bf16 peak for MFU (default: known for H100, H200, "
                        "H800, A100)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="optimizer steps")
    p.add_argument("--router", choices=("topk", "token_rounding"), default=d.router,
                   help="training-time router of every MoE layer")
    p.add_argument("--data", default=d.data, metavar="FILE",
                   help="UTF-8 text file to train on (default: pydoc_data.topics)")
    p.add_argument("--device", default=d.device,
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=d.dtype,
                   help="parameter dtype; auto = bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--backend", choices=("auto", "torch", "cute"), default=d.backend,
                   help="sonic.MoE backend: cute = CuTe-DSL kernels on a Hopper GPU, torch = "
                        "PyTorch reference, auto = cute where it can run")
    p.add_argument("--precision", choices=("bf16", "fp8"), default=d.precision,
                   help="expert GEMM precision of every sonic.MoE layer: fp8 = block-scaled "
                        "e4m3 (1x128 activation, 128x128 weight scales; Hopper with the cute "
                        "backend, a slow emulation with --backend torch); needs --d-model and "
                        "--d-expert multiples of 128 and computes in bfloat16")
    p.add_argument("--activation-cache", choices=("bf16", "fp8"), default=d.activation_cache,
                   help="how every MoE layer keeps H for backward: bf16 (as computed) or fp8 "
                        "(e4m3 + fp32 1x128 scales, about half the bytes; needs --dtype "
                        "bfloat16, d-expert a multiple of 64, --ep 1)")
    p.add_argument("--seed", type=_non_negative_int, default=d.seed,
                   help="seed of the initialisation and of the training windows (0 to 2**63 - 2)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="windows per step (B); T = B * seq-len tokens per MoE layer")
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help="bytes per window")
    p.add_argument("--d-model", type=_positive_int, default=None,
                   help="model dim d")
    p.add_argument("--layers", type=_positive_int, default=None,
                   help="transformer blocks")
    p.add_argument("--heads", type=_positive_int, default=None,
                   help="attention heads")
    p.add_argument("--experts", type=_positive_int, default=None,
                   help="experts E per layer")
    p.add_argument("--top-k", type=_positive_int, default=None,
                   help="experts K per token")
    p.add_argument("--d-expert", type=_positive_int, default=None,
                   help="expert intermediate dim n")
    p.add_argument("--tile", type=_positive_int, default=None,
                   help="M_tile of token rounding: each expert's token count is rounded to a "
                        "multiple of it. Hopper kernels use 128, which suits experts that get "
                        "many tiles of tokens per step (gpu preset: T*K/E = 4096); the cpu "
                        "preset gives each expert T*K/E = 2048*2/8 = 512 tokens, where a tile "
                        "of 32 moves a count by at most 16 (~3%%) under nearest rounding and "
                        "128 by up to 64 (~12%%). Keep it well below T*K/E.")
    p.add_argument("--aux-loss-coef", type=_non_negative_float, default=d.aux_loss_coef,
                   help="coefficient of each MoE layer's load-balancing loss")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help="peak AdamW learning rate (linear warmup, cosine decay to 10%%)")
    p.add_argument("--warmup", type=_non_negative_int, default=d.warmup, help="warmup steps")
    p.add_argument("--eval-every", type=_non_negative_int, default=d.eval_every,
                   help="also evaluate every N steps (0: only at step 0 and at the end); the "
                        "progress bar shows the latest validation loss and its step")
    p.add_argument("--eval-batches", type=_positive_int, default=d.eval_batches,
                   help="fixed validation batches per evaluation")
    p.add_argument("--ep", type=_positive_int, default=d.ep, metavar="N",
                   help="expert parallelism under torchrun (torchrun --nproc_per_node=W -m "
                        "sonic.train --ep N): groups of N ranks split every MoE layer's "
                        "experts, data parallel over the W/N groups; N must divide W and "
                        "--experts. --batch-size is per rank. Under torchrun with --ep 1: "
                        "data parallel only")
    p.add_argument("--ep-chunks", type=_positive_int, default=d.ep_chunks, metavar="C",
                   help="with --ep > 1: split every MoE layer's tokens into C chunks whose "
                        "all-to-alls overlap the expert computation of the other chunks "
                        "(forward and backward; at most 16). 1 = no chunking, the default "
                        "until GPU measurements (benchmarks/bench_ep.py) pick a better one")
    p.add_argument("--ep-recompute-dispatch", action="store_true",
                   help="with --ep > 1: keep each MoE layer's input instead of the token rows "
                        "its rank received, and send those again in backward (less memory, "
                        "one more all-to-all per layer; the same gradients)")
    p.add_argument("--ep-transport", choices=TRANSPORTS, default=d.ep_transport,
                   help="with --ep > 1: what moves the token rows between the ranks: nccl "
                        "(default), copy_engine (NVLink peer memory and copy engines; one "
                        "host) or auto (copy_engine where possible); the same values either way")
    p.add_argument("--save", metavar="PATH", default=None,
                   help="write a checkpoint (model, optimizer, step, config, sampler state; "
                        "torch.save) at the end, after --stop-after and every --save-every "
                        "steps; under torchrun one file per rank, PATH.rank{r}")
    p.add_argument("--save-every", type=_non_negative_int, default=0, metavar="N",
                   help="with --save, also checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", metavar="PATH", default=None,
                   help="continue a run from its --save checkpoint, up to --steps in total "
                        "(same settings; the losses are those of an uninterrupted run)")
    p.add_argument("--stop-after", type=_positive_int, default=None, metavar="N",
                   help="stop after N steps of this invocation (the schedule still spans "
                        "--steps); with --save, resume later with --resume")
    p.add_argument("--log-jsonl", metavar="FILE", default=None,
                   help="write one JSON line per step: step, loss, aux_loss, lr, tokens_per_s, "
                        "and val_loss on evaluation steps (appended to with --resume)")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also log those scalars to TensorBoard in DIR (needs the tensorboard "
                        "package)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   default="info", help="level of the log lines on stderr (rank 0; the other "
                                        "ranks log warnings and errors)")
    p.add_argument("--json", action="store_true",
                   help="print the results as one JSON object on the last line")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def configure_logging(level: int = logging.INFO) -> None:
    """Log sonic's messages to stderr: rank 0 from ``level`` up, the other ranks of a
    ``torchrun`` job only warnings and errors, each line prefixed with its rank."""
    world, rank, _ = world_from_env()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        (f"[rank {rank}] " if world > 1 else "") + "%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("sonic")
    root.handlers = [handler]
    root.setLevel(level if rank == 0 else max(level, logging.WARNING))
    root.propagate = False


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, train, print the results; returns the exit status."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    as_json, progress = args.pop("json"), not args.pop("no_progress")
    configure_logging(getattr(logging, args.pop("log_level").upper()))
    options = {name: args.pop(name) for name in ("save", "save_every", "resume", "stop_after",
                                                 "log_jsonl", "tensorboard")}
    preset, compare, plot = args.pop("preset"), args.pop("compare"), args.pop("plot")
    try:
        if preset == "auto":
            device = args["device"]
            on_gpu = (device or "cuda").startswith("cuda") and torch.cuda.is_available()
            preset = "gpu" if on_gpu else "cpu"
        config = preset_config(preset, **{k: v for k, v in args.items() if v is not None})
        plot = image_path("--plot", plot) if plot else None
        if compare:
            _check_compare(config, options)
        results = {"sonic": train(config, progress=progress, **options)}
        if compare:
            gc.collect()   # the first run's model and optimizer go before the second's come
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            results[compare] = train(replace(config, experts_impl=compare), progress=progress)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    if world_from_env()[1] != 0:   # under torchrun, rank 0 reports
        return 0
    if plot:
        plot_runs(results, plot)
    if as_json:
        print(json.dumps(results if compare else results["sonic"]))
        return 0
    print("\n".join(summary_lines(results["sonic"])))
    if compare:
        print()
        print("\n".join(comparison_lines(results)))
    if plot:
        print(f"plotted to {plot}")
    return 0


def _check_compare(config: TrainConfig, options: dict) -> None:
    """``--compare`` trains twice in one process from scratch: no checkpoints, logs or
    torchrun, and a config torch-gmm can run."""
    used = [f"--{k.replace('_', '-')}" for k, v in options.items() if v not in (None, 0)]
    if used:
        raise ValueError(f"--compare: not with {', '.join(used)} (two runs in one process)")
    if world_from_env()[0] > 1:
        raise ValueError("--compare: runs in one process, not under torchrun")
    replace(config, experts_impl="torch-gmm")   # raises what torch-gmm cannot run


def _leave(code: int) -> None:
    """End the process with ``code``. A torchrun rank leaves without the interpreter's
    shutdown: with its run finished and its process group destroyed, a gloo rank sometimes
    aborted during that shutdown ("terminate called without an active exception" from a
    C++ thread torn down after Python), failing torchrun after a complete run. Nothing is
    left that the exit would not release, so the streams and log handlers are flushed and
    the process exits directly."""
    if world_from_env()[0] == 1:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _leave(main())
