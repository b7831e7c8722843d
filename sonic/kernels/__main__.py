"""Command line: list the registered kernel variants, or compile them all without a GPU.

    python -m sonic.kernels --list
    python -m sonic.kernels --compile-check sm_90a
    python -m sonic.kernels --compile-check sm_100a

The compile check sets ``CUTE_DSL_ARCH`` itself, compiles every variant of that architecture
(the CUDA-core kernels for both, each architecture's grouped-GEMM mainloop for its own) with
placeholder arguments, prints kernel, variant, compile seconds and the count of each PTX
marker, and exits non-zero if a variant fails to compile or lacks a marker.

Where a ``ptxas`` is found (``SONIC_PTXAS``, ``PATH``, or the one Triton bundles) the sm_90a
WGMMA kernels are also assembled, and a variant fails if ptxas serializes its WGMMAs (its
``C7520`` or ``C7514`` advisory): the kernel then still runs correctly, but its mainloop at
about half speed (a dSwiGLU epilogue once did, benchmarks/RESULTS.md). Without a
ptxas the check says so above its summary line.

Where an ``nvdisasm`` is found (``SONIC_NVDISASM``, ``PATH``, or the ``nvidia-cuda-nvdisasm``
wheel of the ``test`` extra) the cubin the DSL built for each sm_90a variant is disassembled,
and a variant fails if a TMA load sits in a waterfall loop: ptxas could not prove the load's
operands warp-uniform, so it issues the load once per distinct value under a
``VOTEU.ANY`` loop. The kernel still runs correctly, but a gathered grouped GEMM whose
producers issue a row box per TMA load once ran three times slower so (benchmarks/RESULTS.md,
"Gathered FP8 GEMMs on 128-wide tiles").
"""

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

# The text of ptxas's advisories that it serialized a kernel's wgmma.mma_async instructions
# (C7520: a compiler-inserted wait in a divergent path; C7514: non-WGMMA instructions reading
# an accumulator while its WGMMAs are in flight).
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"


def _find_tool(tool: str, env: str, bundled: list[str]) -> str | None:
    """``env``'s file if set, else ``tool`` on ``PATH``, else the first executable of
    ``bundled``.

    Raises:
        ValueError: ``env`` is set but names no executable file.
    """
    chosen = os.environ.get(env)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise ValueError(f"{env} must name an executable {tool}, got {chosen!r}")
        return chosen
    return shutil.which(tool) or next((p for p in bundled if os.access(p, os.X_OK)), None)


def find_ptxas() -> str | None:
    """The ptxas to assemble with: ``SONIC_PTXAS``, ``ptxas`` on ``PATH``, else Triton's.

    Raises:
        ValueError: ``SONIC_PTXAS`` is set but names no executable file.
    """
    spec = importlib.util.find_spec("triton")
    bundled = ([os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "ptxas")]
               if spec is not None and spec.origin else [])
    return _find_tool("ptxas", "SONIC_PTXAS", bundled)


def find_nvdisasm() -> str | None:
    """The nvdisasm to read cubins with: ``SONIC_NVDISASM``, ``nvdisasm`` on ``PATH``, else the
    one the ``nvidia-cuda-nvdisasm`` wheel installs.

    Raises:
        ValueError: ``SONIC_NVDISASM`` is set but names no executable file.
    """
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or []) if spec is not None else []
    return _find_tool("nvdisasm", "SONIC_NVDISASM",
                      [p for root in roots
                       for p in sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))])


def tma_waterfalls(nvdisasm: str, cubin: bytes) -> int | str:
    """Disassemble ``cubin``: how many TMA loads (``UTMALDG``) ptxas wrapped in a waterfall loop
    (issued under a uniform predicate that a ``VOTEU.ANY`` loop walks over the warp's distinct
    operand values), or why it could not disassemble."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        run = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        err = (run.stderr or run.stdout).strip()
        return err.splitlines()[0] if err else f"nvdisasm exit {run.returncode}"
    if "VOTEU.ANY" not in run.stdout:
        return 0
    return len(re.findall(r"@!?UP\d+\s+UTMALDG", run.stdout))


def wgmma_serialized(ptxas: str, ptx: str, arch: str) -> bool | str:
    """Assemble ``ptx`` for ``arch``: whether ptxas serialized its WGMMAs, or why it could not
    assemble. A ptxas older than the DSL's PTX ISA is retried at the version it names (the
    kernels use nothing newer)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        for _ in range(2):
            with open(path, "w") as f:
                f.write(ptx)
            run = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.devnull],
                                 capture_output=True, text=True, timeout=600)
            out = run.stdout + run.stderr
            if run.returncode == 0:
                return WGMMA_SERIALIZED in out
            older = re.search(r"Unsupported \.version \S+; current version is '([\d.]+)'", out)
            if older is None:
                break
            ptx = re.sub(r"^\.version \S+", f".version {older.group(1)}", ptx, count=1,
                         flags=re.M)
    return out.strip().splitlines()[0] if out.strip() else f"ptxas exit {run.returncode}"


