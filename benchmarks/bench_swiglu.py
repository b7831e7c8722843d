"""SwiGLU and dSwiGLU-epilogue kernels vs the PyTorch reference, same run, same inputs.

    python benchmarks/bench_swiglu.py [--gate-up concat interleaved] [--config NAME | T,d,n,E,K ...]

At the paper's configurations (docs/design.md §5; P = T·K rows, n = d_expert) times ``sonic.kernels.swiglu.swiglu`` and
``dswiglu_epilogue`` against ``sonic.reference.ops`` (today's GPU path, which builds ``(P, n)``
fp32 temporaries) on the same bf16 inputs. Per shape, layout and kernel it prints the median µs of
both (``_timing.bench``, L2 flushed), the kernel's GB/s on bytes read + written (SwiGLU: ``H``
read, ``A`` written = ``6·P·n`` bytes; backward: ``H``, ``dA'``, scores read, ``dH``, ``A'``,
``ds`` written = ``12·P·n + 8·P`` bytes), its percentage of the same-run device copy bandwidth
(target ≥ 70 %), the speedup, and the largest difference from the reference (a sanity check; the
tests hold the tolerances). ``--config`` (repeatable) times another layer of
:mod:`sonic.baselines.configs` (``P = T·K`` rows of ``n`` columns) instead.

``swiglu+q`` (the FP8 path's A): ``swiglu(h, quantize=True)`` — A written in e4m3 with
its 1×128 scales in the same pass (``H`` read, ``q`` and scales written = ``5·P·n + P·n/32``
bytes) — against sonic's two passes, the SwiGLU kernel then ``fp8_quant.quantize_rows`` (in the
"torch us" column for this row); ``dswiglu+q``: ``dswiglu_epilogue(..., quantize_dh=True)``
(dH also in e4m3 for the dX GEMM: ``12·P·n + 8·P`` + ``2·P·n + P·n/16`` bytes) against the
epilogue kernel then ``quantize_rows(dH)``. The difference must be 0 (bitwise equal).

The FP8 activation cache (``activation_cache="fp8"``): ``swiglu+qh``, ``swiglu(h, quantize=True,
quantize_h=True)`` (H also written in e4m3: ``+ 2·P·n + P·n/16`` bytes) against the quantizing
SwiGLU kernel then ``quantize_rows(H)``; ``dswiglu+h8``, ``dswiglu_epilogue`` reading that e4m3 H
with ``quantize_dh`` (H read in one byte per element, dH written in bf16 and e4m3, both
scale tensors: ``12·P·n + 8·P + P·n/8`` bytes) against ``dequantize_rows`` then the
quantizing epilogue.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, copy_bandwidth, device_name  # noqa: E402

from sonic.baselines.configs import parse_config  # noqa: E402
from sonic.kernels.fp8_quant import dequantize_rows, quantize_rows  # noqa: E402
from sonic.kernels.swiglu import dswiglu_epilogue, swiglu  # noqa: E402
from sonic.reference import ops as ref  # noqa: E402

# (name, T, K, n) of the paper's configurations (docs/design.md §5); OLMoE and 30B share d_expert = 1024.
SHAPES = [("7B", 24576, 8, 256), ("OLMoE/30B", 32768, 8, 1024)]


def _dswiglu_then_quantize(da_prime, h, scores, gate_up):
    """The two passes ``dswiglu_epilogue(..., quantize_dh=True)`` replaces."""
    dh, a_scaled, ds = dswiglu_epilogue(da_prime, h, scores, gate_up)
    return (dh, a_scaled, ds, *quantize_rows(dh))


def _swiglu_then_quantize_h(h, gate_up):
    """The two passes ``swiglu(..., quantize=True, quantize_h=True)`` replaces."""
    return (*swiglu(h, gate_up, quantize=True), *quantize_rows(h))


def _dequantize_then_dswiglu(da_prime, h_q, h_scales, scores, gate_up):
    """The two passes ``dswiglu_epilogue(..., h_scales=..., quantize_dh=True)`` replaces."""
    return dswiglu_epilogue(da_prime, dequantize_rows(h_q, h_scales), scores, gate_up,
                            quantize_dh=True)


def _max_diff(outs, refs) -> float:
    return max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, refs))


def shapes_of(configs):
    """``(name, T, K, n)`` of each ``--config`` layer (``parse_config``'s results), or
    :data:`SHAPES` without any."""
    if not configs:
        return SHAPES
    return [(name, t, k, n) for name, (t, _, n, _, k) in configs]


def _time_shape(name, p, n, gate_ups, copy):
    """Print one row per layout and kernel at ``P = p`` rows of ``n`` columns (random inputs,
    seed 0); ``copy``: the device copy bandwidth in GB/s."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(p, 2 * n, device="cuda", generator=gen, dtype=torch.bfloat16)
    da_prime = torch.randn(p, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    scores = torch.rand(p, device="cuda", generator=gen) + 0.1
    h_q, h_scales = quantize_rows(h)
    for gate_up in gate_ups:
        cases = (
            ("swiglu", 6 * p * n,
             lambda: (ref.swiglu(h, gate_up),), lambda: (swiglu(h, gate_up),)),
            ("dswiglu", 12 * p * n + 8 * p,
             lambda: ref.dswiglu_epilogue(da_prime, h, scores, gate_up),
             lambda: dswiglu_epilogue(da_prime, h, scores, gate_up)),
            ("swiglu+q", 5 * p * n + p * n // 32,
             lambda: quantize_rows(swiglu(h, gate_up)),
             lambda: swiglu(h, gate_up, quantize=True)),
            ("dswiglu+q", 14 * p * n + 8 * p + p * n // 16,
             lambda: _dswiglu_then_quantize(da_prime, h, scores, gate_up),
             lambda: dswiglu_epilogue(da_prime, h, scores, gate_up, quantize_dh=True)),
            ("swiglu+qh", 7 * p * n + 3 * p * n // 32,
             lambda: _swiglu_then_quantize_h(h, gate_up),
             lambda: swiglu(h, gate_up, quantize=True, quantize_h=True)),
            ("dswiglu+h8", 12 * p * n + 8 * p + p * n // 8,
             lambda: _dequantize_then_dswiglu(da_prime, h_q, h_scales, scores, gate_up),
             lambda: dswiglu_epilogue(da_prime, h_q, scores, gate_up, h_scales=h_scales,
                                      quantize_dh=True)),
        )
        for kernel, nbytes, torch_fn, kernel_fn in cases:
            diff = _max_diff(kernel_fn(), torch_fn())
            torch_us = bench(torch_fn)
            kern_us = bench(kernel_fn)
            gbs = nbytes / (kern_us * 1e-6) / 1e9
            print(f"{name:<12} {p:>7} {n:>5} {gate_up:<11} {kernel:<10} | {torch_us:>9.1f} "
                  f"{kern_us:>9.1f} {gbs:>6.0f} {100 * gbs / copy:>5.1f}% "
                  f"{torch_us / kern_us:>6.2f}x {diff:>9.2e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gate-up", nargs="+", default=list(ref.GATE_UP_LAYOUTS),
                        choices=ref.GATE_UP_LAYOUTS)
    parser.add_argument("--config", type=parse_config, action="append",
                        help="a named layer or T,d,n,E,K (repeatable; default: "
                             f"{', '.join(name for name, *_ in SHAPES)})")
    args = parser.parse_args(argv)
    shapes = shapes_of(args.config)
    copy = copy_bandwidth()
    print(f"device: {device_name()}; copy bandwidth {copy:.0f} GB/s (read + write)")
    print(f"{'shape':<12} {'P':>7} {'n':>5} {'gate_up':<11} {'kernel':<10} | {'torch us':>9} "
          f"{'kernel us':>9} {'GB/s':>6} {'% copy':>6} {'speedup':>7} {'max diff':>9}")
    for name, t, k, n in shapes:
        _time_shape(name, t * k, n, args.gate_up, copy)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
