"""ReferenceEplb: complete, even, deterministic placements that beat the naive layout."""

import pytest
import torch

from deepinfer_core.backends.eplb import EplbBackend, EplbSpec
from deepinfer_core.reference.eplb import ReferenceEplb


def make(num_layers=3, num_experts=16, num_slots=20, num_ranks=4):
    return ReferenceEplb(EplbSpec(num_layers, num_experts, num_slots, num_ranks), torch.device("cpu"))


def skewed_load(num_layers, num_experts, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Zipf-like: a few hot experts, a long cold tail, shuffled per layer.
    base = 1000.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
    return torch.stack([base[torch.randperm(num_experts, generator=generator)] for _ in range(num_layers)])


def rank_loads(placement, load, num_ranks):
    """Max-over-ranks load when each expert's load is split evenly over its replicas."""
    counts = torch.stack([torch.bincount(row, minlength=load.shape[1]) for row in placement])
    slot_loads = (load / counts).gather(1, placement)
    return slot_loads.view(placement.shape[0], num_ranks, -1).sum(-1)


def naive_placement(num_layers, num_experts, num_slots):
    row = [e % num_experts for e in range(num_slots)]
    return torch.tensor([row] * num_layers)


def test_satisfies_the_protocol():
    assert isinstance(make(), EplbBackend)


def test_every_expert_is_placed_and_slots_are_filled():
    eplb = make()
    placement = eplb.rebalance(skewed_load(3, 16))
    assert placement.shape == (3, 20) and placement.dtype == torch.int64
    for row in placement:
        assert set(row.tolist()) == set(range(16))


def test_surplus_slots_replicate_the_heaviest_experts():
    load = torch.tensor([[100.0, 1, 1, 1, 60, 1, 1, 1]])
    placement = make(1, 8, 10, 2).rebalance(load)
    counts = torch.bincount(placement[0], minlength=8)
    assert counts[0] == 2 and counts[4] == 2 and counts.sum() == 10


def test_balance_beats_the_naive_layout():
    load = skewed_load(4, 32, seed=3)
    eplb = make(4, 32, 40, 8)
    balanced = rank_loads(eplb.rebalance(load), load, 8).max(-1).values
    naive = rank_loads(naive_placement(4, 32, 40), load, 8).max(-1).values
    assert (balanced < naive).all()
    # Close to the ideal: the mean rank load, or the heaviest single replica if that is larger.
    ideal = torch.maximum(load.sum(-1) / 8, (load.max(-1).values / 2))
    assert (balanced <= ideal * 1.35).all()


def test_without_surplus_packing_alone_balances():
    load = torch.tensor([[8.0, 7, 6, 5, 4, 3, 2, 1]])
    placement = make(1, 8, 8, 2).rebalance(load)
    assert sorted(placement[0].tolist()) == list(range(8))
    assert rank_loads(placement, load, 2).tolist() == [[18.0, 18.0]]


def test_slots_are_sorted_by_expert_within_each_rank():
    placement = make(2, 16, 24, 4).rebalance(skewed_load(2, 16))
    for row in placement.view(2, 4, 6):
        for rank_slots in row:
            assert rank_slots.tolist() == sorted(rank_slots.tolist())


def test_deterministic_and_layers_are_independent():
    load = skewed_load(3, 16, seed=5)
    eplb = make()
    first = eplb.rebalance(load)
    assert torch.equal(first, eplb.rebalance(load.clone()))
    assert torch.equal(eplb.rebalance(load)[1], make(1, 16, 20, 4).rebalance(load[1:2])[0])


def test_integer_loads_are_accepted():
    placement = make(1, 4, 4, 2).rebalance(torch.tensor([[3, 1, 2, 2]]))
    assert rank_loads(placement, torch.tensor([[3.0, 1, 2, 2]]), 2).max() == 4


@pytest.mark.parametrize(
    ("num_slots", "num_ranks", "message"), [(15, 4, "below num_experts"), (18, 4, "evenly")]
)
def test_invalid_specs_raise(num_slots, num_ranks, message):
    with pytest.raises(ValueError, match=message):
        make(1, 16, num_slots, num_ranks)


def test_wrong_load_shape_raises():
    with pytest.raises(ValueError, match="load must be"):
        make().rebalance(torch.ones(2, 16))


def balance(placement, load, num_ranks):
    """Busiest rank / mean rank, per layer."""
    loads = rank_loads(placement, load, num_ranks)
    return loads.max(-1).values / loads.mean(-1)


def test_skewed_routing_reaches_ten_percent_of_the_mean_with_redundancy():
    load = skewed_load(4, 64, seed=1)
    naive = balance(naive_placement(4, 64, 64), load, 8)
    assert (naive > 1.5).all(), "the synthetic routing was meant to be badly skewed"
    assert (balance(make(4, 64, 64, 8).rebalance(load), load, 8) > 1.10).any()  # packing alone is not enough
    balanced = balance(make(4, 64, 80, 8).rebalance(load), load, 8)  # 16 redundant experts
    assert (balanced <= 1.10).all(), balanced


def test_hierarchical_placement_keeps_each_group_on_one_node():
    spec = EplbSpec(num_layers=2, num_experts=32, num_slots=40, num_ranks=8, num_nodes=2, num_groups=8)
    eplb = ReferenceEplb(spec, torch.device("cpu"))
    assert eplb.is_hierarchical
    load = skewed_load(2, 32, seed=7)
    placement = eplb.rebalance(load)
    for row in placement:
        assert set(row.tolist()) == set(range(32))
        nodes = row.view(2, 20)  # ranks 0-3 on node 0, 4-7 on node 1: 20 slots a node
        for group in range(8):
            members = set(range(group * 4, group * 4 + 4))
            on_node = [bool(members & set(node.tolist())) for node in nodes]
            assert sum(on_node) == 1, f"group {group} spans both nodes"
    assert (balance(placement, load, 8) < balance(naive_placement(2, 32, 40), load, 8)).all()
    assert not ReferenceEplb(EplbSpec(1, 32, 40, 8, num_nodes=2, num_groups=1), "cpu").is_hierarchical
