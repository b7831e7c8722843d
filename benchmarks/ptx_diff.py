"""Compare the PTX of the registered kernel variants between two source trees, by instruction kind.

A refactor of a kernel module should leave its instruction schedule alone; this script makes
that checkable without a GPU. Dump the PTX of every registered variant from each tree, then
compare the per-kind instruction counts (and, optionally, the whole text):

    CUTE_DSL_ARCH=sm_90a PYTHONPATH=/path/to/old python benchmarks/ptx_diff.py dump /tmp/ptx-old
    CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD        python benchmarks/ptx_diff.py dump /tmp/ptx-new
    python benchmarks/ptx_diff.py compare /tmp/ptx-old /tmp/ptx-new [--kernel grouped_gemm]

``dump`` compiles with placeholder arguments (the compile check's ``compile_fake``), so it runs
on a CPU-only machine. ``compare`` prints one row per variant and instruction kind whose count
differs (``--all`` prints every kind) and exits non-zero when any count differs.
"""

import argparse
import pathlib
import re
import sys

# Instruction kinds worth watching in a GEMM / epilogue kernel: tensor-core issue, TMA, barriers,
# shared and global memory traffic, shuffles, special-function math, branches.
KINDS = {
    "wgmma.mma_async": r"\bwgmma\.mma_async",
    "wgmma.fence/commit/wait": r"\bwgmma\.(fence|commit_group|wait_group)",
    "tcgen05.mma": r"\btcgen05\.mma",
    "tcgen05.ld/commit/wait": r"\btcgen05\.(ld|commit|wait)",
    "cp.async.bulk.tensor": r"\bcp\.async\.bulk\.tensor",
    "cp.async (non-bulk)": r"\bcp\.async\.(ca|cg)",
    "mbarrier": r"\bmbarrier\.",
    "bar/barrier (named)": r"\b(bar|barrier)\.(sync|arrive|cta)",
    "fence": r"\bfence\.",
    "ld.shared": r"\bld\.shared",
    "st.shared": r"\bst\.shared",
    "ld.global": r"\bld\.global",
    "st.global": r"\bst\.global",
    "shfl.sync": r"\bshfl\.sync",
    "ex2.approx": r"\bex2\.approx",
    "rcp.approx": r"\brcp\.approx",
    "cvt": r"\bcvt\.",
    "fma/mul/add.f32": r"\b(fma|mul|add|sub)\.(rn\.)?(ftz\.)?f32",
    "setmaxnreg": r"\bsetmaxnreg",
    "bra": r"\bbra\b",
    "instructions (lines ending ';')": r";\s*$",
}


def _name(kernel: str, variant: str) -> str:
    return f"{kernel}__{variant}.ptx"


def dump(out_dir: pathlib.Path, kernels: list[str] | None) -> int:
    """Compile every registered variant of the target architecture (``CUTE_DSL_ARCH``) (of
    ``kernels``, or all) and write its PTX."""
    from sonic.kernels import registry, runtime

    out_dir.mkdir(parents=True, exist_ok=True)
    for v in registry.variants(runtime.compile_arch()):
        if kernels and v.kernel not in kernels:
            continue
        ptx = v.compile_fake().artifacts.PTX or ""
        (out_dir / _name(v.kernel, v.variant)).write_text(ptx)
        print(f"{v.kernel:<18} {v.variant:<40} {len(ptx.splitlines()):>7} lines", flush=True)
    return 0


def counts(ptx: str) -> dict[str, int]:
    """Per-kind instruction counts of one PTX text (comments and directives excluded)."""
    lines = [ln.split("//")[0] for ln in ptx.splitlines()]
    lines = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith(".")]
    return {kind: sum(bool(re.search(rx, ln, re.M)) for ln in lines) for kind, rx in KINDS.items()}


def normalized(ptx: str) -> str:
    """PTX with the kernel entry symbols (which embed the Python class path) replaced by
    ``KERNEL<i>``, so that moving a kernel class between modules compares equal."""
    for i, name in enumerate(re.findall(r"\.entry\s+(\w+)", ptx)):
        ptx = ptx.replace(name, f"KERNEL{i}")
    return ptx


def compare(old: pathlib.Path, new: pathlib.Path, kernels: list[str] | None, show_all: bool) -> int:
    """Print the per-kind counts of every variant in ``old`` (differing kinds only, unless
    ``show_all``) and whether the text is identical up to entry symbol names; return the
    number of variants whose counts differ."""
    names = sorted(p.name for p in old.glob("*.ptx"))
    if kernels:
        names = [n for n in names if n.split("__")[0] in kernels]
    differing = 0
    print(f"{'variant':<56} {'kind':<32} {'old':>7} {'new':>7}")
    for name in names:
        label = name[:-4]
        if not (new / name).exists():
            print(f"{label:<56} MISSING in {new}")
            differing += 1
            continue
        old_ptx, new_ptx = (old / name).read_text(), (new / name).read_text()
        a, b = counts(old_ptx), counts(new_ptx)
        differing += a != b
        for kind in KINDS:
            if show_all or a[kind] != b[kind]:
                print(f"{label:<56} {kind:<32} {a[kind]:>7} {b[kind]:>7}")
        same_text = normalized(old_ptx) == normalized(new_ptx)
        total = "instructions (lines ending ';')"
        print(f"{label:<56} {'counts ' + ('identical' if a == b else 'DIFFER'):<32} "
              f"{a[total]:>7} {b[total]:>7}  text {'identical' if same_text else 'differs'}")
    print(f"{len(names)} variant(s), {differing} with differing counts")
    return differing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write the PTX of every registered variant to DIR")
    d.add_argument("dir", type=pathlib.Path)
    d.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    c = sub.add_parser("compare", help="compare per-kind instruction counts of two dumps")
    c.add_argument("old", type=pathlib.Path)
    c.add_argument("new", type=pathlib.Path)
    c.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    c.add_argument("--all", action="store_true", help="print every kind, not only differences")
    args = parser.parse_args(argv)
    if args.cmd == "dump":
        return dump(args.dir, args.kernel)
    return 1 if compare(args.old, args.new, args.kernel, args.all) else 0


if __name__ == "__main__":
    sys.exit(main())
