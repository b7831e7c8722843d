"""Layering of sonic's packages: kernels -> backend -> routing / autograd / nn.

Static checks (AST scan, no imports executed) that ``sonic.kernels`` depends on nothing of
sonic but itself and the leaf ``sonic.types``, that the leaf depends on nothing of sonic, and
that a CPU-only import of the grouped GEMM does not import ``cutlass``.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LEAF = "sonic.types"


def _sonic_imports(path: pathlib.Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``sonic`` module in ``path`` (relative ones
    resolved against ``package``), at any depth (lazy imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{module}" if module else base
            found.append((node.lineno, module))
    return [(line, m) for line, m in found if m == "sonic" or m.startswith("sonic.")]


def _modules(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        package = ".".join(rel.parts[:-1])
        yield path, ".".join(parts), package


def test_kernels_import_only_kernels_and_the_leaf():
    bad = []
    for path, _, package in _modules("sonic/kernels"):
        for line, module in _sonic_imports(path, package):
            if not (module == "sonic.kernels" or module.startswith("sonic.kernels.")
                    or module == LEAF):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "sonic.kernels must import only sonic.kernels.* and sonic.types:\n" + \
        "\n".join(bad)


def test_leaf_imports_nothing_from_sonic():
    path = ROOT / "sonic" / "types.py"
    assert _sonic_imports(path, "sonic") == []


@pytest.mark.parametrize("modules", ["sonic, sonic.kernels.grouped_gemm",
                                     "sonic.kernels.grouped_gemm.interface, "
                                     "sonic.kernels.grouped_gemm.heuristic, sonic.kernels.swiglu"])
def test_grouped_gemm_import_does_not_import_cutlass(modules):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = subprocess.run([sys.executable, "-c",
                            f"import sys, {modules}; print('cutlass' in sys.modules)"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "False"
