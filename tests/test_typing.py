"""The public modules type-check: mypy over the package's user-facing API (the layer, the
routers, the experts op, the custom ops of ``torch.ops.sonic``, the shared types, expert
parallelism, the training job, the backend switches, the activation-memory profiler, the
Hugging Face integration, the PyTorch baselines, the reference and the kernels' host-side
launchers), as a user's checker would read them."""

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = ["sonic/__init__.py", "sonic/nn", "sonic/routing", "sonic/experts", "sonic/ops.py",
          "sonic/types.py", "sonic/distributed", "sonic/train", "sonic/backend.py",
          "sonic/activation_cache.py", "sonic/memory", "sonic/integrations", "sonic/baselines",
          "sonic/_output.py", "sonic/_validation.py", "sonic/_custom_op.py", "sonic/reference",
          # The kernels' host side: launchers, configuration, plan, registry, compile check.
          # Their CuTe-DSL device code (the *_kernel.py modules, the grouped GEMM's mainloops,
          # producers, epilogues and scheduler) is left out: the DSL's values and layouts carry
          # no types mypy can follow.
          "sonic/kernels/__init__.py", "sonic/kernels/__main__.py", "sonic/kernels/runtime.py",
          "sonic/kernels/registry.py", "sonic/kernels/swiglu.py", "sonic/kernels/fp8_quant.py",
          "sonic/kernels/routing_metadata.py", "sonic/kernels/topk.py",
          "sonic/kernels/token_rounding.py", "sonic/kernels/padding.py",
          "sonic/kernels/aggregation.py", "sonic/kernels/grouped_gemm/__init__.py",
          "sonic/kernels/grouped_gemm/interface.py", "sonic/kernels/grouped_gemm/config.py",
          "sonic/kernels/grouped_gemm/heuristic.py", "sonic/kernels/grouped_gemm/self_check.py",
          "sonic/kernels/grouped_gemm/args.py"]


def test_public_modules_type_check():
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", *PUBLIC, "--ignore-missing-imports",
                           "--follow-imports=silent", "--no-error-summary",
                           "--cache-dir", str(REPO / ".mypy_cache")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
