"""GPU stress test and compute-sanitizer driver: sonic's kernel paths against the reference.

Every case goes through the public API (``sonic.topk_routing``, ``sonic.token_rounding_routing``,
``sonic.routing_metadata``, ``sonic.moe_experts``, ``sonic.MoE``), runs forward and backward
with ``backend="auto"`` (the CuTe kernels where they serve the call) and with
``backend="torch"`` (the PyTorch reference) on the same inputs, and compares the output and
every gradient by ``‖auto − torch‖ / ‖torch‖``: at most 3e-2 in bf16, 1e-4 in fp32. A NaN or
inf anywhere, routings that differ, or an exception count as a failure. Token-rounding cases
route both sides by the reference token choice (the kernel's softmax may differ in the last
bit, which can legitimately change which near-equal picks rounding drops) and check the
``"auto"`` token-rounding routing separately by its guarantees.

Modes:

``--sanitize``: a few small cases that together reach every kernel path (top-K and token
rounding routers, gate/up concatenated and interleaved, an expert with no tokens, one expert
taking every token, T = 1, T = 0, bf16, an fp32 case for the fp32 top-K and aggregation
kernels, the ``sonic.MoE`` layer), one line per case; small enough for compute-sanitizer::

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no python benchmarks/stress_gpu.py --sanitize
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck --report-api-errors no python benchmarks/stress_gpu.py --sanitize
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool synccheck --report-api-errors no python benchmarks/stress_gpu.py --sanitize
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --report-api-errors no python benchmarks/stress_gpu.py --sanitize

(each ends with compute-sanitizer's ``ERROR SUMMARY``; a clean run reports 0 errors.)

``--compute-sanitizer``: runs those four commands at once (one GPU, ``--seconds`` the time
limit, default 600) and prints a table of the error records per case and tool, each tool's
``ERROR SUMMARY``, and which grouped-GEMM variants of the sm_90a registry the cases launched
(a plan: the configuration without its sizes); exits with status 1 on any error, failed case
or tool that did not finish. Records are attributed to the case whose markers surround them
in the output; the summaries are the totals::

    python benchmarks/stress_gpu.py --compute-sanitizer [--tools memcheck,initcheck]

It also prints, per tool, the kernels its records were reported in. Under initcheck the
cases run with ``--initcheck``: initcheck does not count TMA stores as writes, so each output
a grouped GEMM writes by TMA is filled with NaN bytes by a memset before its launch
(:func:`fill_tma_outputs`; initcheck reads those rows as written, and the comparison with the
reference catches a row left unwritten), the reference side runs on the CPU (its GPU GEMMs,
cuBLAS's and CUTLASS's, store by TMA too) and the ``sonic.MoE`` layer case is left out (its
router GEMM is cuBLAS's). ``--tma-store-control`` is the control for the first point: torch
reads an output a grouped GEMM wrote with thread stores, then one it wrote by TMA, each between
case markers; records in the second and none in the first mean initcheck does not count TMA
stores as writes::

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --report-api-errors no python benchmarks/stress_gpu.py --tma-store-control

``--cases REGEX`` keeps
the cases whose line matches (both modes); ``--log-dir DIR`` keeps each tool's whole output
as ``DIR/<tool>.log``; ``--shards N`` splits each tool's cases over N processes (initcheck
takes minutes per case).

``--random N --seconds S``: up to N randomized cases or S seconds, whichever comes first::

    python benchmarks/stress_gpu.py --random 2000 --seconds 900 --seed 0

Shapes ``(T, d, n, E, K)`` mix multiples of 64 for ``d`` and ``n`` (the kernel path) with sizes
that are not (8, 24, 72, 100, 3: the fallbacks); routings are top-K, token rounding (tiles 16,
64, 128) or hand-built pairs with empty and hot experts; dtypes bf16 and fp32; both gate/up
layouts. One line per case, the failures marked ``FAIL``.

Both modes end with ``N cases, F failures`` as the last line and exit with status 1 if any case
failed.

NaN poisoning: the API allocates its outputs and intermediates itself (no ``out=`` argument),
so they cannot be handed in pre-filled. Instead, before each random case the CUDA caching
allocator's pool is poisoned: blocks filled with all-ones bytes (NaN in bf16 and fp32) are
allocated and freed, so the case's uninitialised allocations are carved out of NaN memory and
a read of an element no kernel wrote shows up as a non-finite result. This needs the caching
allocator, so it is off under ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``; there compute-sanitizer's
initcheck finds such reads instead.

``--device cpu`` runs the same cases on the CPU (both sides are then the reference): a quick
check of this script itself. Importing this module needs no GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
from dataclasses import dataclass

import torch

import sonic
from sonic.types import GATED_ACTIVATIONS

THRESHOLDS = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
ROUTERS = ("topk", "token_rounding", "empty_experts", "hot_expert")


@dataclass(frozen=True)
class Case:
    """One stress case. ``router``: a sonic router, or hand-built pairs with experts 0 and E-1
    left empty (``"empty_experts"``) or most pairs on one expert (``"hot_expert"``)."""

    T: int
    d: int
    n: int
    E: int
    K: int
    router: str = "topk"
    dtype: torch.dtype = torch.bfloat16
    gate_up: str = "concat"
    tile: int = 64
    layer: bool = False          # through sonic.MoE rather than the functional API
    padded: bool = False         # token rounding padded to its capacity (rows past P)
    precision: str = "bf16"      # "fp8": the FP8 expert path (d, n multiples of 128)
    fp8_epilogues: str = "quantizing"   # sonic.backend.set_fp8_epilogues for precision="fp8"
    fp8_weight_grads: str = "bf16"      # sonic.backend.set_fp8_weight_grads likewise
    activation: str = "swiglu"          # one of sonic.types.ACTIVATIONS

    def __str__(self) -> str:
        kind = "MoE layer" if self.layer else self.router
        return (f"T={self.T} d={self.d} n={self.n} E={self.E} K={self.K} {kind} "
                f"{str(self.dtype).removeprefix('torch.')} {self.gate_up}"
                + (f" tile={self.tile}" if self.router == "token_rounding" else "")
                + (" padded" if self.padded else "")
                + (f" fp8/{self.fp8_epilogues}/wgrad-{self.fp8_weight_grads}"
                   if self.precision == "fp8" else "")
                + (f" {self.activation}" if self.activation != "swiglu" else ""))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    diff, ref = (a - b).norm().item(), b.norm().item()
    return diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))


def _hand_pairs(case: Case, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs in a random order: ``"empty_experts"`` spreads ``K`` distinct experts per token
    over experts 1..E-2 (0 and E-1 get none; with E <= 2 expert 0 takes all); ``"hot_expert"``
    sends every token to expert E // 2 and some also elsewhere."""
    T, E, K = case.T, case.E, case.K
    tokens, experts = [], []
    for t in range(T):
        if case.router == "empty_experts":
            pool = torch.arange(1, E - 1) if E > 2 else torch.zeros(1, dtype=torch.long)
            chosen = pool[torch.randperm(pool.numel(), generator=g)[:K]]
        else:
            hot = E // 2
            others = torch.tensor([e for e in range(E) if e != hot], dtype=torch.long)
            extra = int(torch.randint(0, K, (1,), generator=g))
            chosen = torch.cat([torch.tensor([hot]),
                                others[torch.randperm(others.numel(), generator=g)[:extra]]])
        tokens += [t] * chosen.numel()
        experts += chosen.tolist()
    perm = torch.randperm(len(tokens), generator=g)
    return (torch.tensor(tokens, dtype=torch.int32)[perm],
            torch.tensor(experts, dtype=torch.int32)[perm])


