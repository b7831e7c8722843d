"""EPLB on one process: load statistics, the placement planner and the replica choice."""

import pytest
import torch

import sonic
from sonic.distributed import ExpertLoad, Placement, plan_placement

E, RANKS, SLOTS = 64, 8, 9


def _zipf(num_experts=E, s=1.2, seed=0):
    """Zipf-like per-expert load, hot experts at random indices (seeded)."""
    weights = 1 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    return weights[torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))]


def test_expert_load_counts_pairs_over_steps():
    load = ExpertLoad(6)
    routing = sonic.Routing(torch.tensor([0, 0, 1, 2]), torch.tensor([5, 1, 5, 5]),
                            torch.rand(4), num_tokens=3, num_experts=6)
    load.update(routing)
    load.update(torch.tensor([0, 1], dtype=torch.int32))
    assert load.counts().tolist() == [1, 2, 0, 0, 0, 3]
    assert load.steps == 2
    load.reset()
    assert load.counts().tolist() == [0] * 6
    with pytest.raises(ValueError, match="ExpertLoad counts 6"):
        load.update(sonic.Routing(torch.tensor([0]), torch.tensor([0]), torch.rand(1),
                                  num_tokens=1, num_experts=4))


def test_every_expert_placed_and_slots_respected():
    load = _zipf()
    placement = plan_placement(load, RANKS, SLOTS)
    assert placement.slot_expert.shape == (RANKS * SLOTS,)
    counts = placement.replica_counts()
    assert (counts >= 1).all() and counts.sum() == RANKS * SLOTS
    # Never two replicas of one expert on a rank (avoidable here).
    for r in range(RANKS):
        experts = placement.rank_experts(r).tolist()
        assert len(experts) == SLOTS and len(set(experts)) == SLOTS
    # The redundant slots went to the hottest experts.
    hottest = load.argsort(descending=True)
    assert counts[hottest[0]] == counts.max() > 1
    assert sorted(placement.replicas(int(hottest[0])))[0] >= 0


def test_deterministic():
    a, b = plan_placement(_zipf(), RANKS, SLOTS), plan_placement(_zipf(), RANKS, SLOTS)
    assert torch.equal(a.slot_expert, b.slot_expert)
    assert a.fingerprint() == b.fingerprint()


