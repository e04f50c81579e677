"""DeepSeek-V4.1 under data and expert parallelism (DP2 + EP2, EPLB moving experts mid-run) over gloo
ranks gives the single-process engine's outputs.

Each rank reads only its expert slots of the tiny official-layout checkpoint; the router (`gate.weight`,
`bias`) runs whole on every rank, and each MoE layer sends each token to its experts' ranks and back
(`all_to_all_single`). Data-parallel ranks batch their own requests, so logprobs agree to 1e-5.
"""

from __future__ import annotations

import pytest

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.data_parallel import DataParallelEngine, build_engine
from tests.engine.parallel_workload import assert_same_outputs, run_batch
from tests.models.v41_helpers import random_prompt, tiny_checkpoint

LENGTHS, MAX_TOKENS = [40, 19, 27], [4, 5, 3]
EPLB = {"enable_eplb": True, "eplb_config": {"num_redundant_experts": 2, "window_size": 4, "step_interval": 3}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)[0]


def outputs(directory, **options):
    engine = build_engine(EngineConfig(model=str(directory), dtype="float32", max_num_seqs=2, num_kv_blocks=4,
                                       max_num_batched_tokens=32, quantized_weights="dequantize", worker_timeout_s=120,
                                       **options))
    try:
        done = run_batch(engine, [random_prompt(n, seed=n) for n in LENGTHS], MAX_TOKENS, "r")
        return done, engine, engine.stats()
    finally:
        engine.shutdown()


def test_two_dp_ranks_with_experts_over_both_give_the_single_process_outputs_through_rebalances(checkpoint):
    want, single, _ = outputs(checkpoint)
    got, engine, stats = outputs(checkpoint, data_parallel_size=2, enable_expert_parallel=True, **EPLB)
    assert isinstance(engine, DataParallelEngine)
    assert_same_outputs(got, want, logprob_tol=1e-5)
    named = dict(single.runner.model.named_parameters())
    full = sum(t.numel() * t.element_size() for t in (*named.values(), *single.runner.model.buffers()))
    experts = sum(t.numel() * t.element_size() for name, t in named.items() if ".ffn.experts." in name)
    for rank in stats["rank_memory"]:  # 5 of the 8 experts' bytes a rank: (8 + 2 redundant) slots / 2 ranks
        assert rank["weights_bytes"] == full - experts + experts * 5 // 8
    assert all(r["num_prefill_tokens"] > 0 for r in stats["data_parallel"]), "the front end kept one rank idle"
    assert stats["eplb"]["num_rebalances"] >= 1  # experts moved between the ranks mid-generation