def compile_check(arch: str, out=sys.stdout) -> int:
    """Compile every registered variant of ``arch``; print a table; return the failure count.

    Raises:
        ValueError: ``arch`` is not a compile-check target (:data:`registry.ARCHS`).
    """
    from sonic.kernels import registry, runtime

    if arch not in registry.ARCHS:
        raise ValueError(f"arch must be one of {registry.ARCHS}, got {arch!r}")
    runtime.set_compile_arch(arch)
    ptxas = find_ptxas()
    nvdisasm = find_nvdisasm() if arch == "sm_90a" else None
    assembled = serialized_count = disassembled = waterfall_count = 0
    failures = 0
    rows = []
    for v in registry.variants(arch):
        start = time.perf_counter()
        try:
            artifacts = v.compile_fake().artifacts
            ptx, cubin = artifacts.PTX or "", artifacts.CUBIN
        except Exception:  # a failing variant must not hide the others
            traceback.print_exc()
            rows.append((v.kernel, v.variant, time.perf_counter() - start, "COMPILE FAILED"))
            failures += 1
            continue
        seconds = time.perf_counter() - start
        counts = v.marker_counts(ptx)
        missing = [m for m, c in counts.items() if c == 0]
        status = "ok" if not missing else "MISSING " + ", ".join(missing)
        if ptxas and arch == "sm_90a" and "wgmma.mma_async" in ptx:
            serialized = wgmma_serialized(ptxas, ptx, arch)
            if serialized is True:
                missing.append("serialized WGMMAs")
                serialized_count += 1
                status = f"WGMMA SERIALIZED (ptxas: {WGMMA_SERIALIZED})"
            elif serialized is False:
                assembled += 1
            else:
                status = f"ptxas could not assemble: {serialized}  " + status
        if nvdisasm and cubin:
            waterfalls = tma_waterfalls(nvdisasm, cubin)
            if isinstance(waterfalls, str):
                status = f"nvdisasm could not read the cubin: {waterfalls}  " + status
            elif waterfalls:
                missing.append("TMA waterfall")
                waterfall_count += 1
                status = f"TMA WATERFALL ({waterfalls} UTMALDG in VOTEU.ANY loops)"
            else:
                disassembled += 1
        failures += bool(missing)
        rows.append((v.kernel, v.variant, seconds,
                     " ".join(f"{m}={c}" for m, c in counts.items()) + "  " + status))
    print(f"{'kernel':<18} {'variant':<46} {'compile s':>9}  PTX markers", file=out)
    for kernel, variant, seconds, detail in rows:
        print(f"{kernel:<18} {variant:<46} {seconds:>9.2f}  {detail}", file=out)
    if arch == "sm_90a":
        print(f"ptxas {ptxas}: {assembled} WGMMA kernel(s) assembled unserialized, "
              f"{serialized_count} serialized" if ptxas
              else "no ptxas found (SONIC_PTXAS, PATH, Triton): WGMMA serialization not checked",
              file=out)
        print(f"nvdisasm {nvdisasm}: {disassembled} cubin(s) without TMA waterfalls, "
              f"{waterfall_count} with" if nvdisasm
              else "no nvdisasm found (SONIC_NVDISASM, PATH, nvidia-cuda-nvdisasm): TMA "
                   "waterfalls not checked", file=out)
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
    if args.compile_check and importlib.util.find_spec("cutlass") is None:
        # Every variant would fail on the same missing import: one line instead of a traceback
        # per variant.
        parser.exit(2, f"{parser.prog}: --compile-check needs the CuTe DSL (module 'cutlass'), "
                       f"which is not installed: pip install -e \".[gpu]\" (the 'gpu' extra)\n")
    if args.list:
        from sonic.kernels import registry

        for v in registry.variants():
            print(f"{v.kernel:<18} {v.variant:<46} {','.join(v.archs):<15} markers: "
                  f"{', '.join(v.marker_counts(''))}")
        return 0
    return 1 if compile_check(args.compile_check) else 0


if __name__ == "__main__":
    sys.exit(main())
