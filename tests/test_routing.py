import pytest
import torch

import sonic
from sonic.routing.metadata import pairs_metadata
from sonic.routing.token_rounding import rounded_counts


def _logits(T, E, seed=0, dtype=torch.float32):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_routing_matches_torch(score, renormalize):
    logits = _logits(33, 12)
    r = sonic.topk_routing(logits, 3, score=score, renormalize=renormalize)
    vals, idx = torch.topk(logits, 3)
    assert torch.equal(r.expert_idx.view(33, 3).long(), idx)
    assert torch.equal(r.token_idx.long(), torch.arange(33).repeat_interleave(3))
    if score == "softmax_topk":
        expected = torch.softmax(vals, -1)
    else:
        expected = torch.softmax(logits, -1).gather(1, idx)
        if renormalize:
            expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(r.scores.view(33, 3), expected)
    assert r.scores.dtype == torch.float32 and r.num_tokens == 33 and r.num_experts == 12


def test_topk_ties_prefer_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    r = sonic.topk_routing(logits, 3)
    assert r.expert_idx.tolist() == [1, 2, 4]


@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax"])
def test_router_gradients(score):
    logits = _logits(7, 5, dtype=torch.float64).requires_grad_()
    weights = torch.randn(7 * 2, dtype=torch.float64)
    r = sonic.topk_routing(logits, 2, score=score, renormalize=True)
    (r.scores * weights).sum().backward()
    manual = logits.detach().clone().requires_grad_()
    vals, idx = torch.topk(manual, 2)
    if score == "softmax_topk":
        s = torch.softmax(vals, -1)
    else:
        s = torch.softmax(manual, -1).gather(1, idx)
        s = s / s.sum(-1, keepdim=True)
    (s.flatten() * weights).sum().backward()
    torch.testing.assert_close(logits.grad, manual.grad)
    assert logits.grad.abs().sum() > 0


@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_router_gradcheck(score, renormalize):
    logits = _logits(9, 6, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda l: sonic.topk_routing(l, 3, score=score, renormalize=renormalize).scores, (logits,))


def _tc_counts(logits, k):
    return torch.bincount(torch.topk(logits, k).indices.flatten(), minlength=logits.shape[1])


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
@pytest.mark.parametrize("T,E,k,tile", [(500, 8, 2, 16), (1000, 16, 4, 32), (90, 4, 1, 128)])
def test_token_rounding_properties(rounding, T, E, k, tile):
    logits = _logits(T, E, seed=T + E)
    r = sonic.token_rounding_routing(logits, k, tile=tile, rounding=rounding)
    f = _tc_counts(logits, k)
    counts = torch.bincount(r.expert_idx.long(), minlength=E)
    assert torch.all((counts - f).abs() < tile)
    assert torch.all((counts % tile == 0) | (counts == T))
    if rounding == "up":
        assert torch.all(counts >= f)
    if rounding == "down":
        assert torch.all(counts <= f)
    # no duplicate pairs; expert-major order
    pair_ids = r.expert_idx.long() * T + r.token_idx.long()
    assert pair_ids.unique().numel() == r.num_pairs
    assert torch.all(r.expert_idx[1:] >= r.expert_idx[:-1])

    probs = torch.softmax(logits, -1)
    picked = torch.zeros(T, E, dtype=torch.bool).scatter_(1, torch.topk(logits, k).indices, True)
    tc = torch.where(picked, probs, 0)
    tc = tc / tc.sum(-1, keepdim=True)
    kept = torch.zeros(T, E, dtype=torch.bool)
    kept[r.token_idx.long(), r.expert_idx.long()] = True
    for e in range(E):
        if counts[e] <= f[e]:   # dropped: only picks kept, the strongest by token-choice score
            assert torch.all(picked[kept[:, e], e])
            if (picked[:, e] & ~kept[:, e]).any() and kept[:, e].any():
                assert tc[kept[:, e], e].min() >= tc[picked[:, e] & ~kept[:, e], e].max()
        else:                   # added: every pick kept, additions are the strongest non-picks
            assert torch.all(kept[picked[:, e], e])
            added = kept[:, e] & ~picked[:, e]
            rest = ~kept[:, e] & ~picked[:, e]
            if rest.any():
                assert probs[added, e].min() >= probs[rest, e].max()
    # scores: renormalised TC score for picks, softmax probability for additions
    t, e = r.token_idx.long(), r.expert_idx.long()
    expected = torch.where(picked[t, e], tc[t, e], probs[t, e])
    torch.testing.assert_close(r.scores, expected)


def _naive_token_rounding(logits, k, tile, rounding):
    """Paper Algorithm 4 written per expert: rank every token by (picked, score) descending,
    lower token first on ties, and keep the top r_e."""
    T, E = logits.shape
    probs = torch.softmax(logits, -1)
    top = torch.sort(logits, dim=-1, descending=True, stable=True)
    picks = top.indices[:, :k]
    picked = torch.zeros(T, E, dtype=torch.bool).scatter_(1, picks, True)
    tc = torch.zeros(T, E).scatter_(1, picks, torch.softmax(top.values[:, :k], -1))
    r = rounded_counts(picked.sum(0), tile, rounding, T)
    pairs = []
    for e in range(E):
        rank = sorted(range(T), key=lambda t: (not picked[t, e], -float(tc[t, e] if picked[t, e] else probs[t, e]), t))
        pairs += [(e, t) for t in sorted(rank[:r[e]])]
    return pairs


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
@pytest.mark.parametrize("quantum", [None, 1.0])
def test_token_rounding_matches_naive_with_ties(rounding, quantum):
    logits = _logits(200, 6, seed=3)
    if quantum:  # few distinct logits: ties among picks' scores and among non-picks' probs
        logits = (logits / quantum).round() * quantum
    r = sonic.token_rounding_routing(logits, 2, tile=16, rounding=rounding)
    assert list(zip(r.expert_idx.tolist(), r.token_idx.tolist())) == _naive_token_rounding(
        logits, 2, 16, rounding)


