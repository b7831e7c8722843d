"""The layer benchmark's command line and plot, on the CPU (the timing itself needs a GPU)."""

import importlib.util
import json

import pytest
import torch

import sonic
from sonic.baselines.configs import CONFIGS, PAPER_CONFIGS
from _benchmarks import load_benchmark


def _bench_moe():
    return load_benchmark("bench_moe")


def test_named_shapes_are_the_published_layers():
    assert CONFIGS["DeepSeek-V3"] == (16384, 7168, 2048, 256, 8)
    assert CONFIGS["Mixtral-8x7B"] == (16384, 4096, 14336, 8, 2)
    assert set(PAPER_CONFIGS) <= set(CONFIGS)
    for T, d, n, E, K in CONFIGS.values():
        assert K <= E and min(T, d, n) > 0


def test_plot_draws_every_config_and_sonicmoe_through_its_own_ratio(tmp_path):
    pytest.importorskip("matplotlib")
    bench = _bench_moe()
    results = [{"config": name, "device": "test GPU",
                "sonic": {"fwd_bwd_TFLOPS": 500.0 + i},
                "torch_gmm": {"fwd_bwd_TFLOPS": 300.0}} for i, name in enumerate(CONFIGS)]
    # SonicMoE twice as fast as its own torch-gmm at 7B: drawn at 600 TFLOPS; absent
    # elsewhere (a zero-height bar), without failing.
    anchor = {("7B", "sonicmoe"): {"fwdbwd_ms": 1.0}, ("7B", "torch-gmm"): {"fwdbwd_ms": 2.0}}
    path = tmp_path / "sweep.png"
    bench.plot_results(results, anchor, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_names_each_gemm_launch_by_its_start():
    bench = _bench_moe()
    launches = [(30.0, 3.0), (10.0, 1.0), (60.0, 6.0), (20.0, 2.0), (50.0, 5.0), (40.0, 4.0)]
    assert bench.label_gemm_launches(launches) == list(zip(bench.STEP_GEMMS, range(1, 7)))
    # Any other count (shared experts, FP8 extras) is numbered, never mislabelled.
    assert bench.label_gemm_launches([(2.0, 7.0), (1.0, 8.0)]) == [("GEMM 1", 8.0),
                                                                  ("GEMM 2", 7.0)]


@pytest.mark.parametrize("renormalize", [False, True])
def test_bench_moe_deepseek_layers_equal_sonic_moe(renormalize):
    """bench_moe.py's layers with DeepSeek-V3's router options and a shared expert (sonic's and
    torch-gmm's) compute what sonic.MoE with the same options computes."""
    bench = _bench_moe()
    T, d, n, E, K = 64, 32, 16, 16, 4
    torch.manual_seed(0)
    layer = sonic.MoE(d, n, E, K, score="sigmoid", renormalize=renormalize,
                      routed_scaling_factor=2.5, n_group=4, topk_group=2, expert_bias=True,
                      num_shared_experts=1, backend="torch")
    bias = 0.05 * torch.randn(E)
    layer.expert_bias.copy_(bias)
    x = torch.randn(T, d)
    expect = layer(x)
    scoring = dict(score="sigmoid", renormalize=renormalize, n_group=4, topk_group=2,
                   scaling_factor=2.5, expert_bias=bias)
    shared = (layer.shared_w1, layer.shared_w2)
    args = (x, layer.gate.weight, layer.w1, layer.w2, K)
    for fn in (bench._sonic_layer("topk", 8, scoring=scoring, shared=shared),
               bench._torch_gmm_layer(scoring, shared)):
        torch.testing.assert_close(fn(*args), expect, rtol=1e-5, atol=1e-6)
    # Without the bias the selection differs, so the comparison above can fail.
    unbiased = dict(scoring, expert_bias=torch.zeros(E))
    assert not torch.allclose(bench._torch_gmm_layer(unbiased, shared)(*args), expect)
    assert bench._torch_gmm_layer(None, None) is bench.torch_gmm_moe
    assert bench._describe(scoring, shared) == dict(
        score="sigmoid", renormalize=renormalize, n_group=4, topk_group=2, scaling_factor=2.5,
        expert_bias=True, shared_expert_cols=n)


def test_sonicmoe_rows_are_what_bench_moe_compares_with(tmp_path, capsys):
    """bench_sonicmoe.py's JSON lines, mixed with its other output, are the anchor that
    bench_moe.py --vs-sonicmoe reads and sets beside sonic's ratios."""
    import json

    anchor_bench, bench = load_benchmark("bench_sonicmoe"), _bench_moe()
    sizes = CONFIGS["30B"]
    rows = [anchor_bench.json_row("30B", sizes, "torch-gmm", 56000.0, 56000.0, 8000.0, 12000.0),
            anchor_bench.json_row("30B", sizes, "sonicmoe", 12000.0, 35000.0, 1000.0, 6000.0)]
    path = tmp_path / "sonicmoe.jsonl"
    path.write_text("device: test GPU\n" + "".join(json.dumps(r) + "\n" for r in rows))
    anchor = bench.read_sonicmoe(str(path))
    assert anchor[("30B", "sonicmoe")]["fwdbwd_ms"] == 35.0
    assert anchor[("30B", "torch-gmm")]["fwd_ms"] == 56.0
    sonic_row = {"config": "30B", "fwd_bwd_speedup": 1.75, "fwd_speedup": 5.0,
                 "sonic": {"fwd_bwd_us": 32000.0, "peak_MiB": 4600.0, "saved_MiB": 1000.0}}
    bench.compare_with_sonicmoe([sonic_row], anchor, str(path))
    line = next(s for s in capsys.readouterr().out.splitlines() if s.strip().startswith("30B"))
    # sonic 1.75x its torch-gmm, SonicMoE 56 / 35 = 1.6x its own: 1.094 relative.
    assert "1.750x" in line and "1.600x" in line and "1.094" in line


def test_results_of_an_earlier_run_beside_sonicmoe(tmp_path, capsys):
    """--results sets a saved --json run beside bench_sonicmoe.py's lines without measuring
    (the two programs ran at the same time), and refuses what it would ignore."""
    import json

    anchor_bench, bench = load_benchmark("bench_sonicmoe"), _bench_moe()
    sizes = CONFIGS["DeepSeek-V3"]
    lines = [anchor_bench.json_row("DeepSeek-V3", sizes, "torch-gmm", 33000.0, 88000.0, 1.0, 2.0),
             anchor_bench.json_row("DeepSeek-V3", sizes, "sonicmoe", 23000.0, 67000.0, 1.0, 2.0)]
    smoe = tmp_path / "sonicmoe.jsonl"
    smoe.write_text("".join(json.dumps(r) + "\n" for r in lines))
    # sonic at 1.32x its torch-gmm, SonicMoE at 88 / 67 = 1.313x its own; 7B not in SonicMoE's.
    results = [{"config": name, "device": "test GPU", "fwd_bwd_speedup": speedup,
                "fwd_speedup": 1.5,
                "sonic": {"fwd_bwd_us": 66000.0, "peak_MiB": 9.0, "saved_MiB": 1.0,
                          "fwd_bwd_TFLOPS": 500.0},
                "torch_gmm": {"fwd_bwd_TFLOPS": 380.0}}
               for name, speedup in (("DeepSeek-V3", 1.32), ("7B", 3.0))]
    saved = tmp_path / "sonic.json"
    saved.write_text(json.dumps(results))
    png = tmp_path / "sweep.png"
    argv = ["--results", str(saved), "--vs-sonicmoe", str(smoe)]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(png)]
    bench.main(argv)
    out = capsys.readouterr().out.splitlines()
    line = next(s for s in out if s.strip().startswith("DeepSeek-V3"))
    assert "1.320x" in line and "1.313x" in line and "1.005" in line
    assert any(s.strip().startswith("7B") and "not measured" in s for s in out)
    if "--plot" in argv:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        bench.main(["--results", str(saved), "--vs-sonicmoe", str(smoe), "--config", "7B"])
    with pytest.raises(SystemExit):
        bench.main(["--results", str(saved), "--vs-sonicmoe", str(smoe), "--precision", "fp8"])
    assert "leave out --precision" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--results", str(saved)])
    (tmp_path / "bad.json").write_text(json.dumps([{"config": "7B"}]))
    with pytest.raises(ValueError, match="bench_moe.py --json"):
        bench.main(["--results", str(tmp_path / "bad.json"), "--vs-sonicmoe", str(smoe)])
    (tmp_path / "sonicmoe.jsonl.txt").write_text("not json")
    with pytest.raises(ValueError, match="--results .*: not JSON"):
        bench.main(["--results", str(tmp_path / "sonicmoe.jsonl.txt"), "--plot", str(png)])


