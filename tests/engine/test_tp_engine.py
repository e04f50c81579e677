"""Tensor parallelism over two gloo ranks gives the single-process engine's outputs."""

from __future__ import annotations

from tests.engine import parallel_workload as workload

WEIGHTS_SEED = 11


def test_two_tensor_parallel_ranks_give_the_single_process_outputs(tmp_path):
    # each rank sums half the heads' and half the expert width's contributions, so the fp32 sums round
    # differently from one rank's: identical tokens, logprobs equal to ~1e-6
    workload.check_two_ranks_match_one(tmp_path, WEIGHTS_SEED, tensor_parallel_size=2)
