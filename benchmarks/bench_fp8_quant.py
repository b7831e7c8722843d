"""FP8 quantization kernels vs the PyTorch reference, same run, same inputs.

    python benchmarks/bench_fp8_quant.py [--config NAME | --config T,d,n,E,K ...]

Times ``sonic.kernels.fp8_quant.quantize_rows`` (1×128 activation scales), ``quantize_blocks``
(128×128 weight scales) and ``quantize_cols_grouped`` (the FP8 weight gradients' K-major
copies, 128×1 scales along each expert's rows) against the PyTorch implementation in
``sonic.reference.fp8`` (fp32 temporaries, several passes) at the docs/design.md §5 shapes: ``X
(T, d)`` and ``A (T·K, n)`` for the rows, ``W1 (E, 2n, d)`` and ``W2 (E, d, n)`` for the
blocks, ``X`` gathered by random top-K routing, ``dH (T·K, 2n)`` and ``A' (T·K, n)`` for the
columns; ``--config`` (repeatable) takes another shape of :mod:`sonic.baselines.configs`
(DeepSeek-V3's, say) instead. Prints the median µs of both (``_timing.bench``, L2 flushed), the
kernel's GB/s on bytes read + written (``2·numel`` bf16 read, ``numel`` fp8 and ``numel / 32``
bytes of fp32 scales written; ``numel`` of the copy for the columns), its percentage of the
same-run device copy bandwidth, the speedup, and whether the outputs are bitwise equal (the
tests hold that on harder inputs).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, copy_bandwidth, device_name  # noqa: E402
from bench_grouped_gemm import _routing  # noqa: E402

from sonic.baselines.configs import CONFIGS, PAPER_CONFIGS, parse_config  # noqa: E402
from sonic.kernels import fp8_quant  # noqa: E402
from sonic.reference import fp8 as ref  # noqa: E402


def _equal(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)
               for x, y in zip(a, b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=parse_config, action="append",
                        help="a named layer or T,d,n,E,K (repeatable; default: "
                             f"{', '.join(PAPER_CONFIGS)})")
    args = parser.parse_args(argv)
    shapes = args.config or [(name, CONFIGS[name]) for name in PAPER_CONFIGS]
    copy = copy_bandwidth()
    print(f"device: {device_name()}; copy bandwidth {copy:.0f} GB/s (read + write)")
    print(f"{'shape':<6} {'kernel':<15} {'operand shape':<20} | {'torch us':>9} {'kernel us':>9} "
          f"{'GB/s':>6} {'% copy':>6} {'speedup':>7} {'bitwise':>7}")
    for name, (t, d, n, e, k) in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        gather_idx, offsets = _routing(t, e, k)
        k_offsets = ref.padded_offsets(offsets)
        cases = (("quantize_rows", "X", (t, d), None), ("quantize_rows", "A", (t * k, n), None),
                 ("quantize_blocks", "W1", (e, 2 * n, d), None),
                 ("quantize_blocks", "W2", (e, d, n), None),
                 ("quantize_cols", "X gathered", (t, d), gather_idx),
                 ("quantize_cols", "dH", (t * k, 2 * n), None),
                 ("quantize_cols", "A'", (t * k, n), None))
        for kernel, operand, shape, idx in cases:
            x = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)
            if kernel == "quantize_cols":
                def kernel_fn(x, idx=idx):
                    return fp8_quant.quantize_cols_grouped(x, offsets, k_offsets, idx)

                def torch_fn(x, idx=idx):
                    return ref.quantize_cols_grouped(x, offsets, k_offsets, idx)
            else:
                kernel_fn, torch_fn = getattr(fp8_quant, kernel), getattr(ref, kernel)
            out = kernel_fn(x)
            same = _equal(out, torch_fn(x))
            torch_us = bench(lambda: torch_fn(x))
            kern_us = bench(lambda: kernel_fn(x))
            numel = out[0].numel()
            nbytes = 3 * numel + numel // 32
            gbs = nbytes / (kern_us * 1e-6) / 1e9
            print(f"{name:<6} {kernel:<15} {operand + ' ' + str(shape):<20} | {torch_us:>9.1f} "
                  f"{kern_us:>9.1f} {gbs:>6.0f} {100 * gbs / copy:>5.1f}% "
                  f"{torch_us / kern_us:>6.2f}x {str(same):>7}")
            del x, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
