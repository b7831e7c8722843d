"""Command line: list the registered kernel variants, or compile them all without a GPU.

    python -m sonic.kernels --list
    python -m sonic.kernels --compile-check sm_90a
    python -m sonic.kernels --compile-check sm_100a

The compile check sets ``CUTE_DSL_ARCH`` itself, compiles every variant of that architecture
(the CUDA-core kernels for both, each architecture's grouped-GEMM mainloop for its own) with
placeholder arguments, prints kernel, variant, compile seconds and the count of each PTX marker, and exits
non-zero if a variant fails to compile or lacks a marker.
"""

import argparse
import sys
import time
import traceback


def compile_check(arch: str, out=sys.stdout) -> int:
    """Compile every registered variant of ``arch``; print a table; return the failure count.

    Raises:
        ValueError: ``arch`` is not a compile-check target (:data:`registry.ARCHS`).
    """
    from sonic.kernels import registry, runtime

    if arch not in registry.ARCHS:
        raise ValueError(f"arch must be one of {registry.ARCHS}, got {arch!r}")
    runtime.set_compile_arch(arch)
    failures = 0
    rows = []
    for v in registry.variants(arch):
        start = time.perf_counter()
        try:
            ptx = v.compile_fake().artifacts.PTX or ""
        except Exception:  # a failing variant must not hide the others
            traceback.print_exc()
            rows.append((v.kernel, v.variant, time.perf_counter() - start, "COMPILE FAILED"))
            failures += 1
            continue
        seconds = time.perf_counter() - start
        counts = v.marker_counts(ptx)
        missing = [m for m, c in counts.items() if c == 0]
        failures += bool(missing)
        status = "ok" if not missing else "MISSING " + ", ".join(missing)
        rows.append((v.kernel, v.variant, seconds,
                     " ".join(f"{m}={c}" for m, c in counts.items()) + "  " + status))
    print(f"{'kernel':<18} {'variant':<46} {'compile s':>9}  PTX markers", file=out)
    for kernel, variant, seconds, detail in rows:
        print(f"{kernel:<18} {variant:<46} {seconds:>9.2f}  {detail}", file=out)
    print(f"{len(rows)} variant(s), {failures} failure(s), arch {arch}", file=out)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sonic.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--list", action="store_true", help="print every registered variant")
    group.add_argument("--compile-check", metavar="ARCH",
                       help="compile every variant of ARCH (sm_90a or sm_100a) without a GPU")
    args = parser.parse_args(argv)
    if args.list:
        from sonic.kernels import registry

        for v in registry.variants():
            print(f"{v.kernel:<18} {v.variant:<46} {','.join(v.archs):<15} markers: "
                  f"{', '.join(v.marker_counts(''))}")
        return 0
    return 1 if compile_check(args.compile_check) else 0


if __name__ == "__main__":
    sys.exit(main())
