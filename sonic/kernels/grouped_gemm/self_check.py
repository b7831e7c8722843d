"""On-device self-check of the grouped-GEMM variants: the gate before "auto" uses an untested
mainloop.

The sm_100a mainloop (:mod:`.sm100`) is compile-checked in CI but has never run on a device
here. On an architecture in :data:`SELF_CHECKED_ARCHS` the backend runs each variant once per
process and device on a small ragged problem against a PyTorch fp32 reference before its first
use, and falls back to the reference (with one warning) when it fails
(:mod:`sonic.backend`). The check itself runs on any device the kernels support, so the
H200 GPU suite exercises it too.

Pure torch at import (no ``cutlass``); a check compiles and launches through
:mod:`.interface` like any call.
"""

from __future__ import annotations

import threading

import torch

from sonic.kernels import runtime
from sonic.kernels.grouped_gemm import interface

# Architectures whose grouped GEMMs must pass the self-check before "auto" uses them.
SELF_CHECKED_ARCHS = ("sm_100a",)
# Ragged counts: an empty expert, a 1-row expert, one over two m-tiles.
COUNTS = (37, 0, 300, 1, 130)
TOKENS, DIM_D, DIM_N = 250, 192, 128
# Relative Frobenius error bound of bf16 outputs with fp32 accumulation.
TOLERANCE = 2e-2

_RESULTS: dict[tuple[str, int], tuple[bool, str]] = {}
_LOCK = threading.Lock()


