"""Training loop of the byte-level MoE language model: AdamW, warmup + cosine schedule,
top-K validation, and the activation memory one MoE layer keeps for backward."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sonic import explain_backend, profile_activation_memory
from sonic.train.data import VOCAB_SIZE, ByteCorpus, load_text
from sonic.train.model import ByteMoELM

_VAL_SEED = 1234
"""Seed of the validation windows: fixed, so runs with different seeds or routers are scored on
the same bytes."""

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
_BACKENDS = ("auto", "torch", "cute")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on (defaults: the CLI's defaults).

    Sizes: ``batch_size·seq_len`` = ``T`` tokens per step and per MoE layer; ``d_model`` = ``d``,
    ``experts`` = ``E``, ``top_k`` = ``K``, ``d_expert`` = ``n``; ``tile`` = ``M_tile`` of token
    rounding. ``device=None`` picks CUDA when available, else the CPU; ``dtype="auto"`` is
    bfloat16 on CUDA and float32 on the CPU. ``data=None`` trains on the CPython documentation
    topics. ``eval_every=0`` evaluates only at step 0 and at the end. ``backend`` is passed to
    every `sonic.MoE` layer.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    steps: int = 600
    router: str = "topk"
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
    eval_every: int = 0
    eval_batches: int = 8
    val_fraction: float = 0.1
    data: str | None = None
    device: str | None = None
    dtype: str = "auto"
    backend: str = "auto"
    seed: int = 0

    def __post_init__(self):
        positive = ("steps", "batch_size", "seq_len", "d_model", "layers", "heads", "experts",
                    "top_k", "d_expert", "tile", "eval_batches")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("warmup", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {getattr(self, name)!r}")
        if self.router not in ("topk", "token_rounding"):
            raise ValueError(f"router: expected 'topk' or 'token_rounding', got {self.router!r}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model: expected a multiple of heads={self.heads}, "
                             f"got {self.d_model}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k: expected at most experts={self.experts}, got {self.top_k}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: expected a positive finite number, got {self.lr!r}")
        if not (math.isfinite(self.aux_loss_coef) and self.aux_loss_coef >= 0):
            raise ValueError(f"aux_loss_coef: expected a finite number >= 0, "
                             f"got {self.aux_loss_coef!r}")
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip: expected a positive number, got {self.grad_clip!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {_BACKENDS}, got {self.backend!r}")


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', "
                         f"got {name!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} requested but CUDA is not available")
    return device


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup to 1, then cosine decay to 0.1 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def _lm_loss(model: ByteMoELM, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
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


def train(config: TrainConfig, *, progress: bool = True) -> dict:
    """Train one model from scratch and score it.

    Loss = next-byte cross-entropy + Σ over MoE layers of ``layer.aux_loss`` (load balancing,
    already scaled by ``config.aux_loss_coef``). Same config on the same device → same losses.

    Args:
        config: the run.
        progress: draw a tqdm bar (on stderr) with the loss and tokens/s.

    Returns:
        A JSON-serialisable dict: ``router``, ``steps``, ``train_loss`` (mean cross-entropy of
        the last 10% of steps), ``val_loss_initial`` (step 0) and ``val_loss`` (end), both over
        the same ``eval_batches`` validation batches with top-K routing, ``val_history``
        (``[step, val_loss]`` pairs), ``tokens_per_s`` (training steps after the first, which
        pays for warm-up; periodic evaluations excluded), ``activation_MiB_per_layer``,
        ``params``, ``device``, ``dtype``, ``backend`` (what ``"auto"`` resolved to, and why),
        ``seed``, ``config``.

    Raises:
        ValueError: unusable device, or a corpus too short for ``seq_len``.
    """
    device = _resolve_device(config.device)
    dtype = _DTYPES[config.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    corpus = ByteCorpus(load_text(config.data), val_fraction=config.val_fraction,
                        seq_len=config.seq_len)

    torch.manual_seed(config.seed)
    model = ByteMoELM(max_seq_len=config.seq_len, d_model=config.d_model,
                      num_layers=config.layers, num_heads=config.heads,
                      num_experts=config.experts, top_k=config.top_k,
                      d_expert=config.d_expert, router=config.router, tile=config.tile,
                      aux_loss_coef=config.aux_loss_coef, backend=config.backend,
                      device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)

    def to_device(batch):
        return tuple(t.to(device, non_blocking=True) for t in batch)

    val_gen = torch.Generator().manual_seed(_VAL_SEED)
    val_batches = [to_device(corpus.batch("val", config.batch_size, config.seq_len, val_gen))
                   for _ in range(config.eval_batches)]
    train_gen = torch.Generator().manual_seed(config.seed)

    val_history = [[0, evaluate(model, val_batches)]]
    tokens_per_step = config.batch_size * config.seq_len
    losses = []

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    # Throughput is timed from the end of step 0, which pays for one-off warm-up (kernel
    # compilation, allocator growth); a 1-step run times step 0 itself.
    started = clock()
    warm = None
    eval_seconds = 0.0
    bar = tqdm(range(config.steps), disable=not progress, desc=f"train[{config.router}]",
               unit="step", dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = config.lr * _lr_factor(step, config.steps, config.warmup)
        inputs, targets = to_device(corpus.batch("train", config.batch_size, config.seq_len,
                                                 train_gen))
        lm_loss = _lm_loss(model, inputs, targets)
        loss = lm_loss + sum(layer.aux_loss for layer in model.moe_layers)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(lm_loss.detach())
        if step == 0:
            warm = clock()
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            eval_started = clock()
            val_history.append([step + 1, evaluate(model, val_batches)])
            eval_seconds += clock() - eval_started
        if progress and (step % 10 == 0 or step + 1 == config.steps):
            postfix = {"loss": f"{losses[-1].item():.3f}", "val": f"{val_history[-1][1]:.3f}"}
            if step > 0:
                seconds = time.perf_counter() - warm - eval_seconds
                postfix["tok/s"] = f"{step * tokens_per_step / seconds:.0f}"
            bar.set_postfix(postfix, refresh=False)
    finished = clock()
    bar.close()
    if config.steps > 1:
        tokens_per_s = (config.steps - 1) * tokens_per_step / (finished - warm - eval_seconds)
    else:
        tokens_per_s = tokens_per_step / (finished - started)

    val_history.append([config.steps, evaluate(model, val_batches)])
    tail = max(1, config.steps // 10)
    probe = to_device(corpus.batch("train", config.batch_size, config.seq_len, train_gen))[0]
    return {
        "router": config.router,
        "steps": config.steps,
        "train_loss": torch.stack(losses[-tail:]).mean().item(),
        "val_loss_initial": val_history[0][1],
        "val_loss": val_history[-1][1],
        "val_history": val_history,
        "tokens_per_s": tokens_per_s,
        "activation_MiB_per_layer": _activation_mib(model, probe),
        "params": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "backend": explain_backend(config.backend, device),
        "seed": config.seed,
        "config": asdict(config),
    }
