"""The routing-metadata kernel classes: histogram, scatter, token scan and token order
(imports ``cutlass``).

:mod:`sonic.kernels.routing_metadata` describes the algorithm, validates arguments and
launches; it imports this module on the first compile, so ``import sonic`` does not need
``cutlass``.
"""

import cutlass
from cutlass import Int32, cute
from cuda.bindings import driver as cuda

from sonic.kernels import runtime
from sonic.kernels.routing_metadata import (CHUNK, ITEMS, SCAN_ITEMS, SCAN_THREADS, SCAN_TILE,
                                            THREADS, TOKEN_ITEMS)


@cute.jit
def block_exclusive_scan(vals: cute.Tensor, copy: cute.Tensor, n: Int32, sScratch: cute.Tensor,
                         nthreads: cutlass.Constexpr):
    """In-place exclusive prefix sum of ``vals[0:n]`` (shared or global) by the whole CTA,
    also written to ``copy`` (which may be ``vals`` itself).

    Tiles of ``nthreads·SCAN_ITEMS`` values, each thread owning ``SCAN_ITEMS`` consecutive
    ones (loaded together, so a tile costs one memory round trip); thread sums are scanned
    in a warp with shuffles and across warps through ``sScratch`` (one int per warp), and a
    running carry links the tiles. Returns the total. All threads must call it.
    """
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp_idx = cute.arch.warp_idx()
    items = cute.make_rmem_tensor((SCAN_ITEMS,), Int32)
    carry = Int32(0)
    for tile in cutlass.range(0, n, nthreads * SCAN_ITEMS):
        lo = tile + tidx * SCAN_ITEMS
        local = Int32(0)
        # Clamped, branch-free loads: all SCAN_ITEMS are in flight at once.
        for i in cutlass.range_constexpr(SCAN_ITEMS):
            items[i] = vals[cutlass.min(lo + i, n - 1)]
        for i in cutlass.range_constexpr(SCAN_ITEMS):
            items[i] = Int32(cutlass.select_(lo + i < n, items[i], 0))
            local += items[i]
        incl = local
        for k in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << k)
            if lane >= (1 << k):
                incl += up
        if lane == 31:
            sScratch[warp_idx] = incl
        cute.arch.sync_threads()
        total = Int32(0)
        before = Int32(0)
        for w in cutlass.range_constexpr(nthreads // 32):
            s = sScratch[w]
            if w < warp_idx:
                before += s
            total += s
        run = carry + before + incl - local
        for i in cutlass.range_constexpr(SCAN_ITEMS):
            if lo + i < n:
                vals[lo + i] = run
                copy[lo + i] = run
            run += items[i]
        carry += total
        # sScratch is rewritten by the next tile.
        cute.arch.sync_threads()
    return carry


class RoutingMetadataKernels:
    """The launches of one static configuration: ``E`` experts, top-K or arbitrary pairs."""

    def __init__(self, num_experts: int, topk: bool):
        self.E = num_experts
        self.topk = topk
        # Arbitrary pairs count expert E as one bin more: the padding of a padded routing,
        # whose rows follow every expert's.
        self.bins = num_experts if topk else num_experts + 1
        self.warps = THREADS // 32
        # Threads that share one bin's sum over the chunk histograms (scatter prologue).
        self.groups = min(16, max(1, THREADS // self.bins))

    @cute.jit
    def __call__(self, expert_idx: cutlass.Int64, token_idx: cutlass.Int64, hist: cutlass.Int64,
                 token_work: cutlass.Int64, token_slots: cutlass.Int64,
                 expert_counts: cutlass.Int64, expert_offsets: cutlass.Int64,
                 sorted_pairs: cutlass.Int64, gather_idx: cutlass.Int64, pair_rows: cutlass.Int64,
                 token_offsets: cutlass.Int64, token_rows: cutlass.Int64,
                 num_pairs: Int32, num_tokens: Int32, k: Int32, stream: cuda.CUstream):
        (expert_idx, token_idx, hist, token_work, token_slots, expert_counts, expert_offsets,
         sorted_pairs, gather_idx, pair_rows, token_offsets, token_rows) = (
            runtime.gmem_ptr(Int32, a, 4) for a in (
                expert_idx, token_idx, hist, token_work, token_slots, expert_counts,
                expert_offsets, sorted_pairs, gather_idx, pair_rows, token_offsets, token_rows))
        chunks = cutlass.max((num_pairs + CHUNK - 1) // CHUNK, 1)
        hist_smem = self.bins * 4
        self.histogram(expert_idx, token_idx, hist, token_work, num_pairs, num_tokens).launch(
            grid=[chunks, 1, 1], block=[THREADS, 1, 1], smem=hist_smem, stream=stream)
        if cutlass.const_expr(not self.topk):
            # One CTA more than the full tiles: token_offsets has T + 1 entries.
            self.token_scan(token_work, token_offsets, num_tokens).launch(
                grid=[num_tokens // SCAN_TILE + 1, 1, 1], block=[SCAN_THREADS, 1, 1],
                smem=SCAN_THREADS // 32 * 4, stream=stream)
        scatter_smem = (self.warps + 2 + 2 * self.groups) * self.bins * 4 + self.warps * 4 + 64
        self.scatter(expert_idx, token_idx, hist, token_work, token_slots, expert_counts,
                     expert_offsets,
                     sorted_pairs, gather_idx, pair_rows, token_offsets, token_rows,
                     num_pairs, num_tokens, k, chunks).launch(
            grid=[chunks, 1, 1], block=[THREADS, 1, 1], smem=scatter_smem, stream=stream)
        if cutlass.const_expr(not self.topk):
            self.token_order(token_slots, token_offsets, token_idx, expert_idx, pair_rows,
                             token_rows, num_pairs, num_tokens).launch(
                grid=[chunks * ITEMS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    def _chunk_experts(self, mExperts: cute.Tensor, first: Int32, num_pairs: Int32):
        """Bins of this thread's pairs ``first + i·THREADS`` (``i < ITEMS``): the expert,
        ``E`` for padding (arbitrary pairs only), ``bins`` (no row) past the end or out of
        range.

        Branch-free, and every load is issued before any value is used, so the ITEMS loads
        overlap instead of costing ITEMS memory round trips.
        """
        last = num_pairs - 1
        raw = [mExperts[cutlass.min(first + i * THREADS, last)] for i in range(ITEMS)]
        return [Int32(cutlass.select_((first + i * THREADS < num_pairs) & (raw[i] >= 0)
                                      & (raw[i] < self.bins), raw[i], self.bins))
                for i in range(ITEMS)]

    @cute.kernel
    def histogram(self, expert_idx: cute.Pointer, token_idx: cute.Pointer, hist: cute.Pointer,
                  token_work: cute.Pointer, num_pairs: Int32, num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        sCounts = smem.allocate_tensor(Int32, cute.make_layout(self.bins), byte_alignment=16)
        mExperts = cute.make_tensor(expert_idx, cute.make_layout(num_pairs))
        for e in cutlass.range(tidx, self.bins, THREADS):
            sCounts[e] = 0
        cute.arch.sync_threads()
        chunk_experts = self._chunk_experts(mExperts, chunk * CHUNK + tidx, num_pairs)
        for i in cutlass.range_constexpr(ITEMS):
            p = chunk * CHUNK + i * THREADS + tidx
            e = chunk_experts[i]
            # One shared-memory atomic per expert present in the warp, not per pair: an
            # expert taking every token would otherwise serialise the whole CTA.
            peers = cute.arch.match_sync(0xFFFFFFFF, e)
            below = peers & ((cutlass.Uint32(1) << lane) - 1)
            if e < self.bins and below == 0:
                cute.arch.atomic_add(sCounts.iterator + e, Int32(cute.arch.popc(peers)))
            if cutlass.const_expr(not self.topk):
                # Padding belongs to no token.
                if e < self.E:
                    mTokens = cute.make_tensor(token_idx, cute.make_layout(num_pairs))
                    t = mTokens[p]
                    mWork = cute.make_tensor(token_work, cute.make_layout(num_tokens))
                    cute.arch.atomic_add(mWork.iterator + t, Int32(1))
        cute.arch.sync_threads()
        mHist = cute.make_tensor(hist, cute.make_layout((self.bins, chunk + 1),
                                                      stride=(1, self.bins)))
        for e in cutlass.range(tidx, self.bins, THREADS):
            mHist[e, chunk] = sCounts[e]

    @cute.kernel
    def token_scan(self, token_work: cute.Pointer, token_offsets: cute.Pointer,
                   num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp_idx = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        sWarpSums = smem.allocate_tensor(Int32, cute.make_layout(SCAN_THREADS // 32),
                                         byte_alignment=16)
        # token_work has max(T, 1) entries: index 0 is always readable.
        mCounts = cute.make_tensor(token_work, cute.make_layout(cutlass.max(num_tokens, 1)))
        mOffsets = cute.make_tensor(token_offsets, cute.make_layout(num_tokens + 1))
        first = tile * SCAN_TILE

        # Pairs of the tokens before this tile: whole tiles, so no bound checks, and
        # TOKEN_ITEMS independent loads in flight per thread.
        before = Int32(0)
        for start in cutlass.range(0, first, SCAN_TILE):
            got = [mCounts[start + i * SCAN_THREADS + tidx] for i in range(TOKEN_ITEMS)]
            for v in got:
                before += v
        for k in cutlass.range_constexpr(5):
            before += cute.arch.shuffle_sync_bfly(before, 1 << k)
        if lane == 0:
            sWarpSums[warp_idx] = before
        cute.arch.sync_threads()
        prefix = Int32(0)
        for w in cutlass.range_constexpr(SCAN_THREADS // 32):
            prefix += sWarpSums[w]
        # sWarpSums is rewritten below.
        cute.arch.sync_threads()

        # This warp's tokens: row i is seg + 32·i + lane. Entries at or past T count 0, so
        # mOffsets[T] (written by the CTA whose tile holds index T) is the total.
        seg = first + warp_idx * (32 * TOKEN_ITEMS)
        idx = [seg + 32 * i + lane for i in range(TOKEN_ITEMS)]
        raw = [mCounts[cutlass.max(cutlass.min(j, num_tokens - 1), 0)] for j in idx]
        vals = [Int32(cutlass.select_(j < num_tokens, v, 0)) for j, v in zip(idx, raw)]
        incl = list(vals)
        for k in cutlass.range_constexpr(5):
            ups = [cute.arch.shuffle_sync_up(v, 1 << k) for v in incl]
            incl = [Int32(v + cutlass.select_(lane >= (1 << k), u, 0))
                    for v, u in zip(incl, ups)]
        # Exclusive prefix within the warp's segment; run ends as the segment's total.
        run = Int32(0)
        excl = []
        for v, c in zip(incl, vals):
            excl.append(run + v - c)
            run += cute.arch.shuffle_sync(v, 31)
        if lane == 0:
            sWarpSums[warp_idx] = run
        cute.arch.sync_threads()
        for w in cutlass.range_constexpr(SCAN_THREADS // 32):
            if w < warp_idx:
                prefix += sWarpSums[w]
        for j, e in zip(idx, excl):
            if j <= num_tokens:
                mOffsets[j] = prefix + e

    @cute.kernel
    def scatter(self, expert_idx: cute.Pointer, token_idx: cute.Pointer, hist: cute.Pointer,
                token_work: cute.Pointer, token_slots: cute.Pointer,
                expert_counts: cute.Pointer, expert_offsets: cute.Pointer,
                sorted_pairs: cute.Pointer,
                gather_idx: cute.Pointer, pair_rows: cute.Pointer,
                token_offsets: cute.Pointer, token_rows: cute.Pointer,
                num_pairs: Int32, num_tokens: Int32, k: Int32, chunks: Int32):
        E = self.E
        B = self.bins
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp_idx = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        sBase = smem.allocate_tensor(Int32, cute.make_layout(B), byte_alignment=16)
        sTotals = smem.allocate_tensor(Int32, cute.make_layout(B), byte_alignment=16)
        sWarpCounts = smem.allocate_tensor(Int32, cute.make_layout((B, self.warps)),
                                           byte_alignment=16)
        sScratch = smem.allocate_tensor(Int32, cute.make_layout(self.warps), byte_alignment=16)
        sPartial = smem.allocate_tensor(Int32, cute.make_layout((B, self.groups, 2)),
                                        byte_alignment=16)
        mHists = cute.make_tensor(hist, cute.make_layout((B, chunks), stride=(1, B)))
        mExperts = cute.make_tensor(expert_idx, cute.make_layout(num_pairs))
        mTokens = cute.make_tensor(token_idx, cute.make_layout(num_pairs))
        mWork = cute.make_tensor(token_work, cute.make_layout(num_tokens))
        mSlots = cute.make_tensor(token_slots, cute.make_layout(num_pairs))
        mTokenStarts = cute.make_tensor(token_offsets, cute.make_layout(num_tokens + 1))

        # Everything per pair that needs no histogram is issued first, so its memory latency
        # overlaps the prologue. Experts and tokens of all this thread's pairs (tokens are
        # unused, hence never loaded, for top-K): the steps below then only wait on shared
        # memory.
        chunk_experts = self._chunk_experts(mExperts, chunk * CHUNK + tidx, num_pairs)
        chunk_tokens = [mTokens[cutlass.min(chunk * CHUNK + i * THREADS + tidx, num_pairs - 1)]
                        for i in range(ITEMS)]
        if cutlass.const_expr(not self.topk):
            # Each pair takes a slot in its token's segment: mWork[t] still holds the token's
            # count (the scan only reads it), and each decrement hands out one slot. Slots
            # land in atomic order; token_order sorts them. Branch-free atomics (pairs with
            # no row add 0) so all ITEMS are in flight at once; the slots are stored after
            # the prologue.
            left = [cute.arch.atomic_add(mWork.iterator + t,
                                         Int32(cutlass.select_(e < E, Int32(-1), Int32(0))))
                    for t, e in zip(chunk_tokens, chunk_experts)]
            starts = [mTokenStarts[t] for t in chunk_tokens]

        # Rows before this chunk per expert, and totals per expert, from all histograms.
        # Every CTA reads all of them, so the loads are spread over the whole CTA: ``groups``
        # threads per expert each sum every groups-th chunk (reads coalesced along experts),
        # then the partial sums meet in shared memory.
        for j in cutlass.range(tidx, self.groups * B, THREADS):
            g = j // B
            e = j - g * B
            before = Int32(0)
            total = Int32(0)
            for c in cutlass.range(g, chunks, self.groups, unroll=8):
                v = mHists[e, c]
                total += v
                if c < chunk:
                    before += v
            sPartial[e, g, 0] = before
            sPartial[e, g, 1] = total
        cute.arch.sync_threads()
        for e in cutlass.range(tidx, B, THREADS):
            before = Int32(0)
            total = Int32(0)
            for g in cutlass.range_constexpr(self.groups):
                before += sPartial[e, g, 0]
                total += sPartial[e, g, 1]
            sBase[e] = before
            sTotals[e] = total
            for w in cutlass.range_constexpr(self.warps):
                sWarpCounts[e, w] = 0
        cute.arch.sync_threads()
        if chunk == 0:
            mCounts = cute.make_tensor(expert_counts, cute.make_layout(E))
            for e in cutlass.range(tidx, E, THREADS):
                mCounts[e] = sTotals[e]
        cute.arch.sync_threads()
        block_exclusive_scan(sTotals, sTotals, B, sScratch, THREADS)
        if chunk == 0:
            mOffsets = cute.make_tensor(expert_offsets, cute.make_layout(E + 1))
            for e in cutlass.range(tidx, E, THREADS):
                mOffsets[e] = sTotals[e]
            if tidx == 0:
                if cutlass.const_expr(self.topk):
                    mOffsets[E] = num_pairs
                else:
                    # The routed pairs; padding rows start here.
                    mOffsets[E] = sTotals[E]
        for e in cutlass.range(tidx, B, THREADS):
            sBase[e] = sBase[e] + sTotals[e]

        mSorted = cute.make_tensor(sorted_pairs, cute.make_layout(num_pairs))
        mGather = cute.make_tensor(gather_idx, cute.make_layout(num_pairs))
        mRows = cute.make_tensor(pair_rows, cute.make_layout(num_pairs))
        mTokenRows = cute.make_tensor(token_rows, cute.make_layout(num_pairs))
        lanes_below = (cutlass.Uint32(1) << lane) - 1
        if cutlass.const_expr(not self.topk):
            for i in cutlass.range_constexpr(ITEMS):
                if chunk_experts[i] < E:
                    mSlots[starts[i] + left[i] - 1] = chunk * CHUNK + i * THREADS + tidx
        for i in cutlass.range_constexpr(ITEMS):
            p = chunk * CHUNK + i * THREADS + tidx
            e = chunk_experts[i]
            peers = cute.arch.match_sync(0xFFFFFFFF, e)
            rank = Int32(cute.arch.popc(peers & lanes_below))
            leader = rank == 0 and e < B
            if leader:
                sWarpCounts[e, warp_idx] = Int32(cute.arch.popc(peers))
            cute.arch.sync_threads()
            if e < B:
                row = sBase[e] + rank
                for w in cutlass.range_constexpr(self.warps):
                    if w < warp_idx:
                        row += sWarpCounts[e, w]
                t = Int32(0)
                if cutlass.const_expr(self.topk):
                    t = p // k
                    mTokenRows[p] = row
                else:
                    t = chunk_tokens[i]
                mSorted[row] = p
                mGather[row] = t
                mRows[p] = row
            cute.arch.sync_threads()
            if leader:
                cute.arch.atomic_add(sBase.iterator + e, Int32(cute.arch.popc(peers)))
                sWarpCounts[e, warp_idx] = 0
            cute.arch.sync_warp()

        if cutlass.const_expr(self.topk):
            for t in cutlass.range(chunk * THREADS + tidx, num_tokens + 1, chunks * THREADS):
                mTokenStarts[t] = t * k

    @cute.kernel
    def token_order(self, token_slots: cute.Pointer, token_offsets: cute.Pointer,
                    token_idx: cute.Pointer, expert_idx: cute.Pointer, pair_rows: cute.Pointer,
                    token_rows: cute.Pointer, num_pairs: Int32, num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        mTokens = cute.make_tensor(token_idx, cute.make_layout(num_pairs))
        mExperts = cute.make_tensor(expert_idx, cute.make_layout(num_pairs))
        mRows = cute.make_tensor(pair_rows, cute.make_layout(num_pairs))
        mSlots = cute.make_tensor(token_slots, cute.make_layout(num_pairs))
        mOffsets = cute.make_tensor(token_offsets, cute.make_layout(num_tokens + 1))
        mTokenRows = cute.make_tensor(token_rows, cute.make_layout(num_pairs))
        # One pair per thread (grid = P / THREADS): each pair's loads form a dependent chain,
        # so occupancy, not per-thread work, hides their latency.
        p = block * THREADS + tidx
        # Padding (expert E) has no place among any token's rows.
        if p < num_pairs and mExperts[cutlass.min(p, num_pairs - 1)] < self.E:
            t = mTokens[p]
            lo = mOffsets[t]
            place = lo
            for j in cutlass.range(lo, mOffsets[t + 1], unroll=4):
                if mSlots[j] < p:
                    place += 1
            mTokenRows[place] = mRows[p]
