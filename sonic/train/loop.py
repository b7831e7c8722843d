"""Training loop of the byte-level MoE language model: AdamW, warmup + cosine schedule,
top-K validation, and the activation memory one MoE layer keeps for backward."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from sonic import MoEConfig, collect_aux_losses, explain_backend, profile_activation_memory
from sonic._output import check_writable
from sonic.backend import kernel_support
from sonic.distributed import MAX_CHUNKS
from sonic.types import (TRANSPORTS, ActivationCache, Backend, Precision, Router,
                         Transport)
from sonic.train import parallel
from sonic.train.checkpoint import read_checkpoint, write_checkpoint
from sonic.train.data import VOCAB_SIZE, ByteCorpus, load_text
from sonic.train.model import ByteMoELM

EXPERTS_IMPLS = ("sonic", "torch-gmm")
"""Who runs the MoE layers: `sonic.MoE`, or the torch-gmm baseline on the same parameters
(`sonic.train.model.TorchGmmMoE`)."""

PRESETS = {
    "cpu": {},
    "gpu": dict(d_model=1024, layers=8, heads=8, experts=64, top_k=8, d_expert=1024,
                batch_size=32, seq_len=1024, tile=128, lr=1e-3, steps=300),
}
"""Sizes of :class:`TrainConfig` per preset: ``"cpu"`` is the defaults (0.97 M parameters, a
few minutes on two cores); ``"gpu"`` is a model whose MoE layers dominate the step (about 83%
of its FLOPs: T = 32768 tokens, d = 1024, E = 64 experts of n = 1024, top-8; 1.6 G
parameters), so the experts' speed decides the run's, and which fits one 80 GB GPU also with
the torch-gmm experts."""

PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}
"""Dense bf16 tensor-core peak per GPU (NVIDIA data sheets), matched against
``torch.cuda.get_device_name`` in this order; the denominator of MFU."""

_VAL_SEED = 1234
"""Seed of the validation windows: fixed, so runs with different seeds or routers are scored on
the same bytes."""

logger = logging.getLogger(__name__)

_MAX_SEED = 2**63 - 1
"""Seeds go to ``torch.manual_seed`` (at most ``2**64 - 1``), the probe batch uses ``seed + 1``;
``2**63 - 1`` keeps both in int64."""

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on (defaults: the CLI's defaults).

    Sizes: ``batch_size·seq_len`` = ``T`` tokens per step and per MoE layer; ``d_model`` = ``d``,
    ``experts`` = ``E``, ``top_k`` = ``K``, ``d_expert`` = ``n``; ``tile`` = ``M_tile`` of token
    rounding. ``device=None`` picks CUDA when available, else the CPU; ``dtype="auto"`` is
    bfloat16 on CUDA and float32 on the CPU (bfloat16 everywhere with ``precision="fp8"``, which
    computes in bf16). ``precision`` is every MoE layer's (``"fp8"``: block-scaled e4m3 expert
    GEMMs; d_model and d_expert multiples of 128). ``data=None`` trains on the CPython documentation
    topics. ``eval_every=0`` evaluates only at step 0 and at the end. ``backend`` is passed to
    every `sonic.MoE` layer. ``steps`` is the length of the whole run (the learning-rate
    schedule spans it), also when it is resumed from a checkpoint. ``ep`` is the expert-parallel
    size under ``torchrun`` (see :mod:`sonic.train.parallel`): ``batch_size`` is then per rank,
    the global batch ``WORLD_SIZE·batch_size`` windows; ``ep_chunks`` the ``num_chunks`` of
    every `sonic.distributed.ExpertParallelMoE` (all-to-alls overlapped with the experts of
    other chunks; no effect with ``ep = 1``), ``ep_recompute_dispatch`` its
    ``recompute_dispatch`` (received rows sent again in backward instead of kept),
    ``ep_transport`` its ``transport`` (``"nccl"``, ``"copy_engine"`` or ``"auto"``: what
    moves the token rows; the same values either way).
    ``activation_cache`` is every `sonic.MoE`'s (``"fp8"`` keeps H in e4m3 for backward; it
    needs bfloat16 parameters and ``d_expert`` a multiple of 64). ``experts_impl`` is who runs
    the MoE layers (:data:`EXPERTS_IMPLS`; ``"torch-gmm"`` needs top-K, bf16 and ``ep = 1``).
    ``peak_tflops`` is the GPU's dense bf16 peak for MFU (``None``: :func:`peak_tflops`).
    :func:`preset_config` gives the sizes of a preset (:data:`PRESETS`); the defaults are
    the ``"cpu"`` preset's. :meth:`moe_config` gives the :class:`sonic.MoEConfig` of the
    model's MoE layers, made of the fields ``d_model``, ``d_expert``, ``experts``, ``top_k``,
    ``router``, ``tile``, ``aux_loss_coef``, ``backend``, ``precision`` and
    ``activation_cache``, which it checks.

    Raises:
        ValueError: a field out of range (the message names it).
        TypeError: a layer field of the wrong type (see :meth:`moe_config`).
    """

    steps: int = 600
    router: Router = "topk"
    batch_size: int = 16
    seq_len: int = 128
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    d_expert: int = 128
    tile: int = 32
    aux_loss_coef: float = 0.01
    lr: float = 3e-3
    warmup: int = 40
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    val_fraction: float = 0.1
    data: str | None = None
    device: str | None = None
    dtype: str = "auto"
    backend: Backend = "auto"
    precision: Precision = "bf16"
    seed: int = 0
    ep: int = 1
    ep_chunks: int = 1
    ep_recompute_dispatch: bool = False
    ep_transport: Transport = "nccl"
    activation_cache: ActivationCache = "bf16"
    experts_impl: str = "sonic"
    peak_tflops: float | None = None

    def __post_init__(self):
        if self.experts_impl not in EXPERTS_IMPLS:
            raise ValueError(f"experts_impl: expected one of {EXPERTS_IMPLS}, got "
                             f"{self.experts_impl!r}")
        if self.experts_impl == "torch-gmm" and (self.router, self.precision, self.activation_cache,
                                                 self.ep) != ("topk", "bf16", "bf16", 1):
            raise ValueError("experts_impl: torch-gmm trains top-K routing with bf16 experts on "
                             "one process (router topk, precision bf16, activation_cache bf16, "
                             "ep 1)")
        if self.peak_tflops is not None and not (isinstance(self.peak_tflops, (int, float))
                                                 and math.isfinite(self.peak_tflops)
                                                 and self.peak_tflops > 0):
            raise ValueError(f"peak_tflops: expected a positive number, got {self.peak_tflops!r}")
        positive = ("steps", "batch_size", "seq_len", "d_model", "layers", "heads", "experts",
                    "top_k", "d_expert", "tile", "eval_batches", "ep", "ep_chunks")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("warmup", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < _MAX_SEED:
            raise ValueError(f"seed: expected an integer in [0, {_MAX_SEED}), got {self.seed!r}")
        if not isinstance(self.ep_recompute_dispatch, bool):
            raise ValueError(f"ep_recompute_dispatch: expected a bool, got "
                             f"{self.ep_recompute_dispatch!r}")
        if self.ep_transport not in TRANSPORTS:
            raise ValueError(f"ep_transport: expected one of {TRANSPORTS}, got "
                             f"{self.ep_transport!r}")
        if self.ep_chunks > MAX_CHUNKS:
            raise ValueError(f"ep_chunks: expected at most {MAX_CHUNKS}, got {self.ep_chunks}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model: expected a multiple of heads={self.heads}, "
                             f"got {self.d_model}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: expected a positive finite number, got {self.lr!r}")
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip: expected a positive number, got {self.grad_clip!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {self.dtype!r}")
        self.moe_config()
        if self.precision == "fp8" and self.dtype == "float32":
            raise ValueError("dtype: precision 'fp8' computes in bfloat16; use --dtype "
                             "bfloat16 or auto")
        if self.activation_cache == "fp8" and self.dtype == "float32":
            raise ValueError("activation_cache: 'fp8' keeps a bf16 H in e4m3 and needs "
                             "bfloat16 parameters, got dtype 'float32'")

    def moe_config(self) -> MoEConfig:
        """The :class:`sonic.MoEConfig` of every MoE layer of the model (``experts`` is its
        ``num_experts``; the layer options without a field here keep their defaults).

        Raises:
            TypeError / ValueError: what :class:`sonic.MoEConfig` raises, naming the field.
        """
        return MoEConfig(self.d_model, self.d_expert, self.experts, self.top_k,
                         router=self.router, tile=self.tile, aux_loss_coef=self.aux_loss_coef,
                         backend=self.backend, precision=self.precision,
                         activation_cache=self.activation_cache)


def preset_config(preset: str, **overrides) -> TrainConfig:
    """A :class:`TrainConfig` with the sizes of :data:`PRESETS` ``[preset]`` and ``overrides``.

    Raises:
        ValueError: unknown ``preset``, or what :class:`TrainConfig` raises.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {tuple(PRESETS)}, got {preset!r}")
    return TrainConfig(**{**PRESETS[preset], **overrides})


def flops_per_token(config: TrainConfig) -> float:
    """Training FLOPs (forward and backward) per token of the model :class:`TrainConfig`
    describes, counting matrix products only (PaLM's MFU convention, Chowdhery et al. 2022,
    App. B, with causal attention scoring half of the ``S²`` pairs):

    * MoE layer, ``18·K·d·n``: the up-projection ``2·d·2n`` and down-projection ``2·n·d`` per
      routed pair, times 3 for backward (SonicMoE §2);
    * router ``6·d·E``; attention projections ``24·d²``; attention scores ``6·S·d`` (``QKᵀ``
      and ``AV`` over the causal half);
    * the output head ``6·d·256``.
    """
    d, n, S = config.d_model, config.d_expert, config.seq_len
    per_layer = 18 * config.top_k * d * n + 6 * d * config.experts + 24 * d * d + 6 * S * d
    return config.layers * per_layer + 6 * d * VOCAB_SIZE


def moe_flops_share(config: TrainConfig) -> float:
    """The MoE layers' ``18·K·d·n`` share of :func:`flops_per_token`."""
    moe = config.layers * 18 * config.top_k * config.d_model * config.d_expert
    return moe / flops_per_token(config)


def peak_tflops(device: torch.device) -> float | None:
    """:data:`PEAK_TFLOPS` of ``device``'s GPU model; ``None`` on the CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in PEAK_TFLOPS.items() if key in name), None)


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', "
                         f"got {name!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {name!r} (training "
                         f"needs real tensors)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} requested but CUDA is not available")
    return device


def _check_backend(backend: str, device: torch.device) -> None:
    """``backend="cute"`` where the kernels cannot run fails here, before the model is built,
    instead of in the first forward."""
    if backend == "cute":
        ok, reason = kernel_support(device)
        if not ok:
            raise ValueError(f"backend: 'cute' needs sonic's CuTe kernels, which cannot run "
                             f"here ({reason}); use --backend auto or torch")


def lr_factor(step: int, *, steps: int, warmup: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) over the peak: linear warmup to 1
    over ``warmup`` steps, then cosine decay towards 0.1 at step ``steps`` (the
    ``torch.optim.lr_scheduler.LambdaLR`` factor of :func:`train`)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def _lm_loss(model: torch.nn.Module, inputs: torch.Tensor,
             targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    # Cross-entropy in fp32 even for bf16 models: a bf16 log-softmax rounds the loss itself.
    return F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: ByteMoELM, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-byte cross-entropy (nats) over ``batches``, in eval mode: every `sonic.MoE`
    routes by top-K, whatever router it trains with (SonicMoE §5.2). Restores train mode."""
    model.eval()
    try:
        losses = [_lm_loss(model, inputs, targets) for inputs, targets in batches]
    finally:
        model.train()
    return torch.stack(losses).mean().item()


def _activation_mib(model: ByteMoELM, inputs: torch.Tensor) -> float:
    """MiB the first MoE layer keeps for backward on the ``(B·S, d)`` input it sees for
    ``inputs``, in train mode (so with the training router)."""
    moe = model.moe_layers[0]
    captured = []
    hook = moe.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        hook.remove()
    # Inside a model the layer input is an activation that requires grad; so does the probe.
    x = captured[0].reshape(-1, captured[0].shape[-1]).detach().requires_grad_()
    return profile_activation_memory(moe, x).activation_mib


CHECKPOINT_VERSION = 2
# Fields a resumed run may change; every other one must match the checkpoint's.
# ep_chunks only reorders the sums of expert weight gradients; ep_recompute_dispatch and
# ep_transport change no value: a run may resume with others.
_RESUMABLE_CHANGES = ("steps", "eval_every", "eval_batches", "device", "ep_chunks",
                      "ep_recompute_dispatch", "ep_transport", "peak_tflops")


def load_checkpoint(path: str | os.PathLike, config: TrainConfig, world_size: int = 1,
                    rank: int = 0) -> dict:
    """Read a checkpoint written by :func:`train` with ``save=``
    (:func:`sonic.train.checkpoint.read_checkpoint`: checksum and history verified) and check
    that ``config`` may continue it (same model, data and optimisation settings, same number
    of processes and rank; ``steps`` and evaluation settings may differ).

    Raises:
        ValueError: a corrupted or foreign file, or one ``config`` may not continue.
    """
    state = read_checkpoint(path)
    if state["version"] != CHECKPOINT_VERSION:
        raise ValueError(f"resume: {str(path)!r} is a version {state['version']!r} checkpoint; "
                         f"this sonic reads version {CHECKPOINT_VERSION}")
    saved = state["config"]
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    differ = [f.name for f in fields(TrainConfig) if f.name not in _RESUMABLE_CHANGES
              and saved.get(f.name, defaults[f.name]) != getattr(config, f.name)]
    if differ:
        detail = ", ".join(f"{n}={saved.get(n, defaults[n])!r} (now {getattr(config, n)!r})"
                           for n in differ)
        raise ValueError(f"resume: the checkpoint was trained with different settings: {detail}")
    if (state["world_size"], state["rank"]) != (world_size, rank):
        raise ValueError(f"resume: the checkpoint is rank {state['rank']} of "
                         f"{state['world_size']} processes, this is rank {rank} of {world_size}")
    if state["step"] > config.steps:
        raise ValueError(f"resume: the checkpoint is at step {state['step']}, past "
                         f"steps={config.steps}")
    return state


def _check_model_state(saved: dict, model: torch.nn.Module, path: str) -> None:
    """The checkpoint's model tensors have the model's names, shapes and dtypes."""
    expected = model.state_dict()
    if saved.keys() != expected.keys():
        raise ValueError(f"resume: checkpoint {path!r} holds parameters "
                         f"{sorted(saved.keys() ^ expected.keys())} that do not match the model")
    for key, tensor in expected.items():
        got = saved[key]
        if not isinstance(got, torch.Tensor) or got.shape != tensor.shape \
                or got.dtype != tensor.dtype:
            what = (f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor)
                    else type(got).__name__)
            raise ValueError(f"resume: checkpoint {path!r}: {key} is {what}, the model's is "
                             f"{tuple(tensor.shape)} {tensor.dtype}")


def _check_optimizer_state(optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every AdamW moment has its parameter's shape (``load_state_dict`` checks only the
    number of parameters)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if key != "step" and value.shape != p.shape:
                    raise ValueError(f"resume: checkpoint {path!r}: an optimizer {key} is "
                                     f"{tuple(value.shape)}, its parameter {tuple(p.shape)}")


def _tensorboard_writer(logdir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ValueError("tensorboard: logging to TensorBoard needs the tensorboard package "
                         "(pip install tensorboard)") from err
    return SummaryWriter(logdir)


def train(config: TrainConfig, *, progress: bool = True, save: str | None = None,
          save_every: int = 0, resume: str | None = None, stop_after: int | None = None,
          log_jsonl: str | None = None, tensorboard: str | None = None) -> dict:
    """Train one model (from scratch or from a checkpoint) and score it.

    Loss = next-byte cross-entropy + Σ over MoE layers of their load-balancing loss
    (``config.aux_loss_coef ·`` :func:`sonic.load_balancing_loss`, collected with
    :func:`sonic.collect_aux_losses`). Same config on the same device → same losses, and a run
    stopped and resumed from its checkpoint gives the losses of the uninterrupted run.

    Args:
        config: the run.
        progress: draw a tqdm bar (on stderr) with the loss, the latest validation loss and
            tokens/s.
        save: checkpoint path (``torch.save``: model, optimizer, step, config, data-sampler
            state, losses so far), written at the end of the run, after ``stop_after`` steps
            and every ``save_every`` steps.
        resume: a checkpoint to continue from; the run goes on to ``config.steps``.
        stop_after: stop after this many optimizer steps of this call (the schedule still
            spans ``config.steps``); with ``save``, a checkpoint to resume from.
        log_jsonl: append one JSON line per step: ``step``, ``loss`` (cross-entropy),
            ``aux_loss``, ``lr``, ``tokens_per_s`` (since the first step of this call), and
            ``val_loss`` on steps that evaluated.
        tensorboard: a TensorBoard log dir (``torch.utils.tensorboard``; needs the
            ``tensorboard`` package): the same scalars.

    Under ``torchrun`` (``WORLD_SIZE > 1``) every rank calls this; it initialises
    ``torch.distributed`` (NCCL on CUDA, one device per process, ``cuda:LOCAL_RANK``; gloo on
    the CPU) unless already initialised, and trains expert parallel over groups of
    ``config.ep`` ranks and data parallel over the rest, on a device mesh ``("dp", "ep")``
    with `torch.nn.parallel.DistributedDataParallel` (:mod:`sonic.train.parallel`). Each rank
    reads its own ``batch_size`` windows of a global batch of ``WORLD_SIZE·batch_size`` (the
    windows one process would read with that batch size); the losses are means over all ranks;
    only rank 0 draws the progress bar and writes ``log_jsonl``/``tensorboard``; checkpoints
    are per rank, ``save + ".rank{r}"`` (``resume`` names the same ``PATH``).

    Returns:
        A JSON-serialisable dict: ``router``, ``steps`` (steps done in total), ``train_loss``
        (mean cross-entropy of the last 10% of steps), ``val_loss_initial`` (step 0) and
        ``val_loss`` (end), both over the same ``eval_batches`` validation batches with top-K
        routing, ``val_history`` (``[step, val_loss]`` pairs), ``tokens_per_s`` (training steps
        after the first of this call, which pays for warm-up; periodic evaluations excluded),
        ``activation_MiB_per_layer``, ``params``, ``device``, ``dtype``, ``backend`` (what
        ``"auto"`` resolved to, and why), ``seed``, ``config``, ``losses`` (cross-entropy of
        every step), ``world_size``, ``ep``, ``experts_impl``, ``tokens_per_s_history`` (the
        running ``tokens_per_s`` after each step of this call; ``None`` for its first),
        ``peak_memory_MiB`` (CUDA allocator peak of this call; ``None`` on the CPU),
        ``flops_per_token`` (:func:`flops_per_token`), ``moe_flops_share``, ``peak_tflops``
        (``config.peak_tflops`` or :func:`peak_tflops`) and ``mfu`` (model FLOPs utilisation,
        ``None`` without a known peak); under ``torchrun``, ``tokens_per_s`` is the global
        rate (all ranks' tokens) and ``params`` counts every expert once.

    Raises:
        ValueError: unusable device, a corpus too short for ``seq_len``, a checkpoint that does
            not fit ``config``, TensorBoard requested but not installed, ``config.ep`` that does
            not divide the world size or ``config.experts``.
    """
    device = _resolve_device(config.device)
    _check_backend(config.backend, device)
    for option, path in (("log_jsonl", log_jsonl), ("save", save)):
        if path is not None:
            check_writable(option, path)
    par, device = parallel.setup(config.ep, config.experts, device)
    succeeded = False
    try:
        summary = _train(config, par, device, progress=progress and par.is_main, save=save,
                         save_every=save_every, resume=resume, stop_after=stop_after,
                         log_jsonl=log_jsonl if par.is_main else None,
                         tensorboard=tensorboard if par.is_main else None)
        succeeded = True
        return summary
    finally:
        # A rank that failed alone must not wait at a barrier its peers never reach.
        par.close(together=succeeded)


def _train(config: TrainConfig, par: parallel.Parallel, device: torch.device, *, progress: bool,
           save: str | None, save_every: int, resume: str | None, stop_after: int | None,
           log_jsonl: str | None, tensorboard: str | None) -> dict:
    dtype = _DTYPES[config.dtype] or (torch.bfloat16 if device.type == "cuda"
                                      or config.precision == "fp8" else torch.float32)
    if config.activation_cache == "fp8" and dtype != torch.bfloat16:
        raise ValueError(f"activation_cache: 'fp8' needs bfloat16 parameters; dtype "
                         f"{config.dtype!r} is {dtype} on {device} (pass --dtype bfloat16)")
    corpus = ByteCorpus(load_text(config.data), val_fraction=config.val_fraction,
                        seq_len=config.seq_len)
    if par.distributed:   # one checkpoint file per rank
        save = f"{save}.rank{par.rank}" if save else None
        resume = f"{resume}.rank{par.rank}" if resume else None
    state = load_checkpoint(resume, config, par.world, par.rank) if resume else None
    writer = _tensorboard_writer(tensorboard) if tensorboard else None

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = _build_model(config, par, device, dtype)
    trained = parallel.data_parallel(model, par)   # what the training forwards run through
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)

    def to_device(batch):
        return tuple(t.to(device, non_blocking=True) for t in batch)

    val_gen = torch.Generator().manual_seed(_VAL_SEED)
    val_batches = [to_device(corpus.batch("val", config.batch_size, config.seq_len, val_gen,
                                          shard=par.rank, num_shards=par.world))
                   for _ in range(config.eval_batches)]

    def validate() -> float:
        """Validation loss of the global batches (each rank scores its shard)."""
        loss = evaluate(model, val_batches)
        if par.distributed:
            loss = parallel.mean_over_world(torch.tensor(loss, device=device), par).item()
        return loss

    train_gen = torch.Generator().manual_seed(config.seed)

    if state is not None and resume is not None:      # state comes from resume
        start, val_history, losses = _restore(state, model, optimizer, train_gen, resume)
    else:
        start, val_history, losses = 0, [[0, validate()]], []
    end = config.steps if stop_after is None else min(config.steps, start + stop_after)
    # Built at the resumed step (the optimizer state holds its initial_lr) from this run's
    # `steps`, which a resumed run may change.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, steps=config.steps, warmup=config.warmup),
        last_epoch=start - 1)
    tokens_per_step = config.batch_size * config.seq_len * par.world   # all ranks'

    def checkpoint_state(step: int) -> dict:
        return {"version": CHECKPOINT_VERSION, "step": step, "config": asdict(config),
                "world_size": par.world, "rank": par.rank,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "train_generator": train_gen.get_state(), "rng": torch.get_rng_state(),
                "val_history": val_history, "losses": [float(v) for v in losses]}

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    log = open(log_jsonl, "a" if resume else "w", encoding="utf-8") if log_jsonl else None
    if state is None:   # the step-0 validation loss; a resumed run's log already has it
        _write_record({"step": 0, "val_loss": val_history[0][1]}, log, writer)
    # Throughput is timed from the end of this call's first step, which pays for one-off
    # warm-up (kernel compilation, allocator growth); a 1-step run times that step itself.
    started = clock()
    warm = None
    eval_seconds = 0.0
    rates: list[float | None] = []   # tokens/s after each step of this call
    bar = tqdm(range(start, end), disable=not progress, desc=f"train[{config.router}]",
               unit="step", dynamic_ncols=True, initial=start, total=config.steps)
    redirect = logging_redirect_tqdm(loggers=[logging.getLogger("sonic")])
    redirect.__enter__()   # log lines above the bar, not through it
    try:
        for step in bar:
            lr = scheduler.get_last_lr()[0]
            batch = to_device(corpus.batch("train", config.batch_size, config.seq_len,
                                           train_gen, shard=par.rank, num_shards=par.world))
            lm_loss, aux_loss = _optimizer_step(model, trained, optimizer, scheduler, batch,
                                                config.grad_clip, par)
            losses.append(lm_loss)
            done = step + 1
            if warm is None:
                warm = clock()
            evaluated = None
            if done == config.steps or (config.eval_every and done % config.eval_every == 0):
                eval_started = clock()
                evaluated = validate()
                logger.info("step %d: val loss %.4f", done, evaluated)
                val_history.append([done, evaluated])
                eval_seconds += clock() - eval_started
            rate = None
            if done - start > 1:     # warm was set at the first step
                rate = (done - start - 1) * tokens_per_step / (
                    time.perf_counter() - warm - eval_seconds)  # type: ignore[operator]
            rates.append(rate)
            if log is not None or writer is not None:
                record = {"step": done, "loss": losses[-1].item(),
                          "aux_loss": float(aux_loss), "lr": lr, "tokens_per_s": rate}
                if evaluated is not None:
                    record["val_loss"] = evaluated
                _write_record(record, log, writer)
            if progress and (step % 10 == 0 or done == end or evaluated is not None):
                postfix = {"loss": f"{losses[-1].item():.3f}",
                           f"val@{val_history[-1][0]}": f"{val_history[-1][1]:.3f}"}
                if rate is not None:
                    postfix["tok/s"] = f"{rate:.0f}"
                bar.set_postfix(postfix, refresh=False)
            if save and save_every and done % save_every == 0 and done < end:
                write_checkpoint(save, checkpoint_state(done))
                logger.info("step %d: checkpoint written to %s", done, save)
        finished = clock()
    finally:
        bar.close()
        redirect.__exit__(None, None, None)
        if log is not None:
            log.close()
    steps_run = end - start
    # Past the first step (its warm-up excluded) when there is more than one.
    tokens_per_s = ((steps_run - 1) * tokens_per_step / (finished - warm - eval_seconds)
                    if steps_run > 1 and warm is not None
                    else steps_run * tokens_per_step / (finished - started))

    if end == config.steps and val_history[-1][0] != end:   # resumed at its last step
        val_history.append([config.steps, validate()])
    if writer is not None:
        writer.close()
    if save:
        write_checkpoint(save, checkpoint_state(end))
        logger.info("step %d: checkpoint written to %s", end, save)
    probe = to_device(corpus.batch("train", config.batch_size, config.seq_len,
                                   torch.Generator().manual_seed(config.seed + 1)))[0]
    return _summary(config, par, device, dtype, model, probe, end=end, losses=losses,
                    val_history=val_history, tokens_per_s=tokens_per_s, rates=rates)


