"""The MoE layer with each expert activation: the CuTe kernels against sonic's PyTorch path, same
run, same inputs.

    python benchmarks/bench_activations.py [--config 30B] [--config 7B]

Per configuration ``(T, d, n, E, K)`` and activation (:data:`sonic.types.ACTIVATIONS`), one
``sonic.MoE`` layer in bf16 with softmax top-K routing, timed as a training step (forward and
backward with a random ``dO``, gradients set to None between steps; ``_timing.bench`` medians)
and as a forward under ``torch.no_grad``, on ``backend="cute"`` (the gated activations in the
fused up-proj and dH epilogues, the non-gated ones as the reference activation between the
CuTe GEMMs) and ``backend="torch"`` (PyTorch's grouped GEMMs and the reference activation).
Prints ms, TFLOPS (the expert GEMMs' FLOPs: ``6·P·d·n`` forward for a gated activation,
``4·P·d·n`` otherwise, three times that per step, ``P = T·K``) and the step's ratio to SwiGLU
on the CuTe kernels and to the torch backend.
"""

import argparse
import os
import sys

import torch

import sonic
from sonic.baselines.configs import ACCEPTED, parse_config
from sonic.reference.activations import is_gated
from sonic.types import ACTIVATIONS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import bench  # noqa: E402


def _time(layer, x, dout) -> tuple[float, float]:
    """``(step µs, forward µs)`` of ``layer`` on ``x``."""
    params = [x, *layer.parameters()]

    def step():
        layer(x).backward(dout)

    def forward():
        with torch.no_grad():
            layer(x)

    return bench(step, grad_to_none=params), bench(forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=parse_config, action="append", help=ACCEPTED)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_activations.py needs a CUDA GPU")
    configs = args.config or [parse_config("30B")]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name, (T, d, n, E, K) in configs:
        print(f"\n{name}  T={T} d={d} n={n} E={E} K={K}  bf16, softmax top-K")
        print(f"  {'activation':12s} {'backend':8s} {'fwd ms':>8s} {'step ms':>8s} "
              f"{'fwd TF':>7s} {'step TF':>7s} {'vs swiglu':>9s} {'vs torch':>8s}")
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=gen,
                        requires_grad=True)
        dout = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        swiglu_step = None
        for activation in ACTIVATIONS:
            fwd_flop = (6 if is_gated(activation) else 4) * T * K * d * n
            times = {}
            for backend in ("cute", "torch"):
                torch.manual_seed(0)
                layer = sonic.MoE(d, n, E, K, activation=activation, backend=backend,
                                  device="cuda", dtype=torch.bfloat16)
                times[backend] = _time(layer, x, dout)
                del layer
            if swiglu_step is None:
                swiglu_step = times["cute"][0]
            for backend, (step_us, fwd_us) in times.items():
                vs_swiglu = f"{swiglu_step / step_us:9.3f}" if backend == "cute" else " " * 9
                vs_torch = (f"{times['torch'][0] / step_us:8.3f}" if backend == "cute"
                            else " " * 8)
                print(f"  {activation:12s} {backend:8s} {fwd_us / 1e3:8.3f} {step_us / 1e3:8.3f} "
                      f"{fwd_flop / fwd_us / 1e6:7.1f} {3 * fwd_flop / step_us / 1e6:7.1f} "
                      f"{vs_swiglu} {vs_torch}", flush=True)


if __name__ == "__main__":
    main()
