"""A small byte-level transformer language model whose FFNs are `sonic.MoE` layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sonic import MoE, MoEConfig
from sonic.types import Transport
from sonic.baselines import torch_gmm_moe
from sonic.train.data import VOCAB_SIZE


def switch_load_balancing_loss(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``E · Σ_e f_e·p_e`` (Switch Transformer eq. 4, with ``f_e`` the top-``k`` pairs of expert
    ``e`` over ``T`` and ``p_e`` its mean router probability) from stock PyTorch ops: the aux
    loss a plain PyTorch MoE computes, equal to `sonic.load_balancing_loss` of top-K routing.

    Args:
        logits: ``(T, E)`` router logits.
        k: experts per token.

    Returns:
        A 0-d float32 tensor (float64 for float64 logits), attached to ``logits``' graph.
    """
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(acc), dim=-1)
    experts = logits.topk(k, dim=-1).indices.reshape(-1)
    counts = torch.zeros(logits.shape[1], device=logits.device, dtype=acc)
    counts.scatter_add_(0, experts, counts.new_ones(1).expand(experts.shape[0]))
    num_tokens = max(logits.shape[0], 1)
    return logits.shape[1] * (counts / num_tokens * probs.mean(dim=0)).sum()


class TorchGmmMoE(nn.Module):
    """A `sonic.MoE`'s router and experts run by the torch-gmm baseline
    (`sonic.baselines.torch_gmm_moe`: ``torch._grouped_mm`` and PyTorch's autograd), for
    comparing training speed and memory with sonic on the same model.

    Shares the parameters of ``moe`` (``gate``, ``w1``, ``w2``, same state-dict names) and its
    top-K routing (``top_k``, ``score``); in training mode with ``aux_loss_coef > 0`` each
    forward appends ``aux_loss_coef ·`` :func:`switch_load_balancing_loss` to
    :attr:`aux_losses`, which the caller empties (`ByteMoELM.take_aux_losses`).

    Raises:
        ValueError: ``moe`` trains with another router than top-K, or with FP8.
    """

    def __init__(self, moe: MoE):
        super().__init__()
        if moe.router != "topk" or moe.precision != "bf16" or moe.activation_cache != "bf16":
            raise ValueError(f"experts: torch-gmm runs top-K routing with bf16 GEMMs and cache, "
                             f"got router={moe.router!r}, precision={moe.precision!r}, "
                             f"activation_cache={moe.activation_cache!r}")
        self.gate, self.w1, self.w2 = moe.gate, moe.w1, moe.w2
        self.top_k, self.score, self.aux_loss_coef = moe.top_k, moe.score, moe.aux_loss_coef
        self.aux_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., d)`` → ``(..., d)``."""
        tokens = x.reshape(-1, x.shape[-1])
        out = torch_gmm_moe(tokens, self.gate.weight, self.w1, self.w2, self.top_k,
                            score=self.score)
        if self.training and self.aux_loss_coef:
            logits = tokens @ self.gate.weight.t()
            self.aux_losses.append(self.aux_loss_coef
                                   * switch_load_balancing_loss(logits, self.top_k))
        return out.reshape(x.shape)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on ``(B, S, d_model)`` through
    ``F.scaled_dot_product_attention`` (which picks a fused kernel where one exists)."""

    def __init__(self, d_model: int, num_heads: int, *, device=None, dtype=None):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.num_heads, d // self.num_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, d))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + moe(norm(x))``."""

    def __init__(self, d_model: int, num_heads: int, moe: MoE, *, device=None, dtype=None):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, num_heads, device=device, dtype=dtype)
        self.moe_norm = nn.LayerNorm(d_model, device=device, dtype=dtype)
        # A sonic.MoE, or what replaced it (its expert-parallel share, the torch-gmm baseline).
        self.moe: nn.Module = moe

    def sonic_moe(self) -> MoE:
        """This block's layer while it is still the `sonic.MoE` it was built with.

        Raises:
            TypeError: it was replaced already (experts sharded or run by torch-gmm).
        """
        if not isinstance(self.moe, MoE):
            raise TypeError(f"the block's MoE layer was already replaced by a "
                            f"{type(self.moe).__name__}; replace it once")
        return self.moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class ByteMoELM(nn.Module):
    """Byte-level (vocab 256) causal language model with MoE feed-forward layers.

    Token and learned position embeddings, ``num_layers`` pre-norm blocks (causal attention +
    ``sonic.MoE`` with SwiGLU experts), a final LayerNorm and an output head tied to the token
    embedding.

    Args:
        max_seq_len: longest sequence the position embedding covers.
        num_layers: transformer blocks.
        num_heads: attention heads.
        moe: the :class:`sonic.MoEConfig` of every block's `sonic.MoE` (its ``router`` is the
            training-time router; ``eval()`` routes by top-K); its ``d_model`` is the
            embedding dim ``d``, which must be a multiple of ``num_heads``.
        device, dtype: where and in which dtype the parameters live.

    Raises:
        ValueError: ``moe.d_model`` not a multiple of ``num_heads``, or a non-positive
            ``max_seq_len``, ``num_layers`` or ``num_heads``.
    """

    def __init__(self, *, max_seq_len: int, num_layers: int, num_heads: int, moe: MoEConfig,
                 device=None, dtype=None):
        super().__init__()
        for name, value in (("max_seq_len", max_seq_len), ("num_layers", num_layers),
                            ("num_heads", num_heads)):
            if value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value}")
        d_model = moe.d_model
        if d_model % num_heads:
            raise ValueError(f"d_model: expected a multiple of num_heads={num_heads}, "
                             f"got {d_model}")
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d_model, device=device, dtype=dtype)
        self.pos_emb = nn.Embedding(max_seq_len, d_model, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(
            Block(d_model, num_heads, MoE.from_config(moe, device=device, dtype=dtype),
                  device=device, dtype=dtype)
            for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self._init_dense(num_layers)

    def _init_dense(self, num_layers: int) -> None:
        # GPT-2 style: small embeddings, and residual-branch outputs scaled by 1/sqrt(2·layers)
        # so the residual stream's variance does not grow with depth. The experts keep the
        # initialisation sonic.MoE gives them.
        std = 0.02
        nn.init.normal_(self.tok_emb.weight, std=std)
        nn.init.normal_(self.pos_emb.weight, std=std)
        for block in self._blocks():
            nn.init.normal_(block.attn.qkv.weight, std=std)
            nn.init.normal_(block.attn.proj.weight, std=std / (2 * num_layers) ** 0.5)

    def _blocks(self) -> list[Block]:
        # nn.ModuleList yields Modules to a type checker; the blocks are Blocks.
        return list(self.blocks)  # type: ignore[arg-type]

    def shard_experts(self, group, num_chunks: int = 1, recompute_dispatch: bool = False,
                      transport: Transport = "nccl") -> None:
        """Expert parallelism: replace every block's `sonic.MoE` by its share on this rank of
        ``group``, a `sonic.distributed.ExpertParallelMoE` (router and experts
        ``ep_rank·E/ep …`` copied) with ``num_chunks`` pipelined chunks, ``recompute_dispatch``
        and ``transport`` as there. Collective over ``group``; the model must be the same
        on every rank of it (same seed)."""
        from sonic.distributed import ExpertParallelMoE

        for block in self._blocks():
            block.moe = ExpertParallelMoE.from_moe(block.sonic_moe(), group=group,
                                                   num_chunks=num_chunks,
                                                   recompute_dispatch=recompute_dispatch,
                                                   transport=transport)

    def use_torch_gmm_experts(self) -> None:
        """Run every block's MoE by the torch-gmm baseline (:class:`TorchGmmMoE`), keeping
        its parameters: the model computes what it computed, with PyTorch's ops."""
        for block in self._blocks():
            block.moe = TorchGmmMoE(block.sonic_moe())

    def take_aux_losses(self) -> list[torch.Tensor]:
        """The aux losses the :class:`TorchGmmMoE` layers appended since the last call (sonic's
        layers hand theirs to `sonic.collect_aux_losses`), emptying their lists."""
        taken: list[torch.Tensor] = []
        for block in self._blocks():
            if isinstance(block.moe, TorchGmmMoE):
                taken += block.moe.aux_losses
                block.moe.aux_losses = []
        return taken

    @property
    def moe_layers(self) -> list[nn.Module]:
        """The MoE layer of every block, first to last: a `sonic.MoE` or what replaced it."""
        return [block.moe for block in self._blocks()]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte logits.

        Args:
            tokens: ``(B, S)`` int64 bytes in ``[0, 256)``, ``S <= max_seq_len``.

        Returns:
            ``(B, S, 256)`` logits in the parameters' dtype.

        Raises:
            ValueError: ``tokens`` not 2-D or longer than ``max_seq_len``.
        """
        if tokens.dim() != 2 or tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"tokens: expected (B, S) with S <= {self.max_seq_len}, "
                             f"got shape {tuple(tokens.shape)}")
        x = self.tok_emb(tokens) + self.pos_emb.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tok_emb.weight.t()
