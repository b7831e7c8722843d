"""Expert activations beyond SwiGLU: the reference up-proj and dH steps for any of them.

Gated (GLU variants, Shazeer 2020, "GLU Variants Improve Transformer"): ``H = X·W1ᵀ`` has
``2n`` columns split into ``gate`` and ``up`` (``gate_up`` layout) and ``A = φ(gate) ⊙ up``:
SwiGLU (φ = SiLU), GeGLU (φ = GELU, exact or tanh-approximated) and ReGLU (φ = ReLU).
Non-gated: ``H`` has ``n`` columns and ``A = φ(H)``: ReLU² (So et al. 2021, "Primer") and GELU.
The dataflow is SonicMoE's (§3.2, App. C) with the activation and its derivative as the only
change (``sonic::moe_experts`` runs it with these steps on the torch backend): the forward
keeps X (by reference), H, the scores and the metadata; the backward recomputes A from H and
takes the score gradient as ``⟨dA', A⟩``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sonic.reference import ops
from sonic.reference.ops import (accumulate_dtype, copy_into, grouped_mm, merge_gate_up,
                                 split_gate_up)
from sonic.types import ACTIVATIONS, GATED_ACTIVATIONS as GATED


def is_gated(activation: str) -> bool:
    """Whether ``activation`` is a GLU variant (``w1`` has ``2n`` rows) or not (``n`` rows)."""
    return activation in GATED


def _phi(g: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(φ(g), φ'(g))`` of the elementwise function of a gated activation, or of a non-gated
    one, in ``g``'s dtype."""
    if name in ("swiglu",):
        sig = torch.sigmoid(g)
        return g * sig, sig * (1 + g * (1 - sig))
    if name in ("geglu", "gelu"):
        cdf = 0.5 * (1 + torch.erf(g / math.sqrt(2)))
        pdf = torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
        return g * cdf, cdf + g * pdf
    if name == "geglu_tanh":
        c = math.sqrt(2 / math.pi)
        inner = c * (g + 0.044715 * g ** 3)
        t = torch.tanh(inner)
        return (0.5 * g * (1 + t),
                0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g))
    if name == "reglu":
        return F.relu(g), (g > 0).to(g.dtype)
    if name == "relu2":
        r = F.relu(g)
        return r * r, 2 * r
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def activate(h: torch.Tensor, activation: str, gate_up: str = "concat") -> torch.Tensor:
    """The up-projection's epilogue: ``A (P, n)`` from ``H (P, 2n)`` (gated) or ``(P, n)``,
    math in the accumulation dtype (fp32; fp64 for fp64), one rounding to ``h``'s dtype."""
    if activation == "swiglu":
        return ops.swiglu(h, gate_up)
    acc = accumulate_dtype(h.dtype)
    if is_gated(activation):
        gate, up = split_gate_up(h, gate_up)
        return (_phi(gate.to(acc), activation)[0] * up.to(acc)).to(h.dtype)
    return _phi(h.to(acc), activation)[0].to(h.dtype)


def activation_backward(da_prime: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor,
                        activation: str, gate_up: str = "concat"):
    """The dH epilogue for any activation: from ``dA' (P, n)``, the saved ``H`` and each row's
    score ``s``, ``(dH, A' = s·A, ds = ⟨dA', A⟩)`` with ``dA = s·dA'``; dH and A' in ``h``'s
    dtype, ds in the accumulation dtype (SwiGLU: :func:`sonic.reference.ops.dswiglu_epilogue`
    itself)."""
    if activation == "swiglu":
        return ops.dswiglu_epilogue(da_prime, h, row_scores, gate_up)
    acc = accumulate_dtype(h.dtype)
    dap = da_prime.to(acc)
    s = row_scores.to(acc).unsqueeze(-1)
    if is_gated(activation):
        gate, up = split_gate_up(h, gate_up)
        u = up.to(acc)
        phi, dphi = _phi(gate.to(acc), activation)
        a = phi * u
        da = s * dap
        dh = merge_gate_up(da * u * dphi, da * phi, gate_up)
    else:
        a, dphi = _phi(h.to(acc), activation)
        dh = s * dap * dphi
    return dh.to(h.dtype), (s * a).to(h.dtype), (dap * a).sum(dim=-1)


def up_proj(x: torch.Tensor, w1: torch.Tensor, offsets: torch.Tensor, gather_idx: torch.Tensor,
            gate_up: str, *, h_out: torch.Tensor | None = None, activation: str = "swiglu"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sonic.reference.ops.up_proj_swiglu` for any activation: ``(H, A)``, H
    ``(P, 2n)`` (gated) or ``(P, n)``, ``A = act(H)`` ``(P, n)``; with ``h_out`` H is written
    there."""
    if activation == "swiglu":
        return ops.up_proj_swiglu(x, w1, offsets, gather_idx, gate_up, h_out=h_out)
    h = grouped_mm(x, w1.transpose(1, 2), offsets, gather_idx)
    return copy_into(h_out, h), activate(h, activation, gate_up)


def dh_step(dout: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
            gather_idx: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor, gate_up: str, *,
            overwrite_h: bool = False, a_out: torch.Tensor | None = None,
            activation: str = "swiglu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sonic.reference.ops.dh_dswiglu` for any activation: ``dA' = gather(dO)·W2``
    then :func:`activation_backward`, ``(dH, A', ds)``; ``overwrite_h`` is accepted and
    ignored (dH is always a new tensor), A' goes into ``a_out`` when given."""
    if activation == "swiglu":
        return ops.dh_dswiglu(dout, w2, offsets, gather_idx, h, row_scores, gate_up,
                              overwrite_h=overwrite_h, a_out=a_out)
    dh, a_scaled, ds = activation_backward(grouped_mm(dout, w2, offsets, gather_idx), h,
                                           row_scores, activation, gate_up)
    return dh, copy_into(a_out, a_scaled), ds
