"""CPU checks of the sm_100a (Blackwell) grouped GEMM prototype: every variant compiles for
sm_100a with tcgen05 UMMA, TMEM allocation and TMEM loads in its PTX; the UMMA shared-memory
layouts the kernel relies on equal the WGMMA ones; the launchers reject bad input and the
self-check reports, instead of raising, when no sm_100 device is present."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from sonic.kernels import grouped_gemm_sm100 as sm100

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl) is "
                                                           "not importable")


def _run(*args):
    # A fresh process: CUTE_DSL_ARCH must be set before cutlass is first imported.
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)


@needs_cutlass
def test_every_sm100_variant_compiles_with_tcgen05():
    checked = _run("-m", "sonic.kernels.grouped_gemm_sm100")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = [x for x in checked.stdout.splitlines() if x.startswith("grouped_gemm_sm100")]
    assert len(lines) == len(sm100.SM100_VARIANTS)
    for line in lines:
        assert line.rstrip().endswith("ok"), line
        assert "tcgen05.mma=0" not in line and "tcgen05.alloc=0" not in line, line


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


def test_self_check_reports_without_sm100_device():
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("an sm_100 device is present: tests/gpu runs the real self-check")
    ok, message = sm100.self_check("up_proj")
    assert not ok and message
    with pytest.raises(KeyError, match="unknown sm100 variant"):
        sm100.self_check("no_such_variant")


def test_sm100_launchers_reject_bad_input():
    offsets = torch.tensor([0, 3, 5], dtype=torch.int32)
    a = torch.randn(5, 64).to(torch.bfloat16)
    b = torch.randn(2, 64, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="a must be on a CUDA device"):
        sm100.grouped_gemm(a, b, offsets)
    with pytest.raises(TypeError, match="a must have dtype bfloat16"):
        sm100.grouped_gemm(a.float(), b, offsets)
    with pytest.raises(ValueError, match="gate_up must be"):
        sm100.grouped_gemm_swiglu(a, b, offsets, offsets, "stacked")
    with pytest.raises(ValueError, match="a must be on a CUDA device"):
        sm100.grouped_gemm_varlen_k(a, b, offsets)
