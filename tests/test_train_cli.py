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


# ------------------------------------------------- checkpoints, per-step logs, TensorBoard

from sonic.train.__main__ import main as train_main  # noqa: E402
from sonic.train.checkpoint import MAGIC, read_checkpoint, write_checkpoint  # noqa: E402
from sonic.train.loop import TrainConfig, train  # noqa: E402

FAST = dict(steps=4, batch_size=2, seq_len=16, d_model=32, layers=1, heads=2, experts=4,
            top_k=2, d_expert=16, tile=4, eval_batches=1, eval_every=2, warmup=1,
            device="cpu")


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_resume_continues_exactly(tmp_path, router):
    config = TrainConfig(router=router, **FAST)
    straight = train(config, progress=False)
    ckpt = tmp_path / "ckpt.pt"
    first = train(config, progress=False, save=str(ckpt), stop_after=2)
    assert first["steps"] == 2 and ckpt.exists()
    resumed = train(config, progress=False, resume=str(ckpt), save=str(ckpt))
    assert first["losses"] + resumed["losses"][2:] == straight["losses"]
    assert resumed["losses"] == straight["losses"] and resumed["steps"] == 4
    assert resumed["val_history"] == straight["val_history"]
    state = read_checkpoint(ckpt)
    assert state["step"] == 4 and state["config"]["router"] == router
    assert {"model", "optimizer", "train_generator"} <= state.keys()


def test_resume_refuses_other_settings(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    train(TrainConfig(**FAST), progress=False, save=str(ckpt), stop_after=1)
    with pytest.raises(ValueError, match="d_model"):
        train(TrainConfig(**{**FAST, "d_model": 64}), progress=False, resume=str(ckpt))


def test_jsonl_log_has_one_line_per_step(tmp_path):
    log = tmp_path / "log.jsonl"
    assert train_main(["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--d-model",
                       "32", "--layers", "1", "--heads", "2", "--experts", "4", "--d-expert",
                       "16", "--eval-batches", "1", "--eval-every", "2", "--device", "cpu",
                       "--no-progress", "--log-jsonl", str(log)]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    steps = records[1:]   # records[0]: the step-0 validation loss
    assert all({"loss", "aux_loss", "lr", "tokens_per_s"} <= r.keys() for r in steps)
    assert all(math.isfinite(r["loss"]) and r["aux_loss"] > 0 for r in steps)
    assert "val_loss" in records[2] and "val_loss" not in records[1]


def test_tensorboard_missing_is_a_usage_error(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(SystemExit) as exc:
        train_main(["--steps", "1", "--device", "cpu", "--no-progress", "--tensorboard", "tb"])
    assert exc.value.code == 2 and "pip install tensorboard" in capsys.readouterr().err


def test_tensorboard_writer_gets_the_scalars(monkeypatch, tmp_path):
    import types

    written = []

    class Writer:
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, tag, value, step):
            written.append((tag, step))

        def close(self):
            written.append(("closed", None))

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    train(TrainConfig(**FAST), progress=False, tensorboard=str(tmp_path))
    tags = {tag for tag, _ in written}
    assert {"train/loss", "train/lr", "train/aux_loss", "val/loss", "closed"} <= tags
    assert ("train/loss", 4) in written


# ------------------------------------------------------------- what a new user hit

def test_help_states_each_default_once_and_no_doubled_percent():
    proc = run_cli("--help")
    assert proc.returncode == 0 and "%%" not in proc.stdout
    # argparse wraps an option's help over several lines: split the text at each option.
    import re

    options = re.split(r"\n  (?=-)", proc.stdout)
    for text in options:
        assert text.count("default") <= 1, text
    assert "default: None" not in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--backend", "cute"], "backend: 'cute' needs sonic's CuTe kernels"),
    (["--device", "meta"], "device: expected 'cpu', 'cuda' or 'cuda:N', got 'meta'"),
    (["--seed", str(2**70)], "seed: expected an integer in [0, 9223372036854775807)"),
    (["--seed", "-1"], "--seed"),
    (["--log-jsonl", "no/such/folder/log.jsonl"], "the folder 'no/such/folder'"),
    (["--save", "no/such/folder/ckpt.pt"], "the folder 'no/such/folder'"),
])
def test_usage_errors_before_training(args, message):
    proc = run_cli(*TINY, "--no-progress", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "train[" not in proc.stderr   # no step ran


@pytest.mark.parametrize("eval_every", [0, 2, 3])
def test_jsonl_log_has_the_first_and_last_validation_loss(tmp_path, eval_every):
    log = tmp_path / "log.jsonl"
    result = train(TrainConfig(**{**FAST, "steps": 5, "eval_every": eval_every}),
                   progress=False, log_jsonl=str(log))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0] == {"step": 0, "val_loss": result["val_loss_initial"]}
    assert records[-1]["step"] == 5 and records[-1]["val_loss"] == result["val_loss"]
    logged = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    assert logged == result["val_history"]
    expected = [0] + ([s for s in range(1, 5) if s % eval_every == 0] if eval_every else []) + [5]
    assert [s for s, _ in logged] == expected


