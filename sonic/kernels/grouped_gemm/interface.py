"""Torch-facing grouped GEMMs: validation, allocation, tile plan, architecture dispatch, launch.

docs/design.md §3–4; SonicMoE (arXiv 2512.14080) §4.1: every expert's GEMM runs in ONE persistent,
warp-specialised launch whose tile scheduler reads the per-expert row ranges ``expert_offsets``
on the device, so no host synchronisation and no per-expert launch is needed.

This module imports no ``cutlass``: the kernel class of a configuration's architecture
(:data:`sonic.kernels.grouped_gemm.config.MAINLOOPS`) is imported on first compile.
"""

import contextlib
import contextvars
import functools
import importlib
from typing import Callable

import torch

from sonic.kernels import runtime
from sonic.kernels.grouped_gemm import heuristic
from sonic.kernels.grouped_gemm.args import Operands, Sizes
from sonic.kernels.grouped_gemm.config import (CLUSTER, MAINLOOPS, MAX_EXPERTS, TILE_K_FP8, VEC,
                                               GroupedGemmConfig)
from sonic.kernels.registry import KernelVariant, register
from sonic.types import GATE_UP_LAYOUTS


def kernel_class(cfg: GroupedGemmConfig):
    """The kernel class of ``cfg`` (its :attr:`GroupedGemmConfig.mainloop`; imports its module,
    hence ``cutlass``)."""
    module, name = cfg.mainloop.split(":")
    return getattr(importlib.import_module(module), name)


def compile_config(cfg: GroupedGemmConfig, keep_ptx: bool = False):
    """Compile ``cfg`` with placeholder arguments (on the CPU for the compile check, or on the
    GPU at first launch): a :class:`sonic.kernels.runtime.Launcher`."""
    return compile_kernel(kernel_class(cfg)(cfg), keep_ptx)


def compile_kernel(kernel, keep_ptx: bool = False):
    """Compile the kernel object ``kernel`` (a :class:`.base.GroupedGemmKernel`) with
    placeholder :class:`~.args.Operands` addresses and :class:`~.args.Sizes`."""
    import cutlass

    operands = Operands(*(runtime.fake_address() for _ in Operands._fields))
    sizes = Sizes(*(cutlass.Int32(1) for _ in Sizes._fields))
    return runtime.compile_launcher(kernel, *operands, *sizes, keep_ptx=keep_ptx)


def _launcher(cfg: GroupedGemmConfig):
    return runtime.compiled(cfg.cache_key, lambda: compile_config(cfg))


@functools.cache
def _resident(index: int, cluster: int) -> int:
    """CTAs (``cluster == 1``) or clusters of ``cluster`` CTAs that device ``index`` runs at
    once at one CTA per SM: a persistent grid larger than that would run a tail wave."""
    if cluster == 1:
        return torch.cuda.get_device_properties(index).multi_processor_count
    from cutlass.utils import HardwareInfo

    with torch.cuda.device(index):
        return HardwareInfo(index).get_max_active_clusters(cluster)


@functools.cache
def device_memory(index: int) -> heuristic.DeviceMemory:
    """SMs, L2 bytes and DRAM bandwidth (bytes/s; None where the driver does not report the
    memory clock) of CUDA device ``index``, for :func:`heuristic.plan`."""
    props = torch.cuda.get_device_properties(index)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    # Double data rate: two transfers per memory clock.
    bandwidth = clock_khz * 1e3 * 2 * bus_bits / 8 if clock_khz and bus_bits else None
    return heuristic.DeviceMemory(props.multi_processor_count, props.L2_cache_size, bandwidth)


# SMs the grouped GEMMs leave free (see sm_margin); a context variable, so it is per thread.
_SM_MARGIN = contextvars.ContextVar("sonic_grouped_gemm_sm_margin", default=0)


@contextlib.contextmanager
def sm_margin(num_sms: int):
    """Context in which every grouped GEMM launched by this thread sizes its persistent grid
    for ``num_sms`` fewer SMs (clusters: ``ceil(num_sms / cluster)`` fewer clusters), at least
    one CTA (cluster).

    Why: a persistent grid of one CTA per SM holds every SM until its last tile, so a
    communication kernel queued on another stream (NCCL's all-to-all) gets no SM until the
    GEMM ends; left free SMs let it run alongside. Results are bitwise unchanged: the static
    scheduler (``tile_scheduler``) hands whole work items to CTAs, each computed with the same
    k-loop whatever the grid size; only which CTA computes a tile, and when, changes.

    Raises:
        ValueError: ``num_sms`` negative or not an int.
    """
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 0:
        raise ValueError(f"num_sms must be a non-negative int, got {num_sms!r}")
    token = _SM_MARGIN.set(num_sms)
    try:
        yield
    finally:
        _SM_MARGIN.reset(token)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_ctas(device: torch.device, work_items: int, cluster: int = 1) -> int:
    """Persistent grid size: one CTA (cluster) per resident slot less the :func:`sm_margin`,
    at most one per work item."""
    resident = _resident(_index(device), cluster) - -(-_SM_MARGIN.get() // cluster)
    return cluster * max(1, min(resident, work_items))


def _check_offsets(expert_offsets, device) -> int:
    runtime.check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32,), ndim=1,
                         device=device)
    num_experts = expert_offsets.numel() - 1
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"expert_offsets must have E+1 entries with 1 <= E <= {MAX_EXPERTS}, "
                         f"got {expert_offsets.numel()} entries")
    return num_experts


def _check_width(name: str, size: int) -> None:
    if size <= 0 or size % VEC:
        raise ValueError(f"{name} must be a positive multiple of {VEC}, got {size}")


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
                 gather_idx: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """varlen-M grouped GEMM: ``out[r] = A[r] · b[e]ᵀ`` for every row ``r`` of expert ``e``.

    docs/design.md §3 (up-proj ``H = gather(X)·W1ᵀ``, down-proj ``Y = A·W2ᵀ``, backward
    ``dX̃ = dH·W1``) and §4; SonicMoE (arXiv 2512.14080) §4.1. One persistent launch for all
    experts, fp32 accumulation, bf16 output, bitwise deterministic; no host synchronisation.

    Args:
        a: bf16, contiguous, CUDA. ``(P, K)`` rows already sorted by expert, or with
            ``gather_idx`` the ``(T, K)`` source rows (``A[r] = a[gather_idx[r]]``, gathered
            while loading, never materialised).
        b: ``(E, N, K)`` bf16, either contiguous (K-major: per expert the ``nn.Linear``
            (out, in) layout) or the ``transpose(1, 2)`` view of a contiguous ``(E, K, N)``
            (N-major, e.g. ``w2.transpose(1, 2)`` for the backward's ``dO·W2``); no copy is made.
        expert_offsets: ``(E+1,)`` int32, contiguous: expert ``e`` owns rows
            ``[expert_offsets[e], expert_offsets[e+1])``; non-decreasing from 0 with
            ``expert_offsets[E] <= P`` (as :class:`sonic.RoutingMetadata` builds it). The
            rows past ``expert_offsets[E]`` (a padded routing's padding) are not written:
            :func:`sonic.kernels.padding.fill_padding_rows` fills them where an op returns
            them. Read on the device only; not validated against the data.
        gather_idx: ``(P,)`` int32, contiguous, values in ``[0, T)``, or None.
        out: ``(P, N)`` bf16, contiguous, written in place and returned; allocated if None.

    Returns:
        ``(P, N)`` bf16.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor is not a contiguous CUDA tensor of the right rank, devices differ,
            shapes disagree, ``K`` or ``N`` is not a positive multiple of 8, or ``E`` exceeds
            1024.
    """
    return _varlen_m(a, b, expert_offsets, gather_idx, out, None)[0]


