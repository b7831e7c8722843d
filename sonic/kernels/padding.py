"""A padded routing's padding rows filled on the GPU, without reading the padding back.

A padded routing (token rounding's ``padded=True``, :attr:`sonic.Routing.num_valid`) has a
static number of pairs ``P`` of which only the first ``expert_offsets[E]`` rows belong to an
expert; no grouped GEMM computes the rest. An op whose output kept them as the allocator
left them would not be a function of its inputs (``torch.library.opcheck`` and CUDA graphs
replaying different data see it). The reference writes zeros there (and an all-zero block's
scale in the FP8 scales); this kernel writes the same value into the CuTe backend's outputs,
reading ``expert_offsets[E]`` on the device: no host synchronisation, and work proportional
to the padding alone (a routing without padding costs one launch whose threads read one
offset and return).

A tensor is seen as ``(outer, P, row)`` 4-byte words with ``row`` contiguous and the ``P``
rows at ``dim``: ``(P,)`` and ``(P, W)`` tensors have ``outer = 1``, the FP8 path's
column-major scales ``(W/128, P)`` have ``row = 1``. Each thread of a grid-stride loop stores
one unit of the fill word: 16 bytes where every row is a multiple of 16 bytes and the tensor
16-byte aligned, 4 bytes otherwise.
"""

import functools

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register

THREADS = 256
# Blocks per SM of the grid-stride loop: the grid is sized without knowing the padding.
BLOCKS_PER_SM = 4
_WORD = 4


def _compile(vec: int, keep_ptx: bool = False):
    """Compile one static configuration with placeholder arguments."""
    import cutlass

    from sonic.kernels.padding_kernel import PaddingKernel

    return runtime.compile_launcher(PaddingKernel(vec), runtime.fake_address(),
                                    runtime.fake_address(), *(cutlass.Int32(1) for _ in range(6)),
                                    keep_ptx=keep_ptx)


def fill_padding_rows(t: torch.Tensor, expert_offsets: torch.Tensor, dim: int = 0,
                      value: float = 0.0) -> torch.Tensor:
    """Write ``value``, in place, into ``t``'s rows ``expert_offsets[E]:P`` along ``dim``.

    Args:
        t: contiguous CUDA tensor with its ``P`` rows at ``dim``: ``(P,)`` or ``(P, W)`` (``dim
            = 0``; ``W`` times the element size a multiple of 4 bytes), or ``(B, P)`` of
            4-byte elements (``dim = 1``, e.g. the FP8 path's 1×128 scales).
        expert_offsets: ``(E+1,)`` int32 on ``t``'s device (:attr:`sonic.RoutingMetadata.
            expert_offsets`); read on the device only. Rows before ``expert_offsets[E]`` are
            not touched; with ``expert_offsets[E] >= P`` nothing is written.
        dim: the dimension of the ``P`` rows, 0 or 1 (1 only for 2-D tensors).
        value: 0, or for an fp32 ``t`` any float (e.g. an all-zero FP8 block's scale, 1.0).

    Returns:
        ``t``.

    Raises:
        TypeError: ``expert_offsets`` is not int32, or ``t`` is not a tensor.
        ValueError: ``t`` is not a contiguous CUDA tensor of 1 or 2 dimensions or requires
            grad, ``expert_offsets`` is not a 1-D tensor of at least one entry on ``t``'s device,
            ``dim`` is not a dimension of ``t``, a row is not a whole number of 4-byte
            words, ``t`` takes ``2**31`` stores or more (over 8 GiB; 32 GiB with 16-byte
            rows), or a nonzero ``value`` for a ``t`` that is not fp32.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a tensor, got {type(t).__name__}")
    runtime.check_tensor("t", t, dtypes=(t.dtype,), ndim=t.dim())
    if t.requires_grad:
        raise ValueError("t must not require grad: the fill writes through its memory, which "
                         "autograd does not see (fill a detached output)")
    if t.dim() not in (1, 2):
        raise ValueError(f"t must have 1 or 2 dimensions, got {t.dim()}")
    runtime.check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32,), ndim=1,
                         device=t.device)
    if expert_offsets.numel() < 1:
        raise ValueError("expert_offsets must have E+1 >= 1 entries, got 0")
    if dim not in range(t.dim()):
        raise ValueError(f"dim must be a dimension of t ({t.dim()}-D), got {dim}")
    rows = t.shape[dim]
    outer = t.shape[0] if dim == 1 else 1
    row_bytes = _row_bytes(t, dim)
    if row_bytes % _WORD:
        raise ValueError(f"t's rows must be whole 4-byte words, got {row_bytes} bytes per row "
                         f"({tuple(t.shape)} {t.dtype}, dim {dim})")
    if value != 0 and t.dtype != torch.float32:
        raise ValueError(f"value must be 0 for a {t.dtype} t (a nonzero fill is fp32 only), "
                         f"got {value}")
    # The fill's fp32 bit pattern, which the kernel stores as a 32-bit word (a zero of another
    # dtype: all bits clear, -0.0 included).
    word = (int(torch.tensor(value, dtype=torch.float32).view(torch.int32))
            if t.dtype == torch.float32 else 0)
    if t.numel() == 0:
        return t
    vec = store_words(t, dim)
    stores = _stores(t, dim)
    if stores >= 2**31:
        raise ValueError(f"t must take fewer than 2**31 stores of {_WORD * vec} bytes, got "
                         f"{tuple(t.shape)} {t.dtype}")
    row_units = row_bytes // (_WORD * vec)
    blocks = min(-(-stores // THREADS), BLOCKS_PER_SM * _sm_count(t.device))
    fn = runtime.compiled(("padding", vec), lambda: _compile(vec))
    fn(runtime.address(t, _WORD * vec), runtime.address(expert_offsets, 4),
       expert_offsets.numel() - 1, rows, row_units, outer, word, blocks)
    return t


def _row_bytes(t: torch.Tensor, dim: int) -> int:
    """Bytes of one of ``t``'s rows along ``dim``: the whole row of a ``(P, W)`` tensor, one
    element otherwise."""
    return t.element_size() * (t.shape[1] if dim == 0 and t.dim() == 2 else 1)


def store_words(t: torch.Tensor, dim: int = 0) -> int:
    """4-byte words per store for ``t``: 4 (16 bytes) where every row is a multiple of 16
    bytes and ``t`` 16-byte aligned, else 1."""
    return 4 if _row_bytes(t, dim) % 16 == 0 and t.data_ptr() % 16 == 0 else 1


def fits(t: torch.Tensor, dim: int = 0) -> bool:
    """Whether :func:`fill_padding_rows` serves ``t``: a contiguous CUDA tensor of 1 or 2
    dimensions that does not require grad, rows of whole 4-byte words, fewer than ``2**31``
    stores."""
    if not (t.is_cuda and t.is_contiguous() and t.dim() in (1, 2) and dim < t.dim()
            and not t.requires_grad):
        return False
    return _row_bytes(t, dim) % _WORD == 0 and _stores(t, dim) < 2**31


def _stores(t: torch.Tensor, dim: int) -> int:
    """Stores that fill all of ``t``: its bytes over the store width."""
    return t.numel() * t.element_size() // (_WORD * store_words(t, dim))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


for _vec in (1, 4):
    register(KernelVariant(
        kernel="padding",
        variant=f"vec{_vec}",
        compile_fake=functools.partial(_compile, _vec, keep_ptx=True),
        ptx_markers=("st.global.v4" if _vec == 4 else ("st.global.b32", "st.global.u32"),)))
