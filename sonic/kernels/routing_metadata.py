"""Routing metadata ("index shuffling") on the GPU: a stable counting sort of pairs by expert.

docs/design.md §2 and §4; MetaShuffling (PyTorch blog, 2025). From the routed pairs this builds a
:class:`sonic.RoutingMetadata` on the device, with no host synchronisation (graph-capturable)
and bitwise-deterministic results: positions come from counts and ranks, never from the order
in which atomics land.

The pairs are cut into chunks of ``CHUNK`` consecutive pairs, one CTA each:

1. *histogram* — each CTA counts its chunk's pairs per expert (``hist[chunk, e]``). For
   arbitrary pairs it also counts pairs per token (atomics: only the totals matter).
2. *scatter* — each CTA sums the histograms of all chunks (expert totals, their exclusive prefix
   = ``expert_offsets``) and of the chunks before its own (its first row per expert), then walks
   its chunk in order, 256 pairs at a time: a pair's row is that base plus the number of earlier
   pairs of the same expert in the step (``match.any`` + ``popc`` inside a warp, per-warp
   counts in shared memory across warps). Rows of an expert therefore keep pair order.

Top-K pairs are token-major (``p = t·K + j``), so ``token_offsets[t] = t·K`` and ``token_rows``
equals ``pair_rows``: two launches in all. Arbitrary pairs (token rounding) need the pairs
grouped by token as well: an exclusive scan of the per-token counts into ``token_offsets``, then
each pair takes a slot in its token's segment, and a last launch orders every segment by pair
index (a pair's place = the number of smaller pair indices in its segment), so ``token_rows``
keeps pair order too: four launches. Arbitrary pairs may carry padding (expert ``E``, a padded
token-rounding routing): it is counted as one bin more, so its rows follow every expert's and
``expert_offsets[E]`` is the number of routed pairs, and it is left out of the token grouping.

The token scan runs one CTA per tile of ``SCAN_TILE`` tokens. A CTA first sums the counts of all
tokens before its tile itself (redundant across CTAs, but with no inter-CTA communication the
result cannot depend on scheduling), then scans its tile. Every load and store is coalesced: a
warp owns ``32·TOKEN_ITEMS`` consecutive tokens as ``TOKEN_ITEMS`` rows of 32, lane ``l``
holding element ``l`` of each row, so a warp instruction touches one 128-byte line. The counts
are only read (a CTA may still be summing them while another writes its offsets), so the
scatter takes slots by decrementing them: slot ``offsets[t] + old - 1``; it issues those
atomics before its histogram prologue so their latency overlaps it. The segment ordering runs
one pair per thread, since each pair's work is a chain of dependent loads.
"""


import functools
from typing import Any

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register
from sonic.types import ROUTING_METADATA_MAX_EXPERTS, RoutingMetadata

# Threads per CTA and pairs per thread of the chunked passes; a CTA's chunk is their product.
THREADS = 256
ITEMS = 8
CHUNK = THREADS * ITEMS
# Values per thread in a tile of block_exclusive_scan (the scatter's scan over experts).
SCAN_ITEMS = 16
# Threads per CTA of the token scan, tokens per thread, and tokens per CTA (its tile). At 1024
# threads a thread has at most 64 registers: the TOKEN_ITEMS-long arrays must fit (ptxas: 42).
SCAN_THREADS = 1024
TOKEN_ITEMS = 8
SCAN_TILE = SCAN_THREADS * TOKEN_ITEMS


def _compile(num_experts: int, topk: bool, keep_ptx: bool = False):
    """Compile the launches of one static configuration with placeholder arguments."""
    import cutlass

    from sonic.kernels.routing_metadata_kernel import RoutingMetadataKernels

    addresses = [runtime.fake_address() for _ in range(12)]
    return runtime.compile_launcher(RoutingMetadataKernels(num_experts, topk), *addresses,
                                    cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
                                    keep_ptx=keep_ptx)