def _optimizer_step(model: ByteMoELM, trained, optimizer, scheduler, batch: tuple,
                    grad_clip: float, par: parallel.Parallel) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on ``batch = (inputs, targets)``: the LM loss through ``trained`` (the model,
    or its data-parallel wrapper) plus the MoE layers' aux losses, backward, gradients clipped
    to ``grad_clip``, then the optimizer and schedule steps. Returns the detached
    ``(lm_loss, aux_loss)``, distributed: their means over the ranks (the global batch's)."""
    inputs, targets = batch
    with collect_aux_losses(model) as aux_losses:
        lm_loss = _lm_loss(trained, inputs, targets)
    aux_losses += model.take_aux_losses()
    aux_loss = sum(aux_losses[1:], aux_losses[0]) if aux_losses else lm_loss.new_zeros(())
    optimizer.zero_grad(set_to_none=True)
    (lm_loss + aux_loss).backward()
    parallel.clip_grad_norm(model, grad_clip, par)
    optimizer.step()
    scheduler.step()
    lm_loss, aux_loss = lm_loss.detach(), aux_loss.detach()
    if par.distributed:
        lm_loss, aux_loss = parallel.mean_over_world(
            torch.stack([lm_loss.float(), aux_loss.float()]), par)
    return lm_loss, aux_loss


def _restore(state: dict, model: ByteMoELM, optimizer, train_gen: torch.Generator,
             resume: str) -> tuple[int, list, list]:
    """Load a checked checkpoint ``state`` into the model, optimizer and generators; returns
    ``(step, val_history, losses)`` to continue from."""
    _check_model_state(state["model"], model, resume)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    _check_optimizer_state(optimizer, resume)
    train_gen.set_state(state["train_generator"])
    torch.set_rng_state(state["rng"])
    return (state["step"], [list(v) for v in state["val_history"]],
            [torch.tensor(v) for v in state["losses"]])


def _build_model(config: TrainConfig, par: parallel.Parallel, device: torch.device,
                 dtype: torch.dtype) -> ByteMoELM:
    """The model of ``config`` from its seed, its experts run by ``config.experts_impl`` and,
    with ``par.ep > 1``, split over the EP group."""
    torch.manual_seed(config.seed)
    model = ByteMoELM(max_seq_len=config.seq_len, num_layers=config.layers,
                      num_heads=config.heads, moe=config.moe_config(),
                      device=device, dtype=dtype)
    if config.experts_impl == "torch-gmm":
        model.use_torch_gmm_experts()
    if par.ep > 1:
        model.shard_experts(par.ep_group, num_chunks=config.ep_chunks,
                            recompute_dispatch=config.ep_recompute_dispatch,
                            transport=config.ep_transport)
    logger.info("model: %d layers, d=%d, E=%d experts of n=%d, top-%d, %s router; %s %s on %s; "
                "T=%d tokens per MoE layer and step", config.layers, config.d_model,
                config.experts, config.d_expert, config.top_k, config.router, dtype,
                config.precision, device, config.batch_size * config.seq_len)
    return model


def _write_record(record: dict, log, writer) -> None:
    """One step's record as a JSON line of ``log`` and scalars of the TensorBoard ``writer``
    (either may be ``None``)."""
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()
    if writer is not None:
        for key, value in record.items():
            if key != "step" and value is not None:
                writer.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", value,
                                  record["step"])


