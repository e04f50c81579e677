"""DSpark through the engine (`speculative_config={"method": "dspark", ...}`): greedy and seeded outputs
equal those without speculation (chunked prefill, preemption, a prefix hit with replay, async scheduling,
structured output), and a forced-correct drafter (the target's own tokens as drafts) has every draft
accepted and leaves the caches as a run that never drafted, bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.sampling_params import StructuredOutputsParams
from deepinfer_core.testing.serving import serve
from tests.models.test_v41_dspark import attach
from tests.models.v41_helpers import dspark_checkpoint, make_engine, random_prompt

K = 3  # drafts a step (at most the block size, 5)


def spec(policy: str = "fixed") -> dict:
    return {"method": "dspark", "num_speculative_tokens": K, "draft_length_policy": policy}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return dspark_checkpoint(tmp_path_factory)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_and_seeded_outputs_equal_no_speculation_with_chunks_preemption_and_async(checkpoint):
    prompts = [random_prompt(n, seed=n) for n in (118, 121, 124, 126)]  # every request crosses a block edge
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, seed=4, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 93, "num_kv_blocks": 5}
    plain = serve(make_engine(*checkpoint, **options), prompts, params)
    engine = make_engine(*checkpoint, speculative_config=spec(), async_scheduling=True, **options)
    assert token_ids(serve(engine, prompts, params)) == token_ids(plain)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_verified_tokens"] > 0, stats


def test_outputs_equal_no_speculation_after_a_prefix_hit_and_under_a_grammar(checkpoint):
    shared = random_prompt(128, seed=42)
    first, second = shared + [9, 9], shared + random_prompt(6, seed=43)
    params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{2}")),
              SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)]
    options = {"max_num_seqs": 2, "num_kv_blocks": 6, "enable_prefix_caching": True}
    results = []
    for speculative_config in (None, spec()):
        engine = make_engine(*checkpoint, speculative_config=speculative_config, **options)
        results.append([token_ids(serve(engine, [first], params[1])), token_ids(serve(engine, [second, first], params))])
        assert engine.stats()["prefix_cache_hit_tokens"] > 0 and engine.stats()["prefix_cache_replay_tokens"] > 0
    assert results[1] == results[0]
    assert engine.stats()["spec_verified_tokens"] > 0


def test_a_forced_correct_drafter_accepts_every_draft_and_leaves_the_caches_bit_for_bit(checkpoint):
    prompts = [random_prompt(n, seed=n) for n in (9, 17)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # deterministic mode: a verification step computes each row bit for bit as a decode step does
    options = {"max_num_seqs": 2, "num_kv_blocks": 4, "deterministic": True}
    never = make_engine(*checkpoint, **options)
    attach(never, checkpoint[0], k=K)  # its windows filled, its drafts never verified
    want = token_ids(serve(never, prompts, params))
    future = {str(i): p + w for i, (p, w) in enumerate(zip(prompts, want))}
    engine = make_engine(*checkpoint, speculative_config=spec(), **options)
    drafter = engine.runner.mtp
    drafted = drafter._draft

    def forced(plan, states, sampled, anchors):
        drafted(plan, states, sampled, anchors)  # the block still runs; its drafts are replaced
        return [(future[plan.requests[i].request_id][p + 2 : p + 2 + K], [0.0] * K) for i, p in sampled]

    drafter._draft = forced
    assert token_ids(serve(engine, prompts, params)) == want
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_verified_tokens"] >= 8
    for mine, theirs in zip(drafter.rings, never.runner.mtp.drafter.rings, strict=True):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(engine.runner.kv_cache.layers, never.runner.kv_cache.layers, strict=True):
        assert torch.equal(mine.window, theirs.window)