def _inputs(case: Case, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Inputs on ``device``, identical for both backends. Router logits are bf16-representable
    so that the top-K kernel (which orders fp32 by value with the lowest log2(E) mantissa bits
    cleared) picks exactly what the stable sort picks."""
    g = torch.Generator().manual_seed(seed)
    T, d, n, E = case.T, case.d, case.n, case.E
    up_rows = 2 * n if case.activation in GATED_ACTIVATIONS else n
    made = {
        "x": torch.randn(T, d, generator=g),
        "w1": torch.randn(E, up_rows, d, generator=g) / d ** 0.5,
        "w2": torch.randn(E, d, n, generator=g) / n ** 0.5,
        "logits": torch.randn(T, E, generator=g).bfloat16().float(),
    }
    if case.router in ("empty_experts", "hot_expert"):
        made["token_idx"], made["expert_idx"] = _hand_pairs(case, g)
        made["scores"] = torch.rand(made["token_idx"].numel(), generator=g) + 0.1
    out = {}
    for name, t in made.items():
        if t.is_floating_point() and name in ("x", "w1", "w2"):
            t = t.to(case.dtype)
        elif name == "logits" and case.dtype == torch.bfloat16:
            t = t.to(case.dtype)
        out[name] = t.to(device)
    return out


def _run(case: Case, inputs: dict[str, torch.Tensor], backend: str):
    """Forward + backward with ``backend``: ``(routing pairs, {name: tensor})`` with the output
    and the gradient of every differentiable input."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point())
              for k, v in inputs.items()}
    if case.layer:
        layer = sonic.MoE(case.d, case.n, case.E, case.K, router=case.router, tile=case.tile,
                          gate_up=case.gate_up, aux_loss_coef=0.01, backend=backend,
                          activation=case.activation, device=leaves["x"].device,
                          dtype=case.dtype)
        with torch.no_grad():
            layer.w1.copy_(leaves["w1"])
            layer.w2.copy_(leaves["w2"])
            layer.gate.weight.copy_(torch.linspace(-1, 1, case.E * case.d).reshape(case.E, case.d))
        out, aux = layer(leaves["x"], return_aux_loss=True)
        pairs = (layer.last_routing.token_idx, layer.last_routing.expert_idx)
        named = {"w1": layer.w1, "w2": layer.w2, "gate": layer.gate.weight}
    else:
        if case.router == "topk":
            routing = sonic.topk_routing(leaves["logits"], case.K, backend=backend)
        elif case.router == "token_rounding":
            # Token choice by the reference on both sides: the top-K kernel's fused softmax may
            # differ from torch's in the last bit, which can reorder near-equal picks of an
            # expert and so which ones rounding drops; _check_token_rounding covers the kernel.
            routing = sonic.token_rounding_routing(leaves["logits"], case.K, tile=case.tile,
                                                   backend="torch", padded=case.padded)
        else:
            routing = sonic.Routing(leaves["token_idx"], leaves["expert_idx"], leaves["scores"],
                                    case.T, case.E)
        meta = sonic.routing_metadata(routing, backend=backend)
        out = sonic.moe_experts(leaves["x"], leaves["w1"], leaves["w2"], routing.scores,
                                routing.token_idx, routing.expert_idx, gate_up=case.gate_up,
                                backend=backend, metadata=meta, precision=case.precision,
                                activation=case.activation)
        pairs = (routing.token_idx, routing.expert_idx)
        aux = None
        named = {"w1": leaves["w1"], "w2": leaves["w2"]}
        named["scores" if "scores" in leaves else "logits"] = leaves.get("scores",
                                                                         leaves["logits"])
    grad_out = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    loss = (out.float() * grad_out).sum() + (aux if aux is not None else 0)
    loss.backward()
    results = {"out": out.detach(), "x.grad": leaves["x"].grad}
    for name, t in named.items():
        results[f"{name}.grad"] = t.grad
    return pairs, results