def test_progress_bar_ends_on_the_last_validation_loss():
    proc = run_cli(*TINY, "--steps", "5", "--eval-every", "2")
    assert proc.returncode == 0, proc.stderr
    bars = [line for line in proc.stderr.replace("\r", "\n").splitlines() if "train[" in line]
    last_bar = bars[-1]
    assert "val@5=" in last_bar, last_bar


# ------------------------------------------------------------- checkpoint integrity

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A checkpoint after 2 of 4 steps, and the losses of the run resumed from it."""
    ckpt = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    train(TrainConfig(**FAST), progress=False, save=str(ckpt), stop_after=2)
    return ckpt, ckpt.read_bytes()


def resume_from(path):
    return train(TrainConfig(**FAST), progress=False, resume=str(path))


def forge(path, state):
    """Write ``state`` as write_checkpoint does, with a valid checksum but none of its checks:
    what a hand-edited file re-saved by someone who knows the format looks like."""
    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path.write_bytes(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_corrupted_byte_is_refused(saved_run, tmp_path, seed):
    _, data = saved_run
    rng = random.Random(seed)
    offset = rng.randrange(len(MAGIC) + 65, len(data))   # anywhere in the payload
    corrupted = bytearray(data)
    corrupted[offset] ^= 1 << rng.randrange(8)
    path = tmp_path / "bad.pt"
    path.write_bytes(bytes(corrupted))
    with pytest.raises(ValueError, match="is corrupted: its SHA-256 does not match"):
        resume_from(path)


def test_a_corrupted_checksum_is_refused(saved_run, tmp_path):
    _, data = saved_run
    corrupted = bytearray(data)
    corrupted[len(MAGIC) + 3] = ord("0") if corrupted[len(MAGIC) + 3] != ord("0") else ord("1")
    (tmp_path / "bad.pt").write_bytes(bytes(corrupted))
    with pytest.raises(ValueError, match="is corrupted"):
        resume_from(tmp_path / "bad.pt")


@pytest.mark.parametrize("step", [1, 3, 0])
def test_an_edited_step_is_detected(saved_run, tmp_path, step):
    """A step changed and saved again with a valid checksum: the losses, the validation
    history and the optimizer's step count no longer fit it."""
    state = read_checkpoint(saved_run[0])
    state["step"] = step
    forge(tmp_path / "edited.pt", state)
    with pytest.raises(ValueError, match=f"is at step {step} but holds 2 step losses"):
        resume_from(tmp_path / "edited.pt")
    state["losses"] = state["losses"][:step] + [1.0] * max(0, step - 2)   # edited as well
    forge(tmp_path / "edited.pt", state)
    with pytest.raises(ValueError, match="optimizer state has taken|validation steps"):
        resume_from(tmp_path / "edited.pt")


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"step: 2\nloss: 1.5\n", "is not a sonic.train checkpoint"),
])
def test_empty_and_text_files_are_refused(tmp_path, content, message):
    (tmp_path / "c.pt").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        resume_from(tmp_path / "c.pt")


def test_a_plain_torch_save_is_refused(saved_run, tmp_path):
    torch.save(read_checkpoint(saved_run[0]), tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="is not a sonic.train checkpoint"):
        resume_from(tmp_path / "plain.pt")


@pytest.mark.parametrize("key", ["model", "optimizer", "losses", "rng"])
def test_missing_keys_are_named(saved_run, tmp_path, key):
    state = read_checkpoint(saved_run[0])
    del state[key]
    forge(tmp_path / "c.pt", state)
    with pytest.raises(ValueError, match=f"lacks {key}"):
        resume_from(tmp_path / "c.pt")
    with pytest.raises(ValueError, match=f"lacks {key}"):
        write_checkpoint(tmp_path / "d.pt", state)


def test_model_tensors_of_another_shape_or_dtype_are_refused(saved_run, tmp_path):
    state = read_checkpoint(saved_run[0])
    w1 = state["model"]["blocks.0.moe.w1"]
    state["model"]["blocks.0.moe.w1"] = w1.double()
    write_checkpoint(tmp_path / "c.pt", state)
    with pytest.raises(ValueError, match="blocks.0.moe.w1 is .* torch.float64, the model's"):
        resume_from(tmp_path / "c.pt")
    state["model"]["blocks.0.moe.w1"] = w1[:, :-1]
    write_checkpoint(tmp_path / "c.pt", state)
    with pytest.raises(ValueError, match="blocks.0.moe.w1 is"):
        resume_from(tmp_path / "c.pt")
    del state["model"]["blocks.0.moe.w1"]
    write_checkpoint(tmp_path / "c.pt", state)
    with pytest.raises(ValueError, match="do not match the model"):
        resume_from(tmp_path / "c.pt")


