"""``torchrun -m sonic.train --ep N`` on CPU: gloo, 2 and 4 processes, tiny models, a few steps.

Every distributed run is a real ``python -m torch.distributed.run`` on a free port, in its own
session, killed with all its ranks if it outlives its timeout (a hang fails, never blocks).
"""

import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonic.train.checkpoint import read_checkpoint
from sonic.train.data import ByteCorpus
from sonic.train.parallel import check_ep

REPO = Path(__file__).resolve().parents[1]
B = 2   # windows per rank
TINY = ("--steps", "4", "--seq-len", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--experts", "4", "--top-k", "2", "--d-expert", "16", "--eval-batches", "2",
        "--eval-every", "2", "--warmup", "1", "--lr", "0.01", "--device", "cpu", "--json",
        "--no-progress")
TOL = 1e-5   # fp32: the runs differ only in summation order


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SONIC_TRAIN_PG_TIMEOUT": "60",
           "PYTHONPATH": str(REPO)}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # torchrun and every rank it started
        proc.communicate()
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                 "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
                 "-m", "sonic.train", *args], timeout)


def single(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "sonic.train", *args], timeout)


def only_json(proc: subprocess.CompletedProcess) -> dict:
    """The one JSON line of a run (rank 0's); fails on a nonzero exit or other JSON lines."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


@functools.lru_cache(maxsize=None)
def distributed(nproc: int, ep: int, *extra: str) -> dict:
    return only_json(torchrun(nproc, *TINY, "--batch-size", str(B), "--ep", str(ep), *extra))


@functools.lru_cache(maxsize=None)
def one_process(batch_size: int, *extra: str) -> dict:
    return only_json(single(*TINY, "--batch-size", str(batch_size), *extra))


def assert_same_run(got: dict, want: dict) -> None:
    assert len(got["losses"]) == len(want["losses"]) == 4
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) < TOL, (got["losses"], want["losses"])
    assert [s for s, _ in got["val_history"]] == [s for s, _ in want["val_history"]]
    for (_, a), (_, b) in zip(got["val_history"], want["val_history"]):
        assert abs(a - b) < TOL, (got["val_history"], want["val_history"])


def test_ep2_on_two_ranks_prints_one_json_line():
    result = distributed(2, 2)
    assert result["world_size"] == 2 and result["ep"] == 2 and result["config"]["ep"] == 2
    assert result["steps"] == 4 and len(result["losses"]) == 4
    assert all(math.isfinite(v) and v > 0 for v in result["losses"])
    for key in ("train_loss", "val_loss_initial", "val_loss", "tokens_per_s"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    # The whole model: every expert counted once, as in one process.
    assert result["params"] == one_process(B)["params"]


@pytest.mark.parametrize("nproc, ep", [(2, 2), (4, 2)])
def test_ep_equals_one_process_on_the_global_batch(nproc, ep):
    """W ranks with B windows each read exactly the windows of one process with W·B; without
    the aux loss (which is per rank, not of the global batch) the runs must agree to fp32
    rounding. An expert gradient reduced over the wrong group, or divided by the DP size
    instead of the world size, or a clip norm missing the other ranks' experts, breaks this:
    at (2, 2) the DP group is one rank, at (4, 2) two."""
    no_aux = ("--aux-loss-coef", "0")
    assert_same_run(distributed(nproc, ep, *no_aux), one_process(nproc * B, *no_aux))


def test_ep_token_rounding_equals_one_process_on_the_global_batch():
    """--router token_rounding with --ep 2: every expert's count is rounded over the tokens of
    both ranks (sonic.distributed.ep_token_rounding_routing), the selection of one process
    rounding the global batch; the runs agree to fp32 rounding (no aux loss: it is per rank)."""
    run = ("--aux-loss-coef", "0", "--router", "token_rounding", "--tile", "8")
    assert_same_run(distributed(2, 2, *run), one_process(2 * B, *run))


def test_ep_fp8_training_follows_one_process():
    """--precision fp8 --activation-cache fp8 with --ep 2, chunked and recomputing the dispatch:
    the whole stack (the FP8 weight copies of each rank's experts remade after every optimizer
    step, the fp8 cache, the chunked pipeline) trains as one process on the global batch does,
    within bf16 rounding of the combine's sums (measured ≤ 0.25% over 4 steps; FP8 sizes:
    d_model and d_expert 128). An integration check: whether the ranks' experts really
    quantize is checked per layer, where FP8 and bf16 differ far more than this
    (tests/test_distributed_fp8.py)."""
    run = ("--aux-loss-coef", "0", "--precision", "fp8", "--activation-cache", "fp8",
           "--d-model", "128", "--d-expert", "128", "--dtype", "bfloat16")
    got = distributed(2, 2, *run, "--ep-chunks", "2", "--ep-recompute-dispatch")
    want = one_process(2 * B, *run)
    assert got["precision"] == "fp8" and got["config"]["activation_cache"] == "fp8"
    for a, b in zip(got["losses"] + [v for _, v in got["val_history"]],
                    want["losses"] + [v for _, v in want["val_history"]]):
        assert abs(a - b) < 5e-3 * abs(b), (got["losses"], want["losses"])


def test_ep_equals_data_parallel_with_the_aux_loss():
    """World 2: --ep 2 against pure data parallelism (--ep 1), aux loss on."""
    assert_same_run(distributed(2, 2), distributed(2, 1))


def test_ep_chunks_and_recompute_dispatch_equal_unchunked():
    """--ep-chunks 3 pipelines every EP layer in 3 chunks, and --ep-recompute-dispatch sends
    the received rows again in backward: the same run up to the order of the expert
    weight-gradient sums (one run for both flags: recomputing changes no value, tested bit
    for bit in tests/test_distributed_overlap.py)."""
    result = distributed(2, 2, "--ep-chunks", "3", "--ep-recompute-dispatch")
    assert result["config"]["ep_chunks"] == 3
    assert result["config"]["ep_recompute_dispatch"] is True
    assert_same_run(result, distributed(2, 2))


def test_ep_transport_auto_is_the_same_run():
    """--ep-transport auto on CPU ranks falls back to torch.distributed: the same run."""
    result = distributed(2, 2, "--ep-transport", "auto")
    assert result["config"]["ep_transport"] == "auto"
    assert_same_run(result, distributed(2, 2))


def test_ep_resume_continues_exactly(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    first = only_json(torchrun(2, *TINY, "--batch-size", str(B), "--ep", "2",
                               "--save", str(ckpt), "--stop-after", "2"))
    assert first["steps"] == 2
    assert (tmp_path / "ckpt.pt.rank0").exists() and (tmp_path / "ckpt.pt.rank1").exists()
    assert not ckpt.exists()
    resumed = only_json(torchrun(2, *TINY, "--batch-size", str(B), "--ep", "2",
                                 "--resume", str(ckpt)))
    assert_same_run(resumed, distributed(2, 2))
    state = read_checkpoint(tmp_path / "ckpt.pt.rank1")
    assert state["world_size"] == 2 and state["rank"] == 1 and state["config"]["ep"] == 2
    assert state["model"]["blocks.0.moe.w1"].shape[0] == 2   # 4 experts / ep 2


def test_ep_not_dividing_the_world_is_an_error():
    proc = torchrun(2, *TINY, "--batch-size", str(B), "--ep", "3")
    assert proc.returncode != 0
    assert "--ep 3 must divide the world size 2" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--ep", "2"], "--ep 2 must divide the world size 1 (run under torchrun"),
    (["--ep", "0"], "--ep"),
    (["--ep-chunks", "0"], "--ep-chunks"),
    (["--ep-chunks", "17"], "ep_chunks: expected at most 16"),
])
def test_ep_errors_without_torchrun(args, message):
    proc = single(*TINY, "--batch-size", str(B), *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_check_ep():
    check_ep(2, 4, 8)
    with pytest.raises(ValueError, match="must divide --experts 6"):
        check_ep(4, 4, 6)
    with pytest.raises(ValueError, match="must divide the world size 6"):
        check_ep(4, 6, 8)


def test_batch_shards_are_the_global_batch():
    corpus = ByteCorpus("".join(chr(97 + i % 26) for i in range(3000)), seq_len=8)
    whole = corpus.batch("train", 6, 8, torch.Generator().manual_seed(5))
    parts = [corpus.batch("train", 2, 8, torch.Generator().manual_seed(5), shard=r,
                          num_shards=3) for r in range(3)]
    for i in range(2):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
    with pytest.raises(ValueError, match="shard"):
        corpus.batch("train", 2, 8, torch.Generator(), shard=3, num_shards=3)