def _check_token_rounding(case: Case, logits: torch.Tensor) -> str | None:
    """Token rounding with the ``"auto"`` token choice (the top-K kernel): what is wrong with
    its routing, or None. Checked by its guarantees rather than against the reference (see
    :func:`_run`): every count a multiple of the tile or clamped to T and within a tile of the
    token-choice count, pairs unique and in range, scores finite and in [0, 1]."""
    logits = logits.detach().requires_grad_()
    r = sonic.token_rounding_routing(logits, case.K, tile=case.tile, backend="auto")
    r.scores.sum().backward()
    counts = torch.bincount(r.expert_idx.long(), minlength=case.E)
    tc = torch.bincount(sonic.topk_routing(logits.detach(), case.K).expert_idx.long(),
                        minlength=case.E)
    keys = r.expert_idx.long() * max(case.T, 1) + r.token_idx.long()
    if not bool(((counts % case.tile == 0) | (counts == case.T)).all()):
        return "token rounding (auto): a count is neither a multiple of the tile nor T"
    if not bool(((counts - tc).abs() < case.tile).all()):
        return "token rounding (auto): a count moved by a tile or more"
    if keys.unique().numel() != keys.numel() or (r.token_idx.numel() and (
            int(r.token_idx.min()) < 0 or int(r.token_idx.max()) >= case.T)):
        return "token rounding (auto): repeated or out-of-range pairs"
    s = r.scores.detach()
    if not bool((torch.isfinite(s) & (s >= 0) & (s <= 1)).all()):
        return "token rounding (auto): a score is not finite or outside [0, 1]"
    if not bool(torch.isfinite(logits.grad).all()):
        return "token rounding (auto): non-finite logits gradient"
    return None


def run_case(case: Case, seed: int, device: torch.device,
             reference_device: torch.device | None = None) -> tuple[bool, str]:
    """``(passed, one-line summary)`` of one case; exceptions are failures, not crashes. The
    reference side runs on ``reference_device`` (default: ``device``) on copies of the same
    inputs."""
    try:
        inputs = _inputs(case, seed, device)
        _poison_allocator(case, device)
        if case.router == "token_rounding":
            problem = _check_token_rounding(case, inputs["logits"])
            if problem:
                return False, problem
        previous = (sonic.backend.set_fp8_epilogues(case.fp8_epilogues),
                    sonic.backend.set_fp8_weight_grads(case.fp8_weight_grads))
        try:
            pairs_auto, auto = _run(case, inputs, "auto")
            pairs_ref, ref = _run(case, {k: v.to(reference_device or device)
                                         for k, v in inputs.items()}, "torch")
        finally:
            sonic.backend.set_fp8_epilogues(previous[0])
            sonic.backend.set_fp8_weight_grads(previous[1])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - report and go on with the next case
        return False, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    if not all(torch.equal(a.long().to(b.device), b.long())
               for a, b in zip(pairs_auto, pairs_ref)):
        return False, "routings differ between backends"
    threshold = THRESHOLDS[case.dtype]
    errors = {}
    for name, r in ref.items():
        a = auto[name]
        if (a is None) != (r is None):
            return False, f"{name}: gradient missing on one backend"
        if r is not None and r.numel():
            errors[name] = _rel(a.to(r.device), r)
    worst = max(errors, key=lambda k: errors[k] if errors[k] == errors[k] else float("inf"),
                default=None)
    passed = all(e <= threshold for e in errors.values())  # NaN compares False: a failure
    summary = "empty" if worst is None else f"max rel err {errors[worst]:.2e} ({worst})"
    return passed, summary


