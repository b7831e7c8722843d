"""The varlen-K epilogue's ``stmatrix`` staging, emulated on the CPU: the WGMMA accumulator's
fragment stored by ``stmatrix.x4`` (and its ``.trans`` form) at the row addresses
``stmatrix_row`` gives each lane must put every value of a warpgroup's ``64 x SLAB`` box where
the element-wise staging puts it (``swizzled``), each exactly once.

The hardware rules emulated are the PTX ISA's: an ``m8n8`` matrix's row ``r`` is held by lanes
``4r .. 4r+3``, two adjacent 16-bit columns per 32-bit register, lane ``8i + r`` gives the
shared address of row ``r`` of matrix ``i`` (16 contiguous bytes), and ``.trans`` stores the
matrix's column ``r`` there instead. The WGMMA ``m64nN`` accumulator: warp ``w``'s lane ``l``
holds rows ``16w + l // 4`` and ``+ 8`` at columns ``8j + 2 (l % 4)`` and ``+ 1``.
"""

from types import SimpleNamespace

import pytest

from sonic.kernels.grouped_gemm.config import SLAB


@pytest.fixture
def kernel(sm90a_compile):
    """The kernel modules' ``stmatrix_row``, ``swizzled`` and ``WgmmaAccumulator``, imported
    for sm_90a: cutlass keeps the target of its first import, so importing it here without
    one would skip the in-process sm_90a compile checks that run after this module."""
    from sonic.kernels.grouped_gemm.epilogue.base import stmatrix_row, swizzled
    from sonic.kernels.grouped_gemm.sm90 import WgmmaAccumulator
    return SimpleNamespace(stmatrix_row=stmatrix_row, swizzled=swizzled,
                           WgmmaAccumulator=WgmmaAccumulator)


def _accumulator_element(warp, lane, group, half, v0):
    """(row, column) of the box that the WGMMA fragment puts in this register half."""
    return 16 * warp + lane // 4 + 8 * half, 8 * group + 2 * (lane % 4) + v0


def _staged_box(kernel, transposed):
    """{element offset: (row, column) of the accumulator} after every warp's stmatrix."""
    # The staging takes the register pairs in the accumulator's own order, four per
    # instruction (one per matrix).
    pairs = list(kernel.WgmmaAccumulator.pairs(SimpleNamespace(row_blocks=1), 0, 0))
    assert len(pairs) == 4 * (SLAB // 16)
    stored = {}
    for warp in range(4):
        for k in range(len(pairs) // 4):
            matrices = [(p.j, p.v1) for p in pairs[4 * k:4 * k + 4]]
            for i, (group, half) in enumerate(matrices):
                # Matrix i's 8 x 8 values: row r, column c from lane 4r + c // 2.
                values = [[_accumulator_element(warp, 4 * r + c // 2, group, half, c % 2)
                           for c in range(8)] for r in range(8)]
                for r in range(8):
                    base = kernel.stmatrix_row(warp, 8 * i + r, k, transposed)
                    assert base % 8 == 0, "a stored row must be 16-byte aligned"
                    row = [values[c][r] for c in range(8)] if transposed else values[r]
                    for c, element in enumerate(row):
                        assert base + c not in stored, f"offset {base + c} written twice"
                        stored[base + c] = element
    return stored


@pytest.mark.parametrize("transposed", [False, True])
def test_stmatrix_staging_places_every_value_where_the_elementwise_staging_does(kernel,
                                                                              transposed):
    stored = _staged_box(kernel, transposed)
    swizzled = kernel.swizzled
    expected = {(swizzled(n, m) if transposed else swizzled(m, n)): (m, n)
                for m in range(64) for n in range(SLAB)}
    assert stored == expected


def test_the_emulation_tells_the_two_layouts_apart(kernel):
    # Each staging checked against the other's expectation fails: the comparison above can.
    swizzled = kernel.swizzled
    untransposed = {swizzled(m, n): (m, n) for m in range(64) for n in range(SLAB)}
    transposed = {swizzled(n, m): (m, n) for m in range(64) for n in range(SLAB)}
    assert (_staged_box(kernel, True) != untransposed
            and _staged_box(kernel, False) != transposed)
