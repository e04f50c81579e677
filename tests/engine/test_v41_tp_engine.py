"""DeepSeek-V4.1 under tensor parallelism over two gloo ranks gives the single-process engine's outputs.

Each rank reads only its slices of the tiny official-layout checkpoint (FP8 projections, FP4 experts),
holds half the query heads, output groups and expert width, and computes the router (`bias`), Engram,
the two-level indexer and the single-pass mHC whole (`models/tensor_parallel_v41.py`).
"""

from __future__ import annotations

import pytest

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.executor.mp import MultiprocExecutor
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
from tests.engine.parallel_workload import assert_same_outputs, run_batch
from tests.models.v41_helpers import random_prompt

# FP4 experts cut in two need a width of whole 32-input scale groups per rank: 64, not the tiny 32
TP_CONFIG = tiny_v41_config(moe_intermediate_size=64)
# chunked prefill through the ratio-2 and ratio-1 compressors, the candidate blocks and both Engram
# layers, then decode; request 1 greedy, request 0 seeded sampling (`run_batch`)
LENGTHS, MAX_TOKENS = [40, 19], [3, 4]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("tiny-v41-tp"), TP_CONFIG, seed=7)


def outputs(directory, **options):
    # the FP4 experts are read as packed byte slices and expanded once at load (not per step: faster)
    engine = Engine(EngineConfig(model=str(directory), dtype="float32", max_num_seqs=2, num_kv_blocks=4,
                                 max_num_batched_tokens=32, quantized_weights="dequantize", **options))
    try:
        if options.get("tensor_parallel_size", 1) > 1:
            assert isinstance(engine.executor, MultiprocExecutor) and engine.executor.world_size == 2
        prompts = [random_prompt(n, seed=n) for n in LENGTHS]
        return run_batch(engine, prompts, MAX_TOKENS, "r")
    finally:
        engine.shutdown()


def test_two_tensor_parallel_ranks_give_the_single_process_tokens_and_logprobs(checkpoint):
    want = outputs(checkpoint)
    got = outputs(checkpoint, tensor_parallel_size=2)
    # split sums of heads and expert width round differently from one rank's: logprobs to 1e-5
    assert_same_outputs(got, want, logprob_tol=1e-5)
    assert [len(want[f"r{i}"][0]) for i in range(len(LENGTHS))] == MAX_TOKENS