def grouped_gemm_swiglu(x: torch.Tensor, w1: torch.Tensor, expert_offsets: torch.Tensor,
                        gather_idx: torch.Tensor, gate_up: str, *,
                        h_out: torch.Tensor | None = None,
                        activation: str = "swiglu") -> tuple[torch.Tensor, torch.Tensor]:
    """Up-proj with the SwiGLU epilogue: ``H = gather(X)·W1ᵀ``, ``A = SwiGLU(H)``, one launch
    (or another GLU variant's ``A = φ(gate) ⊙ up``, ``activation``).

    docs/design.md §3 forward; SonicMoE (arXiv 2512.14080) §4.1.2. The epilogue stores H (kept for the
    backward) and A, computed from H's bf16 values exactly as :func:`sonic.kernels.swiglu.swiglu`
    does, so A equals the backward's recomputation bitwise.

    Args:
        x: ``(T, d)`` bf16, contiguous, CUDA; rows gathered by ``gather_idx`` while loading.
        w1: ``(E, 2n, d)`` bf16, contiguous; rows ``[gate; up]`` (``gate_up="concat"``) or
            alternating (``"interleaved"``).
        expert_offsets: ``(E+1,)`` int32, as for :func:`grouped_gemm`.
        gather_idx: ``(P,)`` int32, values in ``[0, T)``.
        gate_up: ``"concat"`` or ``"interleaved"``.
        h_out: ``(P, 2n)`` bf16, contiguous: where H is written (e.g. a chunk's rows of a
            buffer holding the H of several calls), allocated if None.
        activation: the GLU variant, one of :data:`sonic.types.GATED_ACTIVATIONS`
            (Shazeer 2020; the gate functions of :mod:`sonic.kernels.activation`).

    Returns:
        ``(H, A)``: ``(P, 2n)`` and ``(P, n)`` bf16; H is ``h_out`` when given.

    Raises:
        TypeError / ValueError: as :func:`grouped_gemm`; also an unknown ``gate_up`` or
            ``activation``, or ``n`` not a multiple of 8 (of 64 with ``"concat"``).
    """
    if gate_up not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up must be one of {GATE_UP_LAYOUTS}, got {gate_up!r}")
    if gather_idx is None:
        raise ValueError("gather_idx is required: the SwiGLU epilogue serves the gathered "
                         "up-proj")
    n = w1.shape[1] // 2 if w1.ndim == 3 else 0
    if n <= 0 or n % (64 if gate_up == "concat" else VEC) or w1.shape[1] % 2:
        raise ValueError(f"w1 must have 2n rows per expert with n a multiple of "
                         f"{64 if gate_up == 'concat' else VEC}, got shape {tuple(w1.shape)}")
    return _varlen_m(x, w1, expert_offsets, gather_idx, h_out, gate_up, activation=activation)


