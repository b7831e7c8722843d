"""`MoE`: a drop-in Mixture-of-Experts feed-forward layer (router + SwiGLU experts)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from sonic._validation import check_bool, check_choice, check_int, check_non_negative, check_tensor
from sonic.autograd.moe_experts import moe_experts
from sonic.reference.ops import GATE_UP_LAYOUTS, accumulate_dtype
from sonic.routing.metadata import routing_metadata
from sonic.routing.token_rounding import ROUNDINGS, token_rounding_routing
from sonic.routing.topk import SCORES, topk_routing
from sonic.routing.types import Routing

ROUTERS = ("topk", "token_rounding")


def load_balancing_loss(logits: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Switch-Transformer auxiliary loss ``E · Σ_e f_e · p_e`` (Fedus et al. 2021, eq. 4).

    ``f_e``: fraction of routed pairs that went to expert e (not differentiable); ``p_e``: mean
    router probability of expert e. Equals 1 for perfectly uniform routing, and 0 for an empty
    batch (no tokens, no imbalance). A 0-d tensor in fp32 (fp64 for fp64 logits), differentiable
    with respect to ``logits``.
    """
    num_experts = logits.shape[1]
    acc = accumulate_dtype(logits.dtype)
    probs = torch.softmax(logits.to(acc), dim=-1)
    counts = torch.zeros(num_experts, device=logits.device, dtype=acc)
    counts.scatter_add_(0, routing.expert_idx.long(), counts.new_ones(1).expand(routing.num_pairs))
    # An empty batch has no imbalance: 0, still attached to the logits' graph (not 0/0 = NaN).
    fraction = counts / max(routing.num_pairs, 1)
    mean_probs = probs.sum(dim=0) / max(logits.shape[0], 1)
    return num_experts * (fraction * mean_probs).sum()