def test_rounded_counts_modes():
    counts = torch.tensor([0, 1, 63, 64, 65, 127, 128, 200])
    assert rounded_counts(counts, 128, "up", 1000).tolist() == [0, 128, 128, 128, 128, 128, 128, 256]
    assert rounded_counts(counts, 128, "down", 1000).tolist() == [0, 0, 0, 0, 0, 0, 128, 128]
    assert rounded_counts(counts, 128, "nearest", 1000).tolist() == [0, 0, 0, 128, 128, 128, 128, 256]
    assert rounded_counts(counts, 128, "up", 150).tolist()[-1] == 150


def test_token_rounding_gradients_reach_logits():
    logits = _logits(64, 4, dtype=torch.float64).requires_grad_()
    r = sonic.token_rounding_routing(logits, 2, tile=8, rounding="up")
    r.scores.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_token_rounding_gradcheck():
    logits = _logits(24, 4, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda l: sonic.token_rounding_routing(l, 2, tile=4).scores, (logits,))


def _naive_metadata(tok, exp, T, E):
    rows = sorted(range(len(tok)), key=lambda p: (exp[p], p))
    pair_rows = [0] * len(tok)
    for r, p in enumerate(rows):
        pair_rows[p] = r
    by_token = sorted(range(len(tok)), key=lambda p: (tok[p], p))
    return rows, pair_rows, [pair_rows[p] for p in by_token]


@pytest.mark.parametrize("T,E,P", [(1, 1, 1), (30, 7, 55), (100, 64, 300), (5, 3, 0)])
def test_routing_metadata_matches_naive(T, E, P):
    g = torch.Generator().manual_seed(P)
    tok = torch.randint(0, T, (P,), generator=g, dtype=torch.int32)
    exp = torch.randint(0, E, (P,), generator=g, dtype=torch.int32)
    m = sonic.routing_metadata(sonic.Routing(tok, exp, torch.rand(P), T, E))
    rows, pair_rows, token_rows = _naive_metadata(tok.tolist(), exp.tolist(), T, E)
    assert m.sorted_pairs.tolist() == rows
    assert m.pair_rows.tolist() == pair_rows
    assert m.token_rows.tolist() == token_rows
    assert m.gather_idx.tolist() == [int(tok[p]) for p in rows]
    counts = torch.bincount(exp.long(), minlength=E)
    assert m.expert_counts.tolist() == counts.tolist()
    assert m.expert_offsets.tolist() == [0] + counts.cumsum(0).tolist()
    assert m.token_offsets.tolist() == [0] + torch.bincount(tok.long(), minlength=T).cumsum(0).tolist()
    assert all(t.dtype == torch.int32 for t in m.tensors())


@pytest.mark.parametrize("T,E,k", [(1, 1, 1), (37, 9, 3), (64, 128, 8)])
def test_topk_metadata_path_equals_general_path(T, E, k):
    r = sonic.topk_routing(_logits(T, E, seed=T), k)
    assert r.top_k == k
    fast = sonic.routing_metadata(r)
    general = pairs_metadata(r.token_idx, r.expert_idx, T, E)
    for a, b in zip(fast.tensors(), general.tensors()):
        assert torch.equal(a, b)


def _token_rounding_by_full_sort(logits, k, tile, rounding):
    """Algorithm 4 literally: sort every expert's column by the combined score C, keep r_e."""
    T, E = logits.shape
    probs = torch.softmax(logits, -1)
    picks = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    picked = torch.zeros(T, E, dtype=torch.bool).scatter_(1, picks, True)
    tc = torch.zeros(T, E).scatter_(1, picks, torch.softmax(logits.gather(1, picks), -1))
    combined = torch.where(picked, tc, probs - 1)
    order = torch.sort(combined, dim=0, descending=True, stable=True).indices
    kept_counts = rounded_counts(picked.sum(0), tile, rounding, T)
    kept = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        kept[order[: kept_counts[e], e], e] = True
    return kept


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
@pytest.mark.parametrize("ties", ["none", "rounded", "repeated_rows"])
def test_token_rounding_equals_full_sort(rounding, ties):
    T, E, k, tile = 300, 8, 2, 16
    logits = _logits(T, E, seed=5)
    if ties == "rounded":  # exact ties in the picks' scores and the non-picks' probabilities
        logits = (logits * 2).round() / 2
    elif ties == "repeated_rows":  # whole groups of tokens tie at every expert's boundary
        logits = logits[torch.arange(T) % 5]
    r = sonic.token_rounding_routing(logits, k, tile=tile, rounding=rounding)
    kept = torch.zeros(T, E, dtype=torch.bool)
    kept[r.token_idx.long(), r.expert_idx.long()] = True
    assert torch.equal(kept, _token_rounding_by_full_sort(logits, k, tile, rounding))
