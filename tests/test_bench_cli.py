"""The layer benchmark's command line and plot, on the CPU (the timing itself needs a GPU)."""

import importlib.util
import pathlib

import pytest

from sonic.baselines.configs import CONFIGS, PAPER_CONFIGS


def _bench_moe():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
