"""CPU checks of the Blackwell (sm_100a) path: the UMMA shared-memory layouts the kernel relies
on equal the WGMMA ones; the self-check reports instead of raising without an sm_100 device;
and the backend's dispatch on a (monkeypatched) compute capability 10.x device — self-check
pass, fail with one warning and the reference fallback, ``backend="cute"`` raising, and
:func:`sonic.explain_backend`'s report — so CI covers it without a Blackwell GPU. That every
sm_100a variant compiles with tcgen05 markers is tests/test_kernels_compile.py's."""

import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch

from sonic import backend, explain_backend
from sonic.kernels import runtime
from sonic.kernels.grouped_gemm import self_check
from sonic.reference import ops as reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl) is "
                                                           "not importable")
CUDA0 = torch.device("cuda", 0)


def _run(*args):
    # A fresh process: CUTE_DSL_ARCH must be set before cutlass is first imported.
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)


_LAYOUTS = """
import os
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
import cutlass
import cutlass.utils.blackwell_helpers as sm100
import cutlass.utils.hopper_helpers as sm90
from cutlass import cute
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.tensor_utils import LayoutEnum

BF16 = cutlass.BFloat16


@cute.jit
def compare():
    for major, enum in ((OperandMajorMode.K, LayoutEnum.ROW_MAJOR),
                        (OperandMajorMode.MN, LayoutEnum.COL_MAJOR)):
        for tile_n in (128, 256):
            tiler = (128, tile_n, 64)
            mma = cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
                BF16, cutlass.Float32, (128, tile_n, 16), tcgen05.CtaGroup.ONE,
                tcgen05.OperandSource.SMEM, major, major))
            thr = mma.get_slice(0)
            for umma, wgmma, part in (
                    (sm100.make_smem_layout_a(mma, tiler, BF16, 3),
                     sm90.make_smem_layout_a(enum, tiler, BF16, 3), thr.partition_A),
                    (sm100.make_smem_layout_b(mma, tiler, BF16, 3),
                     sm90.make_smem_layout_b(enum, tiler, BF16, 3), thr.partition_B)):
                ptr = cute.make_ptr(BF16, 0, cute.AddressSpace.smem)
                # Same swizzle, and every element at the same offset once partitioned for UMMA.
                assert str(umma.inner) == str(wgmma.inner), (umma, wgmma)
                mine = part(cute.make_tensor(ptr, wgmma.outer)).layout
                assert str(cute.coalesce(mine)) == str(cute.coalesce(umma.outer)), (mine, umma)
    print("same")


compare()
"""


@needs_cutlass
def test_umma_smem_layouts_equal_wgmma_layouts(tmp_path):
    # The sm_90 producers write the WGMMA layouts; UMMA must read the same bytes.
    script = tmp_path / "layouts.py"    # the DSL compiles from source: no `python -c`
    script.write_text(_LAYOUTS)
    probe = _run(str(script))
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert probe.stdout.strip().endswith("same")


def test_self_check_reports_without_a_supported_device():
    if runtime.kernels_available()[0]:
        pytest.skip("a supported GPU is present: tests/gpu runs the real self-check")
    ok, message = self_check.self_check("up_proj")
    assert not ok and message.startswith("up_proj: ")
    with pytest.raises(KeyError, match="unknown grouped-GEMM self-check variant"):
        self_check.self_check("no_such_variant")


