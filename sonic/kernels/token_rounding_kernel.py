"""The token-rounding selection kernel class (imports ``cutlass``).

:mod:`sonic.kernels.token_rounding` describes the algorithm, validates arguments and
launches; it imports this module on the first compile, so ``import sonic`` does not need
``cutlass``.
"""

import cutlass
from cutlass import Int32, cute
from cuda.bindings import driver as cuda

from sonic.kernels import runtime
from sonic.kernels.token_rounding import (BINS, ITEMS, KEY_EXPERTS, KEY_THREADS, KEY_TOKENS,
                                          PICK_KEY, RADIX_BITS, THREADS)

# Warps per CTA: block_scan keeps one partial sum per warp in shared memory.
WARPS = THREADS // 32
# Row pitch of the keys kernel's staged tile: one word of padding keeps both the row-wise
# writes and the column-wise reads free of shared-memory bank conflicts.
KEY_PITCH = KEY_EXPERTS + 1
# The write pass scans two counts at once: above v in the high bits, equal to v in the low.
PACK_BITS = 16
PACK = 1 << PACK_BITS


@cute.jit
def block_scan(value: Int32, sScratch: cute.Tensor):
    """``(exclusive prefix, total)`` of one value per thread over the CTA, in thread
    order. All threads must call it; ``sScratch`` holds one int per warp."""
    lane = cute.arch.lane_idx()
    warp_idx = cute.arch.warp_idx()
    incl = value
    for k in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << k)
        incl = Int32(incl + cutlass.select_(lane >= (1 << k), up, 0))
    if lane == 31:
        sScratch[warp_idx] = incl
    cute.arch.sync_threads()
    before = Int32(0)
    total = Int32(0)
    for w in cutlass.range_constexpr(WARPS):
        s = sScratch[w]
        before = Int32(before + cutlass.select_(w < warp_idx, s, 0))
        total += s
    # sScratch is rewritten by the next call.
    cute.arch.sync_threads()
    return before + incl - value, total