def _problem(device):
    """Fresh random inputs (fixed seed, never zeros): ``(rand, offsets, gather_idx, offs)``."""
    gen = torch.Generator().manual_seed(17)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) + 0.1).to(torch.bfloat16).to(device)

    offsets = torch.zeros(len(COUNTS) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(COUNTS).cumsum(0)
    gidx = torch.randint(0, TOKENS, (int(offsets[-1]),), generator=gen, dtype=torch.int32)
    return rand, offsets.to(device), gidx.to(device), offsets.tolist()


def _ref_m(a_rows, w, off):
    """Per-expert fp32 ``a_rows[rows of e] · w[e]ᵀ`` (``w`` ``(E, N, K)``)."""
    return torch.cat([a_rows[off[e]:off[e + 1]].float() @ w[e].float().t()
                      for e in range(len(off) - 1)])


def _check_varlen_m(device, gather: bool, b_n_major: bool):
    rand, offsets, gidx, off = _problem(device)
    x = rand(TOKENS if gather else gidx.numel(), DIM_D)
    w = (rand(len(off) - 1, DIM_D, 2 * DIM_N).transpose(1, 2) if b_n_major
         else rand(len(off) - 1, 2 * DIM_N, DIM_D))
    # NaN-filled: a row the kernel fails to write fails the check.
    out = torch.full((gidx.numel(), 2 * DIM_N), float("nan"), dtype=torch.bfloat16,
                     device=device)
    got = interface.grouped_gemm(x, w, offsets, gather_idx=gidx if gather else None, out=out)
    return [("out", got, _ref_m(x[gidx.long()] if gather else x, w, off))]


def _check_swiglu(device, gate_up: str):
    rand, offsets, gidx, off = _problem(device)
    x, w1 = rand(TOKENS, DIM_D), rand(len(off) - 1, 2 * DIM_N, DIM_D)
    h, act = interface.grouped_gemm_swiglu(x, w1, offsets, gidx, gate_up)
    h_ref = _ref_m(x[gidx.long()], w1, off)
    hb = h_ref.to(torch.bfloat16).float()
    gate, up = ((hb[:, :DIM_N], hb[:, DIM_N:]) if gate_up == "concat"
                else (hb[:, 0::2], hb[:, 1::2]))
    return [("H", h, h_ref), ("A", act, gate * torch.sigmoid(gate) * up)]


def _check_dswiglu(device):
    rand, offsets, gidx, off = _problem(device)
    n = DIM_N
    dout, w2 = rand(TOKENS, DIM_D), rand(len(off) - 1, DIM_D, n)
    h = rand(gidx.numel(), 2 * n)
    scores = torch.rand(gidx.numel(), device=device) + 0.1
    dh, a_scaled, ds = interface.grouped_gemm_dswiglu(dout, w2, offsets, gidx, h, scores)
    dap = _ref_m(dout[gidx.long()], w2.transpose(1, 2), off)
    g, u = h[:, :n].float(), h[:, n:].float()
    sig = torch.sigmoid(g)
    s = scores[:, None]
    act = g * sig * u
    dh_ref = torch.cat([s * dap * u * sig * (1 + g * (1 - sig)), s * dap * g * sig], 1)
    return [("dH", dh, dh_ref), ("A'", a_scaled, act * s), ("ds", ds, (dap * act).sum(1))]


def _check_varlen_k(device, gather_a: bool, gather_b: bool):
    rand, offsets, gidx, off = _problem(device)
    a = rand(TOKENS if gather_a else gidx.numel(), 2 * DIM_N)
    b = rand(TOKENS if gather_b else gidx.numel(), DIM_D)
    got = interface.grouped_gemm_varlen_k(a, b, offsets,
                                          gather_idx_a=gidx if gather_a else None,
                                          gather_idx_b=gidx if gather_b else None)
    a_rows = a[gidx.long()] if gather_a else a
    b_rows = b[gidx.long()] if gather_b else b
    ref = torch.stack([a_rows[off[e]:off[e + 1]].float().t() @ b_rows[off[e]:off[e + 1]].float()
                       for e in range(len(off) - 1)])
    return [("C", got, ref)]


# Variant -> check. The six GEMMs of docs/design.md §3 with both fused epilogues, plus the operand
# forms the backend may also send (gathered N-major B; varlen-K with neither or both gathered).
VARIANTS = {
    "up_proj": lambda dev: _check_varlen_m(dev, True, False),
    "up_proj_swiglu_concat": lambda dev: _check_swiglu(dev, "concat"),
    "up_proj_swiglu_interleaved": lambda dev: _check_swiglu(dev, "interleaved"),
    "down_proj": lambda dev: _check_varlen_m(dev, False, False),
    "dx": lambda dev: _check_varlen_m(dev, False, True),
    "da_prime": lambda dev: _check_varlen_m(dev, True, True),
    "dh_dswiglu": _check_dswiglu,
    "dw1": lambda dev: _check_varlen_k(dev, False, True),
    "dw2": lambda dev: _check_varlen_k(dev, True, False),
    "varlen_k": lambda dev: _check_varlen_k(dev, False, False),
    "varlen_k_gather_ab": lambda dev: _check_varlen_k(dev, True, True),
}


def varlen_m_variant(gathered: bool, b_n_major: bool) -> str:
    """The self-check variant of a plain varlen-M call."""
    return {(True, False): "up_proj", (False, False): "down_proj", (False, True): "dx",
            (True, True): "da_prime"}[(gathered, b_n_major)]


def varlen_k_variant(gather_a: bool, gather_b: bool) -> str:
    """The self-check variant of a varlen-K call."""
    return {(True, False): "dw2", (False, True): "dw1", (False, False): "varlen_k",
            (True, True): "varlen_k_gather_ab"}[(gather_a, gather_b)]


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def required(device) -> bool:
    """Whether ``device``'s grouped GEMMs must pass :func:`self_check` before "auto" uses them
    (its architecture is in :data:`SELF_CHECKED_ARCHS`)."""
    return runtime.device_arch(_device(device)) in SELF_CHECKED_ARCHS


def self_check(variant: str, device=None) -> tuple[bool, str]:
    """Run ``variant`` once on a small ragged problem (an empty expert, a 1-row expert, an
    expert over two m-tiles; unwritten outputs read as NaN) against a PyTorch fp32 reference
    on ``device``; the result is cached per (variant, device) for the process.

    Args:
        variant: a key of :data:`VARIANTS`.
        device: CUDA device; ``None``: the current one.

    Returns:
        ``(ok, message)``: the relative error of each output, or why the check failed (the
        kernels cannot run there, a compile or launch error, a mismatch).

    Raises:
        KeyError: ``variant`` is unknown.
    """
    if variant not in VARIANTS:
        raise KeyError(f"unknown grouped-GEMM self-check variant {variant!r}; known: "
                       f"{', '.join(VARIANTS)}")
    ok, reason = runtime.kernels_available(device)
    if not ok:
        return False, f"{variant}: {reason}"
    dev = _device(device)
    key = (variant, dev.index)
    with _LOCK:
        if key not in _RESULTS:
            _RESULTS[key] = _run(variant, dev)
        return _RESULTS[key]


def results(device=None) -> dict[str, tuple[bool, str]]:
    """The self-checks run so far on ``device``: ``{variant: (ok, message)}``."""
    index = _device(device).index
    return {v: r for (v, i), r in _RESULTS.items() if i == index}


def _run(variant: str, device: torch.device) -> tuple[bool, str]:
    arch = runtime.device_arch(device)
    try:
        with torch.cuda.device(device):
            outputs = VARIANTS[variant](device)
            torch.cuda.synchronize(device)
    except Exception as err:  # a failing kernel must become a fallback, not a crash
        return False, f"{arch} {variant}: {type(err).__name__}: {err}"
    report = []
    for name, got, ref in outputs:
        rel = ((got.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        report.append(f"{name} rel err {rel:.1e}")
        if not rel < TOLERANCE:  # NaN (an unwritten element) fails too
            return False, f"{arch} {variant}: {name} mismatch ({', '.join(report)})"
    return True, f"{arch} {variant}: " + ", ".join(report)
