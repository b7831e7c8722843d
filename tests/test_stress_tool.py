"""The compute-sanitizer driver of ``benchmarks/stress_gpu.py``: its case filter and log parsing,
on the CPU (the sanitizer itself needs a GPU)."""

import sys

import pytest
from _benchmarks import load_benchmark


def _stress():
    return load_benchmark("stress_gpu")


LOG = """\
========= COMPUTE-SANITIZER
@@ case begin T=256 d=128 n=128 E=8 K=2 topk bfloat16 concat
========= Uninitialized __global__ memory read of size 16 bytes
=========     at kernel_a+0x1f0 in /tmp/x.py:12
=========     by thread (3,0,0) in block (0,0,0)
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void at::native::reduce_kernel<512, 1>(T1)+0x80
=========     by thread (0,0,0) in block (1,0,0)
========= Uninitialized __global__ memory read of size 16 bytes
=========     at kernel_a+0x2a0 in /tmp/x.py:14
@@ case end
    1 ok   T=256 d=128 n=128 E=8 K=2 topk bfloat16 concat: max rel err 3.94e-03 (x.grad)
========= ERROR SUMMARY: 3 errors
"""


def test_records_are_counted_per_case_and_per_kernel():
    stress = _stress()
    per_case, total, _, failed = stress.parse_sanitizer_log(LOG)
    assert per_case["T=256 d=128 n=128 E=8 K=2 topk bfloat16 concat"] == 3
    assert total == 3 and failed == []
    assert stress.record_kernels(LOG) == {"kernel_a": 2,
                                          "void at::native::reduce_kernel<512, 1>(T1)": 1}


def test_cases_past_the_print_limit_are_unknown(monkeypatch):
    """Once a run has printed its limit of records, the cases after it show unknown (None),
    not 0; the case that reached the limit keeps its count, and merging keeps unknown."""
    stress = _stress()
    monkeypatch.setattr(stress, "PRINT_LIMIT", 2)
    cut = LOG + "@@ case begin T=1 d=128 n=128 E=8 K=2 topk bfloat16 concat\n@@ case end\n" + (
        "========= ERROR SUMMARY: 9 errors were not printed. Use --print-limit option\n")
    per_case = stress.parse_sanitizer_log(cut)[0]
    assert per_case["T=256 d=128 n=128 E=8 K=2 topk bfloat16 concat"] == 3
    assert per_case["T=1 d=128 n=128 E=8 K=2 topk bfloat16 concat"] is None
    merged = stress.merge_sanitizer_logs([stress.parse_sanitizer_log(cut),
                                          stress.parse_sanitizer_log(LOG)])[0]
    assert merged["T=1 d=128 n=128 E=8 K=2 topk bfloat16 concat"] is None
    assert merged["T=256 d=128 n=128 E=8 K=2 topk bfloat16 concat"] == 6
    # without the limit reached, a case with no records has 0
    assert stress.parse_sanitizer_log(LOG.replace("@@ case end", "@@ case end\n@@ case begin "
                                                  "T=1 x\n@@ case end"))[0]["T=1 x"] == 0


def test_case_filter():
    stress = _stress()
    every = stress.sanitize_cases()
    picked = stress.sanitize_cases(r"topk bfloat16 (concat|interleaved)$")
    assert 0 < len(picked) < len(every)
    assert all("topk bfloat16" in str(c) for c in picked)
    with pytest.raises(SystemExit):
        stress.main(["--sanitize", "--device", "cpu", "--cases", "no such case"])
    with pytest.raises(SystemExit):
        stress.main(["--sanitize", "--device", "cpu", "--cases", "("])


def test_sanitizer_cases_run_every_activation_and_plans_tell_them_apart():
    """Each activation's fused epilogues are their own kernels: the cases run every gated one
    and a non-gated one, and a plan's key names its activation."""
    from sonic.types import GATED_ACTIVATIONS
    stress = _stress()
    activations = {c.activation for c in stress.sanitize_cases()}
    assert set(GATED_ACTIVATIONS) <= activations and activations - set(GATED_ACTIVATIONS)
    pytest.importorskip("cutlass")
    plans = stress.registered_gemm_plans()
    assert (plans["varlen_m_n512_k1536_gather_swiglu_concat"]
            != plans["varlen_m_n512_k1536_gather_geglu_concat"])


