"""Token rounding's per-expert selection on the GPU: one CTA per expert, no host read.

SonicMoE (arXiv 2512.14080) §5.2, Algorithm 4; docs/design.md §2. Each expert ``e`` keeps the top
``r_e`` tokens of its column of the combined score ``C`` (token-choice picks first, by their
token-choice score, then non-picks by ``S[t, e]``; the lower token first among equals), where
``r_e`` is its top-K count ``f_e`` rounded to a multiple of the tile and clamped to ``[0, T]``.

The combined score becomes one int32 sort key per (expert, token), laid out expert-major
``(E, T)``: a non-pick's key is the bit pattern of its fp32 probability, a pick's is the bit
pattern of its token-choice score plus ``2**30``. Both are non-negative floats at most 1, whose
bits order like integers below ``2**30``, so every pick outranks every non-pick and comparing
keys compares ``C`` exactly (no ``S − 1`` rounding). The expert-major layout makes each CTA's
reads contiguous: building it costs one transposing pass over the ``(T, E)`` probabilities,
which a strided read of a column would pay ``E/8``-fold in 32-byte sectors in every pass below.

One launch runs three kernels:

* *counts* zeroed (one CTA);
* *keys* — per ``KEY_TOKENS × KEY_EXPERTS`` tile of the probabilities: staged through shared
  memory (coalesced reads along ``E``, writes along ``T``), its picks' keys set from their
  token-choice scores, and its picks per expert added to the top-K counts ``f_e`` (one global
  atomic per expert and tile);
* *select*, a CTA per expert:

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
   keys come before it; one block scan of both counts (packed in one int) gives each thread
   the equal keys and the kept tokens before it, so each expert's tokens come out ascending.
   A kept pair's source is where its score's gradient
   goes in ``[tc_scores (T·K) | S (T·E) | one unused slot]``: a kept pick's is its top-K pair
   ``t·K + j`` (the keys kernel records each pick's ``j`` in an ``(E, T)`` int8 array, read
   back only for kept picks), an added pair's ``T·K + t·E + e``,
   padding's the last slot; its score is its key
   with a pick's ``2**30`` taken off (the token-choice score of a pick, ``S[t, e]`` of an
   added pair), so the routing's scores need no gathers.
"""

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
# The keys kernel's tile (tokens × experts) and threads.
KEY_TOKENS = 128
KEY_EXPERTS = 32
KEY_THREADS = 256
ROUNDINGS = ("nearest", "up", "down")


def _compile(rounding: str, top_k: int, keep_ptx: bool = False):
    """Compile one static configuration with placeholder arguments."""
    import cutlass

    from sonic.kernels.token_rounding_kernel import TokenRoundingSelect

    addresses = [runtime.fake_address() for _ in range(11)]
    return runtime.compile_launcher(TokenRoundingSelect(rounding, top_k), *addresses,
                                    *(cutlass.Int32(1) for _ in range(4)), keep_ptx=keep_ptx)


def kernel_fits(num_tokens: int, num_experts: int) -> bool:
    """Whether the kernel serves ``(T, E)`` logits: int32 indices into ``E·T`` keys and into
    the ``T·K + T·E + 1`` gradient slots of ``source``, for any ``K <= MAX_TOP_K``."""
    return num_tokens * (num_experts + MAX_TOP_K) < 2**31


def token_rounding_select(probs: torch.Tensor, tc_scores: torch.Tensor, tc_experts: torch.Tensor,
                          tile: int, rounding: str, capacity: int):
    """Token rounding's kept pairs and their scores (SonicMoE §5.2, Algorithm 4 steps 2–5), on
    the GPU in one launch with no host synchronisation.

    Args:
        probs: ``(T, E)`` fp32 ``softmax(logits)`` (or the router's other affinities, each in
            ``[0, 1]``), CUDA.
        tc_scores: ``(T·K,)`` fp32 token-choice scores in ``[0, 1]``, token-major
            (``sonic.topk_routing``).
        tc_experts: ``(T, K)`` int32 token-choice experts, ``K <= 16``, same device.
        tile: ``M_tile``, ``>= 1``.
        rounding: ``"nearest"``, ``"up"`` or ``"down"``.
        capacity: length of the outputs, at least the number of kept pairs (see
            :func:`sonic.routing.token_rounding.capacity`).

    Returns:
        ``(token_idx, expert_idx, source, scores, num_kept)``: ``(capacity,)`` int32, int32,
        int32 and fp32, and a 0-d int32. The first ``num_kept`` pairs are the kept ones,
        grouped by expert (ascending), tokens ascending within an expert; ``source`` is each
        score's slot in ``[tc_scores | probs.flatten() | one unused slot]`` (length
        ``T·K + T·E + 1``): the top-K pair ``t·K + j`` of a kept pick, ``T·K + t·E + e`` of
        an added pair, ``T·K + T·E`` of padding; ``scores`` are
        the pick's ``tc_scores[source]`` or the added pair's ``probs[t, e]``, bit for bit (not
        differentiable: :func:`sonic.routing.token_rounding.kept_scores` attaches their
        gradient through ``source``). The rest is padding: expert ``E``, token 0, score 0.
        Ties as
        :func:`sonic.routing.token_rounding.weakest_pick_ranks` and
        :func:`~sonic.routing.token_rounding.strongest_non_pick_tokens` define them: among
        equal scores the lower token is kept.

    Raises:
        TypeError: a tensor of the wrong dtype.
        ValueError: shapes or devices that disagree, ``K > 16``, ``tile < 1``, an unknown
            ``rounding``, ``capacity`` out of ``[0, 2**31)``, or ``T·(E + 16) >= 2**31``.
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
        raise ValueError(f"T·(E + {MAX_TOP_K}) must be below 2**31, got E={num_experts}, "
                         f"T={num_tokens}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be an int >= 1, got {tile!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity < 2**31:
        raise ValueError(f"capacity must be an int in [0, 2**31), got {capacity!r}")
    device = probs.device
    # Separate buffers: the outputs of the op sonic::token_rounding_select may not alias.
    tokens, experts, source = (torch.empty(capacity, dtype=torch.int32, device=device)
                               for _ in range(3))
    scores = torch.empty(capacity, dtype=torch.float32, device=device)
    num_kept = torch.empty((), dtype=torch.int32, device=device)
    if num_tokens == 0:
        num_kept.zero_()
        return tokens, experts, source, scores, num_kept
    # The kernels' workspace: the (E, T) int32 keys, the E top-K counts and the (E, T) int8
    # choice indices of the picks.
    cells = num_experts * num_tokens
    work = torch.empty(cells + num_experts + (cells + 3) // 4, dtype=torch.int32, device=device)
    fn = runtime.compiled(("token_rounding", rounding, top_k), lambda: _compile(rounding, top_k))
    a = runtime.address
    fn(a(probs.contiguous(), 4), a(tc_scores.contiguous(), 4), a(tc_experts.contiguous(), 4),
       a(work, 4), a(work[cells:], 4), a(work[cells + num_experts:], 4),
       a(tokens, 4), a(experts, 4), a(source, 4), a(scores, 4), a(num_kept, 4),
       num_tokens, num_experts, tile, capacity)
    return tokens, experts, source, scores, num_kept


register(KernelVariant(
    kernel="token_rounding", variant="nearest_K8",
    compile_fake=lambda: _compile("nearest", 8, keep_ptx=True),
    ptx_markers=("match.any.sync.b32", "atom.shared.add", "shfl.sync.up", "bar.sync")))
