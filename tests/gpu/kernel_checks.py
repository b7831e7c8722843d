"""Helpers shared by the GPU kernel tests."""

import pytest
import torch

from sonic.kernels import kernels_available


def require_kernels() -> None:
    """Skip the calling test unless sonic's CuTe kernels can run on the current device."""
    ok, reason = kernels_available()
    if not ok:
        pytest.skip(reason)


def poison_allocator(nbytes: int = 256 << 20) -> None:
    """Fill free blocks of PyTorch's caching allocator with 0xFF bytes.

    The next output buffers are likely carved from them, so an element a kernel leaves unwritten
    reads as NaN (bf16/fp32) or -1 (int32) instead of a plausible stale value.
    """
    torch.full((nbytes,), -1, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
