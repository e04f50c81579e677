"""Expert shards on each EP rank: vLLM's uneven split without EPLB, and EPLB's even split refused with the fix."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends.parallel import GroupInfo, ParallelConfig
from deepinfer_core.config.model import ModelConfig
from deepinfer_core.distributed.eplb_state import ExpertShards
from deepinfer_core.models.layer_plan import build_layer_plan
from deepinfer_core.models.tiny import tiny_config

CPU = torch.device("cpu")


def shards(rank: int, num_experts: int, **layout) -> ExpertShards:
    config = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, **layout)
    return ExpertShards(config, GroupInfo(None, rank, 2, (0, 1)), 2, num_experts, CPU)


def test_nine_experts_split_five_and_four_over_two_ranks():
    first, second = shards(0, 9), shards(1, 9)
    assert (first.local_experts(1), second.local_experts(1)) == ([0, 1, 2, 3, 4], [5, 6, 7, 8])
    assert [p.num_local_slots for p in (*first.placements, *second.placements)] == [5, 5, 4, 4]
    plans = build_layer_plan(ModelConfig.from_dict(tiny_config(n_routed_experts=9)), torch.float32)
    assert {p.moe.num_local_slots for p in second.plans(plans)} == {4}
    assert {p.moe.num_local_slots for p in first.plans(plans)} == {5}
    whole = torch.arange(9 * 3).view(9, 3)
    cut = second.select_local({"model.layers.1.mlp.experts.down_proj": whole, "model.norm.weight": whole})
    assert torch.equal(cut["model.layers.1.mlp.experts.down_proj"], whole[5:])
    assert torch.equal(cut["model.norm.weight"], whole)


def test_eplb_needs_an_even_split_and_says_which_redundant_count_gives_one():
    with pytest.raises(ValueError, match=r"with enable_eplb=True the 11 expert slots \(n_routed_experts 9 \+ "
                       r"eplb_config.num_redundant_experts 2\) must split evenly over the 2 EP ranks.*"
                       r"num_redundant_experts to 3, or turn EPLB off"):
        shards(0, 9, enable_eplb=True, eplb_config={"num_redundant_experts": 2})
    assert shards(1, 9, enable_eplb=True, eplb_config={"num_redundant_experts": 3}).num_local_slots == 6
