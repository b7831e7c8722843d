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
import torch.nn.functional as F

from sonic import MoEConfig, collect_aux_losses
from sonic.train import parallel
from sonic.train.checkpoint import read_checkpoint
from sonic.train.data import ByteCorpus
from sonic.train.model import ByteMoELM
from sonic.train.parallel import check_ep
from test_distributed import _rel, _spawn

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


@pytest.mark.parametrize("nproc, ep", [(2, 2), (4, 2), (4, 4)])
def test_ep_equals_one_process_on_the_global_batch(nproc, ep):
    """W ranks with B windows each read exactly the windows of one process with W·B; without
    the aux loss (which is per rank, not of the global batch) the runs must agree to fp32
    rounding. An expert gradient reduced over the wrong group, or divided by the DP size
    instead of the world size, or a clip norm missing the other ranks' experts, breaks this:
    at (2, 2) and (4, 4) the mesh is ("ep",), at (4, 2) ("dp", "ep") with two EP groups."""
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


@pytest.mark.parametrize("nproc, ep, extra", [(2, 2, ()), (4, 2, ("--aux-loss-coef", "0"))])
def test_ep_resume_continues_exactly(tmp_path, nproc, ep, extra):
    """Stopped after 2 steps and resumed from the per-rank checkpoints, the run is the
    uninterrupted one, also with two EP groups (whose experts the "dp" DDP reduces); the files
    hold the model's own tensors (its keys, this rank's experts), not the DDP wrappers'."""
    ckpt = tmp_path / "ckpt.pt"
    run = (*TINY, "--batch-size", str(B), "--ep", str(ep), *extra)
    first = only_json(torchrun(nproc, *run, "--save", str(ckpt), "--stop-after", "2"))
    assert first["steps"] == 2
    assert all((tmp_path / f"ckpt.pt.rank{r}").exists() for r in range(nproc))
    assert not ckpt.exists()
    resumed = only_json(torchrun(nproc, *run, "--resume", str(ckpt)))
    assert_same_run(resumed, distributed(nproc, ep, *extra))
    last = nproc - 1
    state = read_checkpoint(tmp_path / f"ckpt.pt.rank{last}")
    assert state["world_size"] == nproc and state["rank"] == last and state["config"]["ep"] == ep
    assert state["model"]["blocks.0.moe.w1"].shape[0] == 4 // ep   # 4 experts / ep
    assert not any(key.startswith("module.") for key in state["model"])


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


# --- the gradients of sonic.train.parallel against one process ------------------------------

DP_E, DP_B, DP_S, DP_STEPS = 8, 2, 8, 3
DP_CLIP = 0.05   # below every step's gradient norm: clipping acts
DP_TOL = 1e-10   # fp64; the runs differ only in summation order
DP_NORM_TOL = 1e-6   # the distributed clip accumulates the norm in fp32, whatever the dtype,
# so past the first backward (whose gradients get DP_TOL) every value carries its rounding


def _dp_model() -> ByteMoELM:
    torch.manual_seed(0)
    return ByteMoELM(max_seq_len=DP_S, num_layers=2, num_heads=2, dtype=torch.float64,
                     moe=MoEConfig(16, 8, DP_E, 2, aux_loss_coef=0.01, backend="torch"))


def _dp_batches(world: int) -> list[torch.Tensor]:
    """``DP_STEPS`` global batches of ``world·DP_B`` windows of ``DP_S + 1`` bytes."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (world * DP_B, DP_S + 1), generator=g)
            for _ in range(DP_STEPS)]


def _dp_loss(module: torch.nn.Module, model: ByteMoELM, x: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``module`` (``model`` or its wrapper) on the windows ``x`` plus the aux
    losses of their tokens, in fp64."""
    with collect_aux_losses(model) as aux:
        logits = module(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)) + sum(aux)


