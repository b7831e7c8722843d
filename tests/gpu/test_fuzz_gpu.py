"""The differential fuzzer of ``tests/test_fuzz.py`` on the CuTe kernels: bf16, kernel-sized
``d`` and ``n``, up to 600 tokens, against the fp64 oracle. ``SONIC_FUZZ_ITERS`` iterations
(default 200)."""

import pytest
import torch

from kernel_checks import require_kernels
from test_fuzz import ITERS, _fuzz_moe_experts

pytestmark = pytest.mark.gpu


def test_kernels_against_the_fp64_oracle():
    require_kernels()
    for seed in range(ITERS or 200):
        _fuzz_moe_experts(10_000 + seed, backend="cute", dtypes=(torch.bfloat16,),
                          sizes=((0, 600), (128, 256), (64, 128)), device="cuda")