def grouped_gemm_dswiglu(dout: torch.Tensor, w2: torch.Tensor, expert_offsets: torch.Tensor,
                         gather_idx: torch.Tensor, h: torch.Tensor,
                         row_scores: torch.Tensor, *, dh_out: torch.Tensor | None = None,
                         a_out: torch.Tensor | None = None, activation: str = "swiglu"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's dH kernel: ``dA' = gather(dO)·W2`` with the dSwiGLU epilogue, one launch.

    docs/design.md §3 backward step 1; SonicMoE (arXiv 2512.14080) §4.1.3 and App. C. dA' never leaves
    the registers: the epilogue reads the saved H ("concat" layout) and the row scores and
    stores ``dH = dSwiGLU(s·dA', H)``, ``A' = s·A`` and ``ds = ⟨dA', A⟩`` — the function of
    :func:`sonic.kernels.swiglu.dswiglu_epilogue`, computed from fp32 dA' instead of its bf16
    copy. ``ds`` is summed over n-tiles in a fixed order (bitwise deterministic).

    Args:
        dout: ``(T, d)`` bf16, contiguous, CUDA: the layer's output gradient, rows gathered
            by ``gather_idx``.
        w2: ``(E, d, n)`` bf16, contiguous (read N-major, no copy).
        expert_offsets: ``(E+1,)`` int32, as for :func:`grouped_gemm`.
        gather_idx: ``(P,)`` int32, values in ``[0, T)``.
        h: ``(P, 2n)`` bf16, contiguous, 16-byte aligned: the forward's up-projection output,
            rows ``[gate | up]``.
        row_scores: ``(P,)`` fp32, contiguous: the score of each row.
        dh_out: ``(P, 2n)`` bf16, contiguous: where dH is written, allocated if None. It may be
            ``h`` itself: dH then overwrites H in place, which is safe because every tile
            reads its H slabs into shared memory before it stores their dH, and no two tiles
            touch the same element (the backward thus needs no second ``P x 2n`` buffer).
        a_out: ``(P, n)`` bf16, contiguous: where A' is written, allocated if None.
        activation: the GLU variant of the forward (:func:`grouped_gemm_swiglu`); dH is its
            derivative, ``d_gate = dA·u·φ′(g)``, ``d_up = dA·φ(g)``.

    Returns:
        ``(dH (P, 2n) bf16, A' (P, n) bf16, ds (P,) fp32)``; dH is ``dh_out`` and A' is
        ``a_out`` when given.

    Raises:
        TypeError / ValueError: as :func:`grouped_gemm`; also ``h``, ``row_scores`` or
            ``dh_out`` of the wrong dtype, shape or device, or ``dh_out`` overlapping ``h``
            without being ``h``.
    """
    runtime.check_tensor("w2", w2, dtypes=(torch.bfloat16,), ndim=3)
    runtime.check_tensor("gather_idx", gather_idx, dtypes=(torch.int32,), ndim=1,
                         device=w2.device)
    _check_dswiglu_inputs(h, row_scores, dh_out, gather_idx.numel(), w2.shape[2], w2.device)
    return _varlen_m(dout, w2.transpose(1, 2), expert_offsets, gather_idx, dh_out, None,
                     (h, row_scores), a_out, activation=activation)


def _check_dswiglu_inputs(h, row_scores, dh_out, num_pairs: int, n: int, device) -> None:
    """The dH kernel's H ``(P, 2n)`` bf16, row scores ``(P,)`` fp32, and ``dh_out`` either
    ``h`` or disjoint from it."""
    runtime.check_tensor("h", h, dtypes=(torch.bfloat16,), ndim=2, device=device)
    runtime.check_tensor("row_scores", row_scores, dtypes=(torch.float32,), ndim=1,
                         device=device)
    if tuple(h.shape) != (num_pairs, 2 * n):
        raise ValueError(f"h must have shape (P, 2n) = {(num_pairs, 2 * n)}, got "
                         f"{tuple(h.shape)}")
    if row_scores.numel() != num_pairs:
        raise ValueError(f"row_scores must have P = {num_pairs} entries, got "
                         f"{row_scores.numel()}")
    if dh_out is not None and dh_out.data_ptr() != h.data_ptr() and runtime.overlaps(dh_out, h):
        raise ValueError("dh_out must be h itself or a buffer that does not overlap h: a "
                         "shifted overlap would overwrite H rows another tile still reads")


def _varlen_m(a, b, expert_offsets, gather_idx, out, swiglu, dswiglu=None, act_out=None, *,
              activation="swiglu"):
    """:func:`grouped_gemm` (``swiglu`` and ``dswiglu`` None): ``(out, None)``;
    :func:`grouped_gemm_swiglu`: ``(H, A)``; :func:`grouped_gemm_dswiglu` (``dswiglu`` =
    ``(h, row_scores)``, validated by the caller; ``out`` receives dH, ``act_out`` A'):
    ``(dH, A', ds)``."""
    runtime.check_tensor("a", a, dtypes=(torch.bfloat16,), ndim=2)
    device = a.device
    b_n_major = b.ndim == 3 and not b.is_contiguous() and b.transpose(1, 2).is_contiguous()
    runtime.check_tensor("b", b.transpose(1, 2) if b_n_major else b, dtypes=(torch.bfloat16,),
                         ndim=3, device=device)
    num_experts = _check_offsets(expert_offsets, device)
    if b.shape[0] != num_experts:
        raise ValueError(f"b must have E = {num_experts} experts (expert_offsets has E+1 "
                         f"entries), got shape {tuple(b.shape)}")
    dim_n, dim_k = b.shape[1], b.shape[2]
    if a.shape[1] != dim_k:
        raise ValueError(f"a must have K = {dim_k} columns (b is (E, N, K)), got shape "
                         f"{tuple(a.shape)}")
    _check_width("K", dim_k)
    _check_width("N", dim_n)
    if gather_idx is not None:
        runtime.check_tensor("gather_idx", gather_idx, dtypes=(torch.int32,), ndim=1,
                             device=device)
        num_pairs = gather_idx.numel()
    else:
        num_pairs = a.shape[0]
    # The dH kernel's C is dH, (P, 2n) with n = N.
    out_name, out_cols = ("dh_out", 2 * dim_n) if dswiglu is not None else ("out", dim_n)
    if out is None:
        out = torch.empty(num_pairs, out_cols, dtype=torch.bfloat16, device=device)
    else:
        runtime.check_tensor(out_name, out, dtypes=(torch.bfloat16,), ndim=2, device=device)
        if tuple(out.shape) != (num_pairs, out_cols):
            raise ValueError(f"{out_name} must have shape ({num_pairs}, {out_cols}), got "
                             f"{tuple(out.shape)}")
    act = None
    if swiglu is not None:
        act = torch.empty(num_pairs, dim_n // 2, dtype=torch.bfloat16, device=device)
    gathered = gather_idx is not None
    cfg = heuristic.varlen_m_config(
        dim_n, dim_k, gathered, b_n_major,
        epilogue="dswiglu" if dswiglu is not None else "swiglu" if swiglu else "store",
        gate_up=swiglu, activation=activation,
        **_plan_inputs(device, num_pairs, num_experts))
    ds_parts = None
    if dswiglu is not None:
        if act_out is None:
            act = torch.empty(num_pairs, dim_n, dtype=torch.bfloat16, device=device)
        else:
            runtime.check_tensor("a_out", act_out, dtypes=(torch.bfloat16,), ndim=2,
                                 device=device)
            if tuple(act_out.shape) != (num_pairs, dim_n):
                raise ValueError(f"a_out must have shape ({num_pairs}, {dim_n}), got "
                                 f"{tuple(act_out.shape)}")
            act = act_out
        ds_parts = torch.zeros(num_pairs, cfg.n_tiles, dtype=torch.float32, device=device)
    if num_pairs == 0 or a.shape[0] == 0:
        return (out, act) if dswiglu is None else (out.zero_(), act.zero_(), ds_parts.sum(1))
    addr = runtime.address
    operands = Operands(a=addr(a, 16), b=addr(b, 16), c=addr(out, 16),
                        act=addr(act, 16) if act is not None else None,
                        gather_a=addr(gather_idx, 4) if gathered else None,
                        offsets=addr(expert_offsets, 4))
    if dswiglu is not None:
        operands = operands._replace(h=addr(dswiglu[0], 16), scores=addr(dswiglu[1], 4),
                                     ds=addr(ds_parts, 4))
    _launch_varlen_m(cfg, device, operands, a.shape[0], num_pairs, num_experts)
    if dswiglu is not None:
        return out, act, ds_parts.sum(1)
    return out, act


def _launch(cfg: GroupedGemmConfig, device, operands: Operands, rows_a: int, rows_b: int,
            num_experts: int, work_items: int) -> None:
    """Launch ``cfg`` on a persistent grid of at most ``work_items`` CTAs (clusters)."""
    sizes = Sizes(rows_a, rows_b, num_experts, _num_ctas(device, work_items, cfg.cluster))
    _launcher(cfg)(*operands.addresses(), *sizes)


def _launch_varlen_m(cfg: GroupedGemmConfig, device, operands: Operands, rows_a: int,
                     num_pairs: int, num_experts: int) -> None:
    """Launch varlen-M ``cfg`` over ``num_pairs`` rows (of ``rows_a`` source rows of A)."""
    # Each expert adds at most one partial m-tile.
    m_tiles_bound = (num_pairs + cfg.tile_m - 1) // cfg.tile_m + num_experts
    _launch(cfg, device, operands, rows_a, num_pairs, num_experts,
            cfg.varlen_m_work_items(m_tiles_bound))


def grouped_gemm_fp8(a_q: torch.Tensor, a_scales: torch.Tensor, b_q: torch.Tensor,
                     b_scales: torch.Tensor, expert_offsets: torch.Tensor, *,
                     gather_idx: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Block-scaled FP8 varlen-M grouped GEMM: ``out[r] = dequant(A)[r] · dequant(b[e])ᵀ``.

    DeepSeek-V3 (arXiv 2412.19437) §3.3 fine-grained quantization: e4m3 operands,
    A scaled per ``1 x 128`` (row, k-block), B per ``128 x 128`` (n-block, k-block), the
    WGMMA partial sums promoted into fp32 every k-block of 128
    (:mod:`sonic.kernels.grouped_gemm.sm90_fp8`). Computes, per expert ``e`` and row ``r``,
    ``sum_kb (a_q[r, kb]·b_q[e, :, kb]ᵀ) · a_scales[kb, r] · b_scales[e, n // 128, kb]`` in
    fp32, rounded once to bf16. One persistent launch, bitwise deterministic, no host
    synchronisation. Hopper (sm_90a) only.

    Args:
        a_q: float8_e4m3fn, contiguous, CUDA, 16-byte aligned: ``(P, K)`` rows sorted by
            expert, or with ``gather_idx`` the ``(T, K)`` source rows (``A[r] =
            a_q[gather_idx[r]]``, gathered while loading).
        a_scales: ``(K/128, rows of a_q)`` fp32, contiguous: block ``kb`` of source row ``s``
            is scaled by ``a_scales[kb, s]`` (gathered rows take their source row's scales).
        b_q: ``(E, N, K)`` float8_e4m3fn, contiguous (K-major: FP8 WGMMA reads both operands
            K-major, so an N-major weight needs a transposed FP8 copy).
        b_scales: ``(E, N/128, K/128)`` fp32, contiguous.
        expert_offsets: ``(E+1,)`` int32, as for :func:`grouped_gemm`.
        gather_idx: ``(P,)`` int32, contiguous, values in ``[0, T)``, or None.
        out: ``(P, N)`` bf16, contiguous, written in place and returned; allocated if None.

    Returns:
        ``(P, N)`` bf16.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: ``K`` or ``N`` is not a positive multiple of 128, a scale tensor has the
            wrong shape, a tensor is not a contiguous CUDA tensor of the right rank, devices
            differ, shapes disagree, ``E`` exceeds 1024, or the device is not sm_90a (no FP8
            mainloop for it).
    """
    device, num_experts, dim_n, dim_k, num_pairs = _check_fp8_operands(
        ("a_q", "a_scales", "b_q", "b_scales"), a_q, a_scales, b_q, b_scales, expert_offsets,
        gather_idx)
    out = _output("out", out, (num_pairs, dim_n), device)
    cfg = heuristic.varlen_m_config(dim_n, dim_k, gather_idx is not None, ab_dtype="e4m3",
                                    **_plan_inputs(device, num_pairs, num_experts))
    if num_pairs == 0 or a_q.shape[0] == 0:
        return out
    _launch_fp8(cfg, device, num_pairs, num_experts, a_q, a_scales, b_q, b_scales,
                expert_offsets, gather_idx, c=runtime.address(out, 16))
    return out


def grouped_gemm_fp8_swiglu(x_q: torch.Tensor, x_scales: torch.Tensor, w1_q: torch.Tensor,
                            w1_scales: torch.Tensor, expert_offsets: torch.Tensor,
                            gather_idx: torch.Tensor, *, gate_up: str = "concat",
                            h_out: torch.Tensor | None = None,
                            act_out: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 up-proj with the SwiGLU epilogue: ``H = gather(X)·W1ᵀ``,
    ``A = SwiGLU(H)``, one launch.

    The up-proj of the FP8 path; DeepSeek-V3 (arXiv 2412.19437) §3.3 for the
    mainloop (as :func:`grouped_gemm_fp8`: e4m3 operands, X per ``1 x 128``, W1 per
    ``128 x 128``, fp32 promotion every k-block of 128), SonicMoE (arXiv 2512.14080) §4.1.2 for
    the epilogue (as :func:`grouped_gemm_swiglu`: H rounded once to bf16 from the promoted
    fp32 accumulator, A computed from H's bf16 values, so A equals
    :func:`sonic.kernels.swiglu.swiglu` of the returned H bitwise). Bitwise deterministic, no
    host synchronisation. Hopper (sm_90a) only.

    Args:
        x_q: ``(T, d)`` float8_e4m3fn, contiguous, CUDA, 16-byte aligned: the quantized
            tokens, rows gathered by ``gather_idx`` while loading.
        x_scales: ``(d/128, T)`` fp32, contiguous: block ``kb`` of token ``t`` is scaled by
            ``x_scales[kb, t]`` (:func:`sonic.reference.fp8.quantize_rows`).
        w1_q: ``(E, 2n, d)`` float8_e4m3fn, contiguous (K-major): rows ``[gate; up]``
            (``"concat"``) or alternating (``"interleaved"``), quantized in that layout.
        w1_scales: ``(E, 2n/128, d/128)`` fp32, contiguous, the blocks of ``w1_q`` as laid out
            (:func:`sonic.reference.fp8.quantize_blocks`).
        expert_offsets: ``(E+1,)`` int32, as for :func:`grouped_gemm`.
        gather_idx: ``(P,)`` int32, contiguous, values in ``[0, T)``.
        gate_up: ``"concat"`` or ``"interleaved"``.
        h_out: ``(P, 2n)`` bf16, contiguous: where H is written, allocated if None.
        act_out: ``(P, n)`` bf16, contiguous: where A is written, allocated if None.

    Returns:
        ``(H, A)``: ``(P, 2n)`` and ``(P, n)`` bf16; ``h_out`` / ``act_out`` when given.

    Raises:
        TypeError / ValueError: as :func:`grouped_gemm_fp8` (``d`` and ``2n`` positive
            multiples of 128); also ``gather_idx`` None, an unknown ``gate_up``, or ``h_out``
            / ``act_out`` of the wrong dtype, shape or device.
    """
    if gate_up not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up must be one of {GATE_UP_LAYOUTS}, got {gate_up!r}")
    if gather_idx is None:
        raise ValueError("gather_idx is required: the SwiGLU epilogue serves the gathered "
                         "up-proj")
    device, num_experts, dim_n, dim_k, num_pairs = _check_fp8_operands(
        ("x_q", "x_scales", "w1_q", "w1_scales"), x_q, x_scales, w1_q, w1_scales,
        expert_offsets, gather_idx)
    h = _output("h_out", h_out, (num_pairs, dim_n), device)
    act = _output("act_out", act_out, (num_pairs, dim_n // 2), device)
    cfg = heuristic.varlen_m_config(dim_n, dim_k, True, epilogue="swiglu", gate_up=gate_up,
                                    ab_dtype="e4m3",
                                    **_plan_inputs(device, num_pairs, num_experts))
    if num_pairs == 0 or x_q.shape[0] == 0:
        return h, act
    _launch_fp8(cfg, device, num_pairs, num_experts, x_q, x_scales, w1_q, w1_scales,
                expert_offsets, gather_idx, c=runtime.address(h, 16),
                act=runtime.address(act, 16))
    return h, act


def grouped_gemm_fp8_dswiglu(dout_q: torch.Tensor, dout_scales: torch.Tensor,
                             w2t_q: torch.Tensor, w2t_scales: torch.Tensor,
                             expert_offsets: torch.Tensor, gather_idx: torch.Tensor,
                             h: torch.Tensor, row_scores: torch.Tensor, *,
                             dh_out: torch.Tensor | None = None,
                             a_out: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 dH kernel: ``dA' = gather(dO)·W2`` with the dSwiGLU epilogue, one
    launch.

    The FP8 layer uses it (and :func:`grouped_gemm_fp8_swiglu`) under
    :func:`sonic.backend.set_fp8_epilogues` ``("fused")``: over three 600-step seeds of
    ``sonic.train --precision fp8`` on the H200 its validation loss matches bf16's (mean gap
    +0.09%, ``benchmarks/RESULTS.md``), but the layer's step is faster with the store GEMM and
    the one-pass kernels at the 30B shape, so that is the default.

    The backward's dH of the FP8 path; DeepSeek-V3 (arXiv 2412.19437) §3.3 for the
    mainloop (as :func:`grouped_gemm_fp8`), SonicMoE (arXiv 2512.14080) §4.1.3 and App. C for
    the epilogue (as :func:`grouped_gemm_dswiglu`: from the promoted fp32 dA', the saved H
    ("concat") and the row scores it stores ``dH = dSwiGLU(s·dA', H)``, ``A' = s·A`` and
    ``ds = ⟨dA', A⟩``, the latter summed over n-tiles in a fixed order). Bitwise
    deterministic, no host synchronisation. Hopper (sm_90a) only.

    Args:
        dout_q: ``(T, d)`` float8_e4m3fn, contiguous, CUDA, 16-byte aligned: the quantized
            output gradient, rows gathered by ``gather_idx`` while loading.
        dout_scales: ``(d/128, T)`` fp32, contiguous (:func:`sonic.reference.fp8.quantize_rows`).
        w2t_q: ``(E, n, d)`` float8_e4m3fn, contiguous: the quantized ``W2ᵀ`` (per expert
            ``w2[e].T``, K-major for the FP8 WGMMA, which reads both operands K-major).
        w2t_scales: ``(E, n/128, d/128)`` fp32, contiguous: its 128 x 128 block scales
            (:func:`sonic.reference.fp8.quantize_blocks` of ``w2.transpose(1, 2)``).
        expert_offsets: ``(E+1,)`` int32, as for :func:`grouped_gemm`.
        gather_idx: ``(P,)`` int32, contiguous, values in ``[0, T)``.
        h, row_scores, dh_out, a_out: as for :func:`grouped_gemm_dswiglu` (``dh_out`` may be
            ``h``: dH then overwrites H in place).

    Returns:
        ``(dH (P, 2n) bf16, A' (P, n) bf16, ds (P,) fp32)``; dH is ``dh_out`` and A' is
        ``a_out`` when given.

    Raises:
        TypeError / ValueError: as :func:`grouped_gemm_fp8` (``d`` and ``n`` positive
            multiples of 128) and :func:`grouped_gemm_dswiglu`; also ``gather_idx`` None.
    """
    if gather_idx is None:
        raise ValueError("gather_idx is required: the dSwiGLU epilogue serves the gathered "
                         "dA' GEMM")
    device, num_experts, n, dim_k, num_pairs = _check_fp8_operands(
        ("dout_q", "dout_scales", "w2t_q", "w2t_scales"), dout_q, dout_scales, w2t_q,
        w2t_scales, expert_offsets, gather_idx)
    _check_dswiglu_inputs(h, row_scores, dh_out, num_pairs, n, device)
    dh = _output("dh_out", dh_out, (num_pairs, 2 * n), device)
    act = _output("a_out", a_out, (num_pairs, n), device)
    cfg = heuristic.varlen_m_config(n, dim_k, True, epilogue="dswiglu", ab_dtype="e4m3",
                                    **_plan_inputs(device, num_pairs, num_experts))
    ds_parts = torch.zeros(num_pairs, cfg.n_tiles, dtype=torch.float32, device=device)
    if num_pairs == 0 or dout_q.shape[0] == 0:
        return dh, act, ds_parts.sum(1)
    addr = runtime.address
    _launch_fp8(cfg, device, num_pairs, num_experts, dout_q, dout_scales, w2t_q, w2t_scales,
                expert_offsets, gather_idx, c=addr(dh, 16), act=addr(act, 16),
                h=addr(h, 16), scores=addr(row_scores, 4), ds=addr(ds_parts, 4))
    return dh, act, ds_parts.sum(1)


def _check_fp8_operands(names, a_q, a_scales, b_q, b_scales, expert_offsets, gather_idx):
    """Validate the operands of an FP8 varlen-M GEMM (``names``: the caller's names of A, A's
    scales, B, B's scales); ``(device, E, N, K, P)``. Shapes first (device-independent), then
    contiguity and device."""
    fp8, f32 = torch.float8_e4m3fn, torch.float32
    a_name, as_name, b_name, bs_name = names
    for name, t, dtype, ndim in ((a_name, a_q, fp8, 2), (as_name, a_scales, f32, 2),
                                 (b_name, b_q, fp8, 3), (bs_name, b_scales, f32, 3)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise TypeError(f"{name} must be a {dtype} tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    num_experts, dim_n, dim_k = b_q.shape
    block = TILE_K_FP8
    for name, size in ((f"K (columns of {a_name}, last dim of {b_name})", dim_k),
                       (f"N (rows of {b_name} per expert)", dim_n)):
        if size <= 0 or size % block:
            raise ValueError(f"{name} must be a positive multiple of {block} (one FP8 scale "
                             f"block per 128), got {size}")
    if a_q.shape[1] != dim_k:
        raise ValueError(f"{a_name} must have K = {dim_k} columns ({b_name} is (E, N, K)), "
                         f"got shape {tuple(a_q.shape)}")
    if tuple(a_scales.shape) != (dim_k // block, a_q.shape[0]):
        raise ValueError(f"{as_name} must have shape (K/128, rows of {a_name}) = "
                         f"{(dim_k // block, a_q.shape[0])}, got {tuple(a_scales.shape)}")
    if tuple(b_scales.shape) != (num_experts, dim_n // block, dim_k // block):
        raise ValueError(f"{bs_name} must have shape (E, N/128, K/128) = "
                         f"{(num_experts, dim_n // block, dim_k // block)}, got "
                         f"{tuple(b_scales.shape)}")
    runtime.check_tensor(a_name, a_q, dtypes=(fp8,), ndim=2)
    device = a_q.device
    for name, t, dtype, ndim in ((as_name, a_scales, f32, 2), (b_name, b_q, fp8, 3),
                                 (bs_name, b_scales, f32, 3)):
        runtime.check_tensor(name, t, dtypes=(dtype,), ndim=ndim, device=device)
    if _check_offsets(expert_offsets, device) != num_experts:
        raise ValueError(f"{b_name} must have E = {expert_offsets.numel() - 1} experts "
                         f"(expert_offsets has E+1 entries), got shape {tuple(b_q.shape)}")
    if gather_idx is not None:
        runtime.check_tensor("gather_idx", gather_idx, dtypes=(torch.int32,), ndim=1,
                             device=device)
    num_pairs = gather_idx.numel() if gather_idx is not None else a_q.shape[0]
    return device, num_experts, dim_n, dim_k, num_pairs


def _plan_inputs(device, num_pairs: int, num_experts: int) -> dict:
    """A plan's device inputs (:func:`.heuristic.varlen_m_config`,
    :func:`.heuristic.varlen_k_config`): arch, rows per expert and the GPU's memory (None off
    CUDA)."""
    return dict(arch=runtime.device_arch(device),
                rows_per_expert=num_pairs // max(num_experts, 1),
                memory=device_memory(_index(device)) if device.type == "cuda" else None)


def _output(name: str, out, shape: tuple, device) -> torch.Tensor:
    """bf16 output ``out`` of ``shape`` checked, or allocated if None."""
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    runtime.check_tensor(name, out, dtypes=(torch.bfloat16,), ndim=2, device=device)
    if tuple(out.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(out.shape)}")
    return out


def _launch_fp8(cfg, device, num_pairs, num_experts, a_q, a_scales, b_q, b_scales,
                expert_offsets, gather_idx, **epilogue_addrs: int) -> None:
    """Launch an FP8 varlen-M ``cfg``; ``epilogue_addrs``: the epilogue's
    :class:`~.args.Operands` (``c``: the output, SwiGLU's H or dSwiGLU's dH; ``act``; the dH
    kernel's ``h``, ``scores``, ``ds``)."""
    addr = runtime.address
    operands = Operands(a=addr(a_q, 16), b=addr(b_q, 16),
                        gather_a=addr(gather_idx, 4) if gather_idx is not None else None,
                        offsets=addr(expert_offsets, 4), a_scales=addr(a_scales, 4),
                        b_scales=addr(b_scales, 4), **epilogue_addrs)
    _launch_varlen_m(cfg, device, operands, a_q.shape[0], num_pairs, num_experts)


def grouped_gemm_varlen_k(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
                          gather_idx_a: torch.Tensor | None = None,
                          gather_idx_b: torch.Tensor | None = None) -> torch.Tensor:
    """varlen-K grouped GEMM: ``C[e] = A_eᵀ · B_e`` over the rows of expert ``e``.

    docs/design.md §3 backward (``dW2[e] = gather(dO)ᵀ_e · A'_e``, ``dW1[e] = dH_eᵀ · gather(X)_e``)
    and §4; SonicMoE (arXiv 2512.14080) §4.1. One persistent launch, fp32 accumulation in row
    order (bitwise deterministic), bf16 output; an expert with no rows gets zeros.

    Args:
        a: bf16, contiguous, CUDA: ``(P, M)``, or the ``(T_a, M)`` source rows when
            ``gather_idx_a`` is given (row ``r`` of ``A`` is ``a[gather_idx_a[r]]``).
        b: bf16, contiguous: ``(P, N)``, or ``(T_b, N)`` with ``gather_idx_b``.
        expert_offsets: ``(E+1,)`` int32, contiguous, non-decreasing from 0, last entry ``P``.
        gather_idx_a, gather_idx_b: ``(P,)`` int32, contiguous, or None.

    Returns:
        ``(E, M, N)`` bf16.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor is not a contiguous CUDA tensor of the right rank, devices differ,
            the row counts disagree, ``M`` or ``N`` is not a positive multiple of 8, or ``E``
            exceeds 1024.
    """
    runtime.check_tensor("a", a, dtypes=(torch.bfloat16,), ndim=2)
    device = a.device
    runtime.check_tensor("b", b, dtypes=(torch.bfloat16,), ndim=2, device=device)
    num_experts = _check_offsets(expert_offsets, device)
    dim_m, dim_n = a.shape[1], b.shape[1]
    _check_width("M (columns of a)", dim_m)
    _check_width("N (columns of b)", dim_n)
    rows = []
    for name, x, idx in (("a", a, gather_idx_a), ("b", b, gather_idx_b)):
        if idx is not None:
            runtime.check_tensor(f"gather_idx_{name}", idx, dtypes=(torch.int32,), ndim=1,
                                 device=device)
            rows.append(idx.numel())
        else:
            rows.append(x.shape[0])
    if rows[0] != rows[1]:
        raise ValueError(f"a and b must have the same number of rows P (after gathering), got "
                         f"{rows[0]} and {rows[1]}")
    out = torch.empty(num_experts, dim_m, dim_n, dtype=torch.bfloat16, device=device)
    if rows[0] == 0:
        return out.zero_()
    ga, gb = gather_idx_a is not None, gather_idx_b is not None
    plan_inputs = _plan_inputs(device, rows[0], num_experts)
    transpose_c = heuristic.transpose_varlen_k(ga, gb, dim_m=dim_m, dim_n=dim_n, **plan_inputs)
    if transpose_c:
        a, b, gather_idx_a, gather_idx_b = b, a, gather_idx_b, gather_idx_a
        dim_m, dim_n, ga, gb = dim_n, dim_m, gb, ga
    cfg = heuristic.varlen_k_config(dim_m, dim_n, ga, gb, transpose_c, **plan_inputs)
    addr = runtime.address
    operands = Operands(a=addr(a, 16), b=addr(b, 16), c=addr(out, 16),
                        gather_a=None if gather_idx_a is None else addr(gather_idx_a, 4),
                        gather_b=None if gather_idx_b is None else addr(gather_idx_b, 4),
                        offsets=addr(expert_offsets, 4))
    _launch(cfg, device, operands, a.shape[0], b.shape[0], num_experts,
            num_experts * cfg.varlen_k_items_per_expert)
    return out


def grouped_gemm_varlen_k_fp8(a_t_q: torch.Tensor, a_scales: torch.Tensor,
                              b_t_q: torch.Tensor, b_scales: torch.Tensor,
                              k_offsets: torch.Tensor) -> torch.Tensor:
    """Block-scaled FP8 varlen-K grouped GEMM (the weight gradients): ``C[e] = Âᵀ_e · B̂_e``
    over the rows of expert ``e``, from K-major copies.

    DeepSeek-V3 (arXiv 2412.19437) §3.3: e4m3 operands scaled per ``128 x 1`` block
    along the reduction (token) axis, made by
    :func:`sonic.kernels.fp8_quant.quantize_cols_grouped` — each expert's rows transposed
    into ``(columns, R)`` copies, padded to whole 128-row blocks — and the WGMMA partial sums
    promoted into fp32 every block with the product of the row's and the column's scale
    (:mod:`sonic.kernels.grouped_gemm.sm90_fp8`). Computes
    :func:`sonic.reference.fp8.grouped_mm_varlen_k_fp8_reference` up to the fp32 summation
    order inside a block, rounded once to bf16. One persistent launch, bitwise
    deterministic, no host synchronisation; an expert with no rows gets zeros. Hopper
    (sm_90a) only.

    Args:
        a_t_q: ``(M, R)`` float8_e4m3fn, contiguous, CUDA, 16-byte aligned; ``R`` a multiple
            of 128.
        a_scales: ``(R/128, M)`` fp32, contiguous.
        b_t_q: ``(N, R)`` float8_e4m3fn, contiguous, 16-byte aligned.
        b_scales: ``(R/128, N)`` fp32, contiguous, 16-byte aligned (bulk-copied into the
            operand stages).
        k_offsets: ``(E+1,)`` int32, contiguous: expert ``e``'s padded rows ``[k_offsets[e],
            k_offsets[e+1])``, multiples of 128, non-decreasing from 0, at most ``R``
            (:func:`sonic.reference.fp8.padded_offsets`). Read on the device only.

    Returns:
        ``(E, M, N)`` bf16.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: ``M`` or ``N`` not a positive multiple of 128, ``R`` not a multiple of 128,
            shapes disagree, a tensor is not a contiguous CUDA tensor of the right rank,
            devices differ, ``E`` exceeds 1024, the device is not sm_90a, or ``a_t_q``,
            ``b_t_q`` or ``b_scales`` is not 16-byte aligned.
    """
    fp8 = (torch.float8_e4m3fn,)
    runtime.check_tensor("a_t_q", a_t_q, dtypes=fp8, ndim=2)
    device = a_t_q.device
    runtime.check_tensor("b_t_q", b_t_q, dtypes=fp8, ndim=2, device=device)
    num_experts = _check_offsets(k_offsets, device)
    (dim_m, k_rows), dim_n = a_t_q.shape, b_t_q.shape[0]
    for name, size in (("M (rows of a_t_q)", dim_m), ("N (rows of b_t_q)", dim_n)):
        if size <= 0 or size % TILE_K_FP8:
            raise ValueError(f"{name} must be a positive multiple of {TILE_K_FP8}, got {size}")
    if k_rows % TILE_K_FP8:
        raise ValueError(f"R (columns of a_t_q) must be a multiple of {TILE_K_FP8}, got "
                         f"{k_rows}")
    if b_t_q.shape[1] != k_rows:
        raise ValueError(f"b_t_q must have R = {k_rows} columns like a_t_q, got shape "
                         f"{tuple(b_t_q.shape)}")
    for name, scales, cols in (("a_scales", a_scales, dim_m), ("b_scales", b_scales, dim_n)):
        runtime.check_tensor(name, scales, dtypes=(torch.float32,), ndim=2, device=device)
        if tuple(scales.shape) != (k_rows // TILE_K_FP8, cols):
            raise ValueError(f"{name} must have shape (R/128, {cols}) = "
                             f"{(k_rows // TILE_K_FP8, cols)}, got {tuple(scales.shape)}")
    cfg = heuristic.varlen_k_config(dim_m, dim_n, False, False, ab_dtype="e4m3",
                                    arch=runtime.device_arch(device))
    out = torch.empty(num_experts, dim_m, dim_n, dtype=torch.bfloat16, device=device)
    if k_rows == 0:
        return out.zero_()
    addr = runtime.address
    operands = Operands(a=addr(a_t_q, 16, "a_t_q"), b=addr(b_t_q, 16, "b_t_q"),
                        c=addr(out, 16), offsets=addr(k_offsets, 4), a_scales=addr(a_scales, 4),
                        b_scales=addr(b_scales, cfg.b_scales_align, "b_scales"))
    _launch(cfg, device, operands, k_rows, k_rows, num_experts,
            num_experts * cfg.varlen_k_items_per_expert)
    return out


# What each mainloop must show: its MMA (and on sm_100 tensor-memory allocation and loads)
# and TMA operand loads.
_MARKERS = {"sm_90a": ("wgmma.mma_async", "cp.async.bulk.tensor"),
            "sm_100a": ("tcgen05.mma", "tcgen05.alloc", "tcgen05.ld", "cp.async.bulk.tensor")}
# The FP8 mainloop must issue the dense e4m3 x e4m3 -> f32 WGMMA of its 64 x 128 warpgroup tile.
_FP8_MARKERS = ("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
                "cp.async.bulk.tensor")


def _compile_planned(make_config: Callable[..., GroupedGemmConfig], arch: str):
    """Compile the configuration ``make_config`` plans for ``arch``, keeping its PTX."""
    return compile_config(make_config(arch), keep_ptx=True)


def _register(variant: str, make_config: Callable[..., GroupedGemmConfig],
              archs: tuple[str, ...] = tuple(MAINLOOPS),
              markers: tuple[str, ...] | None = None,
              sm90_markers: tuple[str, ...] = ()) -> None:
    """Register a compile-check variant per architecture; ``make_config(arch)`` plans its
    configuration for that architecture; ``markers``: its PTX markers if not the arch's;
    ``sm90_markers``: more that its sm_90a compile must show."""
    for arch in archs:
        register(KernelVariant(
            kernel="grouped_gemm", variant=variant,
            compile_fake=functools.partial(_compile_planned, make_config, arch),
            ptx_markers=(*(markers or _MARKERS[arch]),
                         *(sm90_markers if arch == "sm_90a" else ())),
            archs=(arch,)))


# The forward's up-proj and down-proj, and the backward's dA' (gathered dO · N-major W2).
for _n, _k, _gather, _n_major in ((512, 1536, True, False), (1536, 256, False, False),
                                  (256, 1536, True, True)):
    _register(f"varlen_m_n{_n}_k{_k}_{'gather' if _gather else 'contig'}"
              f"{'_bn' if _n_major else ''}",
              lambda arch, n=_n, k=_k, g=_gather, nm=_n_major: heuristic.varlen_m_config(
                  n, k, g, nm, arch=arch))
# The backward's dX̃ = dH·W1 (contiguous dH, N-major W1); and contiguous A with K > 512 (the
# down-proj at OLMoE / 30B: on sm_90 cooperative 128 x 256 tiles on a 2-CTA cluster, the
# stores deferred into the next tile's mainloop and staged by stmatrix).
_register("varlen_m_n1536_k512_contig_bn",
          lambda arch: heuristic.varlen_m_config(1536, 512, False, True, arch=arch))
_register("varlen_m_n2048_k1024_contig",
          lambda arch: heuristic.varlen_m_config(2048, 1024, False, arch=arch),
          sm90_markers=("stmatrix.sync.aligned.m8n8.x4.shared.b16",))
# The forward's up-proj with the SwiGLU epilogue, both gate/up layouts.
for _n, _gate_up in ((512, "concat"), (2048, "interleaved")):
    _register(f"varlen_m_n{_n}_k1536_gather_swiglu_{_gate_up}",
              lambda arch, n=_n, gu=_gate_up: heuristic.varlen_m_config(
                  n, 1536, True, epilogue="swiglu", gate_up=gu, arch=arch))
# The backward's dH kernel: dA' with the dSwiGLU epilogue, on 128 x 256 tiles (four H slabs
# per tile) and on 128 x 128 tiles (n not a multiple of 256: two); the cluster shares A, or
# B where n has an odd number of n-tiles (1280: five).
for _n in (1024, 192, 1280):
    _register(f"varlen_m_n{_n}_k4096_gather_bn_dswiglu",
              lambda arch, n=_n: heuristic.varlen_m_config(n, 4096, True, True,
                                                           epilogue="dswiglu", arch=arch))
# The other GLU variants' gate functions in both fused epilogues (the data movement is
# SwiGLU's, checked above).
for _act, _gate_up in (("geglu", "concat"), ("geglu_tanh", "interleaved"), ("reglu", "concat")):
    _register(f"varlen_m_n512_k1536_gather_{_act}_{_gate_up}",
              lambda arch, a=_act, gu=_gate_up: heuristic.varlen_m_config(
                  512, 1536, True, epilogue="swiglu", gate_up=gu, arch=arch, activation=a))
    _register(f"varlen_m_n1024_k4096_gather_bn_d{_act}",
              lambda arch, a=_act: heuristic.varlen_m_config(
                  1024, 4096, True, True, epilogue="dswiglu", arch=arch, activation=a))
# The backward's dW2 (gathered dO on the M side, or on sm_90 swapped: C stored transposed
# from 256 x 128 tiles gathering dO on N) and dW1 (gathered X, on sm_90 as C stored
# transposed when N > 2048, the cluster sharing X, or on 256 x 128 tiles gathered on the B
# side; on sm_100 gathered on the B side): heuristic.transpose_varlen_k. On sm_90 128 x 256
# tiles stage C in the last k-tile's ring stage by stmatrix (the transposed C by its .trans
# form).
_register("varlen_k_m1536_n256_gather_a",
          lambda arch: heuristic.varlen_k_config(1536, 256, True, False, arch=arch),
          sm90_markers=("stmatrix.sync.aligned.m8n8.x4.shared.b16",))
# dW2 on an even n-tile count (30B): on sm_90 the cluster shares the gathered dO.
_register("varlen_k_m1536_n512_gather_a",
          lambda arch: heuristic.varlen_k_config(1536, 512, True, False, arch=arch))
_register("varlen_k_m1536_n512_gather_a_ct",
          lambda arch: heuristic.varlen_k_config(1536, 512, True, False, True, arch=arch),
          archs=("sm_90a",), sm90_markers=("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16",))
_register("varlen_k_m1024_n2048_gather_b_ct",
          lambda arch: heuristic.varlen_k_config(1024, 2048, False, True, True, arch=arch),
          archs=("sm_90a",))
_register("varlen_k_m512_n1536_gather_b",
          lambda arch: heuristic.varlen_k_config(512, 1536, False, True, arch=arch))
# C's rows per expert not a multiple of 64: the threads store C (on other 128 x 256 sm_90 tiles
# TMA stores it from the last k-tile's ring stage).
_register("varlen_k_m1000_n512_gather_a_thread_stores",
          lambda arch: heuristic.varlen_k_config(1000, 512, True, False, arch=arch))
# Banded tile orders (n_band): Mixtral-8x7B's up-proj and dH kernel on an H100, whose experts
# hold 4096 rows each against more B than the L2.
_MIXTRAL_ROWS, _H100_MEMORY = 4096, heuristic.DeviceMemory(132, 50 << 20, 3.35e12)
_register("varlen_m_n28672_k4096_gather_swiglu_interleaved_banded",
          lambda arch: heuristic.varlen_m_config(28672, 4096, True, epilogue="swiglu",
                                                 gate_up="interleaved", arch=arch,
                                                 rows_per_expert=_MIXTRAL_ROWS,
                                                 memory=_H100_MEMORY),
          archs=("sm_90a",))
_register("varlen_m_n14336_k4096_gather_bn_dswiglu_banded",
          lambda arch: heuristic.varlen_m_config(14336, 4096, True, True, epilogue="dswiglu",
                                                 arch=arch, rows_per_expert=_MIXTRAL_ROWS,
                                                 memory=_H100_MEMORY),
          archs=("sm_90a",))
# A transposed dW1 whose experts' dH panels outgrow L2 (Mixtral-8x7B's on an H100, were 2n's
# 256-row tiles odd in number; an even number runs untransposed 256 x 128 tiles): the cluster
# shares dH (B) rather than the gathered X.
_register("varlen_k_m4096_n28672_gather_a_ct_share_b",
          lambda arch: heuristic.varlen_k_config(4096, 28672, True, False, True, arch=arch,
                                                 rows_per_expert=_MIXTRAL_ROWS,
                                                 memory=_H100_MEMORY),
          archs=("sm_90a",))
# Plans heuristic.plan does not pick today (bench_grouped_gemm.py --plans times them): a
# 256-row contiguous-A varlen-M tile on a cluster sharing A.
_register("varlen_m_n640_k576_contig_m256_share_a",
          lambda arch: GroupedGemmConfig(varlen_k=False, tile_n=128, pingpong=False,
                                         cluster=CLUSTER,
                                         dim_m=0, dim_n=640, dim_k=576, gather_a=False,
                                         arch=arch, tile_m=256, multicast_a=True),
          archs=("sm_90a",))
# ... and ping-pong varlen-K tiles (dW1 with gathered B, each warpgroup's epilogue under the
# other's mainloop), where an expert's few rows make the tiles' mainloops short.
_register("varlen_k_m4096_n7168_gather_b_pingpong",
          lambda arch: GroupedGemmConfig(varlen_k=True, tile_n=128, pingpong=True, cluster=1,
                                         dim_m=4096, dim_n=7168, dim_k=0, gather_a=False,
                                         gather_b=True, arch=arch),
          archs=("sm_90a",))
# Block-scaled FP8: the gathered up-proj and the contiguous down-proj / dX̃ on
# 256-wide tiles, the contiguous one on 128-wide tiles (N = 384: overlapped promotion) and the
# gathered one on 128-wide tiles (N = 1408: no WGMMA turns).
for _n, _k, _gather in ((512, 1536, True), (1536, 256, False), (384, 256, False),
                        (1408, 2048, True)):
    _register(f"varlen_m_fp8_n{_n}_k{_k}_{'gather' if _gather else 'contig'}",
              lambda arch, n=_n, k=_k, g=_gather: heuristic.varlen_m_config(
                  n, k, g, ab_dtype="e4m3", arch=arch), archs=("sm_90a",), markers=_FP8_MARKERS)
# Block-scaled FP8 dH kernel (dA' with the dSwiGLU epilogue, K-major W2ᵀ copy), on 256-wide
# and (n = 1408) 128-wide tiles.
for _n in (1024, 1408):
    _register(f"varlen_m_fp8_n{_n}_k2048_gather_dswiglu",
              lambda arch, n=_n: heuristic.varlen_m_config(n, 2048, True, epilogue="dswiglu",
                                                           ab_dtype="e4m3", arch=arch),
              archs=("sm_90a",), markers=_FP8_MARKERS)
# ... and in the banded tile order (Mixtral-8x7B's on an H100).
_register("varlen_m_fp8_n14336_k4096_gather_dswiglu_banded",
          lambda arch: heuristic.varlen_m_config(14336, 4096, True, epilogue="dswiglu",
                                                 ab_dtype="e4m3", arch=arch,
                                                 rows_per_expert=_MIXTRAL_ROWS,
                                                 memory=_H100_MEMORY),
          archs=("sm_90a",), markers=_FP8_MARKERS)
# Block-scaled FP8 up-proj with the SwiGLU epilogue, both gate/up layouts; at N = 2n = 384
# (n = 192) a 128-wide concat tile's up half starts in the middle of a W1 scale block, at
# N = 1024 a 256-wide one's halves are whole blocks.
for _n, _gate_up in ((384, "concat"), (1024, "concat"), (1024, "interleaved")):
    _register(f"varlen_m_fp8_n{_n}_k1536_gather_swiglu_{_gate_up}",
              lambda arch, n=_n, gu=_gate_up: heuristic.varlen_m_config(
                  n, 1536, True, epilogue="swiglu", gate_up=gu, ab_dtype="e4m3", arch=arch),
              archs=("sm_90a",), markers=_FP8_MARKERS)
# Block-scaled FP8 up-proj in the banded tile order (Mixtral-8x7B's on an H100).
_register("varlen_m_fp8_n28672_k4096_gather_swiglu_interleaved_banded",
          lambda arch: heuristic.varlen_m_config(28672, 4096, True, epilogue="swiglu",
                                                 gate_up="interleaved", ab_dtype="e4m3",
                                                 arch=arch, rows_per_expert=_MIXTRAL_ROWS,
                                                 memory=_H100_MEMORY),
          archs=("sm_90a",), markers=_FP8_MARKERS)
# Block-scaled FP8 varlen-K (the weight gradients on K-major copies): M with an even
# m-tile count (2-CTA cluster) on 128 x 256 tiles, an odd one (one CTA) on 128 x 128 tiles
# (N not a multiple of 256).
for _m, _n in ((1536, 2048), (384, 384)):
    _register(f"varlen_k_fp8_m{_m}_n{_n}",
              lambda arch, m=_m, n=_n: heuristic.varlen_k_config(m, n, False, False,
                                                                 ab_dtype="e4m3", arch=arch),
              archs=("sm_90a",), markers=_FP8_MARKERS)
