"""DeepSeek-V4.1 under context parallelism over two gloo ranks gives the single-process engine's outputs.

Every prefill step is cut into four pieces, two a rank (`distributed/context_parallel.py`); each rank runs
the whole model over its pieces. What a piece needs from tokens another rank computed is exchanged per
layer: the window keys (`ContextParallelAttention`), the V4.1 compressor's open-group rows and the entries
and index keys every rank closed (`SplitStepExchange`, so the two-level indexer's reindex and reuse layers
read every entry), and the Engram token ids the n-gram look-back reads. The single-pass mHC and the MoE
are per token, so each rank runs them on its own rows.
"""

from __future__ import annotations

import pytest

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.executor.mp import MultiprocExecutor
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
from tests.engine.parallel_workload import assert_same_outputs, run_batch
from tests.models.v41_helpers import random_prompt

# chunked prefill (a 32-token budget, so pieces start mid-group and mid-window) through the ratio-2 and
# ratio-1 compressors, the candidate blocks and both Engram layers, then decode (run whole on each rank);
# request 1 greedy, request 0 seeded sampling (`run_batch`). With a window of 8 and pieces of 3 to 8
# tokens, a piece's window reaches back over other ranks' pieces and the previous step's ring; ratio-2
# groups straddle pieces that start at odd positions; 3 candidate blocks of 2 entries restrict the picks.
# Then a prompt sharing the first one's first 128-token block: a prefix-cache hit, its bounded replay
# and the split steps after it.
LENGTHS, MAX_TOKENS = [150, 19], [3, 4]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("tiny-v41-cp"), tiny_v41_config(), seed=7)


def outputs(directory, **options):
    engine = Engine(EngineConfig(model=str(directory), dtype="float32", max_num_seqs=2, num_kv_blocks=6,
                                 max_num_batched_tokens=32, enable_prefix_caching=True,
                                 quantized_weights="dequantize", **options))
    try:
        if options.get("context_parallel_size", 1) > 1:
            assert isinstance(engine.executor, MultiprocExecutor) and engine.executor.world_size == 2
        prompts = [random_prompt(n, seed=n) for n in LENGTHS]
        done = run_batch(engine, prompts, MAX_TOKENS, "a")
        done |= run_batch(engine, [prompts[0][:140] + random_prompt(25, seed=3)], [3], "b")
        return done, engine.stats()
    finally:
        engine.shutdown()


def test_two_context_parallel_ranks_give_the_single_process_tokens_and_logprobs(checkpoint):
    (want, _), (got, stats) = outputs(checkpoint), outputs(checkpoint, context_parallel_size=2)
    # the pieces' hidden states reach the entries through attention batched differently: logprobs to 1e-5
    assert_same_outputs(got, want, logprob_tol=1e-5)
    assert [len(want[f"a{i}"][0]) for i in range(len(LENGTHS))] == MAX_TOKENS
    assert stats["prefix_cache_hit_tokens"] == 128 and stats["prefix_cache_replay_tokens"] > 0
