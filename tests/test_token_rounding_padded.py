"""Padded token rounding (no host read of P) against the exact routing and the full-sort oracle."""

import pytest
import torch

import sonic
from sonic.nn.moe import load_balancing_loss
from sonic.routing.metadata import pairs_metadata
from sonic.routing.token_rounding import capacity

from test_routing import _token_rounding_by_full_sort


def _logits(T, E, seed, dtype=torch.float32, ties=None):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    if ties == "rounded":            # exact ties among picks' scores and non-picks' probs
        logits = (logits * 2).round() / 2
    elif ties == "repeated_rows":    # whole groups of tokens tie at every expert's boundary
        logits = logits[torch.arange(T) % 5]
    return logits


def _check_padded(logits, k, tile, rounding):
    """The padded routing is the exact one followed by inert padding; returns both."""
    T, E = logits.shape
    exact = sonic.token_rounding_routing(logits, k, tile=tile, rounding=rounding)
    padded = sonic.token_rounding_routing(logits, k, tile=tile, rounding=rounding, padded=True)
    assert exact.num_valid is None and padded.num_valid.dim() == 0
    assert padded.num_pairs == capacity(T, E, k, tile, rounding) >= exact.num_pairs
    assert int(padded.num_valid) == exact.num_pairs
    trimmed = padded.trim()
    assert torch.equal(trimmed.token_idx, exact.token_idx)
    assert torch.equal(trimmed.expert_idx, exact.expert_idx)
    assert torch.equal(trimmed.scores, exact.scores)
    tail = slice(exact.num_pairs, None)
    assert torch.all(padded.expert_idx[tail] == E) and torch.all(padded.token_idx[tail] == 0)
    assert torch.all(padded.scores[tail] == 0)
    return exact, padded


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
@pytest.mark.parametrize("ties", [None, "rounded", "repeated_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padded_equals_exact_and_full_sort(rounding, ties, dtype):
    T, E, k, tile = 300, 8, 2, 16
    logits = _logits(T, E, seed=5, dtype=dtype, ties=ties)
    _, padded = _check_padded(logits, k, tile, rounding)
    trimmed = padded.trim()
    kept = torch.zeros(T, E, dtype=torch.bool)
    kept[trimmed.token_idx.long(), trimmed.expert_idx.long()] = True
    assert torch.equal(kept, _token_rounding_by_full_sort(logits.float(), k, tile, rounding))


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
@pytest.mark.parametrize("T,E,k,tile", [
    (1, 4, 2, 128),      # T = 1, tile larger than T
    (7, 1, 1, 4),        # E = 1
    (40, 6, 6, 8),       # K = E: every token picks every expert
    (50, 16, 1, 64),     # most experts empty or below half a tile
    (64, 5, 1, 1),       # tile 1: nothing to round
])
def test_padded_edge_cases(rounding, T, E, k, tile):
    logits = _logits(T, E, seed=T * E + k)
    if T > 1 and E > 1:
        logits[:, 0] += 8      # expert 0 takes every token
    _check_padded(logits, k, tile, rounding)


def test_padded_empty_batch():
    r = sonic.token_rounding_routing(torch.zeros(0, 4), 2, padded=True)
    assert r.num_pairs == 0 and int(r.num_valid) == 0 and r.trim().num_pairs == 0


def test_padded_metadata_puts_padding_after_the_routed_rows():
    T, E, k, tile = 200, 6, 2, 16
    exact, padded = _check_padded(_logits(T, E, seed=9), k, tile, "up")
    P = exact.num_pairs
    want = pairs_metadata(exact.token_idx, exact.expert_idx, T, E)
    for backend_meta in (sonic.routing_metadata(padded),
                         pairs_metadata(padded.token_idx, padded.expert_idx, T, E)):
        assert torch.equal(backend_meta.expert_counts, want.expert_counts)
        assert torch.equal(backend_meta.expert_offsets, want.expert_offsets)
        assert torch.equal(backend_meta.token_offsets, want.token_offsets)
        for name in ("sorted_pairs", "gather_idx", "pair_rows", "token_rows"):
            assert torch.equal(getattr(backend_meta, name)[:P], getattr(want, name)), name
        # Padding rows: valid indices past the routed rows, so index_select never faults.
        assert torch.equal(backend_meta.sorted_pairs[P:].sort().values,
                           torch.arange(P, padded.num_pairs, dtype=torch.int32))
        assert torch.all(backend_meta.gather_idx[P:] == 0)


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_padded_gradients_to_logits_equal_exact(rounding):
    logits = _logits(120, 6, seed=2, dtype=torch.float64, ties="rounded")
    grads = []
    for padded in (False, True):
        leaf = logits.clone().requires_grad_()
        r = sonic.token_rounding_routing(leaf, 2, tile=8, rounding=rounding, padded=padded)
        weights = torch.sin(torch.arange(r.num_pairs, dtype=torch.float64))
        # Padding gets any weight: its scores are constant 0.
        weights[r.num_pairs if r.num_valid is None else int(r.num_valid):] = float("nan")
        (r.scores * torch.nan_to_num(weights, nan=0.0)).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


def test_padded_gradcheck():
    logits = _logits(24, 4, seed=1, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda l: sonic.token_rounding_routing(l, 2, tile=4, padded=True).scores, (logits,))


def test_load_balancing_loss_ignores_padding():
    logits = _logits(90, 5, seed=4)
    exact, padded = _check_padded(logits, 2, 16, "up")
    assert torch.equal(load_balancing_loss(logits, padded), load_balancing_loss(logits, exact))


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_token_rounding_layer_step_equals_exact_routing(rounding):
    """A training step of a token-rounding MoE (padded routing inside) gives the outputs and
    gradients of the experts run on the exact routing."""
    torch.manual_seed(0)
    layer = sonic.MoE(16, 8, 6, 2, router="token_rounding", tile=8, rounding=rounding,
                      dtype=torch.float64)
    x = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    assert layer.last_routing.num_valid is not None
    grad = torch.randn_like(out)
    out.backward(grad)
    mine = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    x.grad = None
    layer.zero_grad()
    logits = layer.gate(x)
    r = sonic.token_rounding_routing(logits, 2, tile=8, rounding=rounding)
    ref = sonic.moe_experts(x, layer.w1, layer.w2, r.scores, r.token_idx, r.expert_idx)
    ref.backward(grad)
    theirs = [x.grad] + [p.grad for p in layer.parameters()]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_padded_routing_is_built_by_routers_only():
    idx = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_valid"):
        sonic.Routing(idx, idx, torch.zeros(3), 2, 2, num_valid=torch.tensor(1))
    with pytest.raises(ValueError, match="num_valid"):
        sonic.Routing(idx, idx, torch.zeros(3), 2, 2, validated=True, num_valid=torch.ones(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="padded"):
        sonic.token_rounding_routing(torch.zeros(3, 2), 1, padded=1)


def test_padding_rows_with_nan_give_no_nan_gradient(monkeypatch):
    """No GEMM writes a padded routing's padding rows (past ``expert_offsets[E]``), so they hold
    whatever memory held: poisoned with NaN here, the step stays finite under anomaly
    detection (the score gradients of padding rows are zeroed, not propagated)."""
    from sonic.reference import ops as reference

    plain = reference.grouped_mm

    def poisoned(a, b, offsets, gather_idx=None):
        out = plain(a, b, offsets, gather_idx)
        out[int(offsets[-1]):] = float("nan")
        return out

    monkeypatch.setattr(reference, "grouped_mm", poisoned)
    torch.manual_seed(0)
    layer = sonic.MoE(16, 8, 6, 2, router="token_rounding", tile=8, rounding="up",
                      dtype=torch.float64)
    x = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    with torch.autograd.set_detect_anomaly(True):
        out = layer(x)
        assert layer.last_routing.num_pairs > int(layer.last_routing.num_valid)  # padded
        out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(t).all() for t in [x.grad, *(p.grad for p in layer.parameters())])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_scores_differentiate_as_the_gathers(padded, dtype):
    """The selection kernel writes the kept pairs' scores itself; ``kept_scores`` gives them
    the gradients of :func:`scored_routing`'s gathers, to second order, padding none."""
    from sonic.routing import token_rounding as tr

    g = torch.Generator().manual_seed(3)
    T, E, k, tile = 96, 8, 2, 16
    logits = torch.randn(T, E, generator=g, dtype=dtype).requires_grad_()
    probs = logits.softmax(-1)
    tc = sonic.topk_routing(logits, k, backend="torch")
    keys, order, num_kept = tr._selection(tc.scores.detach(), tc.token_idx.long(),
                                          tc.expert_idx.long(), probs.detach(), tile, "up")
    size = keys.numel() if padded else int(num_kept)
    ref = tr.kept_routing(keys, order, num_kept if padded else size, tc.scores, probs,
                          capacity=size if padded else None)
    assert int(ref.num_pairs) > T * k                     # rounding up added pairs
    values = ref.scores.detach().clone()
    # The selection kernel's sources: a pick's top-K pair, an added pair's T·k + t·E + e,
    # padding's T·k + T·E.
    order, num_picks = order[:size], T * k
    added = num_picks + ref.token_idx.long() * E + ref.expert_idx.long()
    source = torch.where(ref.expert_idx < E, torch.where(order < num_picks, order, added),
                         num_picks + T * E)
    mine = tr.kept_scores(values, source, tc.scores, probs)
    torch.testing.assert_close(mine, ref.scores, rtol=0, atol=0)
    w = torch.randn(size, generator=g, dtype=dtype)
    first = [torch.autograd.grad((s * w).sum(), logits, create_graph=True, retain_graph=True)[0]
             for s in (mine, ref.scores)]
    torch.testing.assert_close(first[0], first[1], rtol=0, atol=1e-12)
    assert first[1].abs().max() > 0
    second = [torch.autograd.grad((f ** 2).sum(), logits, retain_graph=True)[0] for f in first]
    torch.testing.assert_close(second[0], second[1], rtol=0, atol=1e-12)
    with torch.no_grad():
        assert tr.kept_scores(values, source, tc.scores, probs) is values
