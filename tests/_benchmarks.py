"""Loading a script of ``benchmarks/`` as a module, for the tests that drive its command line
or helpers on the CPU."""

import importlib.util
import pathlib
import sys


def load_benchmark(name: str):
    """A fresh module of ``benchmarks/<name>.py``, registered in ``sys.modules`` under
    ``name`` while it executes (dataclasses look their module up there)."""
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
