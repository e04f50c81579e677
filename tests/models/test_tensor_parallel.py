"""Tensor-parallel sharding: which slices a rank owns, and a loader that reads only those."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.config import ConfigError, ModelConfig
from deepinfer_core.models import tensor_parallel
from deepinfer_core.models.deepseek_v4.mtp import MultiTokenPredictor
from deepinfer_core.models.loading.checkpoint_files import SafetensorsReader
from deepinfer_core.models.loading.checkpoint_layout import meta_model, tensor_schema
from deepinfer_core.models.loading.mtp_weights import load_mtp_weights
from deepinfer_core.models.loading.weights import load_weights
from deepinfer_core.models.tensor_parallel import (
    Shard,
    mtp_tensor_shards,
    shard_config,
    shard_weights,
    tensor_shards,
)
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint

CONFIG = tiny_config("sliding_csa_hca", moe_intermediate_size=64, o_groups=4)


def test_shard_ranges_split_each_part_evenly():
    assert Shard(0, 1, 2).ranges(8) == [(4, 8)]
    assert Shard(1, 0, 2, parts=2).ranges(8) == [(0, 2), (4, 6)]  # gate rows [0, 4), up rows [4, 8)
    assert Shard(1, 1, 2, parts=2).ranges(8) == [(2, 4), (6, 8)]
    with pytest.raises(ConfigError, match="does not split"):
        Shard(0, 0, 3).ranges(8)


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_slices_tile_every_tensor_and_match_the_sharded_model(size):
    config = ModelConfig.from_dict(CONFIG)
    weights = random_state_dict(config)
    local_schema = tensor_schema(meta_model(shard_config(config, size)))
    slices = [shard_weights(weights, tensor_shards(weights, rank, size)) for rank in range(size)]
    for rank_weights in slices:
        assert {n: tuple(t.shape) for n, t in rank_weights.items()} == {n: s.shape for n, s in local_schema.items()}
    shards = tensor_shards(weights, 0, size)
    assert "model.layers.1.self_attn.kv_proj.weight" not in shards  # the one KV head: replicated
    assert "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight" not in shards
    for name, shard in shards.items():
        pieces = [slices[rank][name] for rank in range(size)]
        if shard.parts == 1:
            whole = torch.cat(pieces, dim=shard.dim)
        else:  # each rank holds a slice of the gate half then of the up half
            halves = [p.chunk(2, dim=shard.dim) for p in pieces]
            whole = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=shard.dim)
        assert torch.equal(whole, weights[name]), name


def test_the_mtp_layer_is_cut_like_a_target_layer():
    config = ModelConfig.from_dict(CONFIG)
    mtp = {n.removeprefix("mtp."): t for n, t in random_state_dict(config, mtp_layers=1).items() if n.startswith("mtp.")}
    with torch.device("meta"):
        local_schema = tensor_schema(MultiTokenPredictor(shard_config(config, 2), torch.float32))
    for rank in range(2):
        shards = mtp_tensor_shards(mtp, rank, 2)
        # the decoder layer's tensors get exactly a target layer's cuts
        as_target = tensor_shards([f"model.layers.3.{n.removeprefix('0.')}" for n in mtp], rank, 2)
        assert shards == {f"0.{n.removeprefix('model.layers.3.')}": s for n, s in as_target.items()}
        sliced = shard_weights(mtp, shards)
        assert {n: tuple(t.shape) for n, t in sliced.items()} == {n: s.shape for n, s in local_schema.items()}
    assert "0.self_attn.q_b_proj.weight" in shards and "0.mlp.experts.down_proj" in shards
    for replicated in ("0.e_proj.weight", "0.h_proj.weight", "0.enorm.weight", "0.hnorm.weight", "0.norm.weight",
                       "0.hc_head.hc_fn", "0.self_attn.kv_proj.weight", "0.mlp.gate.weight"):
        assert replicated in mtp and replicated not in shards, replicated


@pytest.mark.parametrize(("layout", "quant", "keep_fp4"), [("hf", None, False), ("official", "fp8+fp4", True)])
def test_a_rank_reads_exactly_its_slices_of_the_mtp_layer(tmp_path, layout, quant, keep_fp4):
    model_dir = write_checkpoint(tmp_path, CONFIG, random_state_dict(CONFIG, seed=3, mtp_layers=1), layout=layout,
                                 quant=quant)
    config = ModelConfig.from_dir(model_dir)
    whole = load_mtp_weights(model_dir, config, keep_fp4=keep_fp4)
    for rank in range(2):
        local = load_mtp_weights(model_dir, config, keep_fp4=keep_fp4, tp_rank=rank, tp_size=2)
        expected = shard_weights(whole, mtp_tensor_shards(whole, rank, 2))
        assert local.keys() == expected.keys()
        for name in expected:
            assert torch.equal(local[name].float(), expected[name].float()), name
    assert local["0.self_attn.q_b_proj.weight"].shape[0] * 2 == whole["0.self_attn.q_b_proj.weight"].shape[0]


def test_a_model_that_does_not_split_is_refused():
    config = ModelConfig.from_dict(CONFIG)
    with pytest.raises(ConfigError, match=r"o_groups \(2\) is not a multiple of tensor_parallel_size \(4\)"):
        tensor_parallel.check_tensor_parallel(config.model_copy(update={"o_groups": 2}), 4)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        shard_config(config, 3)


@pytest.mark.parametrize(("layout", "quant", "keep_fp4"), [
    ("hf", None, False), ("official", "fp8", False), ("transformers", "fp8", False),
    ("official", "fp8+fp4", False), ("official", "fp8+fp4", True),  # FP4 experts dequantised, or kept packed
])
def test_a_rank_loads_exactly_its_slices_of_the_whole_checkpoint(tmp_path, monkeypatch, layout, quant, keep_fp4):
    model_dir = write_checkpoint(tmp_path, CONFIG, layout=layout, quant=quant, seed=3)
    config = ModelConfig.from_dir(model_dir)
    whole = load_weights(model_dir, config, keep_fp4=keep_fp4)
    read_whole = []
    original = SafetensorsReader.read
    monkeypatch.setattr(SafetensorsReader, "read", lambda self, name: read_whole.append(name) or original(self, name))
    for rank in range(2):
        shards = tensor_shards(whole, rank, 2)
        local = load_weights(model_dir, config, keep_fp4=keep_fp4, shards=shards)
        expected = shard_weights(whole, shards)
        assert local.keys() == expected.keys()
        for name in expected:
            assert torch.equal(local[name].float(), expected[name].float()), name
    # the query projection (cut on FP8 block edges) and plain or FP4 experts are read in slices, never whole;
    # FP8 tensors cut inside a 128 x 128 scale block (this tiny model's experts) are read whole and cut after
    def is_sliced(name):
        is_routed_expert = ".experts." in name or name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        is_query = name.endswith(("attn.wq_b.weight", "self_attn.q_b_proj.weight")) and "indexer" not in name
        return is_query or (is_routed_expert and quant != "fp8")

    assert not [name for name in read_whole if is_sliced(name)]
