"""Top-K router kernel: per-row bitonic top-K of ``(T, E)`` logits with fused softmax scores.

docs/design.md §4 ("Top-K"), SonicMoE paper §4.3 (Fig. 10). One group of ``G`` lanes of a warp owns one
row of logits; every lane holds ``V = E_pad / G`` of the row's values in registers (``E_pad``: E
rounded up to a power of two), and the whole selection runs in registers and warp shuffles (no
shared memory, no block barrier):

1. **Packing.** Each logit becomes an ``int32`` *key*: the fp32 bit pattern mapped to an integer
   of the same order (negative floats get their magnitude bits flipped; -0.0 counts as +0.0),
   with the low ``log2(E_pad)`` bits replaced by ``E_pad - 1 - column``. Keys are therefore
   unique, a plain integer ``max``/``min`` compares them, and among equal logits the lower column
   wins — the stable order of ``torch.sort(..., descending=True, stable=True)``. Padding columns
   (``E`` not a power of two) get the smallest ``int32``, below every real logit and ``-inf``.
2. **Local top-K.** Each lane sorts blocks of ``K_pad`` keys (``K`` rounded up to a power of two)
   with Batcher's odd-even merge sort (19 compare-exchanges for 8 keys, against 24 for a
   bitonic network) and folds the blocks pairwise: the top ``K_pad`` of two descending lists
   ``a, b`` is the bitonic sequence ``max(a[i], b[K_pad-1-i])``, merged back to descending order.
3. **Across lanes.** ``log2(G)`` butterfly steps (``shfl.sync.bfly``) fold the lanes' lists the
   same way, after which every lane of the group holds the row's top ``K_pad`` keys.
4. **Unpacking and scores.** The column is read back from the low bits. A bf16 logit has 16 zero
   low mantissa bits in fp32, so its key gives the exact logit back; an fp32 logit lost its low
   ``log2(E_pad)`` bits, so the exact logit is re-read from the (cache-resident) row.

Precision: bf16 logits are ordered exactly. fp32 logits are ordered by their value with the
lowest ``log2(E_pad)`` (at most 9) mantissa bits cleared — logits closer than a relative
``2**-(23 - log2(E_pad))`` count as tied and the lower column comes first (paper §4.3). Scores
always use the exact logits in fp32 (accurate ``exp``, one correctly rounded reciprocal per row),
matching PyTorch's fp32 softmax to within a few ulp. NaN logits are not supported.

Cost: the kernel is bound by the integer min/max of the networks (about 8.3 per key for K=8),
not by memory; on H100 it reads T=32768 x E=128 bf16 logits at about 45 % of the copy bandwidth
(``benchmarks/bench_topk.py``), 30x faster than ``torch.topk`` + softmax.

Compiled once per ``(dtype, E, K, score, renormalize, aligned)``; ``T`` is a runtime ``Int32``.
"""

import math
from dataclasses import dataclass

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register

SCORES = ("softmax_topk", "topk_softmax")
MAX_E = 512
MAX_K = 16

_THREADS = 128
# Keys per lane (when E allows). The kernel is bound by the integer min/max of the sorting
# networks (the ALU pipe); the work per row shrinks as fewer lanes share a row (fewer butterfly
# folds, no repeated score math), while more keys per lane cost registers and leave fewer warps
# to hide latency. On H100 at T=32768, K=8, bf16, 64 beat 32 by 2-9 % (E = 64..256) and 128 gained
# at most 3 % more, at up to twice the registers (168 for E=512, K=16, topk_softmax).
_KEYS_PER_LANE = 64
_INT32_MIN = -(2**31)
_VEC_BYTES = 16


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


