"""GPU expert aggregation against an fp32 PyTorch index_add reference."""

import pytest
import torch

from sonic.routing.metadata import pairs_metadata

from kernel_checks import poison_allocator, require_kernels

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_kernels():
    require_kernels()


def _reference(y, meta, row_scores):
    rows = meta.token_rows.long()
    counts = (meta.token_offsets[1:] - meta.token_offsets[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(meta.num_tokens, device=y.device), counts)
    vals = y.float()[rows]
    if row_scores is not None:
        vals = vals * row_scores[rows, None]
    out = torch.zeros(meta.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, owner, vals)


def _routing(t, e, p, mode, gen):
    tokens = torch.randint(0, t, (p,), generator=gen, dtype=torch.int32)
    experts = torch.randint(0, e, (p,), generator=gen, dtype=torch.int32)
    if mode == "topk":
        k = p // t
        tokens = torch.arange(t, dtype=torch.int32).repeat_interleave(k)
    elif mode == "empty_tokens":
        tokens = tokens % max(t // 3, 1)
    elif mode == "one_expert":
        experts.zero_()
    return pairs_metadata(tokens.cuda(), experts.cuda(), t, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scored", [True, False])
@pytest.mark.parametrize("t,e,p,d,mode", [
    (1, 1, 1, 8, "random"), (1, 16, 16, 64, "topk"), (1000, 128, 8000, 1536, "topk"),
    (4097, 512, 4097 * 16, 256, "topk"), (4097, 64, 4097, 2048, "topk"),
    (3001, 32, 9000, 520, "empty_tokens"), (2000, 8, 5000, 4096, "one_expert"),
])
def test_matches_reference(t, e, p, d, mode, dtype, scored):
    from sonic.kernels.aggregation import aggregate

    gen = torch.Generator().manual_seed(t + p + d)
    meta = _routing(t, e, p, mode, gen)
    y = (torch.randn(meta.num_pairs, d, generator=gen) + 0.5).to(dtype).cuda()
    row_scores = torch.rand(meta.num_pairs, generator=gen).cuda() + 0.1 if scored else None
    inputs = [y.clone(), meta.token_rows.clone(), meta.token_offsets.clone()]
    ref = _reference(y, meta, row_scores)
    poison_allocator()
    out = aggregate(y, meta.token_rows, meta.token_offsets, row_scores)
    assert out.shape == (t, d) and out.dtype == dtype
    assert not out.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    poison_allocator()
    again = aggregate(y, meta.token_rows, meta.token_offsets, row_scores)
    assert torch.equal(out, again)
    for a, b in zip(inputs, (y, meta.token_rows, meta.token_offsets)):
        assert torch.equal(a, b)


def test_validation():
    from sonic.kernels.aggregation import aggregate

    y = torch.randn(16, 12, device="cuda")
    rows = torch.arange(16, dtype=torch.int32, device="cuda")
    offsets = torch.arange(17, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="multiple of 8"):
        aggregate(y, rows, offsets)
    with pytest.raises(ValueError, match="one entry per row"):
        aggregate(torch.randn(16, 16, device="cuda"), rows[:8], offsets)
    with pytest.raises(TypeError, match="row_scores must have dtype float32"):
        aggregate(torch.randn(16, 16, device="cuda"), rows, offsets, rows)
