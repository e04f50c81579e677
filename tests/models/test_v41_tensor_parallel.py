"""DeepSeek-V4.1 under tensor parallelism: which tensors a rank cuts, and a loader that reads only its slices
(FP8 projections in whole scale blocks, FP4 experts as packed bytes). The engine's outputs under two ranks:
tests/engine/test_v41_tp_engine.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deepinfer_core.backends.parallel import GroupInfo, ParallelGroups
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_core.models.deepseek_v41.weights import load_v41_checkpoint
from deepinfer_core.models.layer_plan import with_expert_format
from deepinfer_core.models.loading.checkpoint_files import SafetensorsReader
from deepinfer_core.models.loading.checkpoint_layout import tensor_schema
from deepinfer_core.models.tensor_parallel import shard_config, shard_weights, tensor_shards
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint

CONFIG = tiny_v41_config(moe_intermediate_size=64)  # 32 FP4 inputs per rank's slice of w2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = write_v41_checkpoint(tmp_path_factory.mktemp("tiny-v41-tp"), CONFIG, seed=3)
    return directory, V41Config.from_dir(directory)


def local_schema(config: V41Config, size: int, fmt: str) -> dict:
    local = shard_config(config, size)
    plans = with_expert_format(DeepseekV41ForCausalLM.layer_plan(local, torch.float32), fmt)
    with torch.device("meta"):
        return tensor_schema(DeepseekV41ForCausalLM(local, plans, torch.float32))


@pytest.mark.parametrize("keep_fp4", [False, True])
def test_the_ranks_slices_tile_every_tensor_and_match_the_sharded_model(checkpoint, keep_fp4):
    directory, config = checkpoint
    whole = load_v41_checkpoint(directory, config, torch.float32, "cpu", keep_fp4=keep_fp4)
    schema = local_schema(config, 2, "fp4" if keep_fp4 else "dense")
    slices = [shard_weights(whole, tensor_shards(whole, rank, 2)) for rank in range(2)]
    for rank_weights in slices:
        assert {n: tuple(t.shape) for n, t in rank_weights.items()} == {n: s.shape for n, s in schema.items()}
    shards = tensor_shards(whole, 0, 2)
    for name, shard in shards.items():
        pieces = [slices[rank][name] for rank in range(2)]
        halves = [p.chunk(shard.parts, dim=shard.dim) for p in pieces]  # gate rows, then up rows
        rebuilt = torch.cat([h[part] for part in range(shard.parts) for h in halves], dim=shard.dim)
        assert torch.equal(rebuilt, whole[name]), name
    cut = {"attn.wq_b.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink", "ffn.experts.gate_up_proj",
           "ffn.experts.down_proj", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight"}
    assert {f"layers.5.{n}" for n in cut} <= shards.keys()
    # the router with its biases, Engram (tables too), the two-level indexer, the compressor, single-pass mHC
    # and the one KV head are replicated: every rank computes them whole (models/tensor_parallel_v41.py)
    replicated = ["layers.5.ffn.gate.weight", "layers.5.ffn.gate.bias", "layers.5.ffn.gate.bias_vl",
                  "layers.4.engram.embed.weight", "layers.4.engram.embed.scale", "layers.4.engram.wkv.weight",
                  "layers.7.attn.indexer.wq_b.weight", "layers.5.attn.indexer.weights_proj.weight",
                  "layers.5.attn.indexer.wk.weight", "layers.5.attn.compressor.wkv.weight", "layers.5.hc_attn_fn",
                  "layers.5.hc_ffn_base", "layers.5.attn.wq_a.weight", "layers.5.attn.wkv.weight", "embed.weight",
                  "head.weight"]
    for name in replicated:
        assert name in whole and name not in shards, name


@pytest.mark.parametrize("keep_fp4", [False, True])
def test_a_rank_reads_exactly_its_slices_of_the_checkpoint(checkpoint, monkeypatch, keep_fp4):
    directory, config = checkpoint
    whole = load_v41_checkpoint(directory, config, torch.float32, "cpu", keep_fp4=keep_fp4)
    read_whole = []
    original = SafetensorsReader.read
    monkeypatch.setattr(SafetensorsReader, "read", lambda self, name: read_whole.append(name) or original(self, name))
    for rank in range(2):
        shards = tensor_shards(whole, rank, 2)
        local = load_v41_checkpoint(directory, config, torch.float32, "cpu", keep_fp4=keep_fp4, shards=shards)
        expected = shard_weights(whole, shards)
        assert local.keys() == expected.keys()
        for name in expected:
            assert local[name].dtype == expected[name].dtype and torch.equal(local[name], expected[name]), name
    # every cut tensor is read in slices, never whole: the projections (their halves fall on 32 x 32
    # scale-block edges) with only their scale blocks, the FP4 experts as packed codes and scales
    cut = {name.removesuffix(".weight") for name in tensor_shards(whole, 0, 2)}
    assert not [n for n in read_whole if n.removesuffix(".weight").removesuffix(".scale") in cut or ".experts." in n]
    assert "layers.5.attn.indexer.wq_b.weight" in read_whole  # replicated: read whole


def test_an_expert_parallel_rank_reads_only_its_experts_in_slot_order(checkpoint, monkeypatch):
    directory, config = checkpoint
    whole = load_v41_checkpoint(directory, config, torch.float32, "cpu", keep_fp4=True)
    slots = {layer: [5, 2, 7] if layer % 2 else [0, 3, 3] for layer in range(config.num_hidden_layers)}
    read = []
    original = SafetensorsReader.read
    monkeypatch.setattr(SafetensorsReader, "read", lambda self, name: read.append(name) or original(self, name))
    local = load_v41_checkpoint(directory, config, torch.float32, "cpu", keep_fp4=True, local_experts=slots.__getitem__)
    for name, tensor in whole.items():
        parts = name.split(".")
        expected = tensor[slots[int(parts[1])]] if ".ffn.experts." in name else tensor
        assert torch.equal(local[name], expected), name
    assert {int(n.split(".")[4]) for n in read if n.startswith("layers.1.ffn.experts.")} == {2, 5, 7}


def test_in_memory_weights_are_cut_to_an_expert_parallel_ranks_slots(checkpoint):
    """Weights handed over in memory (V4.1's names) keep only the rank's expert slots, like V4's."""
    from deepinfer_core.backends.parallel import ParallelConfig
    from deepinfer_core.distributed.eplb_state import ExpertShards

    directory, config = checkpoint
    whole = load_v41_checkpoint(directory, config, torch.float32, "cpu")
    layout = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    experts = ExpertShards(layout, GroupInfo(None, 1, 2, (0, 1)), config.num_hidden_layers, config.n_routed_experts, "cpu")
    local = experts.select_local(whole)
    for name, tensor in whole.items():
        expected = tensor[4:] if ".ffn.experts." in name else tensor  # rank 1 of 2: experts 4..7
        assert torch.equal(local[name], expected), name


def test_the_model_builds_in_a_context_parallel_group(checkpoint):
    # context parallelism cuts no weight: every rank of the cp group holds the whole model (its steps are
    # split by the runner; tests/engine/test_v41_cp_engine.py)
    _, config = checkpoint
    parallel = replace(ParallelGroups.single(), cp=GroupInfo(None, 0, 2, (0, 1)))
    plans = DeepseekV41ForCausalLM.layer_plan(config, torch.float32)
    with torch.device("meta"):
        whole = DeepseekV41ForCausalLM(config, plans, torch.float32)
        split = DeepseekV41ForCausalLM(config, plans, torch.float32, parallel=parallel)
    assert {n: p.shape for n, p in split.named_parameters()} == {n: p.shape for n, p in whole.named_parameters()}
