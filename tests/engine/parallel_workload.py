"""One workload for the parallel layouts' tests: a single-process engine and a sharded one must agree on it.

Chunked prefill (a 96-token budget), preemption (a pool too small for the batch), prefix-cache hits (a
second round re-sends 256-token prefixes of the first), greedy and seeded-sampled requests, prompts
from 3 tokens to several compression windows (CSA 4, HCA 128) long.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.executor.mp import MultiprocExecutor
from deepinfer_core.testing.serving import serve
from tests.oracle import parity_config, random_state_dict, write_config

CONFIG = parity_config("hca128")
LENGTHS, MAX_TOKENS = [3, 118, 200, 300, 129], [6, 10, 6, 8, 4]
Outputs = dict[str, tuple[list[int], list[float]]]


def make_engine(directory, weights, **options) -> Engine:
    write_config(directory, CONFIG)
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 96, "num_kv_blocks": 7, "enable_prefix_caching": True,
               **options}
    return Engine(EngineConfig(model=str(directory), dtype="float32", **options), weights=weights)


def prompts(lengths=LENGTHS, seed=0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


def run_batch(engine: Engine, batch: list[list[int]], max_tokens: list[int], tag: str) -> Outputs:
    """Every prompt with its own `max_tokens` (odd ones greedy, even ones seeded at temperature 0.8); the
    tokens and chosen logprobs by request id (`tag` + index)."""
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=n, ignore_eos=True, logprobs=0)
              for i, n in enumerate(max_tokens)]
    done = {}
    for out in serve(engine, batch, params, [f"{tag}{i}" for i in range(len(batch))]):
        completion = out.outputs[0]
        done[out.request_id] = (completion.token_ids,
                                [e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids)])
    return done


def generate(engine: Engine) -> tuple[Outputs, dict]:
    """Both rounds' outputs (request id -> tokens, their logprobs) and the engine's counters."""
    first = prompts()
    done = run_batch(engine, first, MAX_TOKENS, "a")
    shared = [first[3][:256] + tail for tail in prompts([40, 7], seed=1)]  # two cached blocks, then new tokens
    done |= run_batch(engine, shared, [5, 5], "b")
    return done, engine.stats()


@functools.cache
def single_process_outputs(weights_seed: int) -> tuple[Outputs, dict]:
    """The single-process engine's outputs on the workload (computed once per test session)."""
    with tempfile.TemporaryDirectory() as directory:
        engine = make_engine(Path(directory), random_state_dict(CONFIG, seed=weights_seed))
        return generate(engine)


def assert_same_outputs(got: Outputs, want: Outputs, logprob_tol: float) -> None:
    """Identical tokens (greedy and seeded sampling alike); logprobs equal to within `logprob_tol`."""
    assert got.keys() == want.keys()
    for request_id, (tokens, logprobs) in want.items():
        assert got[request_id][0] == tokens, request_id
        assert torch.allclose(torch.tensor(got[request_id][1]), torch.tensor(logprobs), rtol=0, atol=logprob_tol), (
            request_id, got[request_id][1], logprobs)


def check_two_ranks_match_one(directory, weights_seed: int, **layout) -> None:
    """The workload on a two-rank `layout` (e.g. `tensor_parallel_size=2`) gives the single-process
    engine's tokens, with the same preemptions and prefix hits. Split sums round differently from one
    rank's, so logprobs are compared to 1e-5 (they differ by ~1e-6)."""
    want, want_stats = single_process_outputs(weights_seed)
    assert want_stats["num_preemptions"] > 0 and want_stats["prefix_cache_hit_tokens"] >= 2 * 256
    engine = make_engine(directory, random_state_dict(CONFIG, seed=weights_seed), **layout)
    try:
        assert isinstance(engine.executor, MultiprocExecutor) and engine.executor.world_size == 2
        got, stats = generate(engine)
    finally:
        engine.shutdown()
    assert (stats["num_preemptions"], stats["prefix_cache_hit_tokens"]) == (
        want_stats["num_preemptions"], want_stats["prefix_cache_hit_tokens"])
    assert_same_outputs(got, want, logprob_tol=1e-5)
