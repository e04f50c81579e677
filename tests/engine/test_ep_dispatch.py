"""Expert-parallel MoE: all-to-all dispatch over 2 gloo ranks gives the single-process layer's output
(top-k and hash routing, replicas, a rank with no tokens, slots the ranks do not divide), and counts
load per slot.

Across ranks the outputs agree to a float32 ulp, not bit for bit: each expert's rows run in a batched
matmul with other rows than in the single-process layer, and MKL's batched matmul is not invariant to
the batch it runs in (seen: 6e-8 between batches of 9 and 10 rows). In a process of its own the
dispatch keeps every batch as it was, and the output is bit for bit the same."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.backends.moe import ExpertPlacement, MoESpec, MoEWeights, ep_slot_share
from deepinfer_core.distributed.eplb_state import placement_maps
from deepinfer_core.executor.mp import _free_port
from deepinfer_core.reference.moe import ReferenceMoE
from deepinfer_core.reference.moe_dispatch import choose_slots

E, H, I, K, VOCAB = 6, 16, 8, 2, 50
SLOTS = [0, 1, 2, 3, 4, 5, 0, 3]  # experts 0 and 3 have a replica each; 4 slots a rank
UNEVEN = [0, 1, 2, 3, 4, 5, 2]  # 7 slots over 2 ranks: rank 0 holds 4 (0, 1, 2, 3), rank 1 three (4, 5, 2)


def layer(is_hash: bool) -> tuple[MoESpec, MoEWeights]:
    g = torch.Generator().manual_seed(3)
    spec = MoESpec(H, I, E, K, "sqrtsoftplus", 1.5, 7.0, is_hash=is_hash)
    weights = MoEWeights(
        router=torch.randn(E, H, generator=g), gate_up=torch.randn(E, 2 * I, H, generator=g) * 0.3,
        down=torch.randn(E, H, I, generator=g) * 0.3, score_bias=None if is_hash else torch.randn(E, generator=g),
        tid2eid=torch.randint(0, E, (VOCAB, K), generator=g) if is_hash else None)
    return spec, weights


def tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    num = (7, 0)[rank]  # rank 1 has nothing to do: its dummy step still joins the collectives
    return torch.randn(num, H, generator=g), torch.randint(0, VOCAB, (num,), generator=g)


def local_layer(spec, weights, rank, group, size, layout=SLOTS):
    from dataclasses import replace

    slots = torch.tensor(layout)
    first, count = ep_slot_share(len(layout), size, rank)
    mine = slots[first : first + count]
    expert_slots, counts = placement_maps(slots, E, 3)
    placement = ExpertPlacement(group, rank, size, count, slots, expert_slots, counts,
                                torch.zeros(len(layout), dtype=torch.int64))
    ep_spec = replace(spec, expert_parallel=True, ep_size=size, ep_rank=rank, num_slots=len(layout))
    assert ep_spec.num_local_slots == count
    return ep_spec, replace(weights, gate_up=weights.gate_up[mine], down=weights.down[mine], placement=placement)


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = {}
        for is_hash, layout in ((False, SLOTS), (True, SLOTS), ("uneven", UNEVEN)):
            spec, weights = layer(is_hash is True)
            ep_spec, ep_weights = local_layer(spec, weights, rank, dist.group.WORLD, 2, layout)
            x, ids = tokens(rank)
            if is_hash == "uneven":  # both ranks send tokens (top-k routing), to rank 0's 4 slots and rank 1's 3
                x = torch.randn(5, H, generator=torch.Generator().manual_seed(rank))
                ids = torch.zeros(5, dtype=torch.long)
            y = ReferenceMoE(ep_spec, torch.device("cpu")).forward(x, ids, ep_weights)
            expected = ReferenceMoE(spec, torch.device("cpu")).forward(x, ids, weights)  # in this process
            out[is_hash] = (y, ep_weights.placement.slot_load.clone(), expected)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_the_single_process_layer():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), results), nprocs=2, join=True)
        results = dict(results)
    for is_hash in (False, True):
        got, load, expected = results[0][is_hash]
        assert got.shape == (7, H) and (got - expected).abs().max() <= 1e-6 * expected.abs().max()
        assert not torch.equal(got, torch.zeros_like(got))
        assert results[1][is_hash][0].shape == (0, H)
        # every assignment of rank 0's 7 tokens counted once, on the slot it was sent to
        assert int(load.sum()) == 7 * K and int(results[1][is_hash][1].sum()) == 0
    for rank in (0, 1):  # 7 slots over 2 ranks (4 and 3): each rank's 5 tokens get the single layer's output
        got, load, expected = results[rank]["uneven"]
        assert got.shape == (5, H) and (got - expected).abs().max() <= 1e-6 * expected.abs().max()
        assert int(load.sum()) == 5 * K


@pytest.mark.parametrize("num_slots", [1, 2, 7, 9, 16, 33])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_slots_split_as_vllm_does_and_every_slot_has_one_owner(num_slots, size):
    shares = [ep_slot_share(num_slots, size, rank) for rank in range(size)]
    counts = [count for _, count in shares]
    assert sum(counts) == num_slots and max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    placement = ExpertPlacement(None, 0, size, counts[0], torch.zeros(num_slots, dtype=torch.int64),
                                torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
                                torch.zeros(num_slots, dtype=torch.int64))
    ranks, local = placement.slot_owners(torch.arange(num_slots))
    expected = [(rank, i) for rank, (_, count) in enumerate(shares) for i in range(count)]
    assert list(zip(ranks.tolist(), local.tolist())) == expected
    assert ep_slot_share(9, 2, 0) == (0, 5) and ep_slot_share(9, 2, 1) == (5, 4)  # vLLM: 9 experts -> 5 + 4


def test_a_placement_sized_against_the_split_is_refused():
    with pytest.raises(ValueError, match="EP rank 1 of 2 holds 3 of the 7 expert slots, not 4"):
        ExpertPlacement(None, 1, 2, 4, torch.tensor(UNEVEN), torch.zeros(E, 1, dtype=torch.int64),
                        torch.ones(E, dtype=torch.int64), torch.zeros(7, dtype=torch.int64))


def test_a_process_of_its_own_dispatches_locally_bit_for_bit_and_replicas_share_the_load():
    spec, weights = layer(False)
    ep_spec, ep_weights = local_layer(spec, weights, 0, None, 1)
    x, ids = torch.randn(40, H), torch.zeros(40, dtype=torch.long)
    expected = ReferenceMoE(spec, torch.device("cpu")).forward(x, ids, weights)
    assert torch.equal(ReferenceMoE(ep_spec, torch.device("cpu")).forward(x, ids, ep_weights), expected)
    hot = torch.zeros(10, K, dtype=torch.long)  # every assignment to expert 0: slots 0 and 6 alternate
    slots = choose_slots(hot, ep_weights.placement)
    assert sorted(set(slots.flatten().tolist())) == [0, 6]
    assert (slots == 0).sum() == (slots == 6).sum() == 10
