"""Value types shared across sonic's layers; a leaf module that imports nothing from sonic.

The GPU kernels (:mod:`sonic.kernels`) may import from here and from nothing else of sonic, so
layers run one way: kernels -> backend -> routing / autograd / nn.

* ``Literal`` types of the string options (:data:`Router`, :data:`Backend`, ...).
* :data:`ACTIVATIONS`, :data:`GATED_ACTIVATIONS` — the experts' activations, and those the
  fused grouped-GEMM epilogues compute.
* :data:`GATE_UP_LAYOUTS` — how the gate and up halves of ``W1``'s rows (and of ``H``'s columns)
  are laid out (docs/design.md, "Names and shapes").
* :data:`FP8_BLOCK`, :data:`GROUPED_GEMM_MAX_EXPERTS`, :data:`ROUTING_METADATA_MAX_EXPERTS` —
  limits that more than one layer checks, defined once.
* :class:`RoutingMetadata` — where every routed pair lives once grouped by expert (docs/design.md §2),
  re-exported as ``sonic.RoutingMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

# The string options of the public API, for type checkers; each module's tuple of valid
# values (GATE_UP_LAYOUTS, ROUTERS, ...) is made from these, so the two cannot drift apart.
# "concat": gate = columns [0, n), up = [n, 2n) (the Hugging Face layout);
# "interleaved": gate = even columns, up = odd columns.
GateUp = Literal["concat", "interleaved"]
Router = Literal["topk", "token_rounding"]
Score = Literal["softmax_topk", "topk_softmax", "sigmoid"]
Rounding = Literal["nearest", "up", "down"]
Backend = Literal["auto", "torch", "cute"]
Precision = Literal["bf16", "fp8"]
ActivationCache = Literal["bf16", "fp8"]
# The experts' activation: the gated GLU variants (H has 2n columns, A = φ(gate) ⊙ up), then the
# non-gated ones (H has n columns, A = φ(H)); see sonic.reference.activations.
GatedActivation = Literal["swiglu", "geglu", "geglu_tanh", "reglu"]
Activation = Literal["swiglu", "geglu", "geglu_tanh", "reglu", "relu2", "gelu"]
# What moves expert parallelism's data all-to-alls (sonic.distributed.ep_moe_experts).
Transport = Literal["nccl", "copy_engine", "auto"]

GATE_UP_LAYOUTS: tuple[GateUp, ...] = get_args(GateUp)
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)
GATED_ACTIVATIONS: tuple[GatedActivation, ...] = get_args(GatedActivation)
ACTIVATIONS: tuple[Activation, ...] = get_args(Activation)

# Side of the FP8 recipe's scale blocks (DeepSeek-V3, arXiv 2412.19437 §3.3): activations carry
# one scale per 1 x FP8_BLOCK row slice, weights one per FP8_BLOCK x FP8_BLOCK block. The
# reference, the quantization kernels, the quantizing SwiGLU and the FP8 grouped GEMM's k-tile
# all use this one value.
FP8_BLOCK = 128

# Largest E each GPU kernel family serves; the limits differ because each comes from where the
# kernel keeps per-expert state. The grouped GEMMs keep an (E+1)-entry table of first tiles in
# shared memory beside the operand stages.
GROUPED_GEMM_MAX_EXPERTS = 1024
# The routing-metadata scatter keeps (warps + 2 + 2·groups) per-expert counters in shared memory,
# which must fit the 48 KiB a launch gets without opting in to more (12·(E+1)·4 bytes at E=512).
ROUTING_METADATA_MAX_EXPERTS = 512


@dataclass(frozen=True)
class RoutingMetadata:
    """Where every routed pair lives once pairs are grouped by expert.

    "Rows" are positions in the expert-sorted order: the rows of expert ``e`` are
    ``expert_offsets[e]:expert_offsets[e+1]``, and within an expert rows keep the pairs' order
    (a stable sort), so the metadata is deterministic. All index tensors are int32 on the
    routing's device.

    Attributes:
        expert_counts: ``(E,)`` — pairs routed to each expert.
        expert_offsets: ``(E+1,)`` — exclusive prefix sum of ``expert_counts``; ``[E] == P``,
            the routed pairs (for a padded routing less than the rows: the padding rows follow).
        sorted_pairs: ``(P,)`` — the pair index of each row.
        gather_idx: ``(P,)`` — the source token of each row (``token_idx[sorted_pairs]``);
            the gather index of the varlen-M GEMMs.
        pair_rows: ``(P,)`` — the row of each pair (inverse permutation of ``sorted_pairs``).
        token_offsets: ``(T+1,)`` — exclusive prefix sum of pairs per token.
        token_rows: ``(P,)`` — rows grouped by token: the rows of token ``t`` are
            ``token_rows[token_offsets[t]:token_offsets[t+1]]``, in pair order. The index of the
            per-token gather-sum (expert aggregation).
        num_tokens: ``T``.
        num_experts: ``E``.
    """

    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    sorted_pairs: torch.Tensor
    gather_idx: torch.Tensor
    pair_rows: torch.Tensor
    token_offsets: torch.Tensor
    token_rows: torch.Tensor
    num_tokens: int
    num_experts: int
    packed: torch.Tensor | None = None
    top_k: int | None = None

    @property
    def num_pairs(self) -> int:
        """``P``, the number of routed pairs (rows)."""
        return self.sorted_pairs.numel()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The index tensors, in field order (for ``ctx.save_for_backward``)."""
        return (self.expert_counts, self.expert_offsets, self.sorted_pairs, self.gather_idx,
                self.pair_rows, self.token_offsets, self.token_rows)

    @classmethod
    def from_tensors(cls, tensors, num_tokens: int, num_experts: int, *,
                     packed: torch.Tensor | None = None,
                     top_k: int | None = None) -> "RoutingMetadata":
        """Inverse of :meth:`tensors`. ``packed``: the one int32 buffer the fields are views of,
        when they are (``torch.ops.sonic.routing_metadata`` returns it; ``top_k`` says whether
        it leaves out ``token_rows``, see :func:`sonic.ops.pack_metadata`)."""
        (expert_counts, expert_offsets, sorted_pairs, gather_idx, pair_rows, token_offsets,
         token_rows) = tensors
        return cls(expert_counts, expert_offsets, sorted_pairs, gather_idx, pair_rows,
                   token_offsets, token_rows, num_tokens=num_tokens, num_experts=num_experts,
                   packed=packed, top_k=top_k)
