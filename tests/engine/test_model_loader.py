"""The runner's build phases (`worker.model_loader`) and its persistent batch (`worker.input_batch`), on
their own: cache sizing from the config or host memory, and the per-request bookkeeping of step plans."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends.parallel import ParallelGroups
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.kv.cache import bytes_per_block
from deepinfer_core.models.layer_plan import BLOCK_SIZE, build_layer_plan
from deepinfer_core.plan import NewRequest, ScheduledRequest, StepPlan
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.worker import model_loader
from deepinfer_core.worker.input_batch import InputBatch
from tests.oracle import parity_config, write_config

RAW = parity_config("hca128")
CONFIG = ModelConfig.from_dict(RAW)
PLANS = build_layer_plan(CONFIG, torch.float32)
CPU = torch.device("cpu")


def test_cache_size_is_the_configured_one_or_what_host_memory_allows(tmp_path, monkeypatch):
    write_config(tmp_path, RAW)

    def engine_config(**options) -> EngineConfig:
        return EngineConfig(model=str(tmp_path), dtype="float32", max_num_seqs=4, max_model_len=1024, **options)

    assert model_loader.available_blocks(PLANS, torch.float32, CPU, engine_config(num_kv_blocks=7)) == 7
    wanted = 4 * 1024 // BLOCK_SIZE  # every slot at full length
    monkeypatch.setattr(model_loader, "_host_memory", lambda: 2**40)
    assert model_loader.available_blocks(PLANS, torch.float32, CPU, engine_config()) == wanted
    per_block = bytes_per_block(PLANS, torch.float32)
    monkeypatch.setattr(model_loader, "_host_memory", lambda: 40 * per_block)  # a quarter of half of it
    assert model_loader.available_blocks(PLANS, torch.float32, CPU, engine_config(gpu_memory_utilization=0.5)) == 5
    monkeypatch.setattr(model_loader, "_host_memory", lambda: per_block)
    with pytest.raises(MemoryError, match="lower max_num_seqs or set num_kv_blocks"):
        model_loader.available_blocks(PLANS, torch.float32, CPU, engine_config())


def test_input_batch_keeps_each_requests_state_from_the_plans():
    batch = InputBatch(None, CONFIG, PLANS, ParallelGroups.single(), CPU)
    assert batch.compress_rates == {p.compress_rate for p in PLANS if p.compress_rate}
    params = SamplingParams(repetition_penalty=1.2)  # the plan sends the ids of requests whose sampling reads them
    new = NewRequest("a", 2, (5,), 3, params, 11, token_ids=(1, 2, 3))
    first = StepPlan((ScheduledRequest("a", 0, (1, 2, 3), True),), new_requests=(new,))
    (state,) = batch.update_states(first)
    assert (state.slot, state.block_table, state.seed, state.token_ids) == (2, [5], 11, [1, 2, 3])
    second = StepPlan((ScheduledRequest("a", 3, (9,), True, new_block_ids=(6,)),))
    assert batch.update_states(second) == [state] and state.block_table == [5, 6] and state.token_ids == [1, 2, 3, 9]
    with pytest.raises(RuntimeError, match="holds no state for"):
        batch.update_states(StepPlan((ScheduledRequest("b", 0, (1,), True),)))
    batch.update_states(StepPlan((), freed_request_ids=("a",)))
    assert batch.requests == {}


def test_every_rank_keys_its_cache_by_the_digests_of_all_ranks(monkeypatch):
    """Under TP or EP each rank reads only its slices and experts: the fingerprint joins every rank's digest
    in rank order, so the ranks agree and a change in any rank's bytes changes every rank's key."""
    import torch.distributed as dist

    from deepinfer_core.backends.parallel import GroupInfo, ParallelConfig
    from deepinfer_core.models.loading.weight_digest import WeightDigest

    def digest_of(value: float) -> WeightDigest:
        digest = WeightDigest()
        digest.add("w", torch.full((4,), value))
        return digest

    config = ParallelConfig(tensor_parallel_size=2)
    one = GroupInfo(None, 0, 1)
    gathered = {}

    def all_gather_object(out, own):  # rank 0's view of a two-rank gather
        out[:] = [own, gathered["other"]]

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    groups = ParallelGroups(config, 0, one, one, one, one)
    gathered["other"] = digest_of(2.0).digest()
    joint = model_loader._weights_identity(digest_of(1.0), groups)
    assert joint != digest_of(1.0).digest()
    gathered["other"] = digest_of(3.0).digest()  # only rank 1's slice differs
    assert model_loader._weights_identity(digest_of(1.0), groups) != joint
    assert model_loader._weights_identity(digest_of(1.0), ParallelGroups.single()) == digest_of(1.0).digest()