def test_an_fp8_case_plans_the_256_wide_interleaved_up_proj_and_dh_kernel():
    """The FP8 fused interleaved case with n = 256 makes the heuristic plan the registered
    256-wide FP8 interleaved up-proj and FP8 dH kernel (no other case reaches them)."""
    pytest.importorskip("cutlass")
    from sonic.kernels.grouped_gemm import heuristic
    stress = _stress()
    case = next(c for c in stress.sanitize_cases("fp8") if c.n == 256 and c.gate_up ==
                "interleaved")
    rows = case.T * case.K // case.E
    up = heuristic.varlen_m_config(2 * case.n, case.d, True, epilogue="swiglu",
                                   gate_up="interleaved", ab_dtype="e4m3", rows_per_expert=rows)
    dh = heuristic.varlen_m_config(case.n, case.d, True, epilogue="dswiglu", ab_dtype="e4m3",
                                   rows_per_expert=rows)
    plans = stress.registered_gemm_plans()
    assert stress.plan_key(up) == plans["varlen_m_fp8_n1024_k1536_gather_swiglu_interleaved"]
    assert stress.plan_key(dh) == plans["varlen_m_fp8_n1024_k2048_gather_dswiglu"]


def test_racecheck_summary_counts_its_errors():
    stress = _stress()
    log = "========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warnings)\n"
    assert stress.parse_sanitizer_log(log)[1] == 2


FAKE_SANITIZER = """\
import subprocess, sys
tool, i = sys.argv[2], sys.argv.index("--print-limit") + 2
skips = []
while sys.argv[i] == "--kernel-name-exclude":
    skips.append(sys.argv[i + 1])
    i += 2
command = sys.argv[i:]
print("skipped kernels:", ",".join(skips))
print("command:", " ".join(command[1:]))
subprocess.run(command + ["--device", "cpu"], check=False)
if tool == "initcheck":
    print("========= Uninitialized __global__ memory read of size 4 bytes")
    print("=========     at fake_kernel+0x10")
    print("========= ERROR SUMMARY: 1 error")
else:
    print("========= ERROR SUMMARY: 0 errors")
"""


def _fake_sanitizer(tmp_path):
    """An executable standing in for compute-sanitizer (:data:`FAKE_SANITIZER`)."""
    fake = tmp_path / "fake_sanitizer.py"
    fake.write_text(FAKE_SANITIZER)
    launcher = tmp_path / "sanitizer"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    launcher.chmod(0o755)
    return launcher


def test_sharded_driver_merges_its_runs(tmp_path, capsys):
    """``--compute-sanitizer --shards 2`` runs each tool's cases over two processes and adds
    their records up; a stand-in for compute-sanitizer runs the cases on the CPU and reports
    one initcheck record per run."""
    stress = _stress()
    launcher = _fake_sanitizer(tmp_path)
    rc = stress.main(["--compute-sanitizer", "--sanitizer", str(launcher), "--shards", "2",
                      "--tools", "memcheck,initcheck", "--cases", "^T=[01] ",
                      "--log-dir", str(tmp_path / "logs"), "--seconds", "300"])
    out = capsys.readouterr().out
    assert rc == 1                                      # initcheck's records fail the run
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "initcheck.0.log", "initcheck.1.log", "memcheck.0.log", "memcheck.1.log"]
    summary = next(ln for ln in out.splitlines() if ln.startswith("ERROR SUMMARY"))
    assert summary.split()[-2:] == ["0", "2"]           # memcheck 0, initcheck 1 + 1
    assert "initcheck.0: 1 records in fake_kernel" in out
    assert "sanitizers: ERRORS" in out
    # No tool skips a kernel; initcheck's runs are prepared for it
    memcheck = (tmp_path / "logs" / "memcheck.0.log").read_text()
    initcheck = (tmp_path / "logs" / "initcheck.0.log").read_text()
    assert "skipped kernels: \n" in memcheck and "skipped kernels: \n" in initcheck
    assert "--initcheck" not in memcheck and "--initcheck" in initcheck


def _launch_args(operands, rows_b):
    from sonic.kernels.grouped_gemm.args import Operands, Sizes
    return (*Operands(**operands).addresses(), *Sizes(rows_a=7, rows_b=rows_b, num_experts=4,
                                                      num_ctas=132))


