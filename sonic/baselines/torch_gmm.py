"""The "torch-gmm" baseline: an MoE layer as a PyTorch user writes it today (docs/design.md §5).

Top-K routing, ``argsort`` of the pairs by expert, a gather of token rows, ``torch._grouped_mm``
for the up- and down-projections with SwiGLU between them, a scaling by the scores and an
``index_add_`` back to tokens; autograd is PyTorch's. It is the reference point of sonic's
speed and memory targets, so it stays deliberately plain: it keeps the gathered ``X``, ``H``,
``silu(gate)``, ``A``, ``Y`` and the scaled ``Y`` for backward (2118 MiB at the 7B config), where sonic keeps only ``H`` and metadata (docs/design.md §3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SCORES = ("softmax_topk", "topk_softmax")
# dtypes torch._grouped_mm accepts, per device type (CUDA and the meta kernel: bfloat16 only).
_GROUPED_MM_DTYPES = {
    "cpu": (torch.bfloat16, torch.float16, torch.float32),
    "cuda": (torch.bfloat16,),
    "meta": (torch.bfloat16,),
}


def torch_gmm_moe(x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, k: int, *, score: str = "softmax_topk") -> torch.Tensor:
    """Top-K MoE layer (router + SwiGLU experts) from stock PyTorch ops.

    ``logits = x·router_weightᵀ``; per token the ``k`` largest logits pick the experts, with
    scores ``softmax`` over the selected logits (``"softmax_topk"``) or the selected entries of
    ``softmax(logits)`` (``"topk_softmax"``), in float32. Pairs are sorted by expert
    (``argsort``, stable), token rows gathered, and per expert ``h = x·W1[e]ᵀ``,
    ``a = silu(h[:, :n]) ⊙ h[:, n:]``, ``y = a·W2[e]ᵀ`` by ``torch._grouped_mm`` (or a loop over
    experts where ``_grouped_mm`` does not take the dtype/device, or rows are not 16-byte
    aligned); ``out[t] = Σ s·y`` by ``index_add_`` in ``x.dtype``. Runs on ``meta`` tensors
    (bfloat16, ``d`` and ``n`` multiples of 8) without host synchronisation.

    Args:
        x: ``(T, d)`` tokens.
        router_weight: ``(E, d)`` router (``nn.Linear(d, E, bias=False).weight``).
        w1: ``(E, 2n, d)`` up-projection, rows ``[gate; up]`` (docs/design.md §1).
        w2: ``(E, d, n)`` down-projection.
        k: experts per token, ``1 <= k <= E``.
        score: ``"softmax_topk"`` or ``"topk_softmax"``.

    Returns:
        ``(T, d)`` in ``x.dtype``.

    Raises:
        TypeError: non-tensor arguments, mismatched dtypes or devices, non-int ``k``.
        ValueError: inconsistent shapes, ``k`` out of range, unknown ``score``, or ``meta``
            tensors that ``torch._grouped_mm`` cannot take (the loop needs expert counts on the
            host).
    """
    T, d, _, E = _check_args(x, router_weight, w1, w2, k, score)
    logits = x @ router_weight.t()
    if score == "softmax_topk":
        top_logits, experts = logits.topk(k, dim=-1)
        scores = F.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        scores, experts = F.softmax(logits, dim=-1, dtype=torch.float32).topk(k, dim=-1)
    return torch_gmm_experts(x, w1, w2, scores, experts)


def torch_gmm_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The expert part of :func:`torch_gmm_moe` for a routing made elsewhere (e.g. sigmoid
    scores with groups, :func:`sonic.reference.ops.scored_topk`).

    Args:
        x: ``(T, d)`` tokens; w1 ``(E, 2n, d)``, w2 ``(E, d, n)`` as in :func:`torch_gmm_moe`.
        scores: ``(T, k)`` float routing weights (applied in ``x.dtype``).
        experts: ``(T, k)`` integer expert indices.

    Returns:
        ``(T, d)`` in ``x.dtype``.
    """
    T, d = x.shape
    E, k = w1.shape[0], experts.shape[1]
    # Pair p = t*k + j (token t's j-th choice); rows are the pairs grouped by expert.
    flat_experts = experts.flatten()
    order = torch.argsort(flat_experts, stable=True)
    row_token = order // k
    # Cumulative row ends per expert, computed on device (no host sync, works on meta).
    ends = torch.searchsorted(flat_experts[order],
                              torch.arange(E, device=x.device, dtype=flat_experts.dtype),
                              right=True, out_int32=True)

    h = _grouped_linear(x[row_token], w1, ends)
    # chunk, not two slices: autograd joins chunk's gradients with one cat, where two slices
    # each zero-fill a full-size gradient and add them.
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up
    y = _grouped_linear(a, w2, ends)
    weighted = y * scores.flatten()[order].unsqueeze(1).to(y.dtype)
    out = torch.zeros(T, d, device=x.device, dtype=x.dtype)
    return out.index_add_(0, row_token, weighted)


def _grouped_linear(rows: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``rows[r]·w[e]ᵀ`` for the rows of each expert ``e`` (``ends``: cumulative row ends)."""
    if _grouped_mm_usable(rows, w):
        return torch._grouped_mm(rows, w.transpose(-2, -1), offs=ends)
    if rows.device.type == "meta":
        raise ValueError(
            f"meta tensors need torch._grouped_mm: dtype bfloat16 with rows 16-byte aligned "
            f"(d and n multiples of 8), got dtype {rows.dtype}, rows {rows.shape[1]}, "
            f"outputs {w.shape[1]}")
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.cat([part @ w_e.t() for part, w_e in zip(rows.split(counts), w)])


def _grouped_mm_usable(rows: torch.Tensor, w: torch.Tensor) -> bool:
    # _grouped_mm needs every row stride (of the inputs and of the output) 16-byte aligned.
    aligned = all(size * rows.element_size() % 16 == 0 for size in (rows.shape[1], w.shape[1]))
    return aligned and rows.dtype in _GROUPED_MM_DTYPES.get(rows.device.type, ())


def _check_args(x, router_weight, w1, w2, k, score) -> tuple[int, int, int, int]:
    named = {"x": x, "router_weight": router_weight, "w1": w1, "w2": w2}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != x.dtype or t.device != x.device:
            raise TypeError(f"{name} must match x's dtype and device ({x.dtype}, {x.device}), "
                            f"got {t.dtype}, {t.device}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be (T, d), got shape {tuple(x.shape)}")
    T, d = x.shape
    if router_weight.dim() != 2 or router_weight.shape[1] != d:
        raise ValueError(f"router_weight must be (E, d={d}), got {tuple(router_weight.shape)}")
    E = router_weight.shape[0]
    if w1.dim() != 3 or w1.shape[0] != E or w1.shape[2] != d or w1.shape[1] % 2:
        raise ValueError(f"w1 must be (E={E}, 2n, d={d}), got {tuple(w1.shape)}")
    n = w1.shape[1] // 2
    if tuple(w2.shape) != (E, d, n):
        raise ValueError(f"w2 must be (E, d, n) = {(E, d, n)}, got {tuple(w2.shape)}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= E:
        raise ValueError(f"k must be in [1, E={E}], got {k}")
    if score not in _SCORES:
        raise ValueError(f"score must be one of {_SCORES}, got {score!r}")
    return T, d, n, E
