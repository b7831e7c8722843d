"""GPU checks of the sm_100a (Blackwell) grouped GEMMs: the on-device self-check of every
variant, then the whole sm_90 grouped-GEMM suite (varlen-M / varlen-K, gathered or not, both
fused epilogues, validation, >2³¹-element addressing) run against the sm_100 launchers.

Runs only on a compute-capability 10.x device; skips elsewhere (an H100/H200 included).
"""

import pytest

from sonic.kernels import grouped_gemm as sm90
from sonic.kernels import grouped_gemm_sm100 as sm100

# The sm_90 suite's tests, collected here again with the sm_100 launchers patched in (each
# imports its launcher from sonic.kernels.grouped_gemm when it runs). Their own autouse
# fixture, which requires an sm_90 device, stays in their module.
from test_grouped_gemm_kernel import (  # noqa: F401
    test_dh_dswiglu_epilogue, test_dh_dswiglu_validation, test_index_math_past_2_31_elements,
    test_up_proj_swiglu_epilogue, test_validation, test_varlen_k, test_varlen_m)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _sm100_launchers(monkeypatch):
    ok, reason = sm100.sm100_available()
    if not ok:
        pytest.skip(reason)
    for name in ("grouped_gemm", "grouped_gemm_swiglu", "grouped_gemm_dswiglu",
                 "grouped_gemm_varlen_k"):
        monkeypatch.setattr(sm90, name, getattr(sm100, name))


@pytest.mark.parametrize("variant", list(sm100.SELF_CHECK_VARIANTS))
def test_self_check(variant):
    ok, message = sm100.self_check(variant)
    assert ok, message
    # Cached: the second call answers the same without running again.
    assert sm100.self_check(variant) == (ok, message)