def test_sonicmoe_bench_says_what_is_missing():
    bench = load_benchmark("bench_sonicmoe")
    if importlib.util.find_spec("sonicmoe") or importlib.util.find_spec("quack"):
        pytest.skip("SonicMoE is installed here")
    for mode in ([], ["--gemm", "dW1"]):
        with pytest.raises(SystemExit, match="needs SonicMoE importable as 'sonicmoe'"):
            bench.main(["--config", "7B", *mode])


def test_sonicmoe_bench_power_needs_gemm(capsys):
    bench = load_benchmark("bench_sonicmoe")
    for argv in (["--power", "1"], ["--gemm", "dX", "--power", "-1"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2
        assert "--power takes a non-negative number of seconds, with --gemm" in \
            capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--gemm", "dW1", "--profile"])
    assert "--profile profiles the layer's step" in capsys.readouterr().err


def test_time_row_runs_each_pass_and_leaves_no_gradient(monkeypatch):
    """bench_moe.time_row (every row of bench_moe.py and bench_sonicmoe.py) on the CPU, its
    GPU timers replaced by counters: forward and step timed, a second of steps sampled, the
    saved bytes of the layer's forward, no gradient left on the inputs."""
    bench = _bench_moe()
    calls = []

    def timed(fn, grad_to_none=None):
        for t in grad_to_none:
            t.grad = None
        fn()
        calls.append("bench")
        return 1000.0 * calls.count("bench")

    def energy(fn, grad_to_none=None):
        calls.append("energy")
        return {"sm_mhz": 1500.0, "watts": 700.0, "J_per_call": 1.0, "throttle": 4}

    def peak(fn, grad):
        calls.append("peak")
        return 7.0

    monkeypatch.setattr(bench, "bench", timed)
    monkeypatch.setattr(bench, "energy_per_call", energy)
    monkeypatch.setattr(bench, "_peak_mib", peak)
    T, d, n, E, K = 32, 16, 8, 4, 2
    torch.manual_seed(0)
    x = torch.randn(T, d, requires_grad=True)
    params = tuple(t.requires_grad_() for t in (torch.randn(E, d), torch.randn(E, 2 * n, d),
                                                 torch.randn(E, d, n)))
    grad = torch.randn(T, d)
    row, step = bench.time_row("torch-gmm", bench.torch_gmm_moe, x, params, K, grad,
                               (x, *params))
    assert calls == ["bench", "bench", "energy", "peak"]
    assert (row["fwd_us"], row["fwd_bwd_us"], row["peak_MiB"]) == (1000.0, 2000.0, 7.0)
    assert row["saved_MiB"] > 0 and row["J_per_step"] == 1.0 and row["throttle"] == 4
    assert all(t.grad is None for t in (x, *params))
    step()
    assert x.grad is not None and x.grad.shape == x.shape


def test_kernel_time_is_per_call(monkeypatch):
    """The profile records PROFILE_CALLS calls; the routing phase's kernel time is one call's."""
    from types import SimpleNamespace

    bench = _bench_moe()
    cuda = SimpleNamespace(name="CUDA")
    # Two kernels per call, 10 + 20 µs each call.
    events = [SimpleNamespace(device_type=cuda, self_device_time_total=10.0 * bench.PROFILE_CALLS),
              SimpleNamespace(device_type=cuda, self_device_time_total=20.0 * bench.PROFILE_CALLS),
              SimpleNamespace(device_type=SimpleNamespace(name="CPU"), self_device_time_total=99.0)]
    monkeypatch.setattr(bench, "_profiled", lambda fn, grad_to_none=(): SimpleNamespace(
        key_averages=lambda: events))
    assert bench._kernel_us(lambda: None) == 30.0


def test_sweep_adds_every_named_shape_after_the_given_ones():
    bench = _bench_moe()
    given = [("7B", CONFIGS["7B"]), ("64,32,16,8,2", (64, 32, 16, 8, 2))]
    swept = bench.chosen_configs(given, sweep=True)
    assert swept[:2] == given and [name for name, _ in swept[2:]] == [
        name for name in CONFIGS if name != "7B"]
    assert bench.chosen_configs(given, sweep=False) == given
    assert bench.chosen_configs(None, sweep=False) == [(n, CONFIGS[n]) for n in PAPER_CONFIGS]


def test_routing_in_step_compares_with_the_same_layer_routed_beforehand(monkeypatch):
    """The layer given its routing beforehand computes what the routing layer computes, and
    the in-step cost is the difference of the two sides' median timings over the rounds."""
    bench = _bench_moe()
    T, d, n, E, K = 64, 32, 16, 8, 2
    torch.manual_seed(0)
    x, gate = torch.randn(T, d), torch.randn(E, d)
    w1, w2 = torch.randn(E, 2 * n, d) / d ** 0.5, torch.randn(E, d, n) / n ** 0.5
    for router in ("topk", "token_rounding"):
        routing = bench._route(router, 16, x @ gate.t(), K)
        before = bench._sonic_layer(router, 16,
                                    routed=(routing, sonic.routing_metadata(routing)))
        torch.testing.assert_close(before(x, gate, w1, w2, K),
                                   bench._sonic_layer(router, 16)(x, gate, w1, w2, K))
    times = iter([1000.0, 900.0, 1010.0, 2000.0, 990.0, 910.0, 1000.0, 905.0, 1005.0, 902.0])
    monkeypatch.setattr(bench, "bench", lambda fn, grad_to_none=None: next(times))
    out = bench._routing_in_step("topk", "sonic-topK", lambda: None, lambda: None, ())
    # alternated, with first: medians 1000 us with the routing, 905 us without (2000 us dropped)
    assert out == {"routing_in_step_us_topk": 95.0, "routing_in_step_share_topk": 0.095}


def test_routing_in_graph_times_both_captured_steps_alternately(monkeypatch):
    """``--routing-in-graph``: each step is captured once with the gradients dropped before
    it, the two replays are timed alternately, and the cost is the difference of medians."""
    bench = _bench_moe()
    leaf = torch.zeros(2, requires_grad=True)
    calls = []

    def step(name):
        def run():
            calls.append((name, leaf.grad))
            leaf.grad = torch.ones(2)
        return run

    def captured(fn):
        fn()                                       # what a capture records
        return fn

    monkeypatch.setattr(bench, "captured", captured)
    times = iter([3000.0, 2800.0, 3010.0, 2790.0, 2990.0, 2810.0, 5000.0, 2800.0, 3000.0,
                  2805.0])
    monkeypatch.setattr(bench, "bench", lambda fn: (fn(), next(times))[1])
    leaf.grad = torch.ones(2)
    out = bench._routing_in_graph("token_rounding", "sonic-TR", step("with"), step("without"),
                                  (leaf,))
    assert out == {"routing_in_graph_us_token_rounding": 200.0,
                   "routing_in_graph_share_token_rounding": 200.0 / 3000.0}
    assert [name for name, _ in calls] == ["with", "without"] + ["with", "without"] * 5
    assert all(grad is None for _, grad in calls)


def test_bench_compile_routes_by_token_rounding_and_refuses_cuda_graphs_off_cuda(capsys):
    """``bench_compile.py --router token_rounding`` times a token-rounding layer (eager and
    compiled on the CPU); ``--modes cuda-graph`` needs a CUDA device and says so."""
    bench = load_benchmark("bench_compile")
    results = bench.measure((32, 16, 8, 4, 2), device="cpu", dtype=torch.float32,
                            modes=["default"], steps=1, router="token_rounding")
    assert set(results) == {"eager", "default"}
    assert all(r["step_ms"] > 0 for r in results.values())
    with pytest.raises(ValueError, match="cuda-graph"):
        bench.measure((32, 16, 8, 4, 2), device="cpu", dtype=torch.float32,
                      modes=["cuda-graph"], steps=1)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--modes", "cuda-graph"])
    assert "--modes cuda-graph needs --device cuda" in capsys.readouterr().err


def test_forced_transpose_gives_pre_gathered_weight_gradients_the_gathered_plan():
    """``bench_grouped_gemm.forced_transpose``: inside it an ungathered varlen-K GEMM is
    stored transposed exactly where the same GEMM gathering the named operand would be, calls
    with a gathered operand are unchanged, and the heuristic is restored after."""
    from sonic.kernels.grouped_gemm import heuristic

    bench = load_benchmark("bench_grouped_gemm")
    original = heuristic.transpose_varlen_k
    shapes = ((4096, 7168), (512, 1024), (7168, 2048), (2048, 4096))
    for gathers in ((False, True), (True, False)):
        want = {s: original(*gathers, "sm_90a", *s) for s in shapes}
        plain = {s: original(False, False, "sm_90a", *s) for s in shapes}
        with bench.forced_transpose(*gathers):
            for s in shapes:
                assert heuristic.transpose_varlen_k(False, False, "sm_90a", *s) == want[s]
                assert heuristic.transpose_varlen_k(*gathers, "sm_90a", *s) == want[s]
        assert heuristic.transpose_varlen_k is original
        assert not any(plain.values())
    # The DeepSeek-V3 weight gradient the control row exists for is stored transposed.
    assert original(False, True, "sm_90a", 4096, 7168)


@pytest.mark.parametrize("routing", ["topk", "balanced"])
def test_grouped_gemm_routing_sorts_every_slot_by_expert(monkeypatch, routing):
    """``bench_grouped_gemm._routing``: each token appears K times with K distinct experts,
    rows sorted by expert; "balanced" gives every expert T·K/E rows (here whole 64-row
    k-tiles), while "topk" leaves the counts ragged."""
    bench = load_benchmark("bench_grouped_gemm")
    monkeypatch.setattr(bench, "ROUTING", routing)
    t, e, k = 2048, 64, 2
    gather_idx, offsets = bench._routing(t, e, k, device="cpu")
    counts = offsets.diff()
    assert offsets[0] == 0 and offsets[-1] == t * k
    assert torch.equal(torch.bincount(gather_idx.long(), minlength=t), torch.full((t,), k))
    for ex in range(e):
        tokens = gather_idx[offsets[ex]:offsets[ex + 1]]
        assert tokens.unique().numel() == tokens.numel()
    if routing == "balanced":
        assert torch.equal(counts, torch.full((e,), t * k // e, dtype=counts.dtype))
    else:
        assert (counts % 64 != 0).any()


def test_grouped_gemm_refuses_options_it_would_ignore(capsys):
    """``bench_grouped_gemm.py --fp8 --gemm`` filters the FP8 rows; a GEMM with no FP8 row
    (the unfused ``up+act*`` and ``dA'+dH*``) is refused by name rather than timing nothing,
    and so are two modes at once and ``--ceiling`` where it has no rows."""
    bench = load_benchmark("bench_grouped_gemm")
    for gemm in ("dA'+dH*", "up+act*"):
        with pytest.raises(SystemExit):
            bench.main(["--fp8", "--gemm", "dW1", "--gemm", gemm])
        assert f"--gemm {gemm} has no FP8 row" in capsys.readouterr().err
    # Modes that would ignore one another.
    for argv, message in ((["--plans", "--share", "both"], "not allowed with"),
                          (["--share", "both", "--fp8"], "not allowed with"),
                          (["--plans", "--fp8", "--gemm", "up+act"],
                           "--gemm up+act has no FP8 plan row"),
                          (["--plans", "--ceiling"], "--ceiling has no rows under --plans")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err
    # Every FP8 row's work has a dense ceiling shape.
    assert set(bench.FP8_GEMMS) < set(bench.GEMMS)
    assert set(bench.FP8_GEMMS.values()) == {"up", "down", "dA'", "dX"}


def test_gemm_rows_go_to_json_and_results_set_the_programs_side_by_side(tmp_path, monkeypatch,
                                                                        capsys):
    """``_row`` with ``--json`` appends the row it prints (time, error, power columns) as a
    JSON line, under the implementation bench_sonicmoe.py sets; ``--results`` groups the
    lines of several files by shape and GEMM and prints each program's runs, their mean,
    clock range, megacycles and energy, and SonicMoE's mean time over sonic's. On the CPU,
    the GPU timer and power sampler replaced by fixed numbers."""
    bench = load_benchmark("bench_grouped_gemm")
    path = tmp_path / "rows.jsonl"
    times = iter([10000.0, 15000.0, 12000.0, 15000.0, 12100.0, 15000.0])  # kernel, torch
    power = iter([(1600, 30.0), (1500, 31.0), (1400, 33.0)])
    monkeypatch.setattr(bench, "bench", lambda fn: next(times))
    monkeypatch.setattr(bench, "device_name", lambda: "test GPU")
    monkeypatch.setattr(bench, "POWER_SECONDS", 1.0)

    def fake_power(fn):
        mhz, mj = next(power)
        return f" | {mhz} MHz", {"sm_mhz": mhz, "watts": 700.0, "mj": mj}

    monkeypatch.setattr(bench, "_power", fake_power)
    monkeypatch.setattr(bench, "JSON_PATH", str(path))
    ref = torch.randn(8, 4)
    for impl in ("sonic", "sonic", "sonicmoe"):
        monkeypatch.setattr(bench, "KERNEL_IMPL", impl)
        timing = bench._row("DeepSeek-V3", "dW1", 1e9, lambda: ref, lambda: ref)
    assert timing == bench.Timing(12100.0, 33.0)
    capsys.readouterr()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["impl"], r["kernel_us"], r["torch_us"], r["rel_err"], r["sm_mhz"], r["mj"])
            for r in rows] == [("sonic", 10000.0, 15000.0, 0.0, 1600, 30.0),
                               ("sonic", 12000.0, 15000.0, 0.0, 1500, 31.0),
                               ("sonicmoe", 12100.0, 15000.0, 0.0, 1400, 33.0)]
    # A second file, without power columns: that program's line leaves them out.
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"shape": "7B", "gemm": "up+act", "impl": "sonic",
                                 "kernel_us": 500.0}) + "\n")
    bench.main(["--results", str(path), str(other)])
    out = capsys.readouterr().out.splitlines()
    sonic_line = next(line for line in out if "dW1" in line and " sonic " in line)
    # Mean 11000 µs; megacycles (10000·1600 + 12000·1500) / 2 / 1e6 = 17.0; mJ (30 + 31) / 2.
    assert "10000 / 12000" in sonic_line and " 11000 |" in sonic_line
    assert "1500-1600 MHz 17.0 Mcycles 30 mJ" in sonic_line
    assert any("DeepSeek-V3 dW1      SonicMoE / sonic time: 1.100x" in line for line in out)
    seven_b = next(line for line in out if line.startswith("7B"))
    assert seven_b.rstrip().endswith("500 |")
    assert not any("7B" in line and "SonicMoE / sonic" in line for line in out)


