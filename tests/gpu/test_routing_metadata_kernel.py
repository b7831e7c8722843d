"""GPU routing-metadata kernels against the PyTorch reference (every field, exactly)."""

import pytest
import torch

from sonic.routing.metadata import RoutingMetadata, pairs_metadata

from kernel_checks import poison_allocator, require_kernels

pytestmark = pytest.mark.gpu

FIELDS = ("expert_counts", "expert_offsets", "sorted_pairs", "gather_idx", "pair_rows",
          "token_offsets", "token_rows")


@pytest.fixture(autouse=True)
def _needs_kernels():
    require_kernels()


def _assert_same(got: RoutingMetadata, ref: RoutingMetadata):
    assert (got.num_tokens, got.num_experts) == (ref.num_tokens, ref.num_experts)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == torch.int32, name
        assert torch.equal(a, b.to(torch.int32)), name


def _topk_experts(t, k, e, mode, gen):
    if mode == "one_expert":
        return torch.full((t, k), e - 1, dtype=torch.int32)
    if mode == "empty_experts":  # only every third expert is used
        e_used = max(1, e // 3)
        pick = torch.rand(t, e_used, generator=gen).argsort(dim=1)[:, :k] * 3
        return pick.to(torch.int32)
    return torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)


@pytest.mark.parametrize("t,k,e,mode", [
    (1, 1, 1, "random"), (1, 8, 128, "random"), (1000, 8, 128, "random"),
    (4097, 16, 512, "random"), (4097, 1, 64, "random"), (3000, 1, 1, "random"),
    (3000, 8, 64, "one_expert"), (2048, 4, 256, "empty_experts"), (24576, 8, 128, "random"),
])
def test_topk_matches_reference(t, k, e, mode):
    from sonic.kernels.routing_metadata import routing_metadata_topk

    gen = torch.Generator().manual_seed(t * 7 + k * 13 + e)
    if mode == "one_expert":
        k = 1 if k > e else k
    experts = _topk_experts(t, min(k, e), e, mode, gen)
    if mode == "one_expert":
        experts = torch.full((t, k), e - 1, dtype=torch.int32)
    experts = experts.cuda()
    tokens = torch.arange(t, dtype=torch.int32, device="cuda").repeat_interleave(experts.shape[1])
    ref = pairs_metadata(tokens, experts.reshape(-1), t, e)
    poison_allocator(64 << 20)
    first = routing_metadata_topk(experts, e)
    _assert_same(first, ref)
    poison_allocator(64 << 20)
    second = routing_metadata_topk(experts, e)
    for name in FIELDS:
        assert torch.equal(getattr(first, name), getattr(second, name)), name


def _random_pairs(t, e, p, mode, gen):
    tokens = torch.randint(0, max(t, 1), (p,), generator=gen, dtype=torch.int32)
    experts = torch.randint(0, e, (p,), generator=gen, dtype=torch.int32)
    if mode == "one_expert":
        experts.fill_(e // 2)
    elif mode == "empty_tokens":  # tokens of the upper half get no pair
        tokens = tokens % max(t // 2, 1)
    elif mode == "expert_major":  # token-rounding style order: grouped by expert
        order = torch.argsort(experts * t + tokens)
        tokens, experts = tokens[order], experts[order]
    elif mode == "padded":  # a padded routing: its last pairs are padding (expert E)
        experts[p - p // 5:] = e
    return tokens, experts


@pytest.mark.parametrize("t,e,p,mode", [
    (1, 1, 1, "random"), (1, 8, 5, "random"), (1000, 128, 7919, "random"),
    (4097, 512, 40000, "random"), (4097, 64, 30000, "one_expert"),
    (3000, 256, 12345, "empty_tokens"), (5000, 64, 40000, "expert_major"), (10, 4, 0, "random"),
    # The token scan's boundaries: one token; a tile of SCAN_TILE = 8192 tokens, just below,
    # at (an extra CTA writes only token_offsets[T]) and just above; several tiles; many tiles
    # with half the tokens empty; the benchmark's size in token-rounding (expert-major) order.
    (1, 16, 3000, "random"), (8191, 128, 30000, "random"), (8192, 128, 30000, "random"),
    (8193, 64, 30001, "expert_major"), (16384, 128, 131072, "random"),
    (40000, 32, 2049, "random"), (200000, 128, 150000, "empty_tokens"),
    (32768, 128, 262144, "expert_major"),
    # Padding pairs: rows after expert_offsets[E], which also close token_rows.
    (3000, 64, 12345, "padded"), (1, 8, 5, "padded"), (8193, 512, 40000, "padded"),
])
def test_pairs_matches_reference(t, e, p, mode):
    from sonic.kernels.routing_metadata import routing_metadata_pairs

    gen = torch.Generator().manual_seed(t + e + p)
    tokens, experts = _random_pairs(t, e, p, mode, gen)
    tokens, experts = tokens.cuda(), experts.cuda()
    ref = pairs_metadata(tokens, experts, t, e)
    poison_allocator(64 << 20)
    first = routing_metadata_pairs(tokens, experts, t, e)
    _assert_same(first, ref)
    poison_allocator(64 << 20)
    second = routing_metadata_pairs(tokens, experts, t, e)
    for name in FIELDS:
        assert torch.equal(getattr(first, name), getattr(second, name)), name


def test_inputs_not_modified_and_validated():
    from sonic.kernels.routing_metadata import routing_metadata_pairs, routing_metadata_topk

    experts = torch.randint(0, 16, (100, 4), dtype=torch.int32, device="cuda")
    before = experts.clone()
    routing_metadata_topk(experts, 16)
    assert torch.equal(experts, before)
    with pytest.raises(ValueError, match="contiguous"):
        routing_metadata_topk(experts.t(), 16)
    with pytest.raises(ValueError, match="num_experts"):
        routing_metadata_topk(experts, 0)
    with pytest.raises(ValueError, match="same length"):
        routing_metadata_pairs(experts[0], experts[1, :3], 100, 16)