@dataclass(frozen=True)
class _Plan:
    """Static shape of one compiled kernel (everything but ``T``)."""

    dtype: torch.dtype
    E: int
    K: int
    score: str
    renormalize: bool
    aligned: bool  # logits' base address is 16-byte aligned
    keys_per_lane_target: int = _KEYS_PER_LANE

    @property
    def E_pad(self) -> int:
        return _next_pow2(self.E)

    @property
    def K_pad(self) -> int:
        return _next_pow2(self.K)

    @property
    def index_bits(self) -> int:
        return self.E_pad.bit_length() - 1

    @property
    def keys_per_lane(self) -> int:
        return max(min(self.E_pad, self.keys_per_lane_target), self.K_pad)

    @property
    def lanes_per_row(self) -> int:
        return self.E_pad // self.keys_per_lane

    @property
    def in_align(self) -> int:
        """Alignment in bytes the kernel assumes of the logits' base address."""
        return _VEC_BYTES if self.aligned else torch.empty((), dtype=self.dtype).element_size()

    @property
    def vec(self) -> int:
        """Logits per load: the largest power of two dividing ``E`` that fits 16 bytes."""
        if not self.aligned:
            return 1
        elem = torch.empty((), dtype=self.dtype).element_size()
        vec = 1
        while (2 * vec * elem <= _VEC_BYTES and self.E % (2 * vec) == 0
               and 2 * vec <= self.keys_per_lane):
            vec *= 2
        return vec

    @property
    def out_vec(self) -> int:
        """Outputs per store: the largest power of two dividing ``K``, at most 4 (16 bytes)."""
        return math.gcd(self.K, 4)

    @property
    def rows_per_cta(self) -> int:
        return _THREADS // self.lanes_per_row


def _compile(plan: _Plan, keep_ptx: bool = False) -> runtime.Launcher:
    """Compile ``plan`` with placeholder arguments."""
    import cutlass

    from sonic.kernels.topk_kernel import TopKKernel

    return runtime.compile_launcher(TopKKernel(plan), runtime.fake_address(),
                                    runtime.fake_address(), runtime.fake_address(),
                                    cutlass.Int32(1), keep_ptx=keep_ptx)


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------


