"""Backend selection: which implementation runs each step of the MoE dataflow.

``"torch"`` is the PyTorch reference (any device). ``"cute"`` runs sonic's CuTe-DSL kernels
where they exist, on a supported GPU, and the reference for the steps that have no kernel yet.
``"auto"`` picks ``"cute"`` when the kernels can run on the tensors' device, else ``"torch"``;
:func:`explain_backend` says why.

On Blackwell (sm_100a) the grouped GEMMs are compile-checked in CI but were never run by the
authors: each grouped-GEMM variant first passes a one-time on-device self-check
(:mod:`sonic.kernels.grouped_gemm.self_check`). Under ``"auto"`` a variant that fails it
warns once and its op runs the PyTorch reference; under ``"cute"`` it raises.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, get_args

import torch

from sonic._validation import check_choice, check_int
# sonic.backend.sm_margin is public; the grouped GEMMs own the setting.
from sonic.kernels import runtime
from sonic.kernels.grouped_gemm.interface import sm_margin  # noqa: F401
from sonic.reference import activations
from sonic.reference import fp8 as fp8_reference
from sonic.reference import ops as reference
from sonic.reference.metadata import pairs_metadata
from sonic.types import GROUPED_GEMM_MAX_EXPERTS, Backend

BACKENDS: tuple[Backend, ...] = get_args(Backend)


@dataclass(frozen=True)
class ExpertOps:
    """The implementations of one backend; signatures as in :mod:`sonic.reference.ops` and
    :func:`sonic.reference.metadata.pairs_metadata`."""

    name: str
    metadata: Callable
    grouped_mm: Callable
    grouped_mm_varlen_k: Callable
    # The up-proj and dH steps of every activation (keyword ``activation``, SwiGLU by default;
    # signatures as in sonic.reference.activations.up_proj / dh_step).
    up_proj_swiglu: Callable
    dh_dswiglu: Callable
    aggregate: Callable
    # FP8 steps (precision="fp8"): signatures as in sonic.reference.fp8
    # (quantize_rows, quantize_blocks) and sonic.reference.ops (the rest).
    quantize_rows: Callable
    quantize_blocks: Callable
    grouped_mm_fp8: Callable
    up_proj_swiglu_fp8: Callable
    dh_dswiglu_fp8: Callable
    # FP8 weight gradients: signatures as in sonic.reference.fp8 (quantize_cols_grouped,
    # grouped_mm_varlen_k_fp8_reference).
    quantize_cols_grouped: Callable
    grouped_mm_varlen_k_fp8: Callable
    # Fills an output's rows past expert_offsets[E] (signature as in
    # sonic.reference.ops.fill_padding_rows); None where the backend's varlen-M steps write
    # the reference's zeros there already.
    fill_padding_rows: Callable | None


def _torch_dh_dswiglu_fp8(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx, h,
                          row_scores, gate_up, **kwargs):
    # The emulation follows set_fp8_epilogues so that CPU runs and the GPU tests compare the
    # kernels with the math they do.
    return reference.dh_dswiglu_fp8(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx,
                                    h, row_scores, gate_up, **kwargs,
                                    da_prime_fp32=_fused_dswiglu(gate_up, gather_idx))


TORCH_OPS = ExpertOps(
    name="torch",
    metadata=pairs_metadata,
    grouped_mm=reference.grouped_mm,
    grouped_mm_varlen_k=reference.grouped_mm_varlen_k,
    up_proj_swiglu=activations.up_proj,
    dh_dswiglu=activations.dh_step,
    aggregate=reference.aggregate,
    quantize_rows=fp8_reference.quantize_rows,
    quantize_blocks=fp8_reference.quantize_blocks_and_transpose,
    grouped_mm_fp8=reference.grouped_mm_fp8,
    up_proj_swiglu_fp8=reference.up_proj_swiglu_fp8,
    dh_dswiglu_fp8=_torch_dh_dswiglu_fp8,
    quantize_cols_grouped=fp8_reference.quantize_cols_grouped,
    grouped_mm_varlen_k_fp8=fp8_reference.grouped_mm_varlen_k_fp8_reference,
    fill_padding_rows=None,
)


def kernel_support(device: torch.device) -> tuple[bool, str]:
    """Whether sonic's CuTe kernels can run on ``device``, and if not, why."""
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA GPU"
    return runtime.kernels_available(device)