def _summary(config: TrainConfig, par: parallel.Parallel, device: torch.device,
             dtype: torch.dtype, model: ByteMoELM, probe: torch.Tensor, *, end: int,
             losses: list, val_history: list, tokens_per_s: float, rates: list) -> dict:
    """What :func:`train` returns (its docstring), from the finished run."""
    peak_mib = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
                else None)
    peak = config.peak_tflops or peak_tflops(device)
    mfu = (tokens_per_s * flops_per_token(config) / (peak * 1e12 * par.world)
           if peak and tokens_per_s else None)
    tail = max(1, len(losses) // 10)
    return {
        "router": config.router,
        "steps": end,
        "train_loss": torch.stack(losses[-tail:]).mean().item() if losses else float("nan"),
        "val_loss_initial": val_history[0][1],
        "val_loss": val_history[-1][1],
        "val_history": val_history,
        "tokens_per_s": tokens_per_s,
        "activation_MiB_per_layer": _activation_mib(model, probe),
        "params": _num_params(model, par),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "backend": explain_backend(config.backend, device),
        "precision": config.precision,
        "seed": config.seed,
        "config": asdict(config),
        "losses": [float(v) for v in losses],
        "world_size": par.world,
        "ep": par.ep,
        "experts_impl": config.experts_impl,
        "tokens_per_s_history": rates,
        "peak_memory_MiB": peak_mib,
        "flops_per_token": flops_per_token(config),
        "moe_flops_share": moe_flops_share(config),
        "peak_tflops": peak,
        "mfu": mfu,
    }


def _num_params(model: ByteMoELM, par: parallel.Parallel) -> int:
    """Parameters of the whole model: a rank holds 1/ep of the experts."""
    replicated, sharded = parallel.split_parameters(model)
    return sum(p.numel() for p in replicated) + par.ep * sum(p.numel() for p in sharded)
