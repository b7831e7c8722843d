import os
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # CuTe DSL keeps the target of its first import, and the in-process compile checks set
    # sm_90a first (sonic.kernels.runtime.set_compile_arch): a test module importing cutlass
    # at collection, before any target is set, would quietly skip them all.
    if "cutlass" in sys.modules and not os.environ.get("CUTE_DSL_ARCH"):
        raise pytest.UsageError(
            "a test module imported cutlass at collection without CUTE_DSL_ARCH; import it "
            "inside the tests, after sonic.kernels.runtime.set_compile_arch")


@pytest.fixture
def sm90a_compile():
    """Make CuTe DSL compile for sm_90a in this process (no GPU needed); skips where
    ``CUTE_DSL_ARCH`` names another target or cutlass was imported for one."""
    from sonic.kernels import runtime

    if os.environ.get("CUTE_DSL_ARCH", "sm_90a") != "sm_90a":
        pytest.skip("CUTE_DSL_ARCH is set to another target")
    try:
        runtime.set_compile_arch("sm_90a")
    except RuntimeError as err:
        pytest.skip(str(err))
    pytest.importorskip("cutlass")
