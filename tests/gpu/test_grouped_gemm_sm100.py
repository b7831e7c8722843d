"""GPU checks of the grouped-GEMM self-check and of the Blackwell (sm_100a) dispatch.

The self-check of every variant runs on any supported device (on an H200 it checks the sm_90a
kernels and the self-check code itself); the sm_100 tests run only on a compute-capability
10.x device and skip elsewhere. On sm_100 the whole grouped-GEMM suite
(tests/gpu/test_grouped_gemm_kernel.py) runs the tcgen05 kernels too: the launchers dispatch
by the device's architecture.
"""

import warnings

import pytest
import torch

from kernel_checks import require_kernels
from sonic import explain_backend
from sonic.kernels import runtime
from sonic.kernels.grouped_gemm import self_check

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_kernels():
    require_kernels()


def _require_sm100():
    if runtime.device_arch() != "sm_100a":
        pytest.skip(f"needs an sm_100 (compute capability 10.x) device, this is "
                    f"{runtime.device_arch()}")


@pytest.mark.parametrize("variant", list(self_check.VARIANTS))
def test_self_check(variant):
    ok, message = self_check.self_check(variant)
    assert ok, message
    # Cached: the second call answers the same without running again.
    assert self_check.self_check(variant) == (ok, message)


def test_sm100_requires_and_reports_self_checks():
    _require_sm100()
    assert self_check.required(torch.cuda.current_device())
    text = explain_backend("auto", "cuda")
    assert "sm_100a: grouped-GEMM self-checks passed: " in text
    assert "failed" not in text, text


def test_sm100_auto_runs_the_kernels_without_warning():
    _require_sm100()
    from sonic.backend import expert_ops

    gen = torch.Generator().manual_seed(3)
    offsets = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device="cuda")
    x = torch.randn(300, 256, generator=gen).to(torch.bfloat16).cuda()
    w = torch.randn(3, 256, 512, generator=gen).to(torch.bfloat16).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = expert_ops("auto", x.device).grouped_mm(x, w, offsets)
    off = offsets.tolist()
    ref = torch.cat([x[off[e]:off[e + 1]].float() @ w[e].float() for e in range(3)])
    assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2
