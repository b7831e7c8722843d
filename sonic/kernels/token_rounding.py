"""Token rounding's per-expert selection on the GPU: one CTA per expert, no host read.

SonicMoE (arXiv 2512.14080) §5.2, Algorithm 4; DESIGN §2. Each expert ``e`` keeps the top
``r_e`` tokens of its column of the combined score ``C`` (token-choice picks first, by their
token-choice score, then non-picks by ``S[t, e]``; the lower token first among equals), where
``r_e`` is its top-K count ``f_e`` rounded to a multiple of the tile and clamped to ``[0, T]``.

The combined score becomes one int32 sort key per (expert, token), laid out expert-major
``(E, T)``: a non-pick's key is the bit pattern of its fp32 probability, a pick's is the bit
pattern of its token-choice score plus ``2**30``. Both are non-negative floats at most 1, whose
bits order like integers below ``2**30``, so every pick outranks every non-pick and comparing
keys compares ``C`` exactly (no ``S − 1`` rounding). The expert-major layout makes each CTA's
reads contiguous: building it costs one transposing copy of the ``(T, E)`` probabilities, which
a strided read of a column would pay ``E/8``-fold in 32-byte sectors in every pass below.

A CTA, per expert:

1. *offsets* — sums ``r_e'`` over all experts (their counts are an input; ``E`` values) for its
   first output slot ``Σ_{e'<e} r_e'`` and the total ``P``, so outputs land grouped by expert
   with no inter-CTA communication; CTA 0 writes ``P``, every CTA fills its share of the
   padding past ``P`` (expert ``E``, token 0).
2. *radix select* — four passes of 8-bit digits over the row find the ``r_e``-th largest key
   ``v`` and how many keys equal to ``v`` are kept (``need``): per pass a 256-bin shared-memory
   histogram of the keys that match the digits found so far (one atomic per distinct digit in
   a warp: ``match.any``), then one warp finds the bin where the count from the top reaches the
   rank still sought. ``O(T)`` per pass, coalesced.
3. *write* — tiles of ``THREADS·ITEMS`` tokens in order, each thread ``ITEMS`` consecutive
   ones: a token is kept when its key exceeds ``v``, or equals it and fewer than ``need`` equal
   keys come before it (a block scan), and its slot is a block scan of the kept flags, so each
   expert's tokens come out ascending. A kept pick's source is its top-K pair ``t·K + j``
   (found among the token's ``K`` choices), an added pair's is ``T·K``.
"""

import functools

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register

THREADS = 512
# Tokens per thread in the write pass (consecutive, so a thread's slots are consecutive).
ITEMS = 4
RADIX_BITS = 8
BINS = 1 << RADIX_BITS
# Added to a pick's score bits: above every probability's bits (fp32 1.0 is 0x3F800000).
PICK_KEY = 1 << 30
MAX_TOP_K = 16
ROUNDINGS = ("nearest", "up", "down")


