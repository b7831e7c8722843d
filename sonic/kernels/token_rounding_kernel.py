"""The token-rounding selection kernel class (imports ``cutlass``).

:mod:`sonic.kernels.token_rounding` describes the algorithm, validates arguments and
launches; it imports this module on the first compile, so ``import sonic`` does not need
``cutlass``.
"""

import cutlass
from cutlass import Int32, cute
from cuda.bindings import driver as cuda

from sonic.kernels import runtime
from sonic.kernels.token_rounding import BINS, ITEMS, PICK_KEY, RADIX_BITS, THREADS

# Warps per CTA: block_scan keeps one partial sum per warp in shared memory.
WARPS = THREADS // 32


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
    def __call__(self, keys: cutlass.Int64, counts: cutlass.Int64, tc_experts: cutlass.Int64,
                 tokens_out: cutlass.Int64, experts_out: cutlass.Int64,
                 source_out: cutlass.Int64, num_valid: cutlass.Int64, num_tokens: Int32,
                 num_experts: Int32, tile: Int32, capacity: Int32, stream: cuda.CUstream):
        ptrs = [runtime.gmem_ptr(Int32, a, 4) for a in (
            keys, counts, tc_experts, tokens_out, experts_out, source_out, num_valid)]
        self.kernel(*ptrs, num_tokens, num_experts, tile, capacity).launch(
            grid=[num_experts, 1, 1], block=[THREADS, 1, 1], stream=stream)

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
    def kernel(self, keys: cute.Pointer, counts: cute.Pointer, tc_experts: cute.Pointer,
               tokens_out: cute.Pointer, experts_out: cute.Pointer, source_out: cute.Pointer,
               num_valid: cute.Pointer, num_tokens: Int32, num_experts: Int32, tile: Int32,
               capacity: Int32):
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
        mChoices = cute.make_tensor(tc_experts, cute.make_layout(T * self.K))
        gKeys = cute.make_tensor(keys + cutlass.Int64(e) * cutlass.Int64(T), cute.make_layout(T))

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
            mSources[p] = 0
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
                # Whole warps per step, so match.any sees every lane.
                for base in cutlass.range(0, T, THREADS):
                    t = base + tidx
                    key = gKeys[cutlass.min(t, T - 1)]
                    live = t < T
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

            # 3. Write the kept tokens in ascending order.
            equal_seen = Int32(0)
            written = Int32(0)
            for base in cutlass.range(0, T, THREADS * ITEMS):
                first_token = base + tidx * ITEMS
                got = [gKeys[cutlass.min(first_token + i, T - 1)] for i in range(ITEMS)]
                equal = [Int32(cutlass.select_((first_token + i < T) & (got[i] == prefix), 1, 0))
                         for i in range(ITEMS)]
                equal_before, equal_total = block_scan(sum(equal), sScratch)
                run = equal_seen + equal_before
                keep = []
                for i in cutlass.range_constexpr(ITEMS):
                    above_v = (first_token + i < T) & (got[i] > prefix)
                    keep.append(Int32(cutlass.select_(above_v | ((equal[i] == 1) & (run < need)),
                                                      1, 0)))
                    run += equal[i]
                slot_before, slot_total = block_scan(sum(keep), sScratch)
                slot = written + slot_before
                for i in cutlass.range_constexpr(ITEMS):
                    if keep[i] == 1:
                        t = first_token + i
                        src = T * self.K
                        if got[i] >= PICK_KEY:
                            for c in cutlass.range_constexpr(self.K):
                                if mChoices[t * self.K + c] == e:
                                    src = t * self.K + c
                        out = before + slot
                        mTokens[out] = t
                        mExperts[out] = e
                        mSources[out] = src
                        slot += 1
                equal_seen += equal_total
                written += slot_total
