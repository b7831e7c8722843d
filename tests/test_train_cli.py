"""Smoke tests of ``python -m sonic.train`` (tiny sizes, a few steps, CPU)."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonic.train.data import ByteCorpus

REPO = Path(__file__).resolve().parents[1]
TINY = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--d-model", "32", "--layers", "1",
        "--heads", "2", "--experts", "4", "--top-k", "2", "--d-expert", "16", "--tile", "4",
        "--eval-batches", "2", "--device", "cpu"]
KEYS = {"router", "steps", "train_loss", "val_loss_initial", "val_loss", "tokens_per_s",
        "activation_MiB_per_layer", "device", "seed"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sonic.train", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def random_text(path: Path, seed: int) -> Path:
    rng = random.Random(seed)
    words = ["moe", "expert", "token", "routing", "tile", "gradient", "naïve", "größe", "→"]
    path.write_text(" ".join(rng.choice(words) for _ in range(600)), encoding="utf-8")
    return path


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_json_result(router):
    result = last_json(run_cli(*TINY, "--router", router, "--json"))
    assert KEYS <= result.keys()
    assert result["router"] == router and result["steps"] == 3 and result["device"] == "cpu"
    for key in ("train_loss", "val_loss_initial", "val_loss", "tokens_per_s",
                "activation_MiB_per_layer"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    # An untrained byte model predicts ~uniformly over 256 bytes.
    assert abs(result["val_loss_initial"] - math.log(256)) < 0.5


def test_data_file_is_deterministic(tmp_path):
    data = random_text(tmp_path / "corpus.txt", seed=3)
    first = last_json(run_cli(*TINY, "--data", str(data), "--seed", "7", "--json"))
    second = last_json(run_cli(*TINY, "--data", str(data), "--seed", "7", "--json",
                               "--no-progress"))
    for key in ("train_loss", "val_loss_initial", "val_loss", "activation_MiB_per_layer"):
        assert first[key] == second[key], key
    assert first["seed"] == 7 and first["config"]["data"] == str(data)


def test_human_summary():
    proc = run_cli(*TINY, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "val loss" in proc.stdout and "activation memory" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--router", "foo"], "--router"),
    (["--steps", "0"], "--steps"),
    (["--top-k", "5"], "top_k"),
    (["--data", "/nonexistent/corpus.txt"], "data"),
    (["--seq-len", "4000"], "seq-len"),
])
def test_bad_arguments_exit_with_usage_error(args, message, tmp_path):
    if args[0] == "--seq-len":
        args = args + ["--data", str(random_text(tmp_path / "small.txt", seed=5))]
    proc = run_cli(*TINY, *args)  # argparse keeps the last value of a repeated flag
    assert proc.returncode == 2
    assert message in proc.stderr


def test_corpus_windows_are_shifted_by_one_byte():
    text = "".join(random.Random(11).choice("abcdefgh€") for _ in range(500))
    corpus = ByteCorpus(text, val_fraction=0.2, seq_len=32)
    data = text.encode("utf-8")
    assert len(corpus.train) + len(corpus.val) == len(data)
    inputs, targets = corpus.batch("val", 4, 32, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (4, 32) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    val = bytes(corpus.val.tolist())
    for row in torch.cat([inputs, targets[:, -1:]], dim=1).tolist():
        assert bytes(row) in val