@pytest.fixture
def fake_device(monkeypatch):
    """Pretend cuda:0 exists with the capability in ``state["cap"]`` and record the
    self-checks asked for; ``state["fail"]`` names the variants whose check fails."""
    state = {"cap": (10, 0), "fail": set(), "asked": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(runtime, "device_capability", lambda device=None: state["cap"])

    def fake_check(variant, device=None):
        state["asked"].append(variant)
        if variant in state["fail"]:
            return False, f"sm_100a {variant}: out mismatch (out rel err 1.0e+00)"
        return True, f"sm_100a {variant}: out rel err 1.0e-03"

    monkeypatch.setattr(self_check, "self_check", fake_check)
    backend._warn_self_check.cache_clear()
    yield state
    backend._warn_self_check.cache_clear()


def test_capabilities_9_and_10_are_supported(fake_device):
    if not HAS_CUTLASS:
        pytest.skip("kernels_available also needs the CuTe DSL")
    for cap, arch, checked in (((9, 0), "sm_90a", False), ((10, 0), "sm_100a", True)):
        fake_device["cap"] = cap
        assert runtime.kernels_available(CUDA0) == (True, "")
        assert runtime.device_arch(CUDA0) == arch
        assert self_check.required(CUDA0) is checked
    fake_device["cap"] = (12, 0)
    ok, reason = runtime.kernels_available(CUDA0)
    assert not ok and "compute capability 12.0" in reason and "sm_100a" in reason


def test_sm90_needs_no_self_check(fake_device):
    fake_device["cap"] = (9, 0)
    assert backend._self_checked("up_proj", CUDA0, strict=True)
    assert fake_device["asked"] == []


def test_passing_self_check_lets_the_kernel_run(fake_device):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend._self_checked("dw1", CUDA0, strict=False)
        assert backend._self_checked("dw1", CUDA0, strict=True)
    assert fake_device["asked"] == ["dw1", "dw1"]


def test_failing_self_check_warns_once_and_falls_back(fake_device):
    fake_device["fail"] = {"up_proj", "down_proj"}
    with pytest.warns(RuntimeWarning, match="self-check failed .*up_proj.*PyTorch reference"):
        assert not backend._self_checked("up_proj", CUDA0, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # the same failure does not warn again
        assert not backend._self_checked("up_proj", CUDA0, strict=False)
    with pytest.warns(RuntimeWarning, match="down_proj"):     # another variant warns once
        assert not backend._self_checked("down_proj", CUDA0, strict=False)


def test_failing_self_check_raises_under_cute(fake_device):
    fake_device["fail"] = {"dh_dswiglu"}
    with pytest.raises(RuntimeError, match="backend='cute' cannot run grouped-GEMM variant "
                                           "'dh_dswiglu'.*self-check failed.*mismatch"):
        backend._self_checked("dh_dswiglu", CUDA0, strict=True)


def test_op_falls_back_to_the_reference_with_the_variant_of_its_operands(fake_device):
    # CPU tensors stand in for the device's: with every check failing, each op must run the
    # reference and have asked for the variant its operand forms select.
    fake_device["fail"] = set(self_check.VARIANTS)
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    gidx = torch.randint(0, 9, (12,), generator=gen, dtype=torch.int32)
    x = torch.randn(9, 16, generator=gen).to(torch.bfloat16)
    rows = torch.randn(12, 16, generator=gen).to(torch.bfloat16)
    # b is (E, K, N): contiguous means N-major for the kernel; the transposed view of a
    # contiguous (E, N, K) (nn.Linear's layout) K-major.
    w_kn = torch.randn(3, 16, 24, generator=gen).to(torch.bfloat16)
    w_nk = w_kn.transpose(1, 2).contiguous().transpose(1, 2)
    ops = backend._cute_ops(strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = ops.grouped_mm(x, w_nk, offsets, gidx)
        assert torch.equal(got, reference.grouped_mm(x, w_nk, offsets, gidx))
        ops.grouped_mm(rows, w_nk, offsets)
        ops.grouped_mm(rows, w_kn, offsets)
        ops.grouped_mm(x, w_kn, offsets, gidx)
        got = ops.grouped_mm_varlen_k(rows, x, offsets, None, gidx)
        assert torch.equal(got, reference.grouped_mm_varlen_k(rows, x, offsets, None, gidx))
        ops.grouped_mm_varlen_k(x, rows, offsets, gidx, None)
    assert fake_device["asked"] == ["up_proj", "down_proj", "dx", "da_prime", "dw1", "dw2"]
    with pytest.raises(RuntimeError, match="'up_proj'"):
        backend._cute_ops(strict=True).grouped_mm(x, w_nk, offsets, gidx)


def test_explain_backend_reports_the_self_checks(fake_device):
    if not HAS_CUTLASS:
        pytest.skip("kernels_available also needs the CuTe DSL")
    fake_device["fail"] = {"dw1"}
    text = explain_backend("auto", CUDA0)
    assert text.startswith("cute: kernels available (sm_100a: grouped-GEMM self-checks passed: ")
    assert "up_proj" in text and "failed, so those ops use the PyTorch reference: dw1 (" in text
    assert "raise RuntimeError: dw1" in explain_backend("cute", CUDA0)
    fake_device["cap"] = (9, 0)
    assert explain_backend("auto", CUDA0) == ("cute: kernels available (sm_90a: grouped GEMMs "
                                              "need no self-check)")
