"""The padding-rows kernel (:func:`sonic.kernels.padding.fill_padding_rows`) against the
reference (:func:`sonic.reference.ops.fill_padding_rows`): every tensor form the expert ops
produce, both store widths, padding from none to all rows, on memory filled with random bits.

    python -m pytest -m gpu tests/gpu/test_padding_kernel.py
"""

import pytest
import torch

from sonic.kernels.padding import fill_padding_rows
from sonic.reference import ops as reference

from kernel_checks import require_kernels

pytestmark = pytest.mark.gpu


def _random_bits(shape, dtype) -> torch.Tensor:
    """A tensor of random bytes (NaN and inf patterns included), so no row is 0 by chance."""
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                            dtype=torch.uint8, device="cuda"))
    return t


def _offsets(num_experts: int, valid: int) -> torch.Tensor:
    """Ragged ``(E+1,)`` int32 offsets ending at ``valid`` (experts may be empty)."""
    cuts = torch.randint(0, valid + 1, (num_experts - 1,)).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([valid])]).to(torch.int32).cuda()


# (shape, dtype, dim, value): H / A / dX̃ rows (16-byte stores), e4m3 rows, a 12-byte row
# (4-byte stores), per-row ds, the FP8 path's (blocks, P) scales, one row, one column.
CASES = [
    ((777, 512), torch.bfloat16, 0, 0.0),
    ((777, 384), torch.float8_e4m3fn, 0, 0.0),
    ((777, 6), torch.bfloat16, 0, 0.0),
    ((777,), torch.float32, 0, 0.0),
    ((3, 777), torch.float32, 1, 1.0),
    ((1, 8), torch.bfloat16, 0, 0.0),
    ((2, 1), torch.float32, 1, -2.5),
]


@pytest.mark.parametrize("shape,dtype,dim,value", CASES)
@pytest.mark.parametrize("padding", ["none", "some", "all"])
def test_fill_matches_reference(shape, dtype, dim, value, padding):
    require_kernels()
    rows = shape[dim]
    valid = {"none": rows, "some": max(rows - 1 - int(torch.randint(0, rows, ())), 0),
             "all": 0}[padding]
    offsets = _offsets(int(torch.randint(1, 9, ())), valid)
    t = _random_bits(shape, dtype)
    before = t.clone()
    want = reference.fill_padding_rows(before.view(torch.uint8).clone().view(dtype), offsets,
                                       dim, value) if dtype != torch.float8_e4m3fn else None
    out = fill_padding_rows(t, offsets, dim, value)
    assert out is t
    bits, old = t.view(torch.uint8), before.view(torch.uint8)
    if dim == 1:
        bits, old = t.t().contiguous().view(torch.uint8), before.t().contiguous().view(torch.uint8)
    row_bytes = bits.numel() // rows
    bits, old = bits.reshape(rows, row_bytes), old.reshape(rows, row_bytes)
    assert torch.equal(bits[:valid], old[:valid]), "a routed row was written"
    if want is not None:
        torch.testing.assert_close(t, want, rtol=0, atol=0, equal_nan=True)
    else:
        assert bits[valid:].eq(0).all()


def test_offsets_past_the_rows_write_nothing():
    require_kernels()
    t = _random_bits((64, 32), torch.bfloat16)
    before = t.clone()
    fill_padding_rows(t, torch.tensor([0, 70, 100], dtype=torch.int32, device="cuda"))
    assert torch.equal(t.view(torch.int16), before.view(torch.int16))


def test_rejects_what_it_cannot_fill():
    require_kernels()
    offsets = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="4-byte words"):
        fill_padding_rows(torch.empty(8, 3, dtype=torch.bfloat16, device="cuda"), offsets)
    with pytest.raises(ValueError, match="value must be 0"):
        fill_padding_rows(torch.empty(8, 8, dtype=torch.bfloat16, device="cuda"), offsets,
                          value=1.0)
    with pytest.raises(ValueError, match="dim must be"):
        fill_padding_rows(torch.empty(8, dtype=torch.float32, device="cuda"), offsets, dim=1)
    with pytest.raises(ValueError, match="must not require grad"):
        fill_padding_rows(torch.zeros(8, 8, device="cuda", requires_grad=True), offsets)
    with pytest.raises(TypeError, match="expert_offsets must have dtype int32"):
        fill_padding_rows(torch.empty(8, 8, dtype=torch.float32, device="cuda"), offsets.long())