def test_skewed_load_max_over_mean_drops():
    """E=64, 8 ranks, 9 slots per rank (8 redundant), Zipf s=1.2 load at random experts:
    contiguous 2.577 → planned 1.001; with no redundant slot (8 per rank) 2.458, as the
    hottest expert alone carries 2.46× a rank's mean."""
    load = _zipf()
    before = Placement.contiguous(E, RANKS).max_over_mean(load)
    after = plan_placement(load, RANKS, SLOTS).max_over_mean(load)
    no_redundancy = plan_placement(load, RANKS, E // RANKS).max_over_mean(load)
    print(f"max/mean rank load: contiguous {before:.3f}, planned {after:.4f}, "
          f"planned without redundant slots {no_redundancy:.3f}")
    assert before == pytest.approx(2.577, abs=1e-3)
    assert after == pytest.approx(1.0007, abs=1e-4)
    assert no_redundancy == pytest.approx(2.458, abs=1e-3)


def test_skewed_routing_realised_rank_load():
    """The workflow on routed pairs: top-4 of 64 experts drawn from the Zipf load on 8 source
    ranks × 512 tokens, counted by :class:`ExpertLoad`; a plan from those counts; the pairs
    each rank would then receive (replicas chosen by :meth:`Placement.pair_slots`). The
    realised max/mean pairs per rank drops from 1.84 (contiguous) to 1.02 (1.002 expected)."""
    load = _zipf()
    g = torch.Generator().manual_seed(1)
    steps = [torch.multinomial(load.expand(512, -1), 4, generator=g).flatten()
             for _ in range(RANKS)]
    tokens = torch.arange(512).repeat_interleave(4)
    stats = ExpertLoad(E)
    for experts in steps:
        stats.update(experts)
    counts = stats.counts()
    placements = {"contiguous": Placement.contiguous(E, RANKS),
                  "planned": plan_placement(counts, RANKS, SLOTS)}
    ratio = {}
    for name, p in placements.items():
        received = torch.zeros(RANKS, dtype=torch.int64)
        for source, experts in enumerate(steps):
            slots = p.pair_slots(tokens, experts, source)
            received += torch.bincount(slots // p.slots_per_rank, minlength=RANKS)
        ratio[name] = (received.max() / received.float().mean()).item()
        # Expected (load split evenly over replicas) and realised agree closely.
        assert ratio[name] == pytest.approx(p.max_over_mean(counts), abs=0.03)
    print(f"realised max/mean pairs per rank: {ratio}")
    assert ratio["contiguous"] > 1.8 and ratio["planned"] < 1.05


def test_uniform_load_stays_balanced():
    uniform = torch.ones(E)
    assert plan_placement(uniform, RANKS, E // RANKS).max_over_mean(uniform) == 1.0
    assert plan_placement(uniform, RANKS, SLOTS).max_over_mean(uniform) == pytest.approx(1.0)
    assert Placement.contiguous(E, RANKS).max_over_mean(uniform) == 1.0


def test_replica_choice_splits_evenly():
    placement = Placement(torch.tensor([0, 1, 0, 2, 0, 1]), num_ranks=3, slots_per_rank=2,
                          num_experts=3)
    assert placement.replicas(0) == [0, 2, 4]
    tokens = torch.arange(30)
    slots = placement.pair_slots(tokens, torch.zeros(30, dtype=torch.long), source_rank=1)
    assert torch.bincount(slots, minlength=6).tolist() == [10, 0, 10, 0, 10, 0]
    slots = placement.pair_slots(tokens, torch.ones(30, dtype=torch.long), source_rank=0)
    assert torch.bincount(slots, minlength=6).tolist() == [0, 15, 0, 0, 0, 15]
    assert placement.pair_slots(tokens[:1], torch.tensor([2]), 0).tolist() == [3]


def test_more_slots_than_ranks_can_separate():
    # 2 experts, 2 ranks, 3 slots each: 4 redundant slots; each expert can have at most 2
    # replicas on distinct ranks, the rest must double up.
    placement = plan_placement(torch.tensor([3.0, 1.0]), 2, 3)
    assert placement.replica_counts().tolist() in ([4, 2], [3, 3])
    assert placement.replica_counts().sum() == 6


def test_validation_errors():
    with pytest.raises(ValueError, match="cannot hold all 64 experts"):
        plan_placement(torch.ones(64), 8, 7)
    with pytest.raises(ValueError, match="non-negative"):
        plan_placement(torch.tensor([1.0, -1.0]), 1, 2)
    with pytest.raises(ValueError, match="non-empty"):
        plan_placement(torch.tensor([]), 1, 2)
    with pytest.raises(ValueError, match="shape"):
        Placement(torch.tensor([0, 1, 2]), num_ranks=2, slots_per_rank=2, num_experts=3)
    with pytest.raises(ValueError, match="without a slot"):
        Placement(torch.tensor([0, 1, 1, 0]), num_ranks=2, slots_per_rank=2, num_experts=3)
    with pytest.raises(ValueError, match=r"in \[0, num_experts=2\)"):
        Placement(torch.tensor([0, 1, 2, 0]), num_ranks=2, slots_per_rank=2, num_experts=2)
    with pytest.raises(ValueError, match="cannot hold"):
        Placement(torch.tensor([0, 1]), num_ranks=1, slots_per_rank=2, num_experts=3)
    with pytest.raises(ValueError, match="divisible"):
        Placement.contiguous(6, 4)
    with pytest.raises(ValueError, match="4 entries"):
        Placement.contiguous(4, 2).rank_load(torch.ones(3))


def test_placement_tables_follow_edits_of_slot_expert():
    """The device tables are derived from ``slot_expert``: an edit of the caller's tensor
    does not reach the placement, and an in-place edit of the placement's own (``.data``
    included) is seen by the next dispatch."""
    mine = torch.tensor([0, 1, 2, 3, 0, 1])
    placement = Placement(mine, num_ranks=2, slots_per_rank=3, num_experts=4)
    counts, table = placement.tables("cpu")
    mine[4] = 3
    assert placement.slot_expert.tolist() == [0, 1, 2, 3, 0, 1]
    assert torch.equal(placement.tables("cpu")[0], counts)
    placement.slot_expert.data[4] = 3
    counts, table = placement.tables("cpu")
    assert counts.tolist() == [1, 2, 1, 2]
    assert table[3, :2].tolist() == [3, 4]
    slots = placement.pair_slots(torch.tensor([0, 1]), torch.tensor([3, 3]), source_rank=0)
    assert sorted(slots.tolist()) == [3, 4]


def test_expert_load_counts_a_token_rounding_layers_padded_routing():
    """A token-rounding layer leaves a padded routing (padding = expert E): update counts its
    routed pairs only, equal to the trimmed routing's counts."""
    torch.manual_seed(3)
    layer = sonic.MoE(16, 8, E, 2, router="token_rounding", tile=4, backend="torch")
    layer(torch.randn(37, 16))
    routing = layer.last_routing
    assert routing.num_valid is not None and int(routing.num_valid) < routing.expert_idx.numel()
    load = ExpertLoad(E)
    load.update(routing)
    load.update(routing.trim())
    want = torch.bincount(routing.trim().expert_idx.long(), minlength=E)
    assert torch.equal(load.counts(), 2 * want)
    assert load.counts().shape == (E,) and load.steps == 2
    load.reset()
    assert torch.equal(load.counts(), torch.zeros(E, dtype=torch.int64))


def test_plan_placement_refuses_a_2d_load_instead_of_flattening_it():
    load = torch.rand(3, E) + 0.1          # steps x experts
    with pytest.raises(ValueError, match=r"1-D .*got shape \(3, 64\).*sum the steps"):
        plan_placement(load, 2, E // 2)
    placement = plan_placement(load.sum(0), 2, E // 2 + 1)
    assert placement.num_experts == E


def test_load_errors_name_the_entry_and_the_condition():
    load = torch.rand(E, dtype=torch.float64) * 1e6
    assert plan_placement(load, 2, E // 2).num_experts == E       # finite float64: accepted
    assert plan_placement(load.numpy(), 2, E // 2).num_experts == E
    bad = load.clone()
    bad[5] = -2.5
    with pytest.raises(ValueError, match="non-negative: entry 5 is -2.5"):
        plan_placement(bad, 2, E // 2)
    bad[5] = float("nan")
    with pytest.raises(ValueError, match="finite: entry 5 is nan"):
        plan_placement(bad, 2, E // 2)
    with pytest.raises(TypeError, match="bool"):
        plan_placement(torch.ones(E, dtype=torch.bool), 2, E // 2)