def test_json_and_results_refuse_the_modes_they_would_ignore(tmp_path, capsys):
    bench = load_benchmark("bench_grouped_gemm")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    not_json = tmp_path / "layer.json"
    not_json.write_text("[{\"config\": \"7B\",\n  \"sonic\": {}}]\n")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"config": "7B", "impl": "sonic"}\n')
    for argv, message in ((["--results", str(empty), "--power", "1"],
                           "--results measures nothing"),
                          (["--results", str(empty), "--config", "7B", "--gemm", "dW1"],
                           "leave out --config, --gemm"),
                          (["--json", "x.jsonl", "--plans"], "--json records the rows of"),
                          (["--results", str(empty)], "holds no GEMM row"),
                          (["--results", str(not_json)], f"{not_json} is not JSON lines"),
                          (["--results", str(wrong)], f"{wrong} holds a line without")):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert message in str(exc.value) + capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_benchmark("bench_sonicmoe").main(["--json", "x.jsonl"])
    assert "--json writes --gemm rows" in capsys.readouterr().err


@pytest.mark.parametrize("only,rows", [
    (("dW1", "up+act"), ["up+act", "up+act/fp8", "dW1", "dW1/fp8", "ceiling up"]),
    (("down",), ["down", "down/fp8", "down/torch-fp8", "ceiling down"]),
    (("dA'+dH", "dX"), ["dA'+dH", "dA'+dH/fp8", "dX", "dX/fp8", "dX/torch-fp8", "ceiling dA'",
                        "ceiling dX"]),
    (("dA'",), ["dA'", "dA'/fp8", "dA'/torch-fp8", "ceiling dA'"]),
    (("dA'", "dA'+dH"), ["dA'", "dA'/fp8", "dA'/torch-fp8", "dA'+dH", "dA'+dH/fp8",
                         "ceiling dA'"]),
])
def test_grouped_gemm_fp8_rows_time_only_the_picked_gemms(monkeypatch, only, rows):
    """``fp8_rows`` with ``only``: the rows (and dense ceiling shapes) of those GEMMs alone,
    in order; here on the CPU with the timing and the kernels stubbed out."""
    bench = load_benchmark("bench_grouped_gemm")
    randn, rand = torch.randn, torch.rand
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: randn(*a, **k))
    monkeypatch.setattr(torch, "rand", lambda *a, device=None, **k: rand(*a, **k))
    monkeypatch.setattr(bench, "_routing", lambda t, e, k: (
        torch.arange(t * k, dtype=torch.int32) % t,
        torch.linspace(0, t * k, e + 1).to(torch.int32)))
    timed = []
    monkeypatch.setattr(bench, "_row", lambda name, gemm, *args: timed.append(gemm))
    monkeypatch.setattr(bench, "_torch_fp8_row",
                        lambda name, gemm, *args, **kw: timed.append(gemm + "/torch-fp8"))
    monkeypatch.setattr(bench, "_fp8_dense_ceiling",
                        lambda name, gemm, *args: timed.append("ceiling " + gemm))
    monkeypatch.setattr(bench, "quantize_rows", lambda a: (a, a))
    monkeypatch.setattr(bench, "quantize_blocks", lambda w: (w, w))
    monkeypatch.setattr(bench, "quantize_cols_grouped", lambda *args: (None, None))
    bench.fp8_rows("test", 16, 8, 4, 2, 2, ceiling=True, only=only)
    assert timed == rows