class MoE(nn.Module):
    """Mixture-of-Experts FFN: a linear router and ``E`` SwiGLU experts run by :func:`moe_experts`.

    Args:
        d_model: ``d``, the model dimension.
        d_expert: ``n``, each expert's intermediate dimension.
        num_experts: ``E``.
        top_k: ``K``, experts per token (``1 <= K <= E``).
        router: ``"topk"`` (token choice) or ``"token_rounding"`` (SonicMoE §5.2, training only);
            settable later: ``layer.router = "token_rounding"``. In ``eval()`` mode the layer
            always routes by top-K, as the paper evaluates token-rounding models.
        tile: ``M_tile`` that token rounding rounds expert counts to.
        score: top-K score function, ``"softmax_topk"`` or ``"topk_softmax"``.
        renormalize: renormalise ``"topk_softmax"`` scores to sum to 1 (a ``bool``).
        rounding: token-rounding mode, ``"nearest"``, ``"up"`` or ``"down"``.
        gate_up: layout of ``w1``'s rows, ``"concat"`` or ``"interleaved"``.
        aux_loss_coef: weight of the load-balancing loss left in :attr:`aux_loss` after forward;
            a finite number ``>= 0``, settable later (checked again then).
        backend: see :func:`moe_experts`.

    Parameters: ``gate.weight (E, d)``, ``w1 (E, 2n, d)``, ``w2 (E, d, n)``; see
    :meth:`reset_parameters` for their initialisation.

    ``forward(x)``: ``x (..., d)`` in the layer's dtype → same shape and dtype. After each
    forward, :attr:`aux_loss` holds ``aux_loss_coef ·`` :func:`load_balancing_loss` in training
    mode (a zero tensor when the coefficient is 0 or in eval mode), attached to the forward's
    graph so that adding it to the loss trains the router, and :attr:`last_routing` the
    :class:`Routing` used. Router scores are fp32 (fp64 in an fp64 layer, so ``gradcheck``
    works).

    Copies: ``copy.deepcopy`` and pickling (``torch.save(layer)``, EMA copies,
    ``torch.optim.swa_utils.AveragedModel``) work after a forward. An autograd graph cannot be
    copied, so a copy's :attr:`aux_loss` and :attr:`last_routing` scores are detached values of
    the last forward: they report it but do not train anything; the original's are unchanged.

    Raises:
        TypeError / ValueError: at construction, a bad size, option or ``aux_loss_coef``; in
            forward, ``x`` not a tensor, not in the layer's dtype, or without last dim ``d``.
    """

    def __init__(self, d_model: int, d_expert: int, num_experts: int, top_k: int, *,
                 router: str = "topk", tile: int = 128, score: str = "softmax_topk",
                 renormalize: bool = False, rounding: str = "nearest", gate_up: str = "concat",
                 aux_loss_coef: float = 0.0, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        check_int("d_model", d_model, low=1)
        check_int("d_expert", d_expert, low=1)
        check_int("num_experts", num_experts, low=1)
        check_int("top_k", top_k, low=1, high=num_experts)
        check_int("tile", tile, low=1)
        check_choice("score", score, SCORES)
        check_choice("rounding", rounding, ROUNDINGS)
        check_choice("gate_up", gate_up, GATE_UP_LAYOUTS)
        check_bool("renormalize", renormalize)
        self.d_model, self.d_expert, self.num_experts, self.top_k = d_model, d_expert, num_experts, top_k
        self.router = router
        self.tile, self.score, self.renormalize, self.rounding = tile, score, renormalize, rounding
        self.gate_up, self.aux_loss_coef, self.backend = gate_up, aux_loss_coef, backend
        factory = {"device": device, "dtype": dtype}
        self.gate = nn.Linear(d_model, num_experts, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * d_expert, d_model, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, d_expert, **factory))
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None
        self.reset_parameters()

    @property
    def router(self) -> str:
        return self._router

    @router.setter
    def router(self, value: str) -> None:
        check_choice("router", value, ROUTERS)
        self._router = value

    @property
    def aux_loss_coef(self) -> float:
        return self._aux_loss_coef

    @aux_loss_coef.setter
    def aux_loss_coef(self, value: float) -> None:
        check_non_negative("aux_loss_coef", value)
        self._aux_loss_coef = value

    def __getstate__(self):
        # The last forward's graph tensors cannot be deep-copied; copies get their values.
        state = super().__getstate__()
        if state.get("aux_loss") is not None:
            state["aux_loss"] = state["aux_loss"].detach()
        if state.get("last_routing") is not None:
            routing = state["last_routing"]
            state["last_routing"] = dataclasses.replace(routing, scores=routing.scores.detach())
        return state

    def reset_parameters(self) -> None:
        """Experts like ``nn.Linear`` (U(±1/sqrt(fan_in))); router N(0, 0.02²) so that routing
        starts near uniform."""
        nn.init.uniform_(self.w1, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.d_expert), 1 / math.sqrt(self.d_expert))
        nn.init.normal_(self.gate.weight, std=0.02)

    def route(self, logits: torch.Tensor) -> Routing:
        """Routing for ``logits (T, E)`` under the current router and mode."""
        if self.training and self.router == "token_rounding":
            return token_rounding_routing(logits, self.top_k, tile=self.tile, rounding=self.rounding,
                                          backend=self.backend)
        return topk_routing(logits, self.top_k, score=self.score, renormalize=self.renormalize,
                            backend=self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        dtype = self.w1.dtype
        if x.dtype != dtype:
            raise TypeError(f"x has dtype {x.dtype} but this MoE layer's parameters are {dtype}; "
                            f"cast the input (x.to({dtype})) or the layer (layer.to({x.dtype}))")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have last dimension d_model={self.d_model}, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.d_model)
        logits = self.gate(tokens)
        routing = self.route(logits)
        out = moe_experts(tokens, self.w1, self.w2,
                          routing.scores.to(accumulate_dtype(tokens.dtype)),
                          routing.token_idx, routing.expert_idx, gate_up=self.gate_up,
                          backend=self.backend,
                          metadata=routing_metadata(routing, backend=self.backend))
        self.last_routing = routing
        if self.aux_loss_coef and self.training:
            self.aux_loss = self.aux_loss_coef * load_balancing_loss(logits, routing)
        else:
            self.aux_loss = logits.new_zeros((), dtype=accumulate_dtype(logits.dtype))
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_expert={self.d_expert}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, router={self.router!r}, tile={self.tile}")
