"""Expert-parallel MoE: all-to-all dispatch over 2 gloo ranks gives the single-process layer's output
(top-k and hash routing, replicas, a rank with no tokens), and counts load per slot.

Across ranks the outputs agree to a float32 ulp, not bit for bit: each expert's rows run in a batched
matmul with other rows than in the single-process layer, and MKL's batched matmul is not invariant to
the batch it runs in (seen: 6e-8 between batches of 9 and 10 rows). In a process of its own the
dispatch keeps every batch as it was, and the output is bit for bit the same."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.backends.moe import ExpertPlacement, MoESpec, MoEWeights
from deepinfer_core.distributed.eplb_state import placement_maps
from deepinfer_core.executor.mp import _free_port
from deepinfer_core.reference.moe import ReferenceMoE
from deepinfer_core.reference.moe_dispatch import choose_slots

E, H, I, K, VOCAB = 6, 16, 8, 2, 50
SLOTS = [0, 1, 2, 3, 4, 5, 0, 3]  # experts 0 and 3 have a replica each; 4 slots a rank


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


def local_layer(spec, weights, rank, group, size):
    slots = torch.tensor(SLOTS)
    per_rank = len(SLOTS) // size
    mine = slots[rank * per_rank : (rank + 1) * per_rank]
    expert_slots, counts = placement_maps(slots, E, 3)
    placement = ExpertPlacement(group, rank, size, per_rank, slots, expert_slots, counts,
                                torch.zeros(len(SLOTS), dtype=torch.int64))
    from dataclasses import replace
    return (replace(spec, expert_parallel=True, ep_size=size, num_slots=len(SLOTS)),
            replace(weights, gate_up=weights.gate_up[mine], down=weights.down[mine], placement=placement))


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = {}
        for is_hash in (False, True):
            spec, weights = layer(is_hash)
            ep_spec, ep_weights = local_layer(spec, weights, rank, dist.group.WORLD, 2)
            x, ids = tokens(rank)
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
