"""Context parallelism over two gloo ranks gives the single-process engine's outputs."""

from __future__ import annotations

from tests.engine import parallel_workload as workload

WEIGHTS_SEED = 11


def test_two_context_parallel_ranks_give_the_single_process_outputs(tmp_path):
    # the pieces' hidden states round differently from one rank's batch (see test_cp_cache): identical
    # tokens, greedy and seeded-sampled, and logprobs equal to ~1e-6
    workload.check_two_ranks_match_one(tmp_path, WEIGHTS_SEED, context_parallel_size=2)