def test_torch_fp8_gathered_rows_time_the_same_work_with_the_gather(monkeypatch):
    """Beside a gathered GEMM, ``/torch-fp8`` runs PyTorch's FP8 grouped GEMM on rows gathered
    beforehand and ``/torch-fp8+gather`` gathers the same e4m3 rows and scales in the timed
    call; a contiguous GEMM gets the first row only. On the CPU, the GEMM stubbed."""
    bench = load_benchmark("bench_grouped_gemm")
    calls = {}
    monkeypatch.setattr(torch, "_scaled_grouped_mm",
                        lambda a, b, sa, sb, offs, out_dtype: (a.float(), sa), raising=False)
    monkeypatch.setattr(bench, "_ceiling_row",
                        lambda shape, gemm, flops, fn: calls.setdefault(gemm, fn()))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    src, w = torch.randn(5, 8), torch.randn(2, 4, 8)
    idx, ends = torch.tensor([4, 0, 0, 3, 1, 2], dtype=torch.int32), torch.tensor([2, 6])
    bench._torch_fp8_row("s", "up", 1.0, src, w, ends, gather_idx=idx)
    assert set(calls) == {"up/torch-fp8", "up/torch-fp8+gather"}
    (pre_a, pre_s), (in_a, in_s) = calls["up/torch-fp8"], calls["up/torch-fp8+gather"]
    assert pre_a.shape == (6, 8) and torch.equal(pre_a, in_a) and torch.equal(pre_s, in_s)
    # Row i of the gathered operand is source row idx[i], its scale that row's amax / 448.
    assert torch.allclose(in_s, src.abs().amax(dim=1)[idx.long()] / 448.0)
    calls.clear()
    bench._torch_fp8_row("s", "dX", 1.0, src, w, ends)
    assert set(calls) == {"dX/torch-fp8"} and calls["dX/torch-fp8"][0].shape == (5, 8)