def _dp_train(step) -> list[dict]:
    """``DP_STEPS`` AdamW steps of ``step.model``: ``step(x)`` runs the backward of the
    global batch ``x``, ``step.clip()`` clips; per step the gradients before and after
    clipping, the norm, the parameters after the step."""
    model = step.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record = []
    for x in _dp_batches(step.world):
        optimizer.zero_grad(set_to_none=True)
        step(x)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = step.clip()
        clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        record.append({"grads": grads, "norm": norm, "clipped": clipped,
                       "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return record


class _RankStep:
    """One rank's backward through :func:`sonic.train.parallel.data_parallel`."""

    def __init__(self, model, par, rank):
        self.model, self.par, self.rank, self.world = model, par, rank, par.world
        self.trained = parallel.data_parallel(model, par)

    def __call__(self, x):
        mine = x[self.rank * DP_B:(self.rank + 1) * DP_B]
        _dp_loss(self.trained, self.model, mine).backward()

    def clip(self):
        return parallel.clip_grad_norm(self.model, DP_CLIP, self.par)


class _OneProcessStep:
    """The single-process reference: the mean over the ranks' windows of their losses."""

    def __init__(self, model, world):
        self.model, self.world = model, world

    def __call__(self, x):
        shards = x.split(DP_B)
        (sum(_dp_loss(self.model, self.model, s) for s in shards) / len(shards)).backward()

    def clip(self):
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), DP_CLIP)


def _dp_case(rank: int, world: int) -> dict:
    """Every ``ep`` dividing ``world``: :func:`_dp_train` through sonic.train.parallel."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    results = {}
    for ep in (e for e in (1, 2, 4) if world % e == 0):
        par, _ = parallel.setup(ep, DP_E, torch.device("cpu"))
        model = _dp_model()
        if ep > 1:
            model.shard_experts(par.ep_group)
        dims = par.mesh.mesh_dim_names
        results[ep] = {"dims": dims, "record": _dp_train(_RankStep(model, par, rank))}
    return results


@functools.lru_cache(maxsize=None)
def _dp_reference(world: int) -> list[dict]:
    return _dp_train(_OneProcessStep(_dp_model(), world))


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_gradients_equal_one_process(world, tmp_path):
    """Every rank's gradients after the DDP backward, the clip norm, the clipped gradients and
    the parameters after each of 3 AdamW steps equal one process's on the global batch (loss:
    the mean of the ranks' losses, aux losses included), in fp64 (the clip norm to its fp32
    accumulation), for every ``ep`` dividing
    the world: pure data parallelism, EP on the mesh ("ep",), and at (4, 2) EP × DP on
    ("dp", "ep"). An expert gradient left summed over its EP group (off by ``ep``), not
    reduced over "dp", a router gradient not averaged, or a norm missing the other ranks'
    experts breaks it: the clip threshold is below every step's norm."""
    want = _dp_reference(world)
    assert all(step["norm"] > DP_CLIP for step in want)
    expected_dims = {1: ("dp",), 2: ("ep",) if world == 2 else ("dp", "ep"), 4: ("ep",)}
    for rank, results in enumerate(_spawn(world, _dp_case, tmp_path, timeout=240)):
        for ep, got in results.items():
            assert got["dims"] == expected_dims[ep]
            local = DP_E // ep
            mine = slice(rank % ep * local, (rank % ep + 1) * local)   # its EP rank's experts
            for step, (g, w) in enumerate(zip(got["record"], want)):
                where = f"rank {rank}, ep {ep}, step {step}"
                assert abs(g["norm"] - w["norm"]) < DP_NORM_TOL * w["norm"], where
                for key, tol in (("grads", DP_NORM_TOL if step else DP_TOL),
                                 ("clipped", DP_NORM_TOL), ("params", DP_NORM_TOL)):
                    for name, ref in w[key].items():
                        if name.endswith(("moe.w1", "moe.w2")) and ep > 1:
                            ref = ref[mine]
                        assert _rel(g[key][name], ref) < tol, (where, key, name)
