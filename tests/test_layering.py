"""Layering of sonic's packages: types -> reference -> kernels -> backend -> ops -> routing /
experts API -> nn -> distributed -> train / integrations.

Static checks (AST scan, no imports executed; module-level and lazy imports alike) that every
module imports only from its own layer or the layers below it, that ``sonic.kernels`` depends
on nothing of sonic but itself and the leaf ``sonic.types``, that the leaf depends on nothing
of sonic, and that a CPU-only import of the grouped GEMM does not import ``cutlass``.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LEAF = "sonic.types"


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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
            # ``from sonic import ops`` imports the module sonic.ops, not the package.
            found += [(node.lineno, f"{module}.{alias.name}"
                       if _is_module(f"{module}.{alias.name}") else module)
                      for alias in node.names]
    return [(line, m) for line, m in found if m == "sonic" or m.startswith("sonic.")]


# Layers, lowest first: (name, module prefixes). A module belongs to the layer of its longest
# matching prefix; the package ``sonic`` (the public API) belongs to the top layer, and
# ``__main__`` modules (command-line tools) sit above all.
LAYERS = (
    ("types", ("sonic.types", "sonic._validation", "sonic._output")),
    ("reference", ("sonic.reference",)),
    ("kernels", ("sonic.kernels",)),
    ("backend", ("sonic.backend", "sonic.activation_cache")),
    ("ops", ("sonic.ops", "sonic._custom_op")),
    ("routing / experts API", ("sonic.routing", "sonic.experts")),
    ("nn", ("sonic.nn",)),
    ("distributed", ("sonic.distributed",)),
    ("train / integrations / tools", ("sonic.train", "sonic.integrations", "sonic.memory",
                                      "sonic.baselines")),
)
TOP = len(LAYERS)


def _rank(module: str) -> int | None:
    """Index of ``module``'s layer in :data:`LAYERS` (``TOP`` for ``__main__`` modules), None
    when no layer claims it (a module outside sonic)."""
    if not (module == "sonic" or module.startswith("sonic.")):
        return None
    if module.endswith(".__main__"):
        return TOP
    if module == "sonic":
        return TOP - 1
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    return None if best is None else best[0]


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


def test_every_module_has_a_layer():
    unclaimed = [name for _, name, _ in _modules("sonic") if _rank(name) is None]
    assert not unclaimed, f"add these modules to a layer of LAYERS: {unclaimed}"


def test_layers_import_only_downwards():
    def layer(rank):
        return LAYERS[rank][0] if rank < TOP else "command line"

    bad = []
    for path, name, package in _modules("sonic"):
        rank = _rank(name)
        for line, module in _sonic_imports(path, package):
            target = _rank(module)
            if target is not None and target > rank:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({layer(rank)}) imports {module} "
                           f"({layer(target)})")
    assert not bad, "imports must go down the layers " + " -> ".join(n for n, _ in LAYERS) + \
        ":\n" + "\n".join(bad)


def test_rank_of_modules():
    assert _rank("sonic.types") == 0
    assert _rank("sonic.kernels.grouped_gemm.sm90") == 2
    assert _rank("sonic.ops") < _rank("sonic.routing.topk") == _rank("sonic.experts.moe_experts")
    assert _rank("sonic.kernels.__main__") == TOP
    assert _rank("sonic") == _rank("sonic.train.loop") == TOP - 1
    assert _rank("sonic.opsx") is None and _rank("numpy") is None


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


def test_shared_limits_match_the_grouped_gemm_config():
    """The grouped GEMM's config takes its limits from the one definition in sonic.types."""
    from sonic import types
    from sonic.kernels.grouped_gemm import config

    assert config.MAX_EXPERTS == types.GROUPED_GEMM_MAX_EXPERTS
    assert config.TILE_K_FP8 == types.FP8_BLOCK