class TokenRoundingSelect:
    """One static configuration: the rounding mode and ``K``."""

    def __init__(self, rounding: str, top_k: int):
        self.rounding = rounding
        self.K = top_k

    @cute.jit
    def __call__(self, probs: cutlass.Int64, tc_scores: cutlass.Int64, tc_experts: cutlass.Int64,
                 keys: cutlass.Int64, counts: cutlass.Int64, slots: cutlass.Int64,
                 tokens_out: cutlass.Int64, experts_out: cutlass.Int64,
                 source_out: cutlass.Int64, scores_out: cutlass.Int64,
                 num_valid: cutlass.Int64, num_tokens: Int32,
                 num_experts: Int32, tile: Int32, capacity: Int32, stream: cuda.CUstream):
        # fp32 probabilities and scores travel as their bits: they become sort keys.
        (probs, tc_scores, tc_experts, keys, counts, tokens_out, experts_out, source_out,
         scores_out, num_valid) = [runtime.gmem_ptr(Int32, a, 4) for a in (
             probs, tc_scores, tc_experts, keys, counts, tokens_out, experts_out, source_out,
             scores_out, num_valid)]
        slots = runtime.gmem_ptr(cutlass.Int8, slots, 4)
        self.zero_counts(counts, num_experts).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)
        self.build_keys(probs, tc_scores, tc_experts, keys, counts, slots, num_tokens,
                        num_experts).launch(
            grid=[(num_tokens + KEY_TOKENS - 1) // KEY_TOKENS,
                  (num_experts + KEY_EXPERTS - 1) // KEY_EXPERTS, 1],
            block=[KEY_THREADS, 1, 1], stream=stream)
        self.kernel(keys, counts, slots, tokens_out, experts_out, source_out, scores_out,
                    num_valid, num_tokens, num_experts, tile, capacity).launch(
            grid=[num_experts, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def zero_counts(self, counts: cute.Pointer, num_experts: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        mCounts = cute.make_tensor(counts, cute.make_layout(num_experts))
        for e in cutlass.range(tidx, num_experts, THREADS):
            mCounts[e] = 0

    @cute.kernel
    def build_keys(self, probs: cute.Pointer, tc_scores: cute.Pointer, tc_experts: cute.Pointer,
                   keys: cute.Pointer, counts: cute.Pointer, slots: cute.Pointer,
                   num_tokens: Int32, num_experts: Int32):
        """The expert-major keys of a ``KEY_TOKENS × KEY_EXPERTS`` tile, its picks added to
        ``counts`` and their choice index ``j`` recorded in ``slots`` (expert-major; other
        cells are never read): the tile is staged in shared memory so that the ``(T, E)``
        reads and the ``(E, T)`` writes are both coalesced."""
        tidx, _, _ = cute.arch.thread_idx()
        bt, be, _ = cute.arch.block_idx()
        T = num_tokens
        E = num_experts
        t0 = bt * KEY_TOKENS
        e0 = be * KEY_EXPERTS
        smem = cutlass.memory.SmemAllocator()
        sTile = smem.allocate_tensor(Int32, cute.make_layout(KEY_TOKENS * KEY_PITCH),
                                     byte_alignment=16)
        sCount = smem.allocate_tensor(Int32, cute.make_layout(KEY_EXPERTS), byte_alignment=16)
        mProbs = cute.make_tensor(probs, cute.make_layout(T * E))
        mKeys = cute.make_tensor(keys, cute.make_layout(T * E))
        mScores = cute.make_tensor(tc_scores, cute.make_layout(T * self.K))
        mChoices = cute.make_tensor(tc_experts, cute.make_layout(T * self.K))
        mCounts = cute.make_tensor(counts, cute.make_layout(E))
        mSlots = cute.make_tensor(slots, cute.make_layout(T * E))
        per_thread = KEY_TOKENS * KEY_EXPERTS // KEY_THREADS
        if tidx < KEY_EXPERTS:
            sCount[tidx] = 0
        # Every load issued before any store: clamped in range, out-of-range cells never
        # leave the tile.
        staged = []
        for i in cutlass.range_constexpr(per_thread):
            flat = i * KEY_THREADS + tidx
            t = cutlass.min(t0 + flat // KEY_EXPERTS, T - 1)
            e = cutlass.min(e0 + flat % KEY_EXPERTS, E - 1)
            staged.append(mProbs[t * E + e])
        for i in cutlass.range_constexpr(per_thread):
            flat = i * KEY_THREADS + tidx
            sTile[flat // KEY_EXPERTS * KEY_PITCH + flat % KEY_EXPERTS] = staged[i]
        cute.arch.sync_threads()
        # The tile's picks outrank every probability (see the module docstring of
        # sonic.kernels.token_rounding); pairs t·K + j of its tokens are contiguous.
        first_pair = t0 * self.K
        for j in cutlass.range(tidx, KEY_TOKENS * self.K, KEY_THREADS):
            if first_pair + j < T * self.K:
                e = mChoices[first_pair + j] - e0
                if e >= 0 and e < KEY_EXPERTS:
                    sTile[j // self.K * KEY_PITCH + e] = mScores[first_pair + j] + PICK_KEY
                    cute.arch.atomic_add(sCount.iterator + e, Int32(1))
                    mSlots[(e0 + e) * T + t0 + j // self.K] = cutlass.Int8(j % self.K)
        cute.arch.sync_threads()
        if tidx < KEY_EXPERTS and e0 + tidx < E:
            if sCount[tidx] > 0:
                cute.arch.atomic_add(mCounts.iterator + e0 + tidx, sCount[tidx])
        for i in cutlass.range_constexpr(per_thread):
            flat = i * KEY_THREADS + tidx
            t = t0 + flat % KEY_TOKENS
            e = e0 + flat // KEY_TOKENS
            if t < T and e < E:
                mKeys[e * T + t] = sTile[flat % KEY_TOKENS * KEY_PITCH + flat // KEY_TOKENS]

    @cute.jit
    def rounded(self, count: Int32, tile: Int32, num_tokens: Int32):
        """``r_e``: ``count`` rounded to a multiple of ``tile``, at most ``T``."""
        bias = 0
        if cutlass.const_expr(self.rounding == "up"):
            bias = tile - 1
        elif cutlass.const_expr(self.rounding == "nearest"):
            bias = tile // 2
        return cutlass.min((count + bias) // tile * tile, num_tokens)

    @cute.kernel
    def kernel(self, keys: cute.Pointer, counts: cute.Pointer, slots: cute.Pointer,
               tokens_out: cute.Pointer, experts_out: cute.Pointer, source_out: cute.Pointer,
               scores_out: cute.Pointer, num_valid: cute.Pointer, num_tokens: Int32,
               num_experts: Int32, tile: Int32, capacity: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        e, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp_idx = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        sScratch = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
        sHist = smem.allocate_tensor(Int32, cute.make_layout(BINS), byte_alignment=16)
        sFound = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)
        T = num_tokens
        mCounts = cute.make_tensor(counts, cute.make_layout(num_experts))
        mTokens = cute.make_tensor(tokens_out, cute.make_layout(capacity))
        mExperts = cute.make_tensor(experts_out, cute.make_layout(capacity))
        mSources = cute.make_tensor(source_out, cute.make_layout(capacity))
        mScoresOut = cute.make_tensor(scores_out, cute.make_layout(capacity))
        row = cutlass.Int64(e) * cutlass.Int64(T)
        gKeys = cute.make_tensor(keys + row, cute.make_layout(T))
        gSlots = cute.make_tensor(slots + row, cute.make_layout(T))

        # 1. This expert's first slot and the total P, from every expert's rounded count.
        before = Int32(0)
        total = Int32(0)
        for j in cutlass.range(tidx, num_experts, THREADS):
            r_j = self.rounded(mCounts[j], tile, T)
            total += r_j
            before = Int32(before + cutlass.select_(j < e, r_j, 0))
        _, before = block_scan(before, sScratch)
        _, total = block_scan(total, sScratch)
        if e == 0 and tidx == 0:
            cute.make_tensor(num_valid, cute.make_layout(1))[0] = total
        for p in cutlass.range(total + e * THREADS + tidx, capacity, num_experts * THREADS):
            mTokens[p] = 0
            mExperts[p] = num_experts
            mSources[p] = T * self.K + T * num_experts
            mScoresOut[p] = 0
        kept = self.rounded(mCounts[e], tile, T)

        if kept > 0:
            # 2. Radix select: the kept-th largest key v, and how many keys equal to v
            # are kept (the lowest tokens among them).
            prefix = Int32(0)
            need = kept
            for step in cutlass.range_constexpr(4):
                shift = 32 - RADIX_BITS * (step + 1)
                for b in cutlass.range(tidx, BINS, THREADS):
                    sHist[b] = 0
                cute.arch.sync_threads()
                # Whole warps per step, so match.any sees every lane; the ITEMS loads are
                # issued before any is used, so they overlap.
                for base in cutlass.range(0, T, THREADS * ITEMS):
                    got = [gKeys[cutlass.min(base + i * THREADS + tidx, T - 1)]
                           for i in range(ITEMS)]
                    for i in cutlass.range_constexpr(ITEMS):
                        key = got[i]
                        live = base + i * THREADS + tidx < T
                        if cutlass.const_expr(step > 0):
                            live = live & ((key >> (shift + RADIX_BITS))
                                           == (prefix >> (shift + RADIX_BITS)))
                        digit = Int32(cutlass.select_(live, (key >> shift) & (BINS - 1), BINS))
                        peers = cute.arch.match_sync(0xFFFFFFFF, digit)
                        first = (peers & ((cutlass.Uint32(1) << lane) - 1)) == 0
                        if first and digit < BINS:
                            cute.arch.atomic_add(sHist.iterator + digit,
                                                 Int32(cute.arch.popc(peers)))
                cute.arch.sync_threads()
                if warp_idx == 0:
                    # Lane l owns bins [8l, 8l + 8); count from the top bin down.
                    per_lane = BINS // 32
                    own = Int32(0)
                    for i in cutlass.range_constexpr(per_lane):
                        own += sHist[lane * per_lane + i]
                    incl = own
                    for k in cutlass.range_constexpr(5):
                        down = cute.arch.shuffle_sync_down(incl, 1 << k)
                        incl = Int32(incl + cutlass.select_(lane + (1 << k) < 32, down, 0))
                    above = incl - own
                    for i in cutlass.range_constexpr(per_lane - 1, -1, -1):
                        h = sHist[lane * per_lane + i]
                        if above < need and above + h >= need:
                            sFound[0] = lane * per_lane + i
                            sFound[1] = above
                        above += h
                cute.arch.sync_threads()
                prefix = prefix | (sFound[0] << shift)
                need = need - sFound[1]
                # sFound is rewritten by the next step.
                cute.arch.sync_threads()

            # 3. Write the kept tokens in ascending order. Keys above v are all kept; keys
            # equal to v are kept in token order until `need` are. One block scan of both
            # counts, packed in one int (each at most THREADS·ITEMS), gives every slot.
            equal_seen = Int32(0)
            written = Int32(0)
            for base in cutlass.range(0, T, THREADS * ITEMS):
                first_token = base + tidx * ITEMS
                got = [gKeys[cutlass.min(first_token + i, T - 1)] for i in range(ITEMS)]
                above = [Int32(cutlass.select_((first_token + i < T) & (got[i] > prefix), 1, 0))
                         for i in range(ITEMS)]
                equal = [Int32(cutlass.select_((first_token + i < T) & (got[i] == prefix), 1, 0))
                         for i in range(ITEMS)]
                packed_before, packed_total = block_scan(
                    sum(above) * PACK + sum(equal), sScratch)
                run = equal_seen + (packed_before & (PACK - 1))
                kept_equal_before = cutlass.min(equal_seen, need)
                slot = (written + (packed_before >> PACK_BITS) + cutlass.min(run, need)
                        - kept_equal_before)
                for i in cutlass.range_constexpr(ITEMS):
                    if (above[i] == 1) | ((equal[i] == 1) & (run < need)):
                        t = first_token + i
                        src = T * self.K + t * num_experts + e
                        # A key is its score's bits, a pick's raised by PICK_KEY.
                        score = got[i]
                        if got[i] >= PICK_KEY:
                            score = got[i] - PICK_KEY
                            src = t * self.K + Int32(gSlots[t])
                        out = before + slot
                        mTokens[out] = t
                        mExperts[out] = e
                        mSources[out] = src
                        mScoresOut[out] = score
                        slot += 1
                    run += equal[i]
                equal_seen += packed_total & (PACK - 1)
                written += ((packed_total >> PACK_BITS) + cutlass.min(equal_seen, need)
                            - kept_equal_before)
