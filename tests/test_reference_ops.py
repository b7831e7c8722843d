"""The reference epilogues against plain autograd (they are the kernels' oracle)."""

import pytest
import torch
import torch.nn.functional as F

from sonic.reference.ops import dswiglu_epilogue, merge_gate_up, split_gate_up, swiglu


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
