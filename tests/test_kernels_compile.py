"""CPU checks of the CuTe-DSL kernel layer: every registered variant compiles for sm_90a and for
sm_100a (each architecture's grouped-GEMM mainloop, tcgen05 and TMEM allocation on sm_100a, and
every CUDA-core kernel for both) and shows its PTX markers; the package imports without cutlass; entry points reject bad input."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from sonic.kernels import kernels_available
from sonic.kernels.__main__ import find_nvdisasm, tma_waterfalls
from sonic.kernels.aggregation import aggregate
from sonic.kernels.routing_metadata import routing_metadata_pairs, routing_metadata_topk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None


def _run(*args):
    # A fresh process: CUTE_DSL_ARCH must be set before cutlass is first imported.
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)


@pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl, the 'gpu' extra) "
                                            "is not importable")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_check_every_variant(arch):
    # The whole sm_100a check takes ~45 s on 2 CPU cores, so CI runs all of it.
    listed = _run("-m", "sonic.kernels", "--list")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[:2] for line in listed.stdout.splitlines()
             if line.strip() and arch in line.split()[2].split(",")]
    kernels = {kernel for kernel, _ in names}
    assert {"topk", "routing_metadata", "aggregation", "grouped_gemm", "swiglu"} <= kernels
    checked = _run("-m", "sonic.kernels", "--compile-check", arch)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(names)} variant(s), 0 failure(s), arch {arch}" in checked.stdout
    if arch == "sm_90a" and find_nvdisasm() is not None:
        # The cubins were read (CI installs nvdisasm with the test extra).
        assert "cubin(s) without TMA waterfalls, 0 with" in checked.stdout, checked.stdout
    for kernel, variant in names:
        line = next((x for x in checked.stdout.splitlines() if x.split()[:2] == [kernel, variant]),
                    None)
        assert line is not None and line.rstrip().endswith("ok"), (kernel, variant, checked.stdout)
        if kernel == "grouped_gemm" and arch == "sm_100a":
            assert "tcgen05.mma=0" not in line and "tcgen05.alloc=0" not in line, line


def test_import_does_not_import_cutlass():
    probe = _run("-c", "import sys, sonic.kernels, sonic.kernels.aggregation, "
                       "sonic.kernels.routing_metadata; print('cutlass' in sys.modules)")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "False"


def test_kernels_available_reports_reason_on_cpu():
    ok, reason = kernels_available("cpu")
    assert not ok and "CUDA" in reason


def test_entry_points_reject_bad_input():
    idx = torch.randint(0, 8, (5, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="expert_idx must be on a CUDA device"):
        routing_metadata_topk(idx, 8)
    with pytest.raises(TypeError, match="expert_idx must have dtype int32"):
        routing_metadata_topk(idx.long(), 8)
    with pytest.raises(ValueError, match="token_idx must have 1 dimension"):
        routing_metadata_pairs(idx, idx, 5, 8)
    y = torch.randn(10, 16)
    rows = torch.arange(10, dtype=torch.int32)
    with pytest.raises(TypeError, match="y must have dtype"):
        aggregate(y.half(), rows, rows)
    with pytest.raises(ValueError, match="y must be on a CUDA device"):
        aggregate(y, rows, rows)


def _fake_ptxas(tmp_path, script):
    path = tmp_path / "ptxas"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


def test_wgmma_serialized_reads_ptxas_advisory(tmp_path, monkeypatch):
    from sonic.kernels.__main__ import find_ptxas, wgmma_serialized

    ptx = ".version 9.4\n.target sm_90a\n"
    # A ptxas older than the PTX: retried at the version it names, then its advisory read.
    older = _fake_ptxas(tmp_path, """
if grep -q '^.version 9.4' "$3"; then
  echo "ptxas $3, line 1; fatal   : Unsupported .version 9.4; current version is '9.0'" >&2
  exit 255
