"""`deepinfer plan`: its per-rank numbers equal what the engine loads and allocates, and its verdict and exit
status follow from them."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from deepinfer_core.backends.parallel import GroupInfo, ParallelConfig, ParallelGroups
from deepinfer_core.cli import main
from deepinfer_core.config import CheckpointError, EngineConfig
from deepinfer_core.entrypoints.sizing import (
    STEP_PEAK_NOTE,
    Budget,
    Layout,
    bytes_by_kind,
    plan_deployment,
    safetensors_dtypes,
)
from deepinfer_core.kv.cache import KVCache
from deepinfer_core.models import registry
from deepinfer_core.models.tiny import random_state_dict, tiny_config, write_checkpoint
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
from deepinfer_core.worker.model_loader import load_model
from deepinfer_core.worker.runner import ModelRunner

EXAMPLES = Path(__file__).parent.parent / "examples" / "configs"
V4_LAYOUTS = [Layout(), Layout(tensor_parallel_size=2), Layout(data_parallel_size=2, enable_expert_parallel=True)]


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    """A tiny V4 checkpoint stored as DeepSeek releases it: FP8 projections, packed FP4 experts (official
    names); expert width 64 so that a tensor-parallel half is still whole FP4 groups."""
    return write_checkpoint(tmp_path_factory.mktemp("v4"), tiny_config(moe_intermediate_size=64), layout="official",
                            quant="fp8+fp4", seed=1)


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    """A tiny V4.1 checkpoint as released (FP8, FP4 experts, Engram); expert width 64 for whole FP4 halves."""
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41"), tiny_v41_config(moe_intermediate_size=64), seed=2)


def rank_groups(layout: Layout, rank: int) -> ParallelGroups:
    """Rank `rank`'s groups without torch.distributed: loading a rank's weights runs no collective, so each
    rank of the layout is loaded here, in this process, by the engine's own `load_model`."""
    config = ParallelConfig(tensor_parallel_size=layout.tensor_parallel_size,
                            data_parallel_size=layout.data_parallel_size,
                            enable_expert_parallel=layout.enable_expert_parallel)
    world, one = tuple(range(config.world_size)), GroupInfo(None, 0, 1, (rank,))
    tp = GroupInfo(None, rank % layout.tensor_parallel_size, layout.tensor_parallel_size, world)
    dp = GroupInfo(None, rank // layout.tensor_parallel_size, layout.data_parallel_size, world)
    ep = GroupInfo(None, rank, config.world_size, world) if layout.enable_expert_parallel else one
    return ParallelGroups(config, rank, tp, one, dp, ep)


def engine_load(model_dir: Path, layout: Layout, rank: int, **options):
    """Rank `rank`'s `load_model`, alone: the one collective of a load, joining the ranks' weight digests
    into the cache fingerprint, is left out (the rank's own digest stands for it; sizes do not depend on it)."""
    from unittest import mock

    from deepinfer_core.worker import model_loader

    config = registry.load_model_config(model_dir)
    engine_config = EngineConfig(model=str(model_dir), dtype="bfloat16", max_num_seqs=4, num_kv_blocks=8,
                                 **options).resolve(config)
    parallel = rank_groups(layout, rank)
    with mock.patch.object(model_loader, "_weights_identity", lambda digest, groups: digest.digest()):
        return load_model(config, engine_config, torch.device("cpu"), parallel=parallel)


@pytest.mark.parametrize("layout", V4_LAYOUTS, ids=["one-rank", "tp2", "dp2-ep2"])
def test_v4_plan_weight_bytes_equal_what_each_rank_loads(v4_dir, layout):
    plan = plan_deployment(v4_dir, layout, Budget(1.0, 512), dtype=torch.bfloat16)
    assert plan.runnable and len(plan.ranks) == layout.world_size
    for rank in range(layout.world_size):
        state = engine_load(v4_dir, layout, rank).model.state_dict()
        assert plan.ranks[rank].device_bytes == bytes_by_kind(state.items())
        assert plan.ranks[rank].host_bytes == dict.fromkeys(plan.ranks[rank].host_bytes, 0)
    if layout.world_size == 1:  # the projections the checkpoint stores in FP8 stay FP8 on the rank
        assert any(t.dtype == torch.float8_e4m3fn for t in state.values())


def test_v4_plan_of_dequantised_weights_equals_what_the_rank_loads(v4_dir):
    plan = plan_deployment(v4_dir, Layout(), Budget(1.0, 512, quantized_weights="dequantize"), dtype=torch.bfloat16)
    state = engine_load(v4_dir, Layout(), 0, quantized_weights="dequantize").model.state_dict()
    assert plan.ranks[0].device_bytes == bytes_by_kind(state.items())
    assert not any(t.dtype in (torch.float8_e4m3fn, torch.int8) for t in state.values())


def test_v4_plan_from_the_config_alone_equals_the_plan_beside_the_checkpoint(v4_dir, tmp_path):
    shutil.copy(v4_dir / "config.json", tmp_path / "v4.json")
    for layout in V4_LAYOUTS:
        alone = plan_deployment(tmp_path / "v4.json", layout, Budget(1.0, 512), dtype=torch.bfloat16)
        beside = plan_deployment(v4_dir, layout, Budget(1.0, 512), dtype=torch.bfloat16)
        assert [r.device_bytes for r in alone.ranks] == [r.device_bytes for r in beside.ranks]


def test_the_mtp_layer_counts_what_the_drafter_loads(tmp_path):
    config_dict = tiny_config(moe_intermediate_size=64)
    weights = random_state_dict(config_dict, seed=1, mtp_layers=1)
    model_dir = write_checkpoint(tmp_path / "mtp", config_dict, weights, layout="official", quant="fp8+fp4")
    config = registry.load_model_config(model_dir)
    engine_config = EngineConfig(model=str(model_dir), dtype="bfloat16", max_num_seqs=4, num_kv_blocks=8,
                                 speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    module = ModelRunner(config, engine_config.resolve(config), torch.device("cpu")).mtp.module
    loaded = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    shutil.copy(model_dir / "config.json", tmp_path / "alone.json")
    for model in (model_dir, tmp_path / "alone.json"):  # FP8 from the headers, or as the release stores it
        plan = plan_deployment(model, Layout(), Budget(1.0, 512, mtp=True), dtype=torch.bfloat16)
        assert plan.ranks[0].device_bytes["mtp"] == loaded
    without = plan_deployment(model_dir, Layout(), Budget(1.0, 512), dtype=torch.bfloat16)
    assert without.ranks[0].device_bytes["mtp"] == 0 and any("--mtp" in note for note in without.notes)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_v41_plan_weight_bytes_equal_what_the_engine_loads(v41_dir, placement):
    plan = plan_deployment(v41_dir, Layout(), Budget(1.0, 512, engram_placement=placement), dtype=torch.bfloat16)
    loaded = engine_load(v41_dir, Layout(), 0, engram_placement=placement)
    state = loaded.model.state_dict()
    host_names = type(loaded.model).host_weight_names(state, placement)
    rank = plan.ranks[0]
    assert rank.device_bytes == bytes_by_kind((n, t) for n, t in state.items() if n not in host_names)
    assert rank.host_bytes == bytes_by_kind((n, t) for n, t in state.items() if n in host_names)
    assert (rank.host_bytes["engram"] > 0) == (placement == "host")
    assert state["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn  # the FP8 projections stay FP8


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_kv_bytes_equal_the_engines_cache_layout(v4_dir, v41_dir, family):
    """The cache the engine allocates grows by the plan's bytes per block with each block, and by its
    bytes per request slot with each slot."""
    model_dir = v4_dir if family == "v4" else v41_dir
    rank = plan_deployment(model_dir, Layout(), Budget(1.0, 512), dtype=torch.bfloat16).ranks[0]
    plans = engine_load(model_dir, Layout(), 0).plans

    def allocated(blocks, slots):
        return sum(s.tensor.numel() * s.tensor.element_size()
                   for s in KVCache(plans, blocks, slots, torch.bfloat16, torch.device("cpu")).stacks)

    assert allocated(9, 4) - allocated(8, 4) == rank.kv_bytes_per_block
    assert allocated(8, 5) - allocated(8, 4) == rank.kv_bytes_per_slot
    assert rank.kv_bytes_per_request == 4 * rank.kv_bytes_per_block + rank.kv_bytes_per_slot  # 512 tokens


def test_concurrency_and_shortfall_follow_the_memory(v4_dir):
    roomy = plan_deployment(v4_dir, Layout(), Budget(1.0, 512), dtype=torch.bfloat16)
    assert roomy.fits and roomy.ranks[0].concurrent_requests == 256  # capped by max_num_seqs
    weights = roomy.ranks[0].device_weight_bytes
    tight = plan_deployment(v4_dir, Layout(), Budget(weights / 2**30, 512), dtype=torch.bfloat16)
    rank = tight.ranks[0]
    assert not tight.fits and rank.concurrent_requests == 0
    needed = (256 * rank.kv_bytes_per_slot + 4 * rank.kv_bytes_per_block) / 0.9
    assert rank.shortfall_bytes == pytest.approx(needed, abs=1)


def test_json_output_and_exit_status(v4_dir, capsys):
    assert main(["plan", str(v4_dir), "--data-parallel-size", "2", "--enable-expert-parallel",
                 "--gpu-memory-gib", "1", "--max-model-len", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["runnable"] and len(out["ranks"]) == 2
    assert {"attention_bytes", "routed_expert_bytes", "engram_bytes", "kv_bytes_per_token", "fits"} <= set(out["ranks"][0])
    assert STEP_PEAK_NOTE in out["notes"]  # the start-up profile's peak is not in the plan, and it says so
    assert main(["plan", str(v4_dir), "--gpu-memory-gib", "0.0001", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and out["ranks"][0]["shortfall_bytes"] > 0


def test_a_layout_this_build_refuses_is_sized_and_marked_not_runnable(v41_dir, capsys):
    # tensor with expert parallelism is refused for every family
    assert main(["plan", str(v41_dir), "-tp", "2", "--enable-expert-parallel", "--gpu-memory-gib", "80"]) == 1
    text = capsys.readouterr().out
    assert "NOT RUNNABLE IN THIS BUILD" in text and "sharding rules" in text
    assert "would fit" in text and "this build does not run the layout" in text
    refused = plan_deployment(v41_dir, Layout(tensor_parallel_size=2, enable_expert_parallel=True), Budget(80, 512),
                              dtype=torch.bfloat16)
    assert not refused.runnable and refused.would_fit and not refused.fits  # sized, and never claimed to run
    whole = plan_deployment(v41_dir, Layout(), Budget(80, 512), dtype=torch.bfloat16).ranks[0].device_bytes
    ep = plan_deployment(v41_dir, Layout(data_parallel_size=2, enable_expert_parallel=True), Budget(80, 512),
                         dtype=torch.bfloat16)
    assert ep.runnable and ep.fits
    assert ep.ranks[1].device_bytes["routed_expert"] * 2 == whole["routed_expert"]
    assert ep.ranks[1].device_bytes["engram"] == whole["engram"]  # replicated


def test_a_hostile_safetensors_header_length_is_refused_before_reading(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(CheckpointError, match="no readable safetensors header"):
        safetensors_dtypes(tmp_path)


def test_the_example_configs_are_the_release_values():
    from tests.models.test_v41_config import RELEASE

    assert json.loads((EXAMPLES / "deepseek-v4.1-flash" / "config.json").read_text()) == RELEASE
    v4 = registry.load_model_config(EXAMPLES / "deepseek-v4-flash")
    assert (v4.num_hidden_layers, v4.n_routed_experts, v4.expert_dtype) == (43, 256, "fp4")
    assert v4.layer_types[:4] == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                  "heavily_compressed_attention"]


def test_v41_plan_under_tensor_parallelism_and_from_the_config_alone_equals_what_each_rank_loads(v41_dir, tmp_path):
    """Cut FP8 projections are loaded dequantised, whole ones stay FP8 (as V4's); without a checkpoint the
    release's FP8 tensors are assumed, which is what the tiny checkpoint stores."""
    tp2 = Layout(tensor_parallel_size=2)
    plan = plan_deployment(v41_dir, tp2, Budget(1.0, 512), dtype=torch.bfloat16)
    assert plan.runnable
    for rank in range(tp2.world_size):
        state = engine_load(v41_dir, tp2, rank).model.state_dict()
        assert plan.ranks[rank].device_bytes == bytes_by_kind(state.items())
    assert state["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn  # replicated: whole, FP8
    assert state["layers.0.attn.wq_b.weight"].dtype == torch.bfloat16  # cut by heads: dequantised
    shutil.copy(v41_dir / "config.json", tmp_path / "v41.json")
    for layout in (Layout(), tp2):
        alone = plan_deployment(tmp_path / "v41.json", layout, Budget(1.0, 512), dtype=torch.bfloat16)
        beside = plan_deployment(v41_dir, layout, Budget(1.0, 512), dtype=torch.bfloat16)
        assert [r.device_bytes for r in alone.ranks] == [r.device_bytes for r in beside.ranks]


def test_bad_input_is_one_plain_sentence(v4_dir, tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing.json")]) == 1
    assert "is neither a checkpoint directory nor a config.json file" in capsys.readouterr().err
    assert main(["plan", str(v4_dir), "--tensor-parallel-size", "8"]) == 1  # 4 heads do not split over 8
    assert "tensor_parallel_size=8 does not fit the model" in capsys.readouterr().err


def test_the_dspark_drafter_counts_what_it_loads(tmp_path):
    """V4.1's `--mtp` counts the DSpark stages as the drafter holds them (FP8 kept, FP4 packed), and
    refuses the layouts the drafter does not run under."""
    from deepinfer_core.models.v41_tiny import tiny_v41_dspark_config

    model_dir = write_v41_checkpoint(tmp_path / "dspark", tiny_v41_dspark_config(), seed=5)
    config = registry.load_model_config(model_dir)
    engine_config = EngineConfig(model=str(model_dir), dtype="bfloat16", max_num_seqs=4, num_kv_blocks=8,
                                 quantized_weights="native",
                                 speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    module = ModelRunner(config, engine_config.resolve(config), torch.device("cpu")).mtp.module
    # its own weights; `module.target` is the target model, shared
    loaded = sum(t.numel() * t.element_size() for n, t in module.state_dict().items() if n.startswith("mtp."))
    plan = plan_deployment(model_dir, Layout(data_parallel_size=2), Budget(1.0, 512, mtp=True), dtype=torch.bfloat16)
    assert loaded and plan.ranks[0].device_bytes["mtp"] == loaded
    assert module.state_dict()["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    without = plan_deployment(model_dir, Layout(), Budget(1.0, 512), dtype=torch.bfloat16)
    assert without.ranks[0].device_bytes["mtp"] == 0 and any("--mtp" in note for note in without.notes)
    with pytest.raises(ValueError, match="data parallelism only"):
        plan_deployment(model_dir, Layout(data_parallel_size=2, enable_expert_parallel=True),
                        Budget(1.0, 512, mtp=True), dtype=torch.bfloat16)