def test_tma_output_ranges_follow_the_configuration():
    """The outputs a launch writes by TMA, as the initcheck run fills them: C of the deferred
    store, dH and A' of the dSwiGLU epilogue (dH left out where it is written over H), the
    whole ``(E, M, N)`` C of varlen-K staged in the ring stage, nothing for ping-pong, varlen-K
    stored by threads, FP8 or the SwiGLU up-proj."""
    from sonic.kernels.grouped_gemm.config import GroupedGemmConfig
    stress = _stress()
    base = dict(dim_m=0, dim_n=256, dim_k=512, tile_n=256, cluster=1)
    store = GroupedGemmConfig(varlen_k=False, pingpong=False, gather_a=False, **base)
    assert store.tma_stored == ("c",)
    args = _launch_args(dict(a=0x1000, b=0x2000, c=0x3000, offsets=0x4000), rows_b=100)
    assert stress.tma_output_ranges(store, args) == [(0x3000, 100 * 256 * 2)]
    dswiglu = GroupedGemmConfig(varlen_k=False, pingpong=False, epilogue="dswiglu",
                                gather_a=True, b_n_major=True, **base)
    assert dswiglu.tma_stored == ("c", "act")
    ops = dict(a=0x1000, b=0x2000, c=0x3000, act=0x5000, h=0x6000, scores=0x7000, ds=0x8000,
               gather_a=0x9000, offsets=0x4000)
    assert stress.tma_output_ranges(dswiglu, _launch_args(ops, rows_b=64)) == [
        (0x3000, 64 * 512 * 2), (0x5000, 64 * 256 * 2)]
    ops["c"] = ops["h"]                                  # dH over H
    assert stress.tma_output_ranges(dswiglu, _launch_args(ops, rows_b=64)) == [
        (0x5000, 64 * 256 * 2)]
    in_stage = GroupedGemmConfig(varlen_k=True, pingpong=False, gather_a=False, gather_b=True,
                                 store_in_stage=True, **dict(base, dim_m=192, dim_k=0))
    assert in_stage.tma_stored == ("c",)
    ops = dict(a=0x1000, b=0x2000, c=0x3000, gather_b=0x9000, offsets=0x4000)
    assert stress.tma_output_ranges(in_stage, _launch_args(ops, rows_b=100)) == [
        (0x3000, 4 * 192 * 256 * 2)]
    for cfg in (GroupedGemmConfig(varlen_k=False, pingpong=True, gather_a=False,
                                  **dict(base, tile_n=128)),
                GroupedGemmConfig(varlen_k=True, pingpong=False, gather_a=True, **base),
                GroupedGemmConfig(varlen_k=False, pingpong=False, epilogue="swiglu",
                                  gate_up="concat", gather_a=True, **base),
                GroupedGemmConfig(varlen_k=False, pingpong=False, gather_a=False,
                                  ab_dtype="e4m3", **dict(base, tile_n=128))):
        assert cfg.tma_stored == (), cfg


def test_initcheck_runs_leave_out_the_layer_case_and_say_so(tmp_path, capsys):
    """Under ``--initcheck`` the ``sonic.MoE`` layer case (its router GEMM is cuBLAS's, stored by
    TMA) is left out of the run, and the driver's table marks it n/a rather than unreached."""
    stress = _stress()
    cases = stress.sanitize_cases("MoE layer|^T=1 ")
    assert [c.layer for c in cases] == [False, True]
    assert stress.initcheck_cases(cases) == cases[:1]
    assert stress.main(["--sanitize", "--initcheck", "--device", "cpu",
                        "--cases", "MoE layer|^T=1 "]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 cases, 0 failures"
    stress.main(["--compute-sanitizer", "--sanitizer", str(_fake_sanitizer(tmp_path)), "--tools",
                 "memcheck,initcheck", "--cases", "MoE layer|^T=1 ", "--seconds", "300"])
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "MoE layer" in ln)
    assert row.split()[-2:] == ["0", "n/a"]


def test_tma_store_control_needs_a_gpu_and_initcheck_a_sanitize_run():
    stress = _stress()
    with pytest.raises(SystemExit):
        stress.main(["--tma-store-control", "--device", "cpu"])
    with pytest.raises(SystemExit):
        stress.main(["--random", "3", "--initcheck", "--device", "cpu"])