fi
echo "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized" >&2
""")
    assert wgmma_serialized(older, ptx, "sm_90a") is True
    # The other serializing advisory: an accumulator read while its WGMMAs are in flight.
    reads_acc = _fake_ptxas(tmp_path, "echo 'ptxas info    : (C7514) Potential Performance Loss: "
                                      "wgmma.mma_async instructions are serialized due to non "
                                      "wgmma instructions reading accumulator registers' >&2\n")
    assert wgmma_serialized(reads_acc, ptx, "sm_90a") is True
    clean = _fake_ptxas(tmp_path, "echo 'ptxas info    : Used 168 registers' >&2\n")
    assert wgmma_serialized(clean, ptx, "sm_90a") is False
    broken = _fake_ptxas(tmp_path, "echo 'ptxas fatal   : Unknown option' >&2; exit 1\n")
    assert wgmma_serialized(broken, ptx, "sm_90a") == "ptxas fatal   : Unknown option"
    monkeypatch.setenv("SONIC_PTXAS", broken)
    assert find_ptxas() == broken
    monkeypatch.setenv("SONIC_PTXAS", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="SONIC_PTXAS must name an executable ptxas"):
        find_ptxas()


def test_tma_waterfalls_reads_the_disassembly(tmp_path, monkeypatch):
    waterfall = """
        /*0100*/                   ELECT P0, URZ, PT ;
        /*0110*/                   VOTEU.ANY UR4, UPT, PT ;
        /*0120*/              @UP0 UTMALDG.2D [UR8], [UR6], desc[URZ] ;
        /*0130*/              @UP0 UTMALDG.3D [UR8], [UR6], desc[URZ] ;
        /*0140*/                   UTMALDG.2D [UR10], [UR6], desc[URZ] ;
