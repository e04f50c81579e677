"""The parallel layout: options validated, ranks laid out as vLLM does, groups built over gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.backends.parallel import EplbConfig, ParallelConfig, ParallelGroups, build_groups
from deepinfer_core.config import EngineConfig
from tests.oracle import parity_config, write_config


def test_world_and_ep_sizes_follow_vllm():
    layout = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, enable_expert_parallel=True)
    assert layout.world_size == 8 and layout.ep_size == 8
    assert ParallelConfig(data_parallel_size=4).ep_size == 1  # without EP every rank holds every expert
    assert [layout.coordinates(r) for r in (0, 1, 2, 7)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (3, 0, 1)]
    assert layout.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.group_ranks("ep") == [list(range(8))]
    cp = ParallelConfig(tensor_parallel_size=2, context_parallel_size=2, data_parallel_size=2)
    assert cp.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert cp.dp_leader(1) == 4


def test_bad_combinations_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        ParallelConfig(enable_eplb=True)
    with pytest.raises(ValueError, match="num_redundant_experts needs enable_eplb"):
        ParallelConfig(enable_expert_parallel=True, eplb_config=EplbConfig(num_redundant_experts=2))
    with pytest.raises(ValueError):
        EplbConfig(step_interval=0)


def test_engine_config_parses_the_vllm_options(tmp_path):
    write_config(tmp_path, parity_config("hca128"))
    config = EngineConfig(model=str(tmp_path), data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                          eplb_config={"num_redundant_experts": 2, "window_size": 10, "step_interval": 5})
    layout = config.parallel_config
    assert layout.world_size == 2 and layout.ep_size == 2 and config.num_ranks == 2
    assert layout.eplb_config == EplbConfig(num_redundant_experts=2, window_size=10, step_interval=5)
    with pytest.raises(ValueError, match="world_size=3 does not match"):
        EngineConfig(model=str(tmp_path), data_parallel_size=2, world_size=3)
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        EngineConfig(model=str(tmp_path), enable_eplb=True)


def test_a_single_rank_has_every_group_to_itself():
    groups = ParallelGroups.single()
    assert all(info.size == 1 and info.rank == 0 and info.group is None for info in (groups.tp, groups.dp, groups.ep))
    with pytest.raises(ValueError, match="world of 1 rank"):
        ParallelGroups.single(ParallelConfig(data_parallel_size=2))


def _group_sums(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        layout = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
        groups = build_groups(layout, rank, timeout_s=60)
        sums = {}
        for kind in ("tp", "dp", "ep", "cp"):
            info = getattr(groups, kind)
            value = torch.tensor([rank])
            dist.all_reduce(value, group=info.group)
            sums[kind] = (int(value), info.rank, info.size, info.ranks)
        results[rank] = sums
    finally:
        dist.destroy_process_group()


def test_groups_built_on_four_gloo_ranks_reduce_over_the_right_ranks():
    from deepinfer_core.executor.mp import _free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_group_sums, args=(4, _free_port(), results), nprocs=4, join=True)
        results = dict(results)
    # ranks: (dp, tp) = (0,0) (0,1) (1,0) (1,1)
    assert results[0]["tp"] == (0 + 1, 0, 2, (0, 1))
    assert results[3]["tp"] == (2 + 3, 1, 2, (2, 3))
    assert results[1]["dp"] == (1 + 3, 0, 2, (1, 3))
    assert results[2]["ep"] == (0 + 1 + 2 + 3, 2, 4, (0, 1, 2, 3))
    assert results[2]["cp"] == (2, 0, 1, (2,))


def test_v41_context_parallelism_with_decoder_trimming_is_refused_before_any_rank_starts(tmp_path):
    """DeepSeek-V4.1 splits a prefill under context parallelism, but not with decoder-side trimming (which
    keeps each request's last prompt rows, while a rank holds only pieces): that is refused by the layout
    checks, naming both, not by the model inside a worker after the ranks started."""
    import json

    from deepinfer_core.engine.data_parallel import build_engine
    from deepinfer_core.models.v41_tiny import tiny_v41_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_v41_config()))
    with pytest.raises(NotImplementedError, match=r"^context parallelism with decoder-side trimming: "
                       r"context_parallel_size=2 with decoder_trimming"):
        build_engine(EngineConfig(model=str(tmp_path), context_parallel_size=2, decoder_trimming=True,
                                  distributed_executor_backend="mp"))


def test_layouts_not_built_yet_are_refused_by_key(tmp_path):
    with pytest.raises(NotImplementedError, match="^tensor and expert parallelism together: tensor_parallel_size=2"):
        ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True).check_implemented()
    with pytest.raises(NotImplementedError, match="^context parallelism with other parallelism: context_parallel_size=2"):
        ParallelConfig(context_parallel_size=2, data_parallel_size=2).check_implemented()
    from deepinfer_core.engine.data_parallel import build_engine

    write_config(tmp_path, parity_config("hca128"))
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(NotImplementedError, match="^context parallelism with speculative decoding: context_parallel_size=2"):
        build_engine(EngineConfig(model=str(tmp_path), context_parallel_size=2, speculative_config=spec))