def _check_num(name: str, value, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _launch(expert_idx: torch.Tensor, token_idx: torch.Tensor | None, num_tokens: int,
            k: int, num_experts: int) -> RoutingMetadata:
    device = expert_idx.device
    num_pairs = expert_idx.numel()
    if num_pairs >= 2**31 - CHUNK:
        raise ValueError(f"at most 2**31 - {CHUNK} pairs are supported, got {num_pairs}")
    i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
    if num_pairs == 0:
        empty = torch.empty(0, **i32)
        return RoutingMetadata(
            expert_counts=torch.zeros(num_experts, **i32),
            expert_offsets=torch.zeros(num_experts + 1, **i32), sorted_pairs=empty,
            gather_idx=empty.clone(), pair_rows=empty.clone(),
            token_offsets=torch.zeros(num_tokens + 1, **i32), token_rows=empty.clone(),
            num_tokens=num_tokens, num_experts=num_experts)
    topk = token_idx is None
    fn = runtime.compiled(("routing_metadata", num_experts, topk),
                          lambda: _compile(num_experts, topk))
    chunks = -(-num_pairs // CHUNK)
    # One allocation split into the seven outputs (field order) and the scratch: allocations
    # dominate the host time of a call.
    bins = num_experts if topk else num_experts + 1
    sizes = (num_experts, num_experts + 1, num_pairs, num_pairs, num_pairs, num_tokens + 1,
             num_pairs, chunks * bins, 0 if topk else num_pairs)
    *fields, hist, token_slots = torch.empty(sum(sizes), **i32).split(sizes)
    out = RoutingMetadata.from_tensors(fields, num_tokens=num_tokens, num_experts=num_experts)
    if token_idx is None:
        # Unused by the top-K launches (tokens follow from pair order); any int32 buffer will do.
        token_idx = token_work = token_slots = expert_idx
    else:
        token_work = torch.zeros(max(num_tokens, 1), **i32)
        # The kernels leave the padding out of the token grouping and write token_rows only
        # up to token_offsets[T] (= expert_offsets[E]); the tail keeps these values: the
        # padding rows in pair order, row r at position r, as in the reference. Written
        # before the launch, so nothing reads memory the kernels left unwritten.
        torch.arange(num_pairs, out=out.token_rows)
    fn(*(t.data_ptr() for t in (expert_idx, token_idx, hist, token_work, token_slots)),
       *(t.data_ptr() for t in out.tensors()), num_pairs, num_tokens, k)
    return out


def routing_metadata_topk(expert_idx: torch.Tensor, num_experts: int) -> RoutingMetadata:
    """Routing metadata of top-K routing, on the GPU in two launches (docs/design.md §2, MetaShuffling).

    Pairs are token-major: pair ``p = t·K + j`` is token ``t``'s ``j``-th expert, as produced by
    :func:`sonic.topk_routing`. Same result as ``sonic.routing_metadata`` on those pairs:
    rows sorted stably by expert, ``token_offsets[t] = t·K``, ``token_rows = pair_rows``.

    Args:
        expert_idx: ``(T, K)`` int32, contiguous, on a CUDA device; values in ``[0, E)``
            (pairs with other values get no row and leave rows unwritten).
        num_experts: ``E`` in ``[1, sonic.types.ROUTING_METADATA_MAX_EXPERTS]`` (512; a
            compile-time constant: each new ``E`` compiles once).

    Returns:
        :class:`sonic.RoutingMetadata`, all int32 on ``expert_idx``'s device, built without a
        host synchronisation; bitwise deterministic.

    Raises:
        TypeError: ``expert_idx`` is not an int32 tensor, or ``num_experts`` not an int.
        ValueError: ``expert_idx`` is not a contiguous 2-D CUDA tensor, or ``num_experts`` is
            outside ``[1, ROUTING_METADATA_MAX_EXPERTS]``.
    """
    runtime.check_tensor("expert_idx", expert_idx, dtypes=(torch.int32,), ndim=2)
    _check_num("num_experts", num_experts, 1, ROUTING_METADATA_MAX_EXPERTS)
    num_tokens, k = expert_idx.shape
    return _launch(expert_idx, None, num_tokens, max(k, 1), num_experts)


def routing_metadata_pairs(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int,
                           num_experts: int) -> RoutingMetadata:
    """Routing metadata of arbitrary (token, expert) pairs (token rounding), on the GPU.

    Same result as ``sonic.routing_metadata``: rows sorted stably by expert, and per token its
    rows in pair order (``token_offsets``, ``token_rows``). Four launches (docs/design.md §2,
    MetaShuffling); no host synchronisation; bitwise deterministic.

    Args:
        token_idx: ``(P,)`` int32, contiguous, CUDA; values in ``[0, T)``.
        expert_idx: ``(P,)`` int32, contiguous, same device; values in ``[0, E]``: ``E`` marks
            a padding pair (:attr:`sonic.Routing.num_valid`), which gets a row after
            ``expert_offsets[E]`` (the routed pairs) and no place in ``token_offsets``; the
            padding rows close ``token_rows`` in pair order (row ``r`` at position ``r``),
            as in the reference (pairs with other values get no row and leave rows
            unwritten).
        num_tokens: ``T`` >= 0.
        num_experts: ``E`` in ``[1, sonic.types.ROUTING_METADATA_MAX_EXPERTS]`` (512; a
            compile-time constant: each new ``E`` compiles once).

    Returns:
        :class:`sonic.RoutingMetadata`, all int32 on the pairs' device.

    Raises:
        TypeError: an index is not an int32 tensor, or a count not an int.
        ValueError: an index is not a contiguous 1-D CUDA tensor, the two differ in length or
            device, or a count is out of range.
    """
    runtime.check_tensor("token_idx", token_idx, dtypes=(torch.int32,), ndim=1)
    runtime.check_tensor("expert_idx", expert_idx, dtypes=(torch.int32,), ndim=1,
                         device=token_idx.device)
    if token_idx.numel() != expert_idx.numel():
        raise ValueError(f"token_idx and expert_idx must have the same length, got "
                         f"{token_idx.numel()} and {expert_idx.numel()}")
    _check_num("num_tokens", num_tokens, 0)
    _check_num("num_experts", num_experts, 1, ROUTING_METADATA_MAX_EXPERTS)
    return _launch(expert_idx, token_idx, num_tokens, 1, num_experts)


_PTX_MARKERS = ("match.any.sync.b32", "popc.b32", "atom.shared.add", "bar.sync")
for _experts, _topk in ((128, True), (512, False)):
    register(KernelVariant(
        kernel="routing_metadata", variant=f"E{_experts}_{'topk' if _topk else 'pairs'}",
        compile_fake=functools.partial(_compile, _experts, _topk, keep_ptx=True),
        ptx_markers=_PTX_MARKERS))