def _poison_allocator(case: Case, device: torch.device) -> None:
    """Fill free blocks of the CUDA caching allocator with all-ones bytes (NaN as bf16/fp32):
    a few blocks as large as the case's working set (large pool) and 1 MiB ones (small pool)."""
    if device.type != "cuda" or os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        return
    P = case.T * case.K + case.E * case.tile
    working = 4 * (P * (2 * case.n + case.d) + case.T * case.d + 3 * case.E * case.n * case.d)
    sizes = [min(working, 8 << 30)] * 4 + [1 << 20] * 64
    blocks = [torch.full((max(s, 4) // 4,), -1, dtype=torch.int32, device=device) for s in sizes]
    del blocks


def sanitize_cases(pattern: str | None = None) -> list[Case]:
    """Small cases that together launch every grouped-GEMM plan :mod:`the heuristic
    <sonic.kernels.grouped_gemm.heuristic>` picks on sm_90a (``--compute-sanitizer`` reports
    which registered variants they covered) and every other kernel path: top-K and token
    rounding (exact and padded), both gate/up layouts, an expert with no tokens, one expert
    taking every token, T = 1, T = 0, fp32, the ``sonic.MoE`` layer, and FP8 under each
    ``set_fp8_epilogues`` choice (top-K, and padded token rounding), and each other activation in its fused epilogues (or, not
    gated, the plain gathered up-proj). The shapes pick the plans: ``n = 128``: one n-tile (the
    cluster shares B), ping-pong 128-wide down-proj and dX; ``d = 384, n = 256``: the
    up-proj's cluster shares A, ping-pong 192-wide tiles; ``n = 384``: dX with K > 512
    (cooperative, deferred stores); ``d = 256, n = 512``: the dH kernel shares A, 256-row
    varlen-K tiles; ``d = 256, n = 256`` interleaved: the 256-wide interleaved up-proj, the
    dA' GEMM sharing B, dW2 on 128 x 256 tiles untransposed; ``d = 256, n = 768``: the
    down-proj with K > 512 on 256-wide tiles; ``n = 192``: the dH kernel on 128-wide tiles;
    ``d = 2304``: dW2 untransposed with its cluster sharing A; FP8 fused with ``n = 256``
    interleaved: the 256-wide FP8 interleaved up-proj and dH kernel. Three registered variants
    no layer plans, so no case covers them: two ``bench_grouped_gemm.py --plans`` candidates
    (256-row varlen-M tiles, ping-pong varlen-K) and the FP8 SwiGLU "concat" up-proj on
    128-wide tiles (planned only where ``n`` is not a multiple of 128, which FP8 refuses)."""
    base = dict(T=256, d=128, n=128, E=8, K=2)
    fp8 = dict(T=256, d=256, n=128, E=8, K=2, precision="fp8")
    cases = [
        Case(**base, router="topk", gate_up="concat"),
        Case(**base, router="topk", gate_up="interleaved"),
        Case(**base, router="token_rounding", gate_up="concat", tile=64),
        Case(**base, router="token_rounding", gate_up="interleaved", tile=64, padded=True),
        Case(**base, router="empty_experts"),
        Case(T=256, d=128, n=128, E=8, K=1, router="hot_expert"),
        Case(T=1, d=128, n=128, E=8, K=2, router="topk"),
        Case(T=0, d=128, n=128, E=8, K=2, router="topk"),
        Case(**base, router="topk", dtype=torch.float32),
        Case(**base, router="topk", layer=True),
        Case(T=256, d=384, n=256, E=8, K=2, router="token_rounding", tile=64, padded=True),
        Case(T=256, d=128, n=384, E=8, K=2, router="topk", gate_up="interleaved"),
        Case(T=256, d=256, n=512, E=8, K=2, router="topk"),
        Case(**fp8, router="topk", fp8_epilogues="store"),
        Case(**fp8, router="topk", gate_up="interleaved"),
        *(Case(**fp8, router="token_rounding", tile=128, padded=True, fp8_epilogues=epilogues)
          for epilogues in ("store", "quantizing")),
        Case(**fp8, router="token_rounding", tile=128, padded=True, fp8_epilogues="fused",
             fp8_weight_grads="fp8"),
        Case(T=256, d=384, n=384, E=8, K=2, router="topk", precision="fp8",
             fp8_epilogues="fused", fp8_weight_grads="fp8"),
        Case(T=256, d=256, n=256, E=8, K=2, router="topk", gate_up="interleaved",
             precision="fp8", fp8_epilogues="fused", fp8_weight_grads="fp8"),
        Case(T=256, d=256, n=256, E=8, K=2, router="topk", gate_up="interleaved"),
        Case(T=256, d=256, n=768, E=8, K=2, router="topk"),
        Case(T=256, d=128, n=192, E=8, K=2, router="topk"),
        Case(T=64, d=2304, n=512, E=8, K=2, router="topk"),
        *(Case(T=256, d=128, n=512, E=8, K=2, router="topk", activation=act)
          for act in ("geglu", "geglu_tanh", "reglu", "relu2")),
        Case(T=256, d=128, n=256, E=8, K=2, router="topk", gate_up="interleaved",
             activation="geglu_tanh"),
    ]
    return [c for c in cases if pattern is None or re.search(pattern, str(c))]


# compute-sanitizer's tools the --compute-sanitizer driver runs, the records each of its runs
# prints at most (``--print-limit``), and its marker lines.
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
PRINT_LIMIT = 200
CASE_BEGIN, CASE_END, GEMM_CONFIG = "@@ case begin", "@@ case end", "@@ gemm config"
_PLAN_FIELDS = ("varlen_k", "ab_dtype", "epilogue", "gate_up", "gather_a", "gather_b",
                "b_n_major", "transpose_c", "tile_m", "tile_n", "pingpong", "cluster",
                "multicast_a", "activation")


def plan_key(cfg) -> str:
    """A grouped-GEMM configuration without its sizes: the compiled code path it selects."""
    return " ".join(f"{f}={getattr(cfg, f)}" for f in _PLAN_FIELDS)


def announce_gemm_plans(fill_tma_stores: bool = False) -> None:
    """From now on print the :func:`plan_key` of each grouped GEMM the first time it is
    launched (a ``@@ gemm config`` line, at once: a run stopped at its time limit still
    reports what it launched); with ``fill_tma_stores``, fill the outputs each launch writes by
    TMA (:func:`fill_tma_outputs`) before it."""
    from sonic.kernels.grouped_gemm import interface

    seen: set[str] = set()
    launcher = interface._launcher

    def announcing(cfg):
        key = plan_key(cfg)
        if key not in seen:
            seen.add(key)
            print(f"{GEMM_CONFIG} {key}", flush=True)
        launch = launcher(cfg)
        if not (fill_tma_stores and cfg.tma_stored):
            return launch

        def filled_launch(*args):
            fill_tma_outputs(cfg, args)
            return launch(*args)
        return filled_launch

    interface._launcher = announcing


# Under initcheck (``--initcheck``): the reference side runs on the CPU. On the GPU it runs
# cuBLAS and CUTLASS GEMMs (torch.matmul, torch._grouped_mm), whose Hopper kernels store their
# output by TMA too, so initcheck reports every later read of the reference's own results
# (excluding those kernels from the tool hides their stores as well; under racecheck an
# exclusion stopped the run in the sanitizer's own "failed to handle a hardware exception").
INITCHECK_REFERENCE = torch.device("cpu")


def initcheck_cases(cases: list[Case]) -> list[Case]:
    """The cases an initcheck run keeps: not the ``sonic.MoE`` layer, whose router GEMM (the
    gate's ``nn.Linear``, cuBLAS) writes the logits by TMA before sonic's top-K kernel reads
    them."""
    return [c for c in cases if not c.layer]


def tma_output_ranges(cfg, args: tuple) -> list[tuple[int, int]]:
    """``[(address, bytes)]`` of the outputs a launch of ``cfg`` writes by TMA
    (``cfg.tma_stored``), from the launcher's arguments (the addresses of
    :class:`~sonic.kernels.grouped_gemm.args.Operands`, then
    :class:`~sonic.kernels.grouped_gemm.args.Sizes`): C ``(P, N)`` of the varlen-M plain
    store, dH ``(P, 2n)`` and A' ``(P, n)`` of the dSwiGLU epilogue, C ``(E, M, N)`` of a
    varlen-K launch (``store_in_stage``), all bf16. An output at the address of one of the
    launch's inputs (the dH kernel writing dH over H) is left out: its rows hold the input's
    values, written before."""
    from sonic.kernels.grouped_gemm.args import Operands, Sizes

    fields = len(Operands._fields)
    operands, sizes = Operands(*args[:fields]), Sizes(*args[fields:])
    if cfg.varlen_k:
        elems = {"c": int(sizes.num_experts) * cfg.dim_m * cfg.dim_n}
    else:
        widths = {"c": 2 * cfg.dim_n if cfg.epilogue == "dswiglu" else cfg.dim_n,
                  "act": cfg.dim_n}
        elems = {name: int(sizes.rows_b) * width for name, width in widths.items()}
    # The operands the launch reads (an operand it never reads carries C's address).
    reads = ("a", "b", "offsets") + (("gather_a",) if cfg.gather_a else ()) + (
        ("gather_b",) if cfg.gather_b else ()) + (
        ("h", "scores") if cfg.epilogue == "dswiglu" else ())
    inputs = {getattr(operands, f) for f in reads}
    return [(getattr(operands, name), elems[name] * 2)
            for name in cfg.tma_stored if getattr(operands, name) not in inputs]


def fill_tma_outputs(cfg, args: tuple) -> None:
    """Fill the outputs :func:`tma_output_ranges` names with all-ones bytes (NaN in bf16) on the
    current stream, before the launch that writes them. compute-sanitizer's initcheck does not
    count TMA stores (``cp.async.bulk.tensor``) as writes: a torch read of a GEMM output that
    TMA wrote in full is reported uninitialised, a read of one written by thread stores is not
    (benchmarks/RESULTS.md). Filled by a memset, which initcheck does count, the rows read as
    written; a row the kernel should write and does not stays NaN, which the case's comparison
    with the reference reports as a failure."""
    from cuda.bindings import driver

    stream = driver.CUstream(torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()))
    for address, size in tma_output_ranges(cfg, args):
        (err,) = driver.cuMemsetD8Async(address, 0xFF, size, stream)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemsetD8Async of {size} bytes at {address:#x} failed: {err}")


def registered_gemm_plans(arch: str = "sm_90a") -> dict[str, str]:
    """``{registered grouped-GEMM variant: plan_key}`` of ``arch``, without compiling (the
    variants' configurations are taken where they would be compiled)."""
    from sonic.kernels import registry
    from sonic.kernels.grouped_gemm import interface

    compile_config = interface.compile_config
    interface.compile_config = lambda cfg, keep_ptx=False: cfg
    try:
        return {v.variant: plan_key(v.compile_fake()) for v in registry.variants(arch)
                if v.kernel == "grouped_gemm"}
    finally:
        interface.compile_config = compile_config


def _sanitizer_errors(lines: list[str]) -> int:
    """Error records among compute-sanitizer's lines: a top-level ``=========`` line that is
    not its banner, a summary or the exit note."""
    quiet = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "Target application",
             "Note:", "This tool")
    return sum(1 for ln in lines if re.match(r"========= \S", ln)
               and not ln[10:].startswith(quiet))


def parse_sanitizer_log(text: str) -> tuple[dict[str, int | None], int | None, set[str],
                                             list[str]]:
    """``({case: error records}, ERROR SUMMARY total or None, GEMM plans, failing case lines)``
    of one ``--compute-sanitizer`` child's output; records outside any case count under
    ``"(outside cases)"``. Once :data:`PRINT_LIMIT` records are printed the tool prints no more,
    so a case begun after that, and the stretch outside cases, have None records (unknown),
    not 0."""
    per_case: dict[str, int | None] = {}
    plans: set[str] = set()
    current, block, failed = "(outside cases)", [], []
    total = None
    printed, cut = 0, "were not printed" in text
    for ln in text.splitlines():
        if ln.startswith(CASE_BEGIN) or ln.startswith(CASE_END):
            records = _sanitizer_errors(block)
            printed += records
            _add_records(per_case, current, records)
            current = ln.split(" ", 3)[3] if ln.startswith(CASE_BEGIN) else "(outside cases)"
            if cut and printed >= PRINT_LIMIT:
                per_case[current] = None
            block = []
        elif ln.startswith(GEMM_CONFIG):
            plans.add(ln[len(GEMM_CONFIG):].strip())
        else:
            block.append(ln)
            # racecheck ends with its own summary line, counting hazards and errors
            summary = re.search(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: .*\((\d+) error", ln)
            if summary:
                total = int(summary.group(1) or summary.group(2))
            if re.match(r"\s*\d+ FAIL ", ln):
                failed.append(ln.strip())
    _add_records(per_case, current, _sanitizer_errors(block))
    return per_case, total, plans, failed


def _add_records(per_case: dict[str, int | None], case: str, records: int | None) -> None:
    """Add ``records`` to ``per_case[case]``; None (unknown) on either side stays None."""
    known = per_case.get(case, 0)
    per_case[case] = None if known is None or records is None else known + records


def record_kernels(text: str) -> dict[str, int]:
    """``{kernel: error records}`` of one compute-sanitizer log: each record's first
    ``at <function>`` frame (the device function it was reported in)."""
    tally: dict[str, int] = {}
    pending = False
    for ln in text.splitlines():
        if _sanitizer_errors([ln]):
            pending = True
        elif pending and re.match(r"=========\s+at ", ln):
            name = re.sub(r"\+0x[0-9a-f]+.*$", "", ln.split(" at ", 1)[1]).strip()
            tally[name] = tally.get(name, 0) + 1
            pending = False
    return tally


def merge_sanitizer_logs(parsed: list[tuple]) -> tuple:
    """One tool's :func:`parse_sanitizer_log` results over its shards, as one: records per
    case and summary totals added (None if a shard printed no summary), plans and failures
    joined."""
    per_case: dict[str, int | None] = {}
    for counts, *_ in parsed:
        for case, n in counts.items():
            _add_records(per_case, case, n)
    totals = [p[1] for p in parsed]
    total = None if any(t is None for t in totals) else sum(totals)
    return (per_case, total, set().union(*(p[2] for p in parsed)),
            [line for p in parsed for line in p[3]])


def run_sanitizers(tools: list[str], timeout: float, sanitizer: str, cases: str | None = None,
                   log_dir: str | None = None, shards: int = 1) -> int:
    """Run ``--sanitize`` under each compute-sanitizer tool (in parallel, one GPU), print the
    table of error records per case and tool, the kernels the records name and the
    grouped-GEMM variants covered; 0 when every tool reports no error and every case passes.
    ``cases``: the ``--cases`` filter handed to each run; ``log_dir``: keep each run's whole
    output there as ``<tool>.log`` (``<tool>.<shard>.log`` with shards); ``shards``: split
    each tool's cases over that many processes (``--shard i/N``), for the slow tools.
    initcheck's runs get ``--initcheck`` (:func:`fill_tma_outputs`, the reference on the CPU,
    :func:`initcheck_cases`)."""
    import subprocess
    import tempfile

    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
    runs = {}
    for tool in tools:
        for shard in range(shards):
            log = tempfile.TemporaryFile(mode="w+")
            proc = subprocess.Popen(
                [sanitizer, "--tool", tool, "--report-api-errors", "no",
                 "--print-limit", str(PRINT_LIMIT),
                 sys.executable, os.path.abspath(__file__), "--sanitize",
                 *(("--initcheck",) if tool == "initcheck" else ()),
                 *(("--cases", cases) if cases else ()),
                 *(("--shard", f"{shard}/{shards}") if shards > 1 else ())],
                stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
            runs[tool, shard] = (proc, log)
    start = time.monotonic()
    codes, parsed = {}, {}
    for (tool, shard), (proc, log) in runs.items():
        try:
            rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.seek(0)
        text = log.read()
        name = f"{tool}.{shard}" if shards > 1 else tool
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, f"{name}.log"), "w") as f:
                f.write(text)
        parsed.setdefault(tool, []).append(parse_sanitizer_log(text))
        codes[tool] = codes.get(tool, 0) or rc
        if rc != 0 or parsed[tool][-1][1] is None:
            print(f"--- {name}: exit {rc}; last lines ---\n" + "\n".join(
                text.splitlines()[-15:]), flush=True)
        for kernel, count in sorted(record_kernels(text).items(), key=lambda kv: -kv[1]):
            print(f"{name}: {count} records in {kernel}", flush=True)
    results = {t: (codes[t], *merge_sanitizer_logs(parsed[t])) for t in tools}
    bad = False
    names = [str(c) for c in sanitize_cases(cases)] + ["(outside cases)"]
    width = max(len(c) for c in names)
    print(f"{'case':<{width}} " + " ".join(f"{t:>10}" for t in tools))
    # "n/a": a case initcheck's runs leave out (initcheck_cases); "-": a case not reached;
    # "?": a case run after its process had printed PRINT_LIMIT records.
    kept = {str(c) for c in initcheck_cases(sanitize_cases(cases))} | {"(outside cases)"}

    def cell(tool: str, case: str) -> str:
        if tool == "initcheck" and case not in kept:
            return "n/a"
        count = results[tool][1].get(case, "-")
        return "?" if count is None else str(count)

    for case in names:
        print(f"{case:<{width}} " + " ".join(f"{cell(t, case):>10}" for t in tools))
    print(f"{'ERROR SUMMARY':<{width}} " + " ".join(
        f"{results[t][2] if results[t][2] is not None else 'none'!s:>10}" for t in tools))
    for tool in tools:
        rc, _, total, _, failed = results[tool]
        bad |= rc != 0 or total is None or total > 0 or bool(failed)
        for line in failed:
            print(f"{tool}: {line}")
    launched = set().union(*(results[t][3] for t in tools))
    registered = registered_gemm_plans()
    covered = sorted(v for v, key in registered.items() if key in launched)
    print(f"grouped-GEMM variants (sm_90a registry) covered: {len(covered)}/{len(registered)}")
    for v, key in registered.items():
        print(f"  {'covered    ' if v in covered else 'not covered'} {v}")
    for key in sorted(launched - set(registered.values())):
        print(f"  launched, not a registered variant: {key}")
    print("sanitizers: " + ("ERRORS" if bad else "clean"), flush=True)
    return 1 if bad else 0


def random_case(rng: random.Random) -> Case:
    """A random case; about a third of d, n off the multiples of 64 the kernels tile by."""
    def dim():
        return rng.choice([64, 128, 256, 512]) if rng.random() < 0.7 else rng.choice(
            [3, 8, 24, 72, 100])

    E = rng.choice([1, 2, 4, 8, 16, 64, 128, 256])
    router = rng.choice(ROUTERS)
    # The layer computes its own logits: only bf16 ones are ordered identically by the top-K
    # kernel and the sort (see _inputs), and only top-K routing (see _run).
    layer = router == "topk" and rng.random() < 0.2
    return Case(T=rng.choice([1, 2, 7, 64, 129, 500, 1024, 4096]), d=dim(), n=dim(), E=E,
                K=rng.randint(1, min(E, 8)), router=router,
                dtype=torch.bfloat16 if layer else rng.choice([torch.bfloat16, torch.float32]),
                gate_up=rng.choice(["concat", "interleaved"]),
                tile=rng.choice([16, 64, 128]), layer=layer)


def tma_store_control(device: torch.device) -> list[str]:
    """The control behind :func:`fill_tma_outputs`, to run under initcheck
    (``--tma-store-control``): between one pair of case markers torch reads in full an output
    a grouped GEMM wrote with thread stores (the SwiGLU up-proj's H), between the next pair one
    written by TMA (the deferred plain store's C). Records between the second pair and none
    between the first say that initcheck does not count TMA stores as writes. Beforehand the
    same GEMMs write into NaN-filled outputs, which must come back finite: every row is
    written, so a record is not a real uninitialised read. Returns the problems found (a
    non-finite output, or a plain store that is not TMA-stored on this device)."""
    from sonic.kernels import runtime
    from sonic.kernels.grouped_gemm import heuristic, interface

    g = torch.Generator(device=device).manual_seed(0)
    E, P, K, N = 8, 1024, 1024, 256
    a = torch.randn(P, K, device=device, dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(E, 2 * N, K, device=device, dtype=torch.bfloat16, generator=g) / 32
    b = torch.randn(E, N, K, device=device, dtype=torch.bfloat16, generator=g) / 32
    offsets = torch.arange(0, P + 1, P // E, device=device, dtype=torch.int32)
    rows = torch.arange(P, device=device, dtype=torch.int32)
    problems = []
    cfg = heuristic.varlen_m_config(N, K, False, epilogue="store",
                                    arch=runtime.device_arch(device),
                                    rows_per_expert=P // E)
    if cfg.tma_stored != ("c",):
        problems.append(f"the plain store here is not TMA-stored: {plan_key(cfg)}")
    nan = float("nan")
    h = interface.grouped_gemm_swiglu(a, w1, offsets, rows, "concat",
                                      h_out=torch.full((P, 2 * N), nan, device=device,
                                                       dtype=torch.bfloat16))[0]
    c = interface.grouped_gemm(a, b, offsets, out=torch.full((P, N), nan, device=device,
                                                             dtype=torch.bfloat16))
    if not (torch.isfinite(h).all() and torch.isfinite(c).all()):
        problems.append("a GEMM left a row of its NaN-filled output unwritten")
    for what, output in (("thread-stored H (SwiGLU up-proj)",
                          lambda: interface.grouped_gemm_swiglu(a, w1, offsets, rows,
                                                                "concat")[0]),
                         ("TMA-stored C (deferred plain store)",
                          lambda: interface.grouped_gemm(a, b, offsets))):
        fresh = output()
        torch.cuda.synchronize(device)
        print(f"{CASE_BEGIN} {what}", flush=True)
        fresh.float().sum().item()
        print(f"{CASE_END}", flush=True)
    return problems


def shard_of(parser: argparse.ArgumentParser, text: str) -> slice:
    """The cases of ``--shard i/N``: every N-th from the i-th."""
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        parser.error(f"--shard must be i/N with 0 <= i < N, got {text!r}")
    return slice(index, None, count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sanitize", action="store_true",
                      help="small cases of every kernel path (for compute-sanitizer)")
    mode.add_argument("--random", type=int, metavar="N", help="run up to N random cases")
    mode.add_argument("--tma-store-control", action="store_true",
                      help="the initcheck control of TMA-stored outputs (run it under "
                           "compute-sanitizer --tool initcheck)")
    mode.add_argument("--compute-sanitizer", action="store_true",
                      help="run --sanitize under compute-sanitizer's tools and tabulate")
    parser.add_argument("--tools", default=",".join(SANITIZER_TOOLS),
                        help="--compute-sanitizer: comma-separated tools (default: all four)")
    parser.add_argument("--sanitizer", default="compute-sanitizer",
                        help="--compute-sanitizer: the compute-sanitizer executable")
    parser.add_argument("--cases", metavar="REGEX",
                        help="--sanitize / --compute-sanitizer: only the cases whose line "
                             "matches this regular expression")
    parser.add_argument("--shards", type=int, default=1, metavar="N",
                        help="--compute-sanitizer: split each tool's cases over N processes")
    parser.add_argument("--shard", metavar="I/N",
                        help="--sanitize: run only the cases i, i+N, i+2N, ... (0-based)")
    parser.add_argument("--initcheck", action="store_true",
                        help="--sanitize: prepare the run for compute-sanitizer's initcheck "
                             "(TMA-stored outputs filled, reference on the CPU, no layer case; "
                             "what --compute-sanitizer passes it)")
    parser.add_argument("--log-dir", metavar="DIR",
                        help="--compute-sanitizer: keep each tool's whole output in DIR/<tool>.log")
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="time limit of --random (default 600)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random cases")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (self-check)")
    args = parser.parse_args(argv)
    if args.random is not None and args.random < 1:
        parser.error(f"--random must be >= 1, got {args.random}")
    if not args.seconds > 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    if args.initcheck and not args.sanitize:
        parser.error("--initcheck prepares a --sanitize run; give it with --sanitize")
    if args.cases is not None:
        try:
            matched = sanitize_cases(args.cases)
        except re.error as e:
            parser.error(f"--cases must be a regular expression, got {args.cases!r}: {e}")
        if not matched:
            parser.error(f"--cases {args.cases!r} matches none of the --sanitize cases")
    if args.compute_sanitizer:
        tools = [t for t in args.tools.split(",") if t]
        unknown = sorted(set(tools) - set(SANITIZER_TOOLS))
        if unknown or not tools:
            parser.error(f"--tools must name some of {SANITIZER_TOOLS}, got {args.tools!r}")
        if args.shards < 1:
            parser.error(f"--shards must be >= 1, got {args.shards}")
        return run_sanitizers(tools, args.seconds, args.sanitizer, args.cases, args.log_dir,
                              args.shards)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available (use --device cpu to check "
                     "the script itself)")
    if args.tma_store_control:
        if device.type != "cuda":
            parser.error("--tma-store-control runs sonic's grouped GEMMs: it needs --device cuda")
        problems = tma_store_control(device)
        for problem in problems:
            print(f"FAIL {problem}", flush=True)
        return 1 if problems else 0
    print(f"device {device}: {sonic.explain_backend('auto', device)}", flush=True)

    rng = random.Random(args.seed)
    cases = sanitize_cases(args.cases) if args.sanitize else None
    if cases is not None and args.shard is not None:
        cases = cases[shard_of(parser, args.shard)]
    if args.sanitize and device.type == "cuda":
        announce_gemm_plans(fill_tma_stores=args.initcheck)
    reference_device = None
    if args.initcheck and cases is not None:
        cases, reference_device = initcheck_cases(cases), INITCHECK_REFERENCE
    start, count, failures = time.monotonic(), 0, 0
    while True:
        if cases is not None:
            if count == len(cases):
                break
            case = cases[count]
        else:
            if count == args.random or time.monotonic() - start > args.seconds:
                break
            case = random_case(rng)
        if cases is not None:
            print(f"{CASE_BEGIN} {case}", flush=True)
        passed, summary = run_case(case, seed=args.seed * 100003 + count, device=device,
                                   reference_device=reference_device)
        if cases is not None:
            print(f"{CASE_END}", flush=True)
        count += 1
        failures += not passed
        print(f"{count:5d} {'ok  ' if passed else 'FAIL'} {case}: {summary}", flush=True)
    print(f"{count} cases, {failures} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