def explain_backend(backend: str = "auto", device: torch.device | str | None = None) -> str:
    """One line saying which backend ``backend`` resolves to on ``device`` and why — or, for
    ``"cute"`` where the kernels cannot run, that a call would raise and why. On an sm_100a
    device it runs every grouped-GEMM self-check (once per process; cached) and names the
    variants that passed and failed; on sm_90a it says none is needed."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    check_choice("backend", backend, BACKENDS)
    if backend == "torch":
        return "torch: requested"
    ok, reason = kernel_support(device)
    if ok:
        return "cute: kernels available" + _self_check_summary(backend, device)
    if backend == "cute":
        return f"raises RuntimeError: backend='cute' cannot run here: {reason}"
    return f"torch: {reason}"


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"cute"`` for ``backend`` on ``device``.

    Raises:
        ValueError: unknown ``backend``.
        RuntimeError: ``backend="cute"`` where the kernels cannot run (the message says why).
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "torch":
        return "torch"
    ok, reason = kernel_support(device)
    if backend == "cute" and not ok:
        raise RuntimeError(f"backend='cute' cannot run here: {reason}")
    if not ok and device.type == "cuda":
        _warn_fallback(reason)
    return "cute" if ok else "torch"


def _self_check_summary(backend: str, device: torch.device) -> str:
    from sonic.kernels.grouped_gemm import self_check

    arch = runtime.device_arch(device)
    if not self_check.required(device):
        return f" ({arch}: grouped GEMMs need no self-check)"
    outcome = {v: self_check.self_check(v, device) for v in self_check.VARIANTS}
    passed = [v for v, (ok, _) in outcome.items() if ok]
    failed = [f"{v} ({message})" for v, (ok, message) in outcome.items() if not ok]
    text = f" ({arch}: grouped-GEMM self-checks passed: {', '.join(passed) or 'none'}"
    if failed:
        action = "raise RuntimeError" if backend == "cute" else "use the PyTorch reference"
        text += f"; failed, so those ops {action}: {'; '.join(failed)}"
    return text + ")"


def _self_checked(variant: str, device: torch.device, strict: bool) -> bool:
    """Whether grouped-GEMM ``variant`` may run on ``device``: no self-check is needed there,
    or it passed. A failure warns once (``strict``: raises).

    Raises:
        RuntimeError: ``strict`` and the self-check failed (the message carries its report).
    """
    from sonic.kernels.grouped_gemm import self_check

    if not self_check.required(device):
        return True
    ok, message = self_check.self_check(variant, device)
    if ok:
        return True
    if strict:
        raise RuntimeError(f"backend='cute' cannot run grouped-GEMM variant {variant!r} here: "
                           f"its on-device self-check failed: {message}")
    _warn_self_check(message)
    return False


@functools.cache
def _warn_self_check(message: str) -> None:
    # Once per variant and device (the message names both): the op then runs the reference.
    warnings.warn(f"sonic: grouped-GEMM self-check failed ({message}); that op uses the "
                  "PyTorch reference", RuntimeWarning, stacklevel=4)


@functools.cache
def _warn_fallback(reason: str) -> None:
    # Once per reason: a GPU user should learn that the kernels are not running, not every call.
    warnings.warn(f"sonic: CuTe kernels unavailable ({reason}); using the PyTorch reference "
                  "backend", RuntimeWarning, stacklevel=3)


class _ProcessChoice:
    """A process-wide choice among ``choices`` (not a context: the backward runs on
    autograd's device threads)."""

    def __init__(self, choices: tuple, default: str):
        self.choices, self.value = choices, default

    def set(self, kind: str) -> str:
        check_choice("kind", kind, self.choices)
        previous, self.value = self.value, kind
        return previous


# Which kernels run the FP8 up-proj and dH steps on the CuTe backend (set_fp8_epilogues).
FP8_EPILOGUES = ("store", "quantizing", "fused")
_fp8_epilogues = _ProcessChoice(FP8_EPILOGUES, "quantizing")


def _fused_dswiglu(gate_up: str, gather_idx) -> bool:
    """Whether the FP8 dH step takes dSwiGLU of the fp32 dA' (the fused kernel's math, which
    the reference then emulates) rather than of its bf16 rounding."""
    return _fp8_epilogues.value == "fused" and gate_up == "concat" and gather_idx is not None


def set_fp8_epilogues(kind: str) -> str:
    """Choose, process-wide, the CuTe kernels of the FP8 path's up-proj and dH steps; returns
    the previous choice. No effect on bf16.

    * ``"store"``: the FP8 GEMM with its store epilogue, then the one-pass SwiGLU / dSwiGLU
      kernel (dH written over H, A' over dA'), and separate passes that quantize A for the
      down-proj and dH for the dX GEMM (and, with ``activation_cache="fp8"``, quantize H
      for the cache and dequantize it before the dH step).
    * ``"quantizing"`` (default): the same kernels doing those passes' work in their own
      pass: the SwiGLU kernel writes A (and the cache's H) in e4m3 with its scales
      (``swiglu(h, quantize=True, quantize_h=)``), the dSwiGLU kernel writes dH in e4m3 too
      and reads the cache's H in e4m3 (``dswiglu_epilogue(quantize_dh=True, h_scales=)``).
      Bitwise the same values as ``"store"``; faster (benchmarks/RESULTS.md).
    * ``"fused"``: :func:`sonic.kernels.grouped_gemm.grouped_gemm_fp8_swiglu` and
      :func:`~sonic.kernels.grouped_gemm.grouped_gemm_fp8_dswiglu` (SwiGLU / dSwiGLU in the
      GEMM's epilogue; dSwiGLU on the fp32 dA' instead of its bf16 rounding). On 256-wide
      FP8 tiles slower than ``"quantizing"`` at OLMoE and level at 30B; over three seeds its
      validation loss matches bf16's (benchmarks/RESULTS.md). Where a call does not fit the
      fused dH kernel (``"interleaved"``, no gather) the store path runs.

    The PyTorch reference emulates the chosen math: under ``"fused"`` its dH step takes
    dSwiGLU of the fp32 dA' wherever the fused kernel would run; the other two choices share
    one math.

    Process-wide rather than a context: the backward runs on autograd's device threads. Read
    inside the ops' implementations when they run (opaque to ``torch.compile``), so a
    compiled layer follows a change without recompiling; a forward and its backward each
    use the choice current when they run.

    Raises:
        ValueError: ``kind`` not in :data:`FP8_EPILOGUES`.
    """
    return _fp8_epilogues.set(kind)


def fp8_epilogues() -> str:
    """The current :func:`set_fp8_epilogues` choice."""
    return _fp8_epilogues.value


# Precision of the FP8 path's weight gradients (set_fp8_weight_grads): "auto" picks one of
# the two precisions by the layer's sizes (fp8_weight_grads_for).
FP8_WEIGHT_GRAD_PRECISIONS = ("fp8", "bf16")
FP8_WEIGHT_GRADS = ("auto", *FP8_WEIGHT_GRAD_PRECISIONS)
_fp8_weight_grads = _ProcessChoice(FP8_WEIGHT_GRADS, "auto")
# "auto" takes FP8 weight gradients where d·n / (2d + 3n) reaches this: the two GEMMs' FLOPs
# (6·P·d·n) against the elements the four column-wise copies move (P·(2d + 3n)), up to
# constant factors. H200 (benchmarks/RESULTS.md, "FP8 weight gradients by layer"): faster at
# DeepSeek-V3 (717), Mixtral-8x7B (1147) and GLM-4.5 (530), level at Qwen3-235B (492),
# slower at 30B (372), OLMoE (293) and 7B (102).
FP8_WEIGHT_GRADS_MIN_INTENSITY = 512


def set_fp8_weight_grads(kind: str) -> str:
    """Choose, process-wide, the precision of ``precision="fp8"``'s weight gradients dW1,
    dW2; returns the previous choice. No effect on bf16.

    * ``"auto"`` (default): ``"fp8"`` where the layer's ``d`` (d_model) and ``n``
      (d_expert) make the GEMMs large against the copies they need, else ``"bf16"``
      (:func:`fp8_weight_grads_for`).
    * ``"bf16"``: the bf16 varlen-K GEMMs on the bf16 dO, A', dH and X.
    * ``"fp8"``: the varlen-K GEMMs on e4m3 operands scaled per ``128 x 1`` block along the
      tokens they sum over (DeepSeek-V3 §3.3 quantizes every GEMM's operands along its
      reduction axis): dO, A', dH and gathered X each quantized once into a K-major copy
      (:func:`sonic.kernels.fp8_quant.quantize_cols_grouped`, every expert's rows padded to
      whole 128-row blocks), then :func:`sonic.kernels.grouped_gemm.grouped_gemm_varlen_k_fp8`.
      Same validation loss as bf16 weight gradients (CPU emulation, and three seeds on the
      GPU), with more peak memory (the copies: about 1–2 GiB at the large layers). On the
      H200 they pay off where the GEMMs are large against the four column-wise quantization
      passes (DeepSeek-V3, Mixtral-8x7B, GLM-4.5); at the OLMoE, 30B and 7B layers they are
      slower (benchmarks/RESULTS.md).

    Both backends follow it (the PyTorch reference emulates the FP8 math). Process-wide
    rather than a context: the backward runs on autograd's device threads. Read (and
    ``"auto"`` resolved) when the layer's forward runs, and carried to its backward as an
    argument of the op ``sonic::moe_experts_fp8`` (and by expert parallelism's autograd
    function): a graph built under one choice keeps it, and ``torch.compile`` recompiles when
    it changes.

    Raises:
        ValueError: ``kind`` not in :data:`FP8_WEIGHT_GRADS`.
    """
    return _fp8_weight_grads.set(kind)


def fp8_weight_grads() -> str:
    """The current :func:`set_fp8_weight_grads` choice (``"auto"`` unresolved)."""
    return _fp8_weight_grads.value


def fp8_weight_grads_for(d: int, n: int) -> str:
    """The weight gradients' precision, ``"fp8"`` or ``"bf16"``, that the current
    :func:`set_fp8_weight_grads` choice gives a layer of model width ``d`` and expert width
    ``n``: ``"auto"`` takes ``"fp8"`` where ``d·n / (2d + 3n)`` is at least
    :data:`FP8_WEIGHT_GRADS_MIN_INTENSITY` — the weight gradients' FLOPs (``6·P·d·n``) per
    element of the four column-wise copies they need (``P·(2d + 3n)``), measured on the H200
    at the named layers (benchmarks/RESULTS.md); the tokens ``P`` cancel.

    Raises:
        TypeError: ``d`` or ``n`` is not an int.
        ValueError: ``d`` or ``n`` is below 1.
    """
    check_int("d", d, low=1)
    check_int("n", n, low=1)
    choice = _fp8_weight_grads.value
    if choice != "auto":
        return choice
    return "fp8" if d * n >= FP8_WEIGHT_GRADS_MIN_INTENSITY * (2 * d + 3 * n) else "bf16"


def expert_ops(backend: str, device: torch.device) -> ExpertOps:
    """The :class:`ExpertOps` that ``backend`` resolves to on ``device``."""
    if resolve_backend(backend, device) == "torch":
        return TORCH_OPS
    return _cute_ops(strict=backend == "cute")


def _cute_metadata(token_idx, expert_idx, num_tokens, num_experts, *, top_k=None):
    from sonic.kernels import routing_metadata as kernels

    if num_experts > kernels.ROUTING_METADATA_MAX_EXPERTS:
        return pairs_metadata(token_idx, expert_idx, num_tokens, num_experts, top_k=top_k)
    expert_idx = expert_idx.to(torch.int32).contiguous()
    if top_k is not None:
        return kernels.routing_metadata_topk(expert_idx.view(num_tokens, top_k), num_experts)
    return kernels.routing_metadata_pairs(token_idx.to(torch.int32).contiguous(), expert_idx,
                                          num_tokens, num_experts)


def _cute_aggregate(y, token_rows, token_offsets, row_scores):
    from sonic.kernels import aggregation as kernels

    if y.dtype not in kernels.DTYPES or y.shape[1] % kernels.VEC:
        return reference.aggregate(y, token_rows, token_offsets, row_scores)
    return kernels.aggregate(y, token_rows, token_offsets, row_scores)


def _epilogue_kernel_fits(h: torch.Tensor) -> bool:
    # The standalone SwiGLU kernels take bf16 rows with n a multiple of 8; fp32/fp16 MoEs run
    # the reference.
    return h.dtype == torch.bfloat16 and h.is_contiguous() and h.shape[1] % 16 == 0


def _cute_up_proj_swiglu(x, w1, offsets, gather_idx, gate_up, *, h_out=None, strict=False,
                         activation="swiglu"):
    from sonic.kernels import grouped_gemm as gemm
    from sonic.kernels import swiglu as kernels

    # The up-proj GEMM with the SwiGLU epilogue beats the GEMM followed by the one-pass SwiGLU
    # kernel at the 7B, OLMoE and 30B shapes (bench_grouped_gemm.py). The other GLU variants
    # run the same epilogue with their gate function; the non-gated activations run the GEMM
    # and the reference activation. The self-check covers the epilogue's data movement, which
    # every GLU variant shares.
    n = w1.shape[1] // 2
    if (activations.is_gated(activation) and _gemm_kernel_fits(x, w1, offsets, gather_idx)
            and w1.is_contiguous() and n % (64 if gate_up == "concat" else gemm.VEC) == 0
            and _self_checked(f"up_proj_swiglu_{gate_up}", x.device, strict)):
        return gemm.grouped_gemm_swiglu(x, w1, offsets, gather_idx, gate_up, h_out=h_out,
                                        activation=activation)
    h = _cute_grouped_mm(x, w1.transpose(1, 2), offsets, gather_idx, strict=strict)
    if activation == "swiglu":
        act = (kernels.swiglu if _epilogue_kernel_fits(h) else reference.swiglu)(h, gate_up)
    else:
        act = activations.activate(h, activation, gate_up)
    return reference.copy_into(h_out, h), act


def _cute_dh_dswiglu(dout, w2, offsets, gather_idx, h, row_scores, gate_up, *,
                     overwrite_h=False, a_out=None, strict=False, activation="swiglu"):
    from sonic.kernels import grouped_gemm as gemm

    # The dH kernel: the dA' GEMM with the dSwiGLU epilogue (or another GLU variant's
    # derivative), H arriving by TMA through the operand ring; it beats the dA' GEMM followed
    # by the one-pass epilogue kernel at the 7B, OLMoE and 30B shapes (bench_grouped_gemm.py).
    # The one-pass kernel computes SwiGLU only: the other activations' unfused step is the
    # reference epilogue after the CuTe GEMM.
    bf16_rows = _epilogue_kernel_fits(h)
    if (bf16_rows and activations.is_gated(activation) and gate_up == "concat"
            and gather_idx is not None and w2.is_contiguous()
            and _gemm_kernel_fits(dout, w2.transpose(1, 2), offsets, gather_idx)
            and h.data_ptr() % 16 == 0 and _self_checked("dh_dswiglu", dout.device, strict)):
        return gemm.grouped_gemm_dswiglu(dout, w2, offsets, gather_idx, h,
                                         row_scores.float().contiguous(),
                                         dh_out=h if overwrite_h else None, a_out=a_out,
                                         activation=activation)
    da_prime = _cute_grouped_mm(dout, w2, offsets, gather_idx, strict=strict).contiguous()
    # The epilogue reads every row: a padded routing's padding rows of dA', which no GEMM
    # tile writes, get zeros first (their dH, A' and ds are overwritten by the step's own fill).
    _cute_fill_padding_rows(da_prime, offsets)
    if not bf16_rows or activation != "swiglu":
        dh, a_scaled, ds = activations.activation_backward(da_prime, h, row_scores, activation,
                                                           gate_up)
        return dh, reference.copy_into(a_out, a_scaled), ds
    return _dswiglu_epilogue_kernel(da_prime, h, row_scores.float().contiguous(), gate_up,
                                    overwrite_h, a_out)


def _dswiglu_epilogue_kernel(da_prime, h, row_scores, gate_up, overwrite_h, a_out,
                             quantize_dh=False, h_scales=None):
    # The one-pass epilogue after a store GEMM. dA' is this step's own temporary, so A' goes
    # over it unless the caller wants it elsewhere; dH goes over H when the caller allows: the
    # step then holds H and dA' only, as the fused dH kernel does. An e4m3 H (h_scales) is
    # dequantized by the kernel as it loads it; dH is then a new bf16 buffer.
    from sonic.kernels import swiglu as kernels

    direct = a_out is not None and a_out.is_contiguous() and a_out.data_ptr() % 16 == 0
    dh, a_scaled, ds, *dh_q = kernels.dswiglu_epilogue(
        da_prime, h, row_scores, gate_up, h_scales=h_scales,
        dh_out=h if overwrite_h and h_scales is None else None,
        a_out=a_out if direct else da_prime, quantize_dh=quantize_dh)
    return (dh, a_scaled if direct else reference.copy_into(a_out, a_scaled), ds, *dh_q)


def _gemm_kernel_fits(a, b_nk, offsets, gather_idx) -> bool:
    # bf16, 16-byte aligned, K and N multiples of 8, B K-major or N-major, E within the
    # kernel's tile table.
    from sonic.kernels import grouped_gemm as kernels

    n, k = b_nk.shape[1], b_nk.shape[2]
    return (a.dtype == b_nk.dtype == torch.bfloat16 and a.is_contiguous()
            and a.data_ptr() % 16 == 0 and b_nk.data_ptr() % 16 == 0
            and (b_nk.is_contiguous() or b_nk.transpose(1, 2).is_contiguous())
            and n % kernels.VEC == 0 and k % kernels.VEC == 0
            and offsets.numel() - 1 <= GROUPED_GEMM_MAX_EXPERTS
            and (gather_idx is None or gather_idx.dtype == torch.int32))


def _cute_grouped_mm(a, b, offsets, gather_idx=None, *, strict=False):
    from sonic.kernels import grouped_gemm as kernels
    from sonic.kernels.grouped_gemm import self_check

    b_nk = b.transpose(1, 2)
    if _gemm_kernel_fits(a, b_nk, offsets, gather_idx) and _self_checked(
            self_check.varlen_m_variant(gather_idx is not None, not b_nk.is_contiguous()),
            a.device, strict):
        return kernels.grouped_gemm(a, b_nk, offsets, gather_idx=gather_idx)
    return reference.grouped_mm(a, b, offsets, gather_idx)


def _cute_grouped_mm_varlen_k(a, b, offsets, gather_idx_a=None, gather_idx_b=None, *,
                              strict=False):
    from sonic.kernels import grouped_gemm as kernels
    from sonic.kernels.grouped_gemm import self_check

    operands_fit = all(
        x.dtype == torch.bfloat16 and x.is_contiguous() and x.data_ptr() % 16 == 0
        and x.shape[1] % kernels.VEC == 0 and (idx is None or idx.dtype == torch.int32)
        for x, idx in ((a, gather_idx_a), (b, gather_idx_b)))
    if (operands_fit and offsets.numel() - 1 <= GROUPED_GEMM_MAX_EXPERTS and _self_checked(
            self_check.varlen_k_variant(gather_idx_a is not None, gather_idx_b is not None),
            a.device, strict)):
        return kernels.grouped_gemm_varlen_k(a, b, offsets, gather_idx_a=gather_idx_a,
                                             gather_idx_b=gather_idx_b)
    return reference.grouped_mm_varlen_k(a, b, offsets, gather_idx_a, gather_idx_b)


def _cute_fill_padding_rows(t, offsets, dim=0, value=0.0):
    # The varlen-M kernels store only expert rows: a padded routing's padding rows get their
    # values from this small kernel, whose work is the padding alone.
    from sonic.kernels import padding as kernels

    if (kernels.fits(t, dim) and offsets.dtype == torch.int32 and offsets.is_contiguous()
            and (value == 0 or t.dtype == torch.float32)):
        return kernels.fill_padding_rows(t, offsets, dim, value)
    return reference.fill_padding_rows(t, offsets, dim, value)


# ------------------------------------------------------------------------------ FP8

FP8_ARCH = "sm_90a"


def check_fp8_backend(backend: str, device: torch.device) -> None:
    """Raise unless ``precision="fp8"`` can run with ``backend`` on ``device``.

    The FP8 grouped GEMM has a Hopper mainloop only, so on a CUDA device other than sm_90a
    ``"cute"`` and ``"auto"`` refuse rather than run the (slow) PyTorch emulation unasked;
    ``"torch"`` emulates the same quantized math anywhere, and off CUDA ``"auto"`` does too.

    Raises:
        RuntimeError: ``backend`` is ``"cute"`` or ``"auto"``, ``device`` is a CUDA device and
            not sm_90a (or, for ``"cute"``, the kernels cannot run there at all).
    """
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return
    arch = None
    if device.type == "cuda":
        arch = runtime.device_arch(device)
    if arch != FP8_ARCH:
        where = f"a {arch} GPU" if arch else f"device {device}"
        raise RuntimeError(
            f"precision='fp8' with backend={backend!r} needs a Hopper GPU ({FP8_ARCH}: the "
            f"block-scaled FP8 grouped GEMM has no other mainloop), got {where}; use "
            "precision='bf16', or backend='torch' for the (slow) PyTorch emulation of the "
            "same FP8 math on any device")
    resolve_backend(backend, device)


def _cute_quantize_rows(x):
    from sonic.kernels import fp8_quant as kernels

    if (x.is_cuda and x.dtype == torch.bfloat16 and x.is_contiguous() and x.data_ptr() % 16 == 0
            and x.shape[1] % kernels.FP8_BLOCK == 0):
        return kernels.quantize_rows(x)
    return fp8_reference.quantize_rows(x)


def _cute_dequantize_rows(q, scales):
    from sonic.kernels import fp8_quant as kernels

    if (q.is_cuda and q.is_contiguous() and q.data_ptr() % 16 == 0
            and q.shape[1] % kernels.FP8_BLOCK == 0):
        return kernels.dequantize_rows(q, scales.contiguous())
    return fp8_reference.dequantize_rows(q, scales).to(torch.bfloat16)


def _cute_quantize_blocks(w):
    from sonic.kernels import fp8_quant as kernels

    # Both orientations in one pass: the transposed copy through shared memory costs less than
    # transposing the whole e4m3 copy afterwards.
    if (w.is_cuda and w.dtype == torch.bfloat16 and w.is_contiguous() and w.data_ptr() % 16 == 0
            and w.shape[-1] % kernels.FP8_BLOCK == 0 and w.shape[-2] % kernels.FP8_BLOCK == 0):
        return kernels.quantize_blocks(w, transposed=True)
    return fp8_reference.quantize_blocks_and_transpose(w)


def _fp8_gemm_fits(a_q, a_scales, b_q, b_scales, offsets, gather_idx) -> bool:
    # The kernel's own limits (K, N multiples of 128 are the layer's precondition).
    return (all(t.is_contiguous() for t in (a_q, a_scales, b_q, b_scales))
            and a_q.data_ptr() % 16 == 0 and b_q.data_ptr() % 16 == 0
            and b_q.shape[1] % 128 == 0 and b_q.shape[2] % 128 == 0
            and offsets.numel() - 1 <= GROUPED_GEMM_MAX_EXPERTS
            and (gather_idx is None or gather_idx.dtype == torch.int32))


def _cute_grouped_mm_fp8(a_q, a_scales, b_q, b_scales, offsets, gather_idx=None, *, out=None):
    from sonic.kernels import grouped_gemm as kernels

    if _fp8_gemm_fits(a_q, a_scales, b_q, b_scales, offsets, gather_idx) and (
            out is None or (out.is_contiguous() and out.data_ptr() % 16 == 0)):
        return kernels.grouped_gemm_fp8(a_q, a_scales, b_q, b_scales, offsets,
                                        gather_idx=gather_idx, out=out)
    return reference.copy_into(out, reference.grouped_mm_fp8(a_q, a_scales, b_q, b_scales,
                                                             offsets, gather_idx))


def _cute_up_proj_swiglu_fp8(x_q, x_scales, w1_q, w1_scales, offsets, gather_idx, gate_up, *,
                             h_out=None, quantize_h=False):
    from sonic.kernels import grouped_gemm as gemm
    from sonic.kernels import swiglu as kernels

    def with_h_q(h, a_q, a_scales):
        return (h, a_q, a_scales) + (_cute_quantize_rows(h) if quantize_h else ())

    # set_fp8_epilogues: the fused kernel, or the FP8 GEMM with its store epilogue then the
    # one-pass SwiGLU kernel; A (and the fp8 cache's H) quantized after it, or by it
    # ("quantizing", the default).
    if (_fp8_epilogues.value == "fused" and gather_idx is not None
            and _fp8_gemm_fits(x_q, x_scales, w1_q, w1_scales, offsets, gather_idx)
            and (h_out is None or (h_out.is_contiguous() and h_out.data_ptr() % 16 == 0))):
        h, act = gemm.grouped_gemm_fp8_swiglu(x_q, x_scales, w1_q, w1_scales, offsets,
                                              gather_idx, gate_up=gate_up, h_out=h_out)
        # The row quantizations read every row: a padded routing's padding rows, which no
        # GEMM tile writes, get the reference's zeros first (the same below for the one-pass
        # SwiGLU kernel).
        for t in (h, act) if quantize_h else (act,):
            _cute_fill_padding_rows(t, offsets)
        return with_h_q(h, *_cute_quantize_rows(act))
    h = _cute_grouped_mm_fp8(x_q, x_scales, w1_q, w1_scales, offsets, gather_idx, out=h_out)
    _cute_fill_padding_rows(h, offsets)
    if not _epilogue_kernel_fits(h):
        return with_h_q(h, *_cute_quantize_rows(reference.swiglu(h, gate_up)))
    if _fp8_epilogues.value == "quantizing" and (h.shape[1] // 2) % kernels.FP8_BLOCK == 0:
        return h, *kernels.swiglu(h, gate_up, quantize=True, quantize_h=quantize_h)
    return with_h_q(h, *_cute_quantize_rows(kernels.swiglu(h, gate_up)))


def _cute_dh_dswiglu_fp8(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx, h, row_scores,
                         gate_up, *, overwrite_h=False, a_out=None, quantize_dh=False,
                         h_scales=None):
    from sonic.kernels import grouped_gemm as gemm
    from sonic.kernels import swiglu as kernels

    def with_dh_q(step):
        return step + (_cute_quantize_rows(step[0]) if quantize_dh else ())

    # The fp8 cache's H: under "quantizing" the one-pass dSwiGLU kernel reads it in e4m3;
    # otherwise it is dequantized into a bf16 buffer of this step's own (dH may go over it).
    if h_scales is not None and (_fp8_epilogues.value != "quantizing" or not (
            h.is_cuda and h.is_contiguous() and h.data_ptr() % 8 == 0
            and h_scales.is_contiguous())):
        h, h_scales, overwrite_h = _cute_dequantize_rows(h, h_scales), None, True
    if (_fused_dswiglu(gate_up, gather_idx)
            and _fp8_gemm_fits(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx)
            and h.dtype == torch.bfloat16 and h.is_contiguous() and h.data_ptr() % 16 == 0
            and (a_out is None or (a_out.is_contiguous() and a_out.data_ptr() % 16 == 0))):
        step = gemm.grouped_gemm_fp8_dswiglu(
            do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx, h,
            row_scores.float().contiguous(), dh_out=h if overwrite_h else None, a_out=a_out)
        # dH's row quantization reads every row; the kernel writes expert rows only.
        if quantize_dh:
            _cute_fill_padding_rows(step[0], offsets)
        return with_dh_q(step)
    da_prime = _cute_grouped_mm_fp8(do_q, do_scales, w2t_q, w2t_scales, offsets, gather_idx)
    # As in the bf16 dH step: the epilogue reads every row of dA', a padded routing's padding
    # rows included.
    _cute_fill_padding_rows(da_prime, offsets)
    if h_scales is None and not _epilogue_kernel_fits(h):
        dh, a_scaled, ds = reference.dswiglu_epilogue(da_prime, h, row_scores, gate_up)
        return with_dh_q((dh, reference.copy_into(a_out, a_scaled), ds))
    # "quantizing": the one-pass kernel writes dH_q beside dH, so the dX GEMM's operand costs
    # no second read of dH.
    in_kernel = (quantize_dh and _fp8_epilogues.value == "quantizing"
                 and (h.shape[1] // 2) % kernels.FP8_BLOCK == 0)
    step = _dswiglu_epilogue_kernel(da_prime, h, row_scores.float().contiguous(), gate_up,
                                    overwrite_h, a_out, quantize_dh=in_kernel,
                                    h_scales=h_scales)
    return step if in_kernel else with_dh_q(step)


def _cute_quantize_cols_grouped(x, offsets, k_offsets, gather_idx=None):
    from sonic.kernels import fp8_quant as kernels

    if (x.is_cuda and x.dtype == torch.bfloat16 and x.is_contiguous() and x.data_ptr() % 16 == 0
            and x.shape[1] % kernels.FP8_BLOCK == 0
            and (gather_idx is None or gather_idx.dtype == torch.int32)):
        return kernels.quantize_cols_grouped(x, offsets, k_offsets, gather_idx)
    return fp8_reference.quantize_cols_grouped(x, offsets, k_offsets, gather_idx)


def _cute_grouped_mm_varlen_k_fp8(a_t_q, a_scales, b_t_q, b_scales, k_offsets):
    from sonic.kernels import grouped_gemm as kernels

    if (all(t.is_contiguous() for t in (a_t_q, a_scales, b_t_q, b_scales))
            and a_t_q.data_ptr() % 16 == 0 and b_t_q.data_ptr() % 16 == 0
            and a_t_q.shape[0] % 128 == 0 and b_t_q.shape[0] % 128 == 0
            and k_offsets.numel() - 1 <= GROUPED_GEMM_MAX_EXPERTS):
        return kernels.grouped_gemm_varlen_k_fp8(a_t_q, a_scales, b_t_q, b_scales, k_offsets)
    return fp8_reference.grouped_mm_varlen_k_fp8_reference(a_t_q, a_scales, b_t_q, b_scales,
                                                           k_offsets)


# Each step runs its kernel where the kernel serves the call (dtype, sizes) and, on sm_100a,
# the variant passed its self-check, and the reference elsewhere, so "auto" never fails on a
# shape the reference handles; ``strict`` (backend="cute") raises on a failed self-check.
def _cute_ops(strict: bool = False) -> ExpertOps:
    def checked(op):
        return functools.partial(op, strict=strict)

    return ExpertOps(
        name="cute",
        metadata=_cute_metadata,
        grouped_mm=checked(_cute_grouped_mm),
        grouped_mm_varlen_k=checked(_cute_grouped_mm_varlen_k),
        up_proj_swiglu=checked(_cute_up_proj_swiglu),
        dh_dswiglu=checked(_cute_dh_dswiglu),
        aggregate=_cute_aggregate,
        quantize_rows=_cute_quantize_rows,
        quantize_blocks=_cute_quantize_blocks,
        grouped_mm_fp8=_cute_grouped_mm_fp8,
        up_proj_swiglu_fp8=_cute_up_proj_swiglu_fp8,
        dh_dswiglu_fp8=_cute_dh_dswiglu_fp8,
        quantize_cols_grouped=_cute_quantize_cols_grouped,
        grouped_mm_varlen_k_fp8=_cute_grouped_mm_varlen_k_fp8,
        fill_padding_rows=_cute_fill_padding_rows,
    )
