"""Expert aggregation on the GPU: every token gathers and sums its expert rows.

docs/design.md §3 (forward step 3, backward step 5) and §4: ``o_t = Σ_j s[row_j] · y[row_j]`` over the
rows ``token_rows[token_offsets[t]:token_offsets[t+1]]`` of token ``t``, accumulated in fp32 in
pair order, with no scatter and no atomics, so the result is deterministic. SonicMoE
(arXiv 2512.14080) §3.2: the aggregation is a gather-sum, which keeps the down-projection GEMM
free of a scatter epilogue.

Each thread owns one token and one 8-element column slice of ``d``: it walks the token's rows,
loading 8 elements per row with one 16-byte load (two for fp32) and accumulating in fp32
registers, then stores its slice once. Neighbouring threads read neighbouring slices of the
same row, so every row is read in full coalesced lines; the index and score loads of a token
are shared through L1. The kernel is bandwidth-bound: the bytes read are ``P·d·size`` plus the
indices, the bytes written ``T·d·size``.
"""

import functools

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register

# Elements per thread: 16 bytes of bf16 (two 16-byte loads for fp32).
VEC = 8
THREADS = 256
# Rows of a token loaded ahead: keeps several independent row loads in flight per thread.
UNROLL = 4

DTYPES = (torch.bfloat16, torch.float32)


def _compile(dtype: torch.dtype, d: int, scored: bool, keep_ptx: bool = False):
    """Compile one static configuration with placeholder arguments."""
    import cutlass

    from sonic.kernels.aggregation_kernel import AggregationKernel

    addresses = [runtime.fake_address() for _ in range(5)]
    return runtime.compile_launcher(AggregationKernel(runtime.cute_dtype(dtype), d, scored),
                                    *addresses, cutlass.Int32(1), keep_ptx=keep_ptx)


def aggregate(y: torch.Tensor, token_rows: torch.Tensor, token_offsets: torch.Tensor,
              row_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token gather-sum of expert rows: ``o_t = Σ s[row] · y[row]`` (docs/design.md §3, §4).

    For token ``t`` the rows are ``token_rows[token_offsets[t]:token_offsets[t+1]]`` (the
    :class:`sonic.RoutingMetadata` fields of the same names); ``s = 1`` when ``row_scores`` is
    None, which is the backward ``dX_t = Σ dX̃[row]``. fp32 accumulation in row order, no
    atomics: bitwise deterministic. A token with no rows gets zeros.

    Args:
        y: ``(P, d)`` bf16 or fp32, contiguous, CUDA; ``d`` a multiple of 8; rows 16-byte aligned.
        token_rows: ``(P,)`` int32, contiguous; values in ``[0, P)``.
        token_offsets: ``(T+1,)`` int32, contiguous, non-decreasing, ``[0] == 0``,
            ``[T] <= len(token_rows)``.
        row_scores: ``(P,)`` fp32, contiguous, or None — the score of each row (expert-sorted
            order, e.g. ``scores[sorted_pairs]``).

    Returns:
        ``(T, d)`` tensor of ``y``'s dtype.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor is not a contiguous CUDA tensor of the right rank, the tensors are
            on different devices, lengths disagree, ``d`` is not a multiple of 8, or ``y`` is
            not 16-byte aligned.
    """
    runtime.check_tensor("y", y, dtypes=DTYPES, ndim=2)
    runtime.check_tensor("token_rows", token_rows, dtypes=(torch.int32,), ndim=1, device=y.device)
    runtime.check_tensor("token_offsets", token_offsets, dtypes=(torch.int32,), ndim=1,
                         device=y.device)
    num_rows, d = y.shape
    if d % VEC:
        raise ValueError(f"y's last dimension d must be a multiple of {VEC}, got {d}")
    if token_rows.numel() != num_rows:
        raise ValueError(f"token_rows must have one entry per row of y ({num_rows}), "
                         f"got {token_rows.numel()}")
    if token_offsets.numel() < 1:
        raise ValueError("token_offsets must have T+1 >= 1 entries, got 0")
    if row_scores is not None:
        runtime.check_tensor("row_scores", row_scores, dtypes=(torch.float32,), ndim=1,
                             device=y.device)
        if row_scores.numel() != num_rows:
            raise ValueError(f"row_scores must have one entry per row of y ({num_rows}), "
                             f"got {row_scores.numel()}")
    num_tokens = token_offsets.numel() - 1
    out = torch.empty(num_tokens, d, dtype=y.dtype, device=y.device)
    if num_tokens == 0 or d == 0:
        return out
    if num_rows == 0:
        return out.zero_()
    scored = row_scores is not None
    fn = runtime.compiled(("aggregation", y.dtype, d, scored), lambda: _compile(y.dtype, d, scored))
    a = runtime.address
    offsets_address = a(token_offsets, 4)
    # Unscored launches never read the score address; token_offsets' stands in for it.
    fn(a(y, 16), a(token_rows, 4), offsets_address,
       offsets_address if row_scores is None else a(row_scores, 4), a(out, 16), num_tokens)
    return out


_SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32"}
for _dtype, _d, _scored in ((torch.bfloat16, 4096, True), (torch.float32, 1536, False)):
    register(KernelVariant(
        kernel="aggregation",
        variant=f"{_SHORT[_dtype]}_d{_d}_{'scored' if _scored else 'unscored'}",
        compile_fake=functools.partial(_compile, _dtype, _d, _scored, keep_ptx=True),
        # 16-byte accesses: for sm_100a the back end emits the fp32 ones as .v2.b64 instead
        # of .v4.b32 (same width, one instruction), so either form counts.
        ptx_markers=(("ld.global.v4", "ld.global.v2.b64"),
                     ("st.global.v4", "st.global.v2.b64"))))