def _stub_plan_rows(monkeypatch, bench, kernel):
    """``plan_rows`` on the CPU: routing, torch's GEMM, the timing and the error stubbed;
    every FP8 GEMM runs ``kernel()``."""
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: randn(*a, **k))
    monkeypatch.setattr(bench, "_routing", lambda t, e, k: (
        torch.arange(t * k, dtype=torch.int32) % t,
        torch.linspace(0, t * k, e + 1).to(torch.int32)))
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: torch.zeros(1), raising=False)
    monkeypatch.setattr(bench, "bench", lambda fn: 1.0)
    monkeypatch.setattr(bench, "_rel_err", lambda out, ref: 0.0)
    monkeypatch.setattr(bench, "_fp8_plan_kernels", lambda *args: {
        gemm: kernel for gemm in bench.FP8_PLAN_GEMMS})


@pytest.mark.parametrize("fp8,only,rows", [
    (True, {"up", "dX", "dW2"}, ["up/fp8", "dX/fp8", "dW2/fp8"]),
    (True, {"dA'", "down"}, ["dA'/fp8", "down/fp8"]),
    (False, {"up", "down", "dW1"}, ["down", "dW1"]),
])
def test_grouped_gemm_plan_rows_force_every_candidate(monkeypatch, capsys, fp8, only, rows):
    """``plan_rows`` times each picked GEMM of its mode once per candidate plan per round, with
    ``heuristic.plan`` answering that candidate for the GEMMs of the operand type timed (FP8
    varlen-M ones gathered or not) and the plan itself for the rest; on the CPU, with the
    kernels and torch's GEMM stubbed out."""
    bench = load_benchmark("bench_grouped_gemm")
    plans = []
    heuristic = bench.heuristic

    def kernel(varlen_k, gathered):
        def call():
            dtype = "e4m3" if fp8 else "bf16"
            plans.append((varlen_k, heuristic.plan(varlen_k, 256, gathered, 256, dim_m=256,
                                                   ab_dtype=dtype)))
        return call

    _stub_plan_rows(monkeypatch, bench, None)
    monkeypatch.setattr(bench, "_fp8_plan_kernels", lambda *args: {
        "up": kernel(False, True), "dA'": kernel(False, True), "down": kernel(False, False),
        "dX": kernel(False, False),
        "dW1": kernel(True, False), "dW2": kernel(True, False)})
    monkeypatch.setattr(bench, "grouped_gemm", lambda *a, **k: kernel(False, False)())
    monkeypatch.setattr(bench, "grouped_gemm_varlen_k", lambda *a, **k: kernel(True, False)())
    bench.plan_rows("test", 16, 8, 4, 2, 2, only, rounds=1, fp8=fp8)
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    candidates = bench.FP8_PLAN_CANDIDATES if fp8 else bench.PLAN_CANDIDATES
    expected = [gemm for varlen_k in (False, True) for _ in candidates[varlen_k]
                for gemm in rows if (gemm.split("/")[0] in ("dW1", "dW2")) == varlen_k]
    assert printed == expected
    # Each row's one call (the error check; the timing stub calls nothing) ran under its
    # candidate, the plan itself where the candidate is None.
    forced = [choice for varlen_k in (False, True) for choice in candidates[varlen_k]
              for gemm in rows if (gemm.split("/")[0] in ("dW1", "dW2")) == varlen_k]
    assert len(plans) == len(forced)
    for (varlen_k, got), choice in zip(plans, forced):
        if choice is not None:
            want = choice if not varlen_k or -(-256 // choice.tile_m) % choice.cluster == 0 \
                else choice._replace(cluster=1)
            assert got == want


def test_grouped_gemm_plan_rows_report_a_rejected_candidate(monkeypatch, capsys):
    """A candidate plan the configuration rejects at the shape (``ValueError``) gets a row
    saying so and the sweep goes on; the plan's own error is raised."""
    bench = load_benchmark("bench_grouped_gemm")

    def kernel():
        if bench.heuristic.plan(False, 256, ab_dtype="e4m3").tile_n == 128:
            raise ValueError("FP8 128-wide tiles rejected here\nsecond line")
    _stub_plan_rows(monkeypatch, bench, kernel)
    bench.plan_rows("test", 16, 8, 4, 2, 2, {"down"}, rounds=1, fp8=True)
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == len(bench.FP8_PLAN_CANDIDATES[False])
    rejected = [row for row in rows if "not a valid plan here" in row]
    assert len(rejected) == 2 and all(row.endswith("rejected here") for row in rejected)

    def failing():
        raise ValueError("the plan itself fails")
    _stub_plan_rows(monkeypatch, bench, failing)
    with pytest.raises(ValueError, match="the plan itself fails"):
        bench.plan_rows("test", 16, 8, 4, 2, 2, {"down"}, rounds=1, fp8=True)


@pytest.mark.parametrize("argv,message", [
    (["--tile", "64"], "--tile sets the token-rounding tile"),
    (["--fp8-weight-grads", "fp8"], "--fp8-weight-grads chooses among the FP8 rows"),
    (["--precision", "bf16", "--fp8-epilogues", "store"],
     "--fp8-epilogues chooses among the FP8 rows"),
])
def test_bench_moe_refuses_options_for_rows_it_would_not_have(capsys, argv, message):
    """A token-rounding tile without token rounding, or FP8 choices without FP8 rows, would
    change nothing: ``bench_moe.py`` says so instead of running without them."""
    with pytest.raises(SystemExit):
        _bench_moe().main(argv)
    assert message in capsys.readouterr().err


def test_bench_swiglu_times_the_named_layers_rows():
    """``bench_swiglu.py --config``: P = T·K rows of n columns of each layer; the paper's
    shapes without it."""
    from sonic.baselines.configs import parse_config

    bench = load_benchmark("bench_swiglu")
    got = bench.shapes_of([parse_config("Mixtral-8x7B"), parse_config("100,256,384,4,2")])
    assert got == [("Mixtral-8x7B", 16384, 2, 14336), ("100,256,384,4,2", 100, 2, 384)]
    assert bench.shapes_of(None) == bench.SHAPES


def _quack_stand_in():
    """QuACK's ``gemm``, ``gemm_gated`` and ``gemm_dgated`` as its reference functions define
    them (fp32 math): varlen-M ``out[rows of e] = A[A_idx[rows]]·B[e]``, varlen-K ``out[e] =
    A[:, A_idx[rows of e]]·B[rows of e]``, gated on interleaved gate/up columns, with the
    dgated row scale SonicMoE passes (dH from ``s·dout``, A' = ``s·A``)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    def mm(A, B, out, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None):
        ends = cu_seqlens_m if cu_seqlens_m is not None else cu_seqlens_k
        for i in range(ends.numel() - 1):
            rows = slice(ends[i].item(), ends[i + 1].item())
            idx = A_idx[rows].long() if A_idx is not None else None
            if cu_seqlens_m is not None:
                a = A[idx] if idx is not None else A[rows]
                out[rows] = (a.float() @ B[i].float()).to(out.dtype)
            else:
                a = A[:, idx] if idx is not None else A[:, rows]
                out[i] = (a.float() @ B[rows].float()).to(out.dtype)

    def gemm(A, B, out, batch_idx_permute=None, dynamic_scheduler=False, **varlen):
        mm(A, B, out, **varlen)

    def gemm_gated(A, B, activation, cu_seqlens_m, A_idx, preact_out, postact_out,
                   store_preact):
        mm(A, B, preact_out, cu_seqlens_m=cu_seqlens_m, A_idx=A_idx)
        gate, up = preact_out[:, 0::2].float(), preact_out[:, 1::2].float()
        postact_out.copy_(F.silu(gate) * up)

    def gemm_dgated(A, B, PreAct, activation, dx_out, postact_out, colvec_scale, colvec_reduce,
                    cu_seqlens_m, A_idx, dynamic_scheduler):
        dout = torch.empty(PreAct.shape[0], B.shape[-1])
        mm(A, B, dout, cu_seqlens_m=cu_seqlens_m, A_idx=A_idx)
        gate, up = PreAct[:, 0::2].float(), PreAct[:, 1::2].float()
        s, sig = colvec_scale.float()[:, None], torch.sigmoid(gate)
        da = s * dout
        dx_out.copy_(torch.stack([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig],
                                 dim=-1).flatten(-2))
        postact_out.copy_(s * gate * sig * up)
        return dx_out, postact_out, (dout * gate * sig * up).sum(-1)

    return SimpleNamespace(gemm=gemm, gemm_gated=gemm_gated, gemm_dgated=gemm_dgated)


def test_sonicmoe_gemm_rows_call_quack_on_bench_grouped_gemm_work(monkeypatch):
    """--gemm's six SonicMoE calls, on a stand-in for QuACK, compute the work of the torch
    reference beside each (shapes, layouts, interleaved gate/up, the scaled dH): what the rows
    compare on the GPU."""
    bench = load_benchmark("bench_sonicmoe")
    seen = {}

    def row(name, gemm, flops, kernel, torch_fn):
        out, ref = kernel(), torch_fn()
        assert out.shape == ref.shape, gemm
        seen[gemm] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()

    monkeypatch.setattr(bench, "_row", row)
    torch.manual_seed(0)
    bench.gemm_rows("tiny", (64, 32, 16, 4, 2), _quack_stand_in(), bench.GEMMS, device="cpu")
    assert set(seen) == set(bench.GEMMS)
    # bf16 rounding of the reference's intermediate dA' is the only difference allowed.
    assert all(err < 1e-2 for err in seen.values()), seen