def test_an_optimizer_moment_of_another_shape_is_refused(saved_run, tmp_path):
    state = read_checkpoint(saved_run[0])
    moments = state["optimizer"]["state"][0]
    moments["exp_avg"] = moments["exp_avg"][:-1]
    write_checkpoint(tmp_path / "c.pt", state)
    with pytest.raises(ValueError, match="an optimizer exp_avg is"):
        resume_from(tmp_path / "c.pt")


def test_the_unedited_copy_still_resumes(saved_run, tmp_path):
    (tmp_path / "copy.pt").write_bytes(saved_run[1])
    assert resume_from(tmp_path / "copy.pt")["steps"] == 4



# ------------------------------------------------------- schedule and logging

def expected_lr(step, steps, warmup, peak):
    """Linear warmup, then cosine decay from the peak to a tenth of it at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@pytest.mark.parametrize("steps, warmup", [(7, 3), (5, 0), (4, 4)])
def test_lr_schedule_values(tmp_path, steps, warmup):
    log = tmp_path / "log.jsonl"
    config = TrainConfig(**{**FAST, "steps": steps, "warmup": warmup, "lr": 2e-3,
                            "eval_every": 0})
    train(config, progress=False, log_jsonl=str(log))
    lrs = [json.loads(line)["lr"] for line in log.read_text().splitlines()[1:]]
    assert lrs == pytest.approx([expected_lr(s, steps, warmup, 2e-3) for s in range(steps)],
                                rel=1e-12, abs=0)


def test_lr_schedule_of_a_resumed_run(tmp_path):
    config = TrainConfig(**{**FAST, "steps": 6, "warmup": 2, "eval_every": 0})
    ckpt, log = tmp_path / "c.pt", tmp_path / "log.jsonl"
    train(config, progress=False, save=str(ckpt), stop_after=3, log_jsonl=str(log))
    train(config, progress=False, resume=str(ckpt), log_jsonl=str(log))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    lrs = [r["lr"] for r in records if "lr" in r]
    assert [r["step"] for r in records if "lr" in r] == [1, 2, 3, 4, 5, 6]
    assert lrs == pytest.approx([expected_lr(s, 6, 2, config.lr) for s in range(6)],
                                rel=1e-12, abs=0)


def test_log_lines_go_to_stderr_through_logging():
    proc = run_cli(*TINY, "--steps", "4", "--eval-every", "2", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "sonic.train" in line]
    assert any("model: 1 layers" in line for line in lines)
    assert [line.split(": ", 1)[1].split(":")[0] for line in lines if "val loss" in line] == \
        ["step 2", "step 4"]
    quiet = run_cli(*TINY, "--no-progress", "--log-level", "warning")
    assert "sonic.train" not in quiet.stderr and quiet.returncode == 0


@pytest.mark.parametrize("env, level, prefix", [
    ({}, "INFO", ""),
    ({"WORLD_SIZE": "4", "RANK": "0"}, "INFO", "[rank 0] "),
    ({"WORLD_SIZE": "4", "RANK": "3"}, "WARNING", "[rank 3] "),
])
def test_logging_is_rank_aware(monkeypatch, env, level, prefix):
    import logging

    from sonic.train.__main__ import configure_logging

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    logger = logging.getLogger("sonic")
    saved = logger.handlers, logger.level, logger.propagate
    try:
        configure_logging()
        assert logging.getLevelName(logger.level) == level
        record = logging.LogRecord("sonic.train", logging.WARNING, __file__, 1, "hi", None, None)
        assert logger.handlers[0].format(record) == f"{prefix}WARNING sonic.train: hi"
    finally:
        logger.handlers, logger.level, logger.propagate = saved


@pytest.mark.parametrize("option,bad,expected", [
    ("--steps", "0", "an integer > 0"), ("--steps", "x", "an integer > 0"),
    ("--warmup", "-1", "an integer >= 0"), ("--lr", "inf", "a finite number > 0"),
    ("--lr", "nan", "a finite number > 0"), ("--aux-loss-coef", "-0.5", "a finite number >= 0"),
])
def test_number_options_name_what_they_expect(capsys, option, bad, expected):
    from sonic.train.__main__ import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([option, bad])
    assert exc.value.code == 2
    assert f"{option}: expected {expected}, got {bad!r}" in capsys.readouterr().err
