"""Tensor parallelism over two gloo ranks gives the single-process engine's outputs."""

from __future__ import annotations

from deepinfer_core.engine.executor import MultiprocExecutor
from tests.engine import parallel_workload as workload
from tests.oracle import random_state_dict

WEIGHTS_SEED = 11


def test_two_tensor_parallel_ranks_give_the_single_process_outputs(tmp_path):
    want, want_stats = workload.single_process_outputs(WEIGHTS_SEED)
    assert want_stats["num_preemptions"] > 0 and want_stats["prefix_cache_hit_tokens"] >= 2 * 256
    engine = workload.make_engine(tmp_path, random_state_dict(workload.CONFIG, seed=WEIGHTS_SEED),
                                  tensor_parallel_size=2)
    try:
        assert isinstance(engine.executor, MultiprocExecutor) and engine.executor.world_size == 2
        got, stats = workload.generate(engine)
    finally:
        engine.shutdown()
    assert (stats["num_preemptions"], stats["prefix_cache_hit_tokens"]) == (
        want_stats["num_preemptions"], want_stats["prefix_cache_hit_tokens"])
    # each rank sums half the heads' and half the expert width's contributions, so the fp32 sums round
    # differently from one rank's: identical tokens, logprobs equal to ~1e-6
    workload.assert_same_outputs(got, want, logprob_tol=1e-5)