"""
    def fake(text, code=0):
        path = tmp_path / f"nvdisasm{code}{len(text)}"
        path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\nexit {code}\n")
        path.chmod(0o755)
        return str(path)

    assert tma_waterfalls(fake(waterfall), b"\x7fELF") == 2
    # Predicated loads without a VOTEU.ANY loop are not a waterfall; neither are plain ones.
    assert tma_waterfalls(fake(waterfall.replace("VOTEU.ANY", "VOTEU.ALL")), b"") == 0
    assert tma_waterfalls(fake("UTMALDG.2D [UR8], [UR6], desc[URZ] ;"), b"") == 0
    assert tma_waterfalls(fake("nvdisasm fatal : bad ELF", 1), b"") == "nvdisasm fatal : bad ELF"
    monkeypatch.setenv("SONIC_NVDISASM", fake(""))
    assert find_nvdisasm() == os.environ["SONIC_NVDISASM"]
    monkeypatch.setenv("SONIC_NVDISASM", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="SONIC_NVDISASM must name an executable nvdisasm"):
        find_nvdisasm()


@pytest.mark.skipif(not HAS_CUTLASS or find_nvdisasm() is None,
                    reason="needs cutlass (the 'gpu' extra) and nvdisasm (the 'test' extra)")
def test_tma_waterfall_of_the_gathered_fp8_tile_with_wgmma_turns_is_caught():
    """The check catches the case it exists for: the gathered FP8 GEMM on 128-wide tiles with
    WGMMA turns (its producers' row-box TMA loads in waterfall loops, 3x slower on an H200);
    the plan as it is has none."""
    script = """
import os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from sonic.kernels.__main__ import find_nvdisasm, tma_waterfalls
from sonic.kernels.grouped_gemm import config, heuristic
from sonic.kernels.grouped_gemm.interface import compile_config

def waterfalls():
    cfg = heuristic.varlen_m_config(1408, 2048, True, ab_dtype="e4m3")
    assert cfg.tile_n == 128
    return tma_waterfalls(find_nvdisasm(), compile_config(cfg, keep_ptx=True).artifacts.CUBIN)

plain = waterfalls()
config.GroupedGemmConfig.wgmma_turns = property(lambda c: c.fp8 and not c.overlapped_promotion)
print(plain, waterfalls())
"""
    run = _run("-c", script)
    assert run.returncode == 0, run.stdout + run.stderr
    plain, turns = run.stdout.split()[-2:]
    assert plain == "0" and int(turns) > 0, run.stdout


@pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl, the 'gpu' extra) "
                                            "is not importable")
@pytest.mark.parametrize("changes,deferred,parts", [
    (dict(), True, 4),                                          # 128 x 256 coop: 4 slabs
    (dict(tile_n=128, tile_m=256), True, 4),                    # 2 row blocks x 2 slabs
    (dict(tile_n=128), True, 2),
    (dict(tile_n=192, pingpong=True), False, None),             # ping-pong hides its stores
    (dict(varlen_k=True, dim_m=512), False, None),              # serialized WGMMAs (C7514)
    (dict(ab_dtype="e4m3"), False, None),                       # the FP8 mainloop's own loop
    (dict(arch="sm_100a", cluster=1), False, None),             # TMEM epilogue warps
    (dict(epilogue="swiglu", gate_up="concat", gather_a=True), False, None),  # spilled
])
def test_deferred_stores_where_measured(changes, deferred, parts):
    """The consumer defers the stores of the cooperative bf16 sm_90 varlen-M store GEMMs only
    (benchmarks/RESULTS.md), in one box per 64-row block and slab."""
    from sonic.kernels.grouped_gemm.config import CLUSTER, GroupedGemmConfig
    from sonic.kernels.grouped_gemm.epilogue import make_epilogue

    fields = dict(varlen_k=False, tile_n=256, pingpong=False, cluster=CLUSTER, dim_m=0,
                  dim_n=2048, dim_k=1024, gather_a=False)
    epilogue = make_epilogue(GroupedGemmConfig(**{**fields, **changes}), ring=None)
    assert epilogue.deferred is deferred
    if deferred:
        assert epilogue.parts == parts


def test_compile_check_without_cutlass_names_the_extra():
    # sys.modules["cutlass"] = None makes both the import and importlib's find_spec miss it.
    code = ("import runpy, sys; sys.modules['cutlass'] = None; "
            "sys.argv = ['sonic.kernels', '--compile-check', 'sm_90a']; "
            "runpy.run_module('sonic.kernels', run_name='__main__')")
    proc = _run("-c", code)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install -e ".[gpu]"' in lines[0], proc.stderr


@pytest.mark.skipif(not HAS_CUTLASS, reason="cutlass (nvidia-cutlass-dsl, the 'gpu' extra) "
                                            "is not importable")
def test_swiglu_long_rows_compile_to_a_loop():
    # Unrolled, a row of n = 14336 made the quantizing dSwiGLU kernel 0.6 MB of machine code and
    # the instruction cache cost it 2.5x its time (benchmarks/RESULTS.md): the code of a long
    # row must not grow with n, in the quantizing kernels nor in the FP8 activation cache's
    # (which take fewer passes per chunk).
    kinds = {"quantize forward": "False, quantize=True",
             "quantize backward": "True, quantize=True",
             "fp8 cache forward": "False, quantize=True, quantize_h=True",
             "fp8 cache backward": "True, quantize=True, h_fp8=True"}
    code = ("import os; os.environ['CUTE_DSL_ARCH'] = 'sm_90a'\n"
            "from sonic.kernels import swiglu\n"
            "for n in (4224, 14336):\n"
            + "".join(f"    print(n, {kind!r}, len(swiglu._compile(n, 'concat', {args}, "
                      f"keep_ptx=True).artifacts.PTX))\n" for kind, args in kinds.items()))
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    sizes = {}
    for line in out.stdout.splitlines():
        n, rest = line.split(" ", 1)
        kind, size = rest.rsplit(" ", 1)
        sizes[int(n), kind.strip("'")] = int(size)
    assert len(sizes) == 2 * len(kinds), out.stdout
    for kind in kinds:
        assert sizes[14336, kind] <= 1.1 * sizes[4224, kind], sizes
