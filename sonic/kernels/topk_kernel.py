"""The top-K router kernel class and its sorting networks (imports ``cutlass``).

:mod:`sonic.kernels.topk` describes the algorithm, plans the static shape (``_Plan``),
validates arguments and launches; it imports this module on the first compile, so
``import sonic`` does not need ``cutlass``.
"""

import cutlass
import cutlass.cute as cute
import torch
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, const_expr

from sonic.kernels import runtime
from sonic.kernels.topk import _INT32_MIN, _THREADS, _VEC_BYTES

_INT64_MIN = -(2**63)

# Sorting networks on Python lists of int32 or int64 DSL values (unrolled at trace time).


def exchange(keys: list, i: int, j: int) -> None:
    """Order ``keys[i] >= keys[j]``."""
    hi = cutlass.max(keys[i], keys[j])
    keys[j] = cutlass.min(keys[i], keys[j])
    keys[i] = hi


def bitonic_merge(keys: list) -> list:
    """Sort a bitonic sequence (length a power of two) into descending order."""
    keys = list(keys)
    n = len(keys)
    stride = n // 2
    while stride >= 1:
        for i in range(n):
            if i & stride == 0:
                exchange(keys, i, i + stride)
        stride //= 2
    return keys


def sort_pairs(n: int) -> tuple:
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


def sort_desc(keys: list) -> list:
    """Sort ``keys`` (length a power of two) into descending order."""
    keys = list(keys)
    for i, j in sort_pairs(len(keys)):
        exchange(keys, i, j)
    return keys


def top_of_two(a: list, b: list) -> list:
    """The top ``len(a)`` of two descending lists of equal length, in descending order."""
    n = len(a)
    return bitonic_merge([cutlass.max(a[i], b[n - 1 - i]) for i in range(n)])


def group_top(keys: list, k_pad: int, lanes: int) -> list:
    """The top ``k_pad`` keys, descending, of the union of ``keys`` over ``lanes`` adjacent lanes.

    Every lane of the group gets the same list: butterfly partners fold each other's lists.
    """
    blocks = [sort_desc(keys[b:b + k_pad]) for b in range(0, len(keys), k_pad)]
    while len(blocks) > 1:
        blocks = [top_of_two(blocks[b], blocks[b + 1]) for b in range(0, len(blocks), 2)]
    top = blocks[0]
    offset = 1
    while offset < lanes:
        top = top_of_two(top, [cute.arch.shuffle_sync_bfly(k, offset=offset) for k in top])
        offset *= 2
    return top