def topk_scores(logits: torch.Tensor, k: int, *, score: str = "softmax_topk",
                renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K experts of every token and their routing scores, by the bitonic top-K kernel.

    docs/design.md §4 / SonicMoE paper §4.3; the same selection and scores as
    :func:`sonic.topk_routing`, which is the PyTorch reference.

    Args:
        logits: ``(T, E)`` router logits, ``bfloat16`` or ``float32``, on a Hopper CUDA device;
            ``E <= 512``. Not modified (a non-contiguous tensor is copied first).
        k: experts per token, ``1 <= k <= min(E, 16)``.
        score: ``"softmax_topk"`` — softmax over the K selected logits; ``"topk_softmax"`` — the
            K largest entries of the softmax over all E logits.
        renormalize: with ``"topk_softmax"``, divide the K scores by their sum (the scores of
            ``"softmax_topk"`` already sum to 1, so it changes nothing there).

    Returns:
        ``(scores, indices)``: ``(T, k)`` float32 scores and ``(T, k)`` int32 expert indices,
        row ``t`` holding token ``t``'s experts by descending logit, the lower index first among
        equal logits. fp32 logits within a relative ``2**-(23 - ceil(log2 E))`` of each other
        count as equal for the order (see the module notes); scores use the exact logits.

    Raises:
        TypeError: ``logits`` is not a tensor or not bf16/fp32; ``k`` is not an int.
        ValueError: ``logits`` is not 2-D or not on a CUDA device, ``E > 512``, ``T·E >= 2**31``,
            ``k`` outside ``[1, min(E, 16)]``, or an unknown ``score``.
        RuntimeError: the CuTe-DSL kernels cannot run on this device (see
            :func:`sonic.kernels.runtime.kernels_available`).
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in (torch.bfloat16, torch.float32):
        dtype = str(logits.dtype).removeprefix("torch.")
        raise TypeError(f"logits must be bfloat16 or float32, got {dtype}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (T, E), got shape {tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= E <= MAX_E:
        raise ValueError(f"logits must have 1 <= E <= {MAX_E} columns (experts), got E={E}")
    if T * E >= 2**31:
        raise ValueError("logits must have fewer than 2**31 elements (32-bit offsets), "
                         f"got T*E={T * E}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= min(E, MAX_K):
        raise ValueError(f"k must be in [1, {min(E, MAX_K)}] (k <= E and k <= {MAX_K}), got {k}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {', '.join(map(repr, SCORES))}, got {score!r}")
    device = logits.device
    if device.type != "cuda":
        raise ValueError(f"logits must be on a CUDA device, got {device}")
    _check_device(device)

    logits = logits.contiguous()
    return _run(logits, k, score, renormalize and score == "topk_softmax",
                logits.data_ptr() % _VEC_BYTES == 0)


def kernel_fits(logits: torch.Tensor, k: int) -> bool:
    """Whether :func:`topk_scores` serves ``(T, E)`` ``logits`` and ``k``: ``T > 0``,
    ``E <= MAX_E``, ``k <= MAX_K``, bf16 or fp32 (the device is checked by the caller)."""
    return (logits.shape[0] > 0 and logits.shape[1] <= MAX_E and k <= MAX_K
            and logits.dtype in (torch.bfloat16, torch.float32))


# Per CUDA device (a tensor's device, index included): ``kernels_available``'s answer.
_DEVICE_OK: dict[torch.device, tuple[bool, str]] = {}


def _check_device(device: torch.device) -> None:
    status = _DEVICE_OK.get(device)
    if status is None:
        status = _DEVICE_OK[device] = runtime.kernels_available(device)
    if not status[0]:
        raise RuntimeError(f"topk_scores needs the CuTe-DSL kernels: {status[1]}")


def _run(logits: torch.Tensor, k: int, score: str, renormalize: bool, aligned: bool,
         keys_per_lane: int = _KEYS_PER_LANE) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel of ``_Plan(logits.dtype, E, k, score, renormalize, aligned,
    keys_per_lane)`` on contiguous CUDA ``logits``; returns ``(scores, indices)``.

    The compile-cache key is a plain tuple of those fields, cheap to hash: the plan itself is
    built only on a cache miss.
    """
    T, E = logits.shape
    device = logits.device
    scores = torch.empty((T, k), dtype=torch.float32, device=device)
    indices = torch.empty((T, k), dtype=torch.int32, device=device)
    if T == 0:
        return scores, indices
    key = ("topk", logits.dtype, E, k, score, renormalize, aligned, keys_per_lane)
    fn = runtime.compiled(key, lambda: _compile(_Plan(*key[1:])))
    # Fresh outputs from the caching allocator are always 16-byte aligned.
    args = (runtime.address(logits, _VEC_BYTES if aligned else logits.element_size()),
            scores.data_ptr(), indices.data_ptr(), T)
    # The launcher runs on the current device's stream.
    if device.index == torch.cuda.current_device():
        fn(*args)
    else:
        with torch.cuda.device(device):
            fn(*args)
    return scores, indices


# --------------------------------------------------------------------------------------------
# Variants for the CPU compile check.
# --------------------------------------------------------------------------------------------

_VARIANTS = {
    # name: (dtype, E, K, score, renormalize, PTX markers beyond the shared ones)
    "bf16_E128_K8_softmax_topk": (torch.bfloat16, 128, 8, "softmax_topk", False, ("ld.global.v4",)),
    "fp32_E512_K16_topk_softmax_renorm": (torch.float32, 512, 16, "topk_softmax", True,
                                          ("ld.global.v4",)),
    "bf16_E96_K6_softmax_topk": (torch.bfloat16, 96, 6, "softmax_topk", False, ("ld.global.v4",)),
}

for _name, (_dtype, _E, _K, _score, _renorm, _markers) in _VARIANTS.items():
    _plan = _Plan(_dtype, _E, _K, _score, _renorm, aligned=True)
    register(KernelVariant(
        kernel="topk",
        variant=_name,
        compile_fake=lambda plan=_plan: _compile(plan, keep_ptx=True),
        # Butterfly shuffles across the lanes of a row and integer max/min on the packed keys.
        ptx_markers=("shfl.sync.bfly.b32", "max.s32", "min.s32") + _markers,
    ))
