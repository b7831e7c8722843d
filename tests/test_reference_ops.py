"""The reference epilogues against plain autograd (they are the kernels' oracle)."""

import pytest
import torch
import torch.nn.functional as F

from sonic.reference.ops import (dswiglu_epilogue, grouped_mm, grouped_mm_varlen_k, merge_gate_up,
                                 split_gate_up, swiglu, up_proj_swiglu)


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_dswiglu_epilogue_matches_autograd(gate_up):
    g = torch.Generator().manual_seed(0)
    P, n = 37, 12
    h = torch.randn(P, 2 * n, generator=g, dtype=torch.float64, requires_grad=True)
    da_prime = torch.randn(P, n, generator=g, dtype=torch.float64)
    s = torch.rand(P, generator=g, dtype=torch.float64) + 0.1
    gate, up = split_gate_up(h, gate_up)
    a = F.silu(gate) * up
    (s[:, None] * a * da_prime).sum().backward()
    dh, a_scaled, ds = dswiglu_epilogue(da_prime, h.detach(), s, gate_up)
    torch.testing.assert_close(dh, h.grad)
    torch.testing.assert_close(a_scaled, s[:, None] * a.detach())
    torch.testing.assert_close(ds, (da_prime * a.detach()).sum(-1))
    torch.testing.assert_close(swiglu(h.detach(), gate_up), a.detach())


def test_gate_up_layouts_round_trip():
    h = torch.arange(12.0).view(2, 6)
    assert torch.equal(merge_gate_up(*split_gate_up(h, "concat"), "concat"), h)
    assert torch.equal(merge_gate_up(*split_gate_up(h, "interleaved"), "interleaved"), h)
    assert split_gate_up(h, "interleaved")[0].tolist() == [[0, 2, 4], [6, 8, 10]]


def test_grouped_mm_gather_equals_materialised_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 12, generator=gen, dtype=torch.float64)
    idx = torch.tensor([3, 0, 0, 6, 2, 5, 1, 1, 4])
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)     # the middle expert is empty
    w1 = torch.randn(3, 10, 12, generator=gen, dtype=torch.float64)
    rows = x.index_select(0, idx)
    expected = torch.cat([rows[:4] @ w1[0].t(), rows[4:] @ w1[2].t()])
    torch.testing.assert_close(grouped_mm(x, w1.transpose(1, 2), offsets, idx), expected)
    h, a = up_proj_swiglu(x, w1, offsets, idx, "interleaved")
    torch.testing.assert_close(h, expected)
    torch.testing.assert_close(a, swiglu(expected, "interleaved"))
    dh = torch.randn(9, 10, generator=gen, dtype=torch.float64)
    grad_w1 = grouped_mm_varlen_k(dh, x, offsets, gather_idx_b=idx)
    torch.testing.assert_close(grad_w1[0], dh[:4].t() @ rows[:4])
    torch.testing.assert_close(grad_w1[1], torch.zeros(10, 12, dtype=torch.float64))
    torch.testing.assert_close(grouped_mm_varlen_k(x, dh, offsets, gather_idx_a=idx),
                               grad_w1.transpose(1, 2))


def test_fill_padding_rows_along_either_dim():
    """The rows past ``offsets[E]`` get the value, along dim 0 of ``(P,)`` / ``(P, W)`` and
    dim 1 of ``(B, P)`` scales; rows before are untouched. Off the GPU the CuTe backend's fill
    is this one."""
    from sonic.backend import _cute_fill_padding_rows
    from sonic.reference.ops import fill_padding_rows

    offsets = torch.tensor([0, 3, 5], dtype=torch.int32)
    for fill in (fill_padding_rows, _cute_fill_padding_rows):
        rows, scales, ds = torch.randn(7, 4), torch.randn(2, 7), torch.randn(7)
        want = [rows.clone(), scales.clone(), ds.clone()]
        want[0][5:], want[1][:, 5:], want[2][5:] = 0, 1.5, 0
        assert fill(rows, offsets) is rows and torch.equal(rows, want[0])
        assert torch.equal(fill(scales, offsets, 1, 1.5), want[1])
        assert torch.equal(fill(ds, offsets), want[2])
        none = torch.randn(5, 4)
        assert torch.equal(fill(none.clone(), offsets), none)