@functools.cache
def _kernels():
    """Build the CuTe-DSL kernel class (imports cutlass, so only on first use)."""
    import cutlass
    from cutlass import cute
    from cuda.bindings import driver as cuda

    Int32 = cutlass.Int32
    warps = THREADS // 32

    @cute.jit
    def block_scan(value: Int32, scratch: cute.Tensor):
        """``(exclusive prefix, total)`` of one value per thread over the CTA, in thread
        order. All threads must call it; ``scratch`` holds one int per warp."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        incl = value
        for k in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << k)
            incl = Int32(incl + cutlass.select_(lane >= (1 << k), up, 0))
        if lane == 31:
            scratch[warp] = incl
        cute.arch.sync_threads()
        before = Int32(0)
        total = Int32(0)
        for w in cutlass.range_constexpr(warps):
            s = scratch[w]
            before = Int32(before + cutlass.select_(w < warp, s, 0))
            total += s
        # scratch is rewritten by the next call.
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
            warp = cute.arch.warp_idx()
            smem = cutlass.memory.SmemAllocator()
            scratch = smem.allocate_tensor(Int32, cute.make_layout(warps), byte_alignment=16)
            hist = smem.allocate_tensor(Int32, cute.make_layout(BINS), byte_alignment=16)
            found = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)
            T = num_tokens
            count_of = cute.make_tensor(counts, cute.make_layout(num_experts))
            tokens = cute.make_tensor(tokens_out, cute.make_layout(capacity))
            experts = cute.make_tensor(experts_out, cute.make_layout(capacity))
            sources = cute.make_tensor(source_out, cute.make_layout(capacity))
            choices = cute.make_tensor(tc_experts, cute.make_layout(T * self.K))
            row = cute.make_tensor(keys + cutlass.Int64(e) * cutlass.Int64(T), cute.make_layout(T))

            # 1. This expert's first slot and the total P, from every expert's rounded count.
            before = Int32(0)
            total = Int32(0)
            for j in cutlass.range(tidx, num_experts, THREADS):
                r_j = self.rounded(count_of[j], tile, T)
                total += r_j
                before = Int32(before + cutlass.select_(j < e, r_j, 0))
            _, before = block_scan(before, scratch)
            _, total = block_scan(total, scratch)
            if e == 0 and tidx == 0:
                cute.make_tensor(num_valid, cute.make_layout(1))[0] = total
            for p in cutlass.range(total + e * THREADS + tidx, capacity, num_experts * THREADS):
                tokens[p] = 0
                experts[p] = num_experts
                sources[p] = 0
            kept = self.rounded(count_of[e], tile, T)

            if kept > 0:
                # 2. Radix select: the kept-th largest key v, and how many keys equal to v
                # are kept (the lowest tokens among them).
                prefix = Int32(0)
                need = kept
                for step in cutlass.range_constexpr(4):
                    shift = 32 - RADIX_BITS * (step + 1)
                    for b in cutlass.range(tidx, BINS, THREADS):
                        hist[b] = 0
                    cute.arch.sync_threads()
                    # Whole warps per step, so match.any sees every lane.
                    for base in cutlass.range(0, T, THREADS):
                        t = base + tidx
                        key = row[cutlass.min(t, T - 1)]
                        live = t < T
                        if cutlass.const_expr(step > 0):
                            live = live & ((key >> (shift + RADIX_BITS))
                                           == (prefix >> (shift + RADIX_BITS)))
                        digit = Int32(cutlass.select_(live, (key >> shift) & (BINS - 1), BINS))
                        peers = cute.arch.match_sync(0xFFFFFFFF, digit)
                        first = (peers & ((cutlass.Uint32(1) << lane) - 1)) == 0
                        if first and digit < BINS:
                            cute.arch.atomic_add(hist.iterator + digit,
                                                 Int32(cute.arch.popc(peers)))
                    cute.arch.sync_threads()
                    if warp == 0:
                        # Lane l owns bins [8l, 8l + 8); count from the top bin down.
                        per_lane = BINS // 32
                        own = Int32(0)
                        for i in cutlass.range_constexpr(per_lane):
                            own += hist[lane * per_lane + i]
                        incl = own
                        for k in cutlass.range_constexpr(5):
                            down = cute.arch.shuffle_sync_down(incl, 1 << k)
                            incl = Int32(incl + cutlass.select_(lane + (1 << k) < 32, down, 0))
                        above = incl - own
                        for i in cutlass.range_constexpr(per_lane - 1, -1, -1):
                            h = hist[lane * per_lane + i]
                            if above < need and above + h >= need:
                                found[0] = lane * per_lane + i
                                found[1] = above
                            above += h
                    cute.arch.sync_threads()
                    prefix = prefix | (found[0] << shift)
                    need = need - found[1]
                    # found is rewritten by the next step.
                    cute.arch.sync_threads()

                # 3. Write the kept tokens in ascending order.
                equal_seen = Int32(0)
                written = Int32(0)
                for base in cutlass.range(0, T, THREADS * ITEMS):
                    first_token = base + tidx * ITEMS
                    got = [row[cutlass.min(first_token + i, T - 1)] for i in range(ITEMS)]
                    equal = [Int32(cutlass.select_((first_token + i < T) & (got[i] == prefix), 1, 0))
                             for i in range(ITEMS)]
                    equal_before, equal_total = block_scan(sum(equal), scratch)
                    run = equal_seen + equal_before
                    keep = []
                    for i in cutlass.range_constexpr(ITEMS):
                        above_v = (first_token + i < T) & (got[i] > prefix)
                        keep.append(Int32(cutlass.select_(above_v | ((equal[i] == 1) & (run < need)),
                                                          1, 0)))
                        run += equal[i]
                    slot_before, slot_total = block_scan(sum(keep), scratch)
                    slot = written + slot_before
                    for i in cutlass.range_constexpr(ITEMS):
                        if keep[i] == 1:
                            t = first_token + i
                            src = T * self.K
                            if got[i] >= PICK_KEY:
                                for c in cutlass.range_constexpr(self.K):
                                    if choices[t * self.K + c] == e:
                                        src = t * self.K + c
                            out = before + slot
                            tokens[out] = t
                            experts[out] = e
                            sources[out] = src
                            slot += 1
                    equal_seen += equal_total
                    written += slot_total

    return TokenRoundingSelect


def _compile(rounding: str, top_k: int, keep_ptx: bool = False):
    """Compile one static configuration with placeholder arguments."""
    import cutlass

    addresses = [runtime.fake_address() for _ in range(7)]
    return runtime.compile_launcher(_kernels()(rounding, top_k), *addresses,
                                    *(cutlass.Int32(1) for _ in range(4)), keep_ptx=keep_ptx)


def kernel_fits(num_tokens: int, num_experts: int) -> bool:
    """Whether the kernel serves ``(T, E)`` logits: int32 indices into ``E·T`` keys."""
    return num_tokens * num_experts < 2**31


def token_rounding_select(probs: torch.Tensor, tc_scores: torch.Tensor, tc_experts: torch.Tensor,
                          tile: int, rounding: str, capacity: int):
    """Token rounding's kept pairs (SonicMoE §5.2, Algorithm 4 steps 2–4), on the GPU with no
    host synchronisation.

    Args:
        probs: ``(T, E)`` fp32 ``softmax(logits)``, CUDA.
        tc_scores: ``(T·K,)`` fp32 token-choice scores, token-major (``sonic.topk_routing``).
        tc_experts: ``(T, K)`` int32 token-choice experts, ``K <= 16``, same device.
        tile: ``M_tile``, ``>= 1``.
        rounding: ``"nearest"``, ``"up"`` or ``"down"``.
        capacity: length of the outputs, at least the number of kept pairs (see
            :func:`sonic.routing.token_rounding.capacity`).

    Returns:
        ``(token_idx, expert_idx, source, num_kept)``: ``(capacity,)`` int32 each and a 0-d
        int32. The first ``num_kept`` pairs are the kept ones, grouped by expert (ascending),
        tokens ascending within an expert; ``source`` is the top-K pair ``t·K + j`` of a kept
        pick and ``T·K`` for an added pair. The rest is padding: expert ``E``, token 0, source 0.
        Ties as :func:`sonic.routing.token_rounding.weakest_pick_ranks` and
        :func:`~sonic.routing.token_rounding.strongest_non_pick_tokens` define them: among equal
        scores the lower token is kept.

    Raises:
        TypeError: a tensor of the wrong dtype.
        ValueError: shapes or devices that disagree, ``K > 16``, ``tile < 1``, an unknown
            ``rounding``, ``capacity`` out of ``[0, 2**31)``, or ``E·T >= 2**31``.
    """
    runtime.check_tensor("probs", probs, dtypes=(torch.float32,), ndim=2)
    runtime.check_tensor("tc_scores", tc_scores, dtypes=(torch.float32,), ndim=1,
                         device=probs.device)
    runtime.check_tensor("tc_experts", tc_experts, dtypes=(torch.int32,), ndim=2,
                         device=probs.device)
    num_tokens, num_experts = probs.shape
    top_k = tc_experts.shape[1]
    if tc_experts.shape[0] != num_tokens or tc_scores.numel() != num_tokens * top_k:
        raise ValueError(f"tc_experts must be (T={num_tokens}, K) and tc_scores (T·K,), got "
                         f"{tuple(tc_experts.shape)} and {tuple(tc_scores.shape)}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"K must be in [1, {MAX_TOP_K}], got {top_k}")
    if not kernel_fits(num_tokens, num_experts):
        raise ValueError(f"E·T must be below 2**31, got E={num_experts}, T={num_tokens}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be an int >= 1, got {tile!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity < 2**31:
        raise ValueError(f"capacity must be an int in [0, 2**31), got {capacity!r}")
    device = probs.device
    out = torch.empty(3 * capacity + 1, dtype=torch.int32, device=device)
    tokens, experts, source, num_kept = out.split((capacity, capacity, capacity, 1))
    num_kept = num_kept.view(())
    if num_tokens == 0:
        num_kept.zero_()
        return tokens, experts, source, num_kept
    tc_experts = tc_experts.contiguous()
    # Sort keys, expert-major (see the module docstring): probability bits, picks raised.
    # A copy even where probs.t() is already contiguous (T = 1 or E = 1): the picks are
    # written into it, and probs is the caller's (autograd saves it for softmax).
    keys = probs.t().clone(memory_format=torch.contiguous_format).view(torch.int32)
    token_of_pair = torch.arange(num_tokens, device=device, dtype=torch.int32).repeat_interleave(top_k)
    picks = tc_experts.view(-1) * num_tokens + token_of_pair
    keys.view(-1).index_copy_(0, picks.long(), tc_scores.contiguous().view(torch.int32) + PICK_KEY)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, tc_experts.view(-1).long(), torch.ones_like(picks))
    fn = runtime.compiled(("token_rounding", rounding, top_k), lambda: _compile(rounding, top_k))
    a = runtime.address
    fn(a(keys, 4), a(counts, 4), a(tc_experts, 4), a(tokens, 4), a(experts, 4), a(source, 4),
       a(num_kept, 4), num_tokens, num_experts, tile, capacity)
    return tokens, experts, source, num_kept


register(KernelVariant(
    kernel="token_rounding", variant="nearest_K8",
    compile_fake=lambda: _compile("nearest", 8, keep_ptx=True),
    ptx_markers=("match.any.sync.b32", "atom.shared.add", "shfl.sync.up", "bar.sync")))
