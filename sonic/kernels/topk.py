"""Top-K router kernel: per-row bitonic top-K of ``(T, E)`` logits with fused softmax scores.

DESIGN §4 ("Top-K"), SonicMoE paper §4.3 (Fig. 10). One group of ``G`` lanes of a warp owns one
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


# --------------------------------------------------------------------------------------------
# Sorting networks on Python lists of int32 DSL values (unrolled at trace time).
# --------------------------------------------------------------------------------------------


def _exchange(keys: list, i: int, j: int) -> None:
    """Order ``keys[i] >= keys[j]``."""
    import cutlass

    hi = cutlass.max(keys[i], keys[j])
    keys[j] = cutlass.min(keys[i], keys[j])
    keys[i] = hi


def _bitonic_merge(keys: list) -> list:
    """Sort a bitonic sequence (length a power of two) into descending order."""
    keys = list(keys)
    n = len(keys)
    stride = n // 2
    while stride >= 1:
        for i in range(n):
            if i & stride == 0:
                _exchange(keys, i, i + stride)
        stride //= 2
    return keys


def _sort_pairs(n: int) -> tuple:
    """Comparators ``(i, j)``, ``i < j``, of Batcher's odd-even merge sort of ``n`` (a power of two)
    keys: 5 / 19 / 63 for 4 / 8 / 16 keys, against 6 / 24 / 80 for a bitonic sorting network."""
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    # Compare only inside the current pair of sorted runs of length p.
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def _sort(keys: list) -> list:
    """Sort ``keys`` (length a power of two) into descending order."""
    keys = list(keys)
    for i, j in _sort_pairs(len(keys)):
        _exchange(keys, i, j)
    return keys


def _top_of_two(a: list, b: list) -> list:
    """The top ``len(a)`` of two descending lists of equal length, in descending order."""
    import cutlass

    n = len(a)
    return _bitonic_merge([cutlass.max(a[i], b[n - 1 - i]) for i in range(n)])


def _group_top(keys: list, k_pad: int, lanes: int) -> list:
    """The top ``k_pad`` keys, descending, of the union of ``keys`` over ``lanes`` adjacent lanes.

    Every lane of the group gets the same list: butterfly partners fold each other's lists.
    """
    import cutlass.cute as cute

    blocks = [_sort(keys[b:b + k_pad]) for b in range(0, len(keys), k_pad)]
    while len(blocks) > 1:
        blocks = [_top_of_two(blocks[b], blocks[b + 1]) for b in range(0, len(blocks), 2)]
    top = blocks[0]
    offset = 1
    while offset < lanes:
        top = _top_of_two(top, [cute.arch.shuffle_sync_bfly(k, offset=offset) for k in top])
        offset *= 2
    return top


# --------------------------------------------------------------------------------------------
# The kernel.
# --------------------------------------------------------------------------------------------


def _make_kernel(plan: _Plan):
    """The ``@cute.jit`` entry of ``plan``: ``(logits, scores, indices addresses, T, stream)``."""
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32, const_expr

    E, K = plan.E, plan.K
    E_pad, K_pad = plan.E_pad, plan.K_pad
    G, V, vec, ovec = plan.lanes_per_row, plan.keys_per_lane, plan.vec, plan.out_vec
    rows_per_cta = plan.rows_per_cta
    mask = E_pad - 1
    in_dtype, in_align = runtime.cute_dtype(plan.dtype), plan.in_align
    exact_keys = plan.dtype != torch.float32  # bf16/fp16 survive the packing bit-exactly
    flip_bits = 0x7FFF0000 if exact_keys else 0x7FFFFFFF
    softmax_all = plan.score == "topk_softmax"
    renormalize = softmax_all and plan.renormalize

    def group_reduce(x, op):
        offset = 1
        while offset < G:
            x = op(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
            offset *= 2
        return x

    # The helpers below run at trace time and unroll into straight-line code over the V values
    # of a lane (Python lists of DSL scalars).

    def load_lane(mX, src_row, lane):
        """This lane's V logits as fp32 and, when E is padded, whether each is a real column."""
        # Chunk i of a lane covers columns [c*vec, c*vec + vec) with c = i*G + lane: the G lanes
        # of a row read adjacent pieces, so every load instruction is fully coalesced.
        chunks = cute.logical_divide(mX[src_row, None], cute.make_layout(vec))
        n_chunks = V // vec
        raw = cute.make_rmem_tensor((vec, n_chunks), mX.element_type)
        for i in range(n_chunks):
            c = i * G + lane
            if E != E_pad:
                # Chunks past E (vec divides E) re-read the last real chunk; their keys are
                # replaced by the padding key, which keeps the loads unpredicated.
                c = cutlass.min(c, E // vec - 1)
            cute.autovec_copy(chunks[None, c], raw[None, i])
        # + 0.0 turns -0.0 into +0.0: PyTorch's sort counts them as equal, integer keys would not.
        vals = [Float32(raw[t % vec, t // vec]) + Float32(0.0) for t in range(V)]
        if E == E_pad:
            return vals, None
        return vals, [((t // vec) * G + lane) * vec + t % vec < E for t in range(V)]

    def softmax_stats(vals, real):
        """Max and sum of exponentials of the whole row (softmax over all E)."""
        if real is not None:
            vals = [Float32(cutlass.select_(real[t], vals[t], -Float32.inf)) for t in range(V)]
        row_max = vals[0]
        for v in vals[1:]:
            row_max = cute.arch.fmax(row_max, v)
        row_max = group_reduce(row_max, cute.arch.fmax)
        row_sum = cute.math.exp(vals[0] - row_max)
        for v in vals[1:]:
            row_sum = row_sum + cute.math.exp(v - row_max)  # exp(-inf) = 0 for padding
        return row_max, group_reduce(row_sum, lambda a, b: a + b)

    def pack_keys(vals, real, lane):
        # Column c*vec + j of chunk i has index term mask - col = (mask - i*G*vec - j) - lane*vec:
        # a per-lane offset plus a constant, one integer add with the packed value.
        lane_term = -(lane * vec)
        keys = []
        for t in range(V):
            bits = vals[t].bitcast(Int32)
            # Negative floats order backwards as integers: flip their magnitude bits. A 16-bit
            # float's fp32 pattern has 16 zero low bits, left as they are so that the index term
            # can be added and the logit read back exactly.
            ordered = bits ^ ((bits >> 31) & flip_bits)
            if not exact_keys:
                ordered = ordered & ~mask
            key = ordered + lane_term + (mask - (t // vec) * G * vec - t % vec)
            if real is not None:
                key = Int32(cutlass.select_(real[t], key, Int32(_INT32_MIN)))
            keys.append(key)
        return keys

    @cute.kernel
    def kernel(mX: cute.Tensor, mScores: cute.Tensor, mIdx: cute.Tensor, num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % G
        row = bidx * rows_per_cta + tidx // G
        # Lanes past the last row still take part in the shuffles; they sort a copy of the last
        # row and skip the stores.
        src_row = cutlass.min(row, num_rows - 1)

        vals, real = load_lane(mX, src_row, lane)
        if const_expr(softmax_all):
            row_max, row_sum = softmax_stats(vals, real)
        keys = pack_keys(vals, real, lane)
        top = _group_top(keys, K_pad, G)

        idx = []
        logit = []
        for j in cutlass.range_constexpr(K):
            col = mask - (top[j] & mask)
            idx.append(col)
            if const_expr(exact_keys):
                ordered = top[j] - (top[j] & mask)
                logit.append((ordered ^ ((ordered >> 31) & flip_bits)).bitcast(Float32))
            else:
                logit.append(Float32(mX[src_row, col]))

        # One correctly rounded reciprocal per row, then products: within an ulp of PyTorch's
        # per-element division, without K division slow paths.
        if const_expr(softmax_all):
            inv_sum = Float32(1.0) / row_sum
            score = [cute.math.exp(logit[j] - row_max) * inv_sum for j in range(K)]
            if const_expr(renormalize):
                total = score[0]
                for j in cutlass.range_constexpr(1, K):
                    total = total + score[j]
                inv_total = Float32(1.0) / total
                score = [s * inv_total for s in score]
        else:
            exps = [cute.math.exp(logit[j] - logit[0]) for j in range(K)]
            total = exps[0]
            for j in cutlass.range_constexpr(1, K):
                total = total + exps[j]
            inv_total = Float32(1.0) / total
            score = [e * inv_total for e in exps]

        if row < num_rows:
            out_s = cute.logical_divide(mScores[row, None], cute.make_layout(ovec))
            out_i = cute.logical_divide(mIdx[row, None], cute.make_layout(ovec))
            frag_s = cute.make_rmem_tensor((ovec,), Float32)
            frag_i = cute.make_rmem_tensor((ovec,), Int32)
            for q in cutlass.range_constexpr(K // ovec):
                # Output piece q is written by lane q % G, so the stores spread over the group.
                if lane == q % G:
                    for j in cutlass.range_constexpr(ovec):
                        frag_s[j] = score[q * ovec + j]
                        frag_i[j] = idx[q * ovec + j]
                    cute.autovec_copy(frag_s, out_s[None, q])
                    cute.autovec_copy(frag_i, out_i[None, q])

    @cute.jit
    def launch(logits: cutlass.Int64, scores: cutlass.Int64, indices: cutlass.Int64,
               num_rows: Int32, stream: cuda.CUstream):
        gmem = runtime.gmem_ptr
        mX = cute.make_tensor(gmem(in_dtype, logits, in_align),
                              cute.make_layout((num_rows, E), stride=(E, 1)))
        mScores = cute.make_tensor(gmem(Float32, scores, _VEC_BYTES),
                                   cute.make_layout((num_rows, K), stride=(K, 1)))
        mIdx = cute.make_tensor(gmem(Int32, indices, _VEC_BYTES),
                                cute.make_layout((num_rows, K), stride=(K, 1)))
        kernel(mX, mScores, mIdx, num_rows).launch(
            grid=[cute.ceil_div(num_rows, rows_per_cta), 1, 1],
            block=[_THREADS, 1, 1],
            stream=stream,
        )

    return launch


def _compile(plan: _Plan, keep_ptx: bool = False) -> runtime.Launcher:
    """Compile ``plan`` with placeholder arguments."""
    import cutlass

    return runtime.compile_launcher(_make_kernel(plan), runtime.fake_address(),
                                    runtime.fake_address(), runtime.fake_address(),
                                    cutlass.Int32(1), keep_ptx=keep_ptx)


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------


def topk_scores(logits: torch.Tensor, k: int, *, score: str = "softmax_topk",
                renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K experts of every token and their routing scores, by the bitonic top-K kernel.

    DESIGN §4 / SonicMoE paper §4.3; the same selection and scores as
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
