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

**Sigmoid scoring** (``score="sigmoid"``, DeepSeek-V3 §2.1.2): the selection runs on the fp32
*choice* ``sigmoid(x) + bias`` (the optional per-expert bias steers the selection only), which
is no longer a bf16 value and must be ordered exactly, so the keys are 64-bit: the ordered fp32
bits in the high word, ``E_pad - 1 - column`` in the low word (a stable descending sort's order
for every distinct pair of values, ties to the lower column). The sigmoid is computed as
PyTorch's CUDA kernel does (``1 / (1 + exp(-x))``, accurate ``exp``, correctly rounded division),
so the choice values, hence the selection, are PyTorch's bit for bit. The weights are the
unbiased ``sigmoid`` of the selected logits (re-read from the row), renormalised on request.
64-bit keys double the registers per key, so these plans hold 32 keys per lane.

**Group-limited selection** (``n_group > 1``; DeepSeek-V3 §2.1.2): experts form ``n_group``
groups of ``E / n_group`` consecutive experts; a group's score is the sum of its two highest
choice values; only the ``topk_group`` best groups (a stable descending order: the lower group
first on ties) stay eligible. The plan keeps every group made of whole rows of ``lanes * vec``
columns (it narrows the loads if needed), so the group of each register is known at trace
time: a lane folds its values of each group into a top-2 pair, ``log2(G)`` butterfly steps
combine the pairs, every lane ranks the group scores with the sorting network on 64-bit
``(score, group)`` keys, and keys outside the kept groups become the padding key before the
top-K. Groups need ``E / n_group`` to be a multiple of the lanes per row; other group shapes
are left to the PyTorch path (:func:`kernel_fits`). Groups of one expert, or
``topk_group = n_group``, select exactly what plain top-K selects and compile as such.