class TopKKernel:
    """The ``@cute.jit`` entry of one :class:`sonic.kernels.topk._Plan`:
    ``(logits, scores, indices, bias addresses, T, stream)``; the bias address is read only by
    plans with a bias."""

    def __init__(self, plan):
        self.E, self.K = plan.E, plan.K
        self.E_pad, self.K_pad = plan.E_pad, plan.K_pad
        self.G, self.V = plan.lanes_per_row, plan.keys_per_lane
        self.vec, self.ovec = plan.vec, plan.out_vec
        self.rows_per_cta = plan.rows_per_cta
        self.mask = plan.E_pad - 1
        self.in_dtype, self.in_align = runtime.cute_dtype(plan.dtype), plan.in_align
        self.exact_keys = plan.dtype != torch.float32  # bf16/fp16 survive the packing bit-exactly
        self.flip_bits = 0x7FFF0000 if self.exact_keys else 0x7FFFFFFF
        self.softmax_all = plan.score == "topk_softmax"
        self.sigmoid = plan.score == "sigmoid"
        self.renormalize = plan.renormalize and plan.score != "softmax_topk"
        self.wide = plan.wide_keys
        if self.wide:
            # The choice values are not bf16 values: exact 32-bit order bits, logits re-read.
            self.exact_keys, self.flip_bits = False, 0x7FFFFFFF
        self.has_bias = plan.bias
        self.n_group, self.topk_group = plan.n_group, plan.topk_group
        self.group_size = plan.group_size

    # The helpers below run at trace time and unroll into straight-line code over the V values
    # of a lane (Python lists of DSL scalars).

    def group_reduce(self, x, op):
        offset = 1
        while offset < self.G:
            x = op(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
            offset *= 2
        return x

    def load_lane(self, mX, src_row, lane):
        """This lane's V values of row ``src_row`` of ``mX`` (the logits, or the ``(1, E)``
        bias) as fp32 and, when E is padded, whether each is a real column."""
        E, E_pad, G, V, vec = self.E, self.E_pad, self.G, self.V, self.vec
        # Chunk i of a lane covers columns [c*vec, c*vec + vec) with c = i*G + lane: the G lanes
        # of a row read adjacent pieces, so every load instruction is fully coalesced.
        gX = cute.logical_divide(mX[src_row, None], cute.make_layout(vec))
        n_chunks = V // vec
        raw = cute.make_rmem_tensor((vec, n_chunks), mX.element_type)
        for i in range(n_chunks):
            c = i * G + lane
            if E != E_pad:
                # Chunks past E (vec divides E) re-read the last real chunk; their keys are
                # replaced by the padding key, which keeps the loads unpredicated.
                c = cutlass.min(c, E // vec - 1)
            cute.autovec_copy(gX[None, c], raw[None, i])
        # + 0.0 turns -0.0 into +0.0: PyTorch's sort counts them as equal, integer keys would not.
        vals = [Float32(raw[t % vec, t // vec]) + Float32(0.0) for t in range(V)]
        if E == E_pad:
            return vals, None
        return vals, [((t // vec) * G + lane) * vec + t % vec < E for t in range(V)]

    def softmax_stats(self, vals, real):
        """Max and sum of exponentials of the whole row (softmax over all E)."""
        V = self.V
        if real is not None:
            vals = [Float32(cutlass.select_(real[t], vals[t], -Float32.inf)) for t in range(V)]
        row_max = vals[0]
        for v in vals[1:]:
            row_max = cute.arch.fmax(row_max, v)
        row_max = self.group_reduce(row_max, cute.arch.fmax)
        row_sum = cute.math.exp(vals[0] - row_max)
        for v in vals[1:]:
            row_sum = row_sum + cute.math.exp(v - row_max)  # exp(-inf) = 0 for padding
        return row_max, self.group_reduce(row_sum, lambda a, b: a + b)

    def pack_keys(self, vals, real, lane):
        G, V, vec, mask, flip_bits = self.G, self.V, self.vec, self.mask, self.flip_bits
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
            if const_expr(self.wide):
                # All 32 value bits above the index: the exact order of fp32 values.
                key = (Int64(ordered) << 32) + Int64(lane_term + (mask - (t // vec) * G * vec
                                                                  - t % vec))
                if real is not None:
                    key = Int64(cutlass.select_(real[t], key, Int64(_INT64_MIN)))
                keys.append(key)
                continue
            if not self.exact_keys:
                ordered = ordered & ~mask
            key = ordered + lane_term + (mask - (t // vec) * G * vec - t % vec)
            if real is not None:
                key = Int32(cutlass.select_(real[t], key, Int32(_INT32_MIN)))
            keys.append(key)
        return keys

    @staticmethod
    def sigmoid_of(x):
        """``1 / (1 + exp(-x))`` as PyTorch's CUDA sigmoid computes it in fp32 (accurate
        ``exp``, correctly rounded division), so that the selection matches it exactly."""
        return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))

    def slot_group(self, t):
        """The group of register ``t`` (the same on every lane: groups span whole rows of
        ``G * vec`` columns), or None for a padding column past E."""
        first = (t // self.vec) * self.G * self.vec
        return first // self.group_size if first < self.E else None

    def limit_groups(self, choice, keys):
        """``keys`` with every expert outside the row's ``topk_group`` best groups replaced by
        the padding key (DeepSeek-V3 §2.1.2: a group scores the sum of its two highest choice
        values; the lower group first on ties)."""
        n, V = self.n_group, self.V
        top1, top2 = [], []
        for g in range(n):
            slots = [t for t in range(V) if self.slot_group(t) == g]
            m1, m2 = choice[slots[0]], -Float32.inf
            for t in slots[1:]:
                m2 = cute.arch.fmax(m2, cute.arch.fmin(m1, choice[t]))
                m1 = cute.arch.fmax(m1, choice[t])
            top1.append(m1)
            top2.append(m2)
        offset = 1
        while offset < self.G:
            for g in range(n):
                o1 = cute.arch.shuffle_sync_bfly(top1[g], offset=offset)
                o2 = cute.arch.shuffle_sync_bfly(top2[g], offset=offset)
                top2[g] = cute.arch.fmax(cute.arch.fmin(top1[g], o1), cute.arch.fmax(top2[g], o2))
                top1[g] = cute.arch.fmax(top1[g], o1)
            offset *= 2
        group_keys = []
        for g in range(n):
            bits = (top1[g] + top2[g]).bitcast(Int32)
            ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
            group_keys.append((Int64(ordered) << 32) + Int64(n - 1 - g))
        n_pad = 1 << max(n - 1, 0).bit_length()
        ranked = sort_desc(group_keys + [Int64(_INT64_MIN)] * (n_pad - n))
        threshold = ranked[self.topk_group - 1]
        kept = [group_keys[g] >= threshold for g in range(n)]
        out = list(keys)
        for t in range(V):
            g = self.slot_group(t)
            if g is not None:
                out[t] = Int64(cutlass.select_(kept[g], keys[t], Int64(_INT64_MIN)))
        return out

    def selection_keys(self, mX, mBias, src_row, lane):
        """``(keys, stats)`` of this lane: packed logits, or (sigmoid) packed ``sigmoid + bias``
        limited to the kept groups; and the row's softmax max and sum (softmax over all E; else
        None)."""
        vals, real = self.load_lane(mX, src_row, lane)
        if const_expr(not self.sigmoid):
            stats = self.softmax_stats(vals, real) if self.softmax_all else None
            return self.pack_keys(vals, real, lane), stats
        choice = [self.sigmoid_of(v) for v in vals]
        if const_expr(self.has_bias):
            bias, _ = self.load_lane(mBias, 0, lane)
            choice = [choice[t] + bias[t] for t in range(self.V)]
        keys = self.pack_keys(choice, real, lane)
        if const_expr(self.n_group > 1):
            keys = self.limit_groups(choice, keys)
        return keys, None

    def routing_scores(self, logit, stats):
        """The K routing scores of the selected logits (descending), fp32."""
        # One correctly rounded reciprocal per row, then products: within an ulp of PyTorch's
        # per-element division, without K division slow paths.
        if const_expr(self.softmax_all):
            row_max, row_sum = stats
            inv_sum = Float32(1.0) / row_sum
            score = [cute.math.exp(logit[j] - row_max) * inv_sum for j in range(self.K)]
        elif const_expr(self.sigmoid):
            score = [self.sigmoid_of(logit[j]) for j in range(self.K)]
        else:
            exps = [cute.math.exp(logit[j] - logit[0]) for j in range(self.K)]
            total = exps[0]
            for j in range(1, self.K):
                total = total + exps[j]
            inv_total = Float32(1.0) / total
            return [e * inv_total for e in exps]
        if const_expr(self.renormalize):
            total = score[0]
            for j in range(1, self.K):
                total = total + score[j]
            inv_total = Float32(1.0) / total
            score = [s * inv_total for s in score]
        return score

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mScores: cute.Tensor, mIdx: cute.Tensor, num_rows: Int32,
               mBias: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % self.G
        row = bidx * self.rows_per_cta + tidx // self.G
        # Lanes past the last row still take part in the shuffles; they sort a copy of the last
        # row and skip the stores.
        src_row = cutlass.min(row, num_rows - 1)

        keys, stats = self.selection_keys(mX, mBias, src_row, lane)
        top = group_top(keys, self.K_pad, self.G)

        idx = []
        logit = []
        for j in cutlass.range_constexpr(self.K):
            if const_expr(self.wide):
                col = self.mask - Int32(top[j] & self.mask)
            else:
                col = self.mask - (top[j] & self.mask)
            idx.append(col)
            if const_expr(self.exact_keys):
                ordered = top[j] - (top[j] & self.mask)
                logit.append((ordered ^ ((ordered >> 31) & self.flip_bits)).bitcast(Float32))
            else:
                logit.append(Float32(mX[src_row, col]))
        score = self.routing_scores(logit, stats)

        if row < num_rows:
            gScores = cute.logical_divide(mScores[row, None], cute.make_layout(self.ovec))
            gIdx = cute.logical_divide(mIdx[row, None], cute.make_layout(self.ovec))
            frag_s = cute.make_rmem_tensor((self.ovec,), Float32)
            frag_i = cute.make_rmem_tensor((self.ovec,), Int32)
            for q in cutlass.range_constexpr(self.K // self.ovec):
                # Output piece q is written by lane q % G, so the stores spread over the group.
                if lane == q % self.G:
                    for j in cutlass.range_constexpr(self.ovec):
                        frag_s[j] = score[q * self.ovec + j]
                        frag_i[j] = idx[q * self.ovec + j]
                    cute.autovec_copy(frag_s, gScores[None, q])
                    cute.autovec_copy(frag_i, gIdx[None, q])

    @cute.jit
    def __call__(self, logits: cutlass.Int64, scores: cutlass.Int64, indices: cutlass.Int64,
                 bias: cutlass.Int64, num_rows: Int32, stream: cuda.CUstream):
        gmem = runtime.gmem_ptr
        E, K = self.E, self.K
        mX = cute.make_tensor(gmem(self.in_dtype, logits, self.in_align),
                              cute.make_layout((num_rows, E), stride=(E, 1)))
        mScores = cute.make_tensor(gmem(Float32, scores, _VEC_BYTES),
                                   cute.make_layout((num_rows, K), stride=(K, 1)))
        mIdx = cute.make_tensor(gmem(Int32, indices, _VEC_BYTES),
                                cute.make_layout((num_rows, K), stride=(K, 1)))
        # Plans without a bias pass None: the kernel's signature, hence its PTX, stays as it was.
        mBias = None
        if const_expr(self.has_bias):
            mBias = cute.make_tensor(gmem(Float32, bias, _VEC_BYTES),
                                     cute.make_layout((1, E), stride=(E, 1)))
        self.kernel(mX, mScores, mIdx, num_rows, mBias).launch(
            grid=[cute.ceil_div(num_rows, self.rows_per_cta), 1, 1],
            block=[_THREADS, 1, 1],
            stream=stream,
        )