Compiled once per ``(dtype, E, K, score, renormalize, aligned, keys per lane, bias, n_group,
topk_group)``; ``T`` is a runtime ``Int32``.
"""

import functools
import math
from dataclasses import dataclass

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register

SCORES = ("softmax_topk", "topk_softmax", "sigmoid")
MAX_E = 512
MAX_K = 16

_THREADS = 128
# Keys per lane (when E allows). The kernel is bound by the integer min/max of the sorting
# networks (the ALU pipe); the work per row shrinks as fewer lanes share a row (fewer butterfly
# folds, no repeated score math), while more keys per lane cost registers and leave fewer warps
# to hide latency. On H100 at T=32768, K=8, bf16, 64 beat 32 by 2-9 % (E = 64..256) and 128 gained
# at most 3 % more, at up to twice the registers (168 for E=512, K=16, topk_softmax).
_KEYS_PER_LANE = 64
# Sigmoid plans sort 64-bit keys: half as many per lane keeps the same registers.
_KEYS_PER_LANE_WIDE = 32
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
    bias: bool = False  # a per-expert fp32 selection bias (sigmoid only)
    n_group: int = 1
    topk_group: int = 1

    @property
    def wide_keys(self) -> bool:
        """64-bit keys: the fp32 choice values must be ordered exactly (sigmoid scoring)."""
        return self.score == "sigmoid"

    @property
    def group_size(self) -> int:
        return self.E // self.n_group

    @property
    def groups_fit(self) -> bool:
        """Whether every group spans whole rows of ``lanes_per_row`` columns (scalar loads)."""
        return self.n_group == 1 or self.group_size % self.lanes_per_row == 0

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
        # With groups, a row of lanes_per_row * vec columns must not straddle two groups.
        while (2 * vec * elem <= _VEC_BYTES and self.E % (2 * vec) == 0
               and 2 * vec <= self.keys_per_lane
               and (self.n_group == 1 or self.group_size % (2 * vec * self.lanes_per_row) == 0)):
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
                                    runtime.fake_address(), cutlass.Int32(1), keep_ptx=keep_ptx)


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------


def topk_scores(logits: torch.Tensor, k: int, *, score: str = "softmax_topk",
                renormalize: bool = False, expert_bias: torch.Tensor | None = None,
                n_group: int = 1, topk_group: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K experts of every token and their routing scores, by the bitonic top-K kernel.

    docs/design.md §4 / SonicMoE paper §4.3; the same selection and scores as
    :func:`sonic.topk_routing`, which is the PyTorch reference (before its
    ``scaling_factor``).

    Args:
        logits: ``(T, E)`` router logits, ``bfloat16`` or ``float32``, on a Hopper CUDA device;
            ``E <= 512``. Not modified (a non-contiguous tensor is copied first).
        k: experts per token, ``1 <= k <= min(E, 16)``.
        score: ``"softmax_topk"`` — softmax over the K selected logits; ``"topk_softmax"`` — the
            K largest entries of the softmax over all E logits; ``"sigmoid"`` — the
            ``sigmoid`` of the K logits with the largest ``sigmoid(logit) + expert_bias``
            (DeepSeek-V3 §2.1.2).
        renormalize: with ``"topk_softmax"`` or ``"sigmoid"``, divide the K scores by their sum
            (the scores of ``"softmax_topk"`` already sum to 1, so it changes nothing there).
        expert_bias: optional ``(E,)`` float bias added to the sigmoid scores for the selection
            only (aux-loss-free balancing); ``score="sigmoid"`` only. Read as fp32.
        n_group: group-limited selection among ``n_group`` groups of ``E / n_group``
            consecutive experts (``score="sigmoid"`` only; a group scores the sum of its two
            highest ``sigmoid + bias``); ``1`` disables it.
        topk_group: the groups kept per token, ``1 <= topk_group <= n_group``; ``None`` means
            ``n_group``.

    Returns:
        ``(scores, indices)``: ``(T, k)`` float32 scores and ``(T, k)`` int32 expert indices,
        row ``t`` holding token ``t``'s experts by descending logit (sigmoid: descending
        ``sigmoid + bias``), the lower index first among equal values. For the softmax scores,
        fp32 logits within a relative ``2**-(23 - ceil(log2 E))`` of each other count as equal
        for the order (see the module notes); sigmoid orders fp32 exactly. Scores use the
        exact logits.

    Raises:
        TypeError: ``logits`` is not a tensor or not bf16/fp32; ``k``, ``n_group`` or
            ``topk_group`` is not an int; ``expert_bias`` is not a float tensor.
        ValueError: ``logits`` is not 2-D or not on a CUDA device, ``E > 512``, ``T·E >= 2**31``,
            ``k`` outside ``[1, min(E, 16)]``, an unknown ``score``, ``expert_bias`` or groups
            with another score than ``"sigmoid"``, ``expert_bias`` not of shape ``(E,)`` on the
            logits' device, ``n_group`` not dividing ``E``, ``topk_group`` outside
            ``[1, n_group]``, ``k`` above the ``topk_group·E/n_group`` eligible experts, or
            groups the kernel does not serve (``E / n_group`` not a multiple of the lanes that
            share a row; :func:`kernel_fits` tells).
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
    n_group, topk_group = _check_selection(logits, k, score, expert_bias, n_group, topk_group)
    device = logits.device
    if device.type != "cuda":
        raise ValueError(f"logits must be on a CUDA device, got {device}")
    _check_device(device)

    logits = logits.contiguous()
    return _run(logits, k, score, renormalize and score != "softmax_topk",
                logits.data_ptr() % _VEC_BYTES == 0, expert_bias=expert_bias,
                n_group=n_group, topk_group=topk_group)


def _check_selection(logits: torch.Tensor, k: int, score: str,
                     expert_bias: torch.Tensor | None, n_group: int,
                     topk_group: int | None) -> tuple[int, int]:
    """Check the bias and group arguments of :func:`topk_scores`; returns the
    ``(n_group, topk_group)`` the kernel compiles: ``(1, 1)`` where groups change nothing
    (groups of one expert select exactly the plain top-K, and so do all groups kept)."""
    E = logits.shape[1]
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    topk_group = n_group if topk_group is None else topk_group
    if score != "sigmoid" and (expert_bias is not None or n_group != 1):
        raise ValueError(f"expert_bias and n_group > 1 need score='sigmoid', got {score!r}")
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or not expert_bias.is_floating_point():
            raise TypeError("expert_bias must be a float tensor")
        if expert_bias.shape != (E,) or expert_bias.device != logits.device:
            raise ValueError(f"expert_bias must have shape (E={E},) on {logits.device}, got "
                             f"{tuple(expert_bias.shape)} on {expert_bias.device}")
    if not (1 <= n_group <= E and E % n_group == 0):
        raise ValueError(f"n_group must divide E={E}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if k > topk_group * (E // n_group):
        raise ValueError(f"k={k} is more than the topk_group*E/n_group = "
                         f"{topk_group * (E // n_group)} eligible experts")
    if E // n_group == 1 or topk_group == n_group:
        return 1, 1
    if not _plan(logits.dtype, E, k, score, False, True, bias=False, n_group=n_group,
                 topk_group=topk_group).groups_fit:
        raise ValueError(f"groups of E/n_group={E // n_group} experts are not a multiple of "
                         "the lanes per row; use the PyTorch path (see kernel_fits)")
    return n_group, topk_group


def _plan(dtype: torch.dtype, E: int, k: int, score: str, renormalize: bool, aligned: bool,
          keys_per_lane: int | None = None, *, bias: bool = False, n_group: int = 1,
          topk_group: int = 1) -> _Plan:
    """The :class:`_Plan` of a call, with the keys per lane of its key width by default."""
    if keys_per_lane is None:
        keys_per_lane = _KEYS_PER_LANE_WIDE if score == "sigmoid" else _KEYS_PER_LANE
    return _Plan(dtype, E, k, score, renormalize, aligned, keys_per_lane, bias, n_group,
                 topk_group)


def kernel_fits(logits: torch.Tensor, k: int, score: str = "softmax_topk", n_group: int = 1,
                topk_group: int | None = None) -> bool:
    """Whether :func:`topk_scores` serves ``(T, E)`` ``logits``, ``k`` and the selection:
    ``T > 0``, ``E <= MAX_E``, ``k <= MAX_K``, bf16 or fp32, and groups (sigmoid only) whose
    size is a multiple of the lanes sharing a row (the device is checked by the caller;
    the group arguments are assumed valid, as :func:`sonic.topk_routing` checked them)."""
    T, E = logits.shape
    if not (T > 0 and E <= MAX_E and k <= MAX_K
            and logits.dtype in (torch.bfloat16, torch.float32)):
        return False
    topk_group = n_group if topk_group is None else topk_group
    if n_group == 1 or E // n_group == 1 or topk_group == n_group:
        return True
    return score == "sigmoid" and _plan(logits.dtype, E, k, score, False, True, n_group=n_group,
                                        topk_group=topk_group).groups_fit


# Per CUDA device (a tensor's device, index included): ``kernels_available``'s answer.
_DEVICE_OK: dict[torch.device, tuple[bool, str]] = {}


def _check_device(device: torch.device) -> None:
    status = _DEVICE_OK.get(device)
    if status is None:
        status = _DEVICE_OK[device] = runtime.kernels_available(device)
    if not status[0]:
        raise RuntimeError(f"topk_scores needs the CuTe-DSL kernels: {status[1]}")


def _run(logits: torch.Tensor, k: int, score: str, renormalize: bool, aligned: bool,
         keys_per_lane: int | None = None, *, expert_bias: torch.Tensor | None = None,
         n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel of ``_plan(logits.dtype, E, k, score, renormalize, aligned,
    keys_per_lane, ...)`` on contiguous CUDA ``logits``; returns ``(scores, indices)``.

    The compile-cache key is a plain tuple of those fields, cheap to hash: the plan itself is
    built only on a cache miss.
    """
    T, E = logits.shape
    device = logits.device
    scores = torch.empty((T, k), dtype=torch.float32, device=device)
    indices = torch.empty((T, k), dtype=torch.int32, device=device)
    if T == 0:
        return scores, indices
    if keys_per_lane is None:
        keys_per_lane = _KEYS_PER_LANE_WIDE if score == "sigmoid" else _KEYS_PER_LANE
    bias_addr = 0
    if expert_bias is not None:
        # An fp32 copy on the device (no host read); the kernel loads it like a logits row.
        expert_bias = expert_bias.to(torch.float32).contiguous()
        if expert_bias.data_ptr() % _VEC_BYTES:
            expert_bias = expert_bias.clone()
        bias_addr = expert_bias.data_ptr()
    key = ("topk", logits.dtype, E, k, score, renormalize, aligned, keys_per_lane,
           expert_bias is not None, n_group, topk_group)
    fn = runtime.compiled(key, lambda: _compile(_Plan(*key[1:])))
    # Fresh outputs from the caching allocator are always 16-byte aligned.
    args = (runtime.address(logits, _VEC_BYTES if aligned else logits.element_size()),
            scores.data_ptr(), indices.data_ptr(), bias_addr, T)
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
    # name: (dtype, E, K, score, renormalize, bias, n_group, topk_group,
    #        PTX markers beyond the shared ones)
    "bf16_E128_K8_softmax_topk": (torch.bfloat16, 128, 8, "softmax_topk", False, False, 1, 1,
                                  ("ld.global.v4", "max.s32", "min.s32")),
    "fp32_E512_K16_topk_softmax_renorm": (torch.float32, 512, 16, "topk_softmax", True, False,
                                          1, 1, ("ld.global.v4", "max.s32", "min.s32")),
    "bf16_E96_K6_softmax_topk": (torch.bfloat16, 96, 6, "softmax_topk", False, False, 1, 1,
                                 ("ld.global.v4", "max.s32", "min.s32")),
    # DeepSeek-V3's router: sigmoid, selection bias, 8 groups of 32, the best 4 kept. 64-bit
    # keys; the bias row is read with vector loads like the logits.
    "bf16_E256_K8_sigmoid_bias_g8_renorm": (torch.bfloat16, 256, 8, "sigmoid", True, True, 8, 4,
                                            ("max.s64", "min.s64", "ld.global.v4.b32")),
    # Sigmoid without bias or groups at the largest E and K, E padded past a power of two.
    "fp32_E384_K16_sigmoid": (torch.float32, 384, 16, "sigmoid", False, False, 1, 1,
                              ("max.s64", "min.s64")),
    "bf16_E96_K6_sigmoid_bias_g3": (torch.bfloat16, 96, 6, "sigmoid", False, True, 3, 2,
                                    ("max.s64", "min.s64")),
}

for _name, (_dtype, _E, _K, _score, _renorm, _bias, _ng, _tg, _markers) in _VARIANTS.items():
    _p = _plan(_dtype, _E, _K, _score, _renorm, True, bias=_bias, n_group=_ng, topk_group=_tg)
    register(KernelVariant(
        kernel="topk",
        variant=_name,
        compile_fake=functools.partial(_compile, _p, keep_ptx=True),
        # Butterfly shuffles across the lanes of a row and integer max/min on the packed keys.
        ptx_markers=("shfl.sync.bfly.b32",) + _markers,
    ))
