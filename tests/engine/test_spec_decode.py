"""Speculative decoding end to end on the reference backend (fp32, CPU): output identical to decoding
without speculation for every drafter, k and policy, over batches, preemption and prefix hits."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.testing.serving import serve
from tests.oracle import parity_config, random_state_dict, write_config

CONFIG = parity_config("sliding_csa_hca")  # window 8, CSA rate 4, HCA rate 16: drafts cross every ring
WEIGHTS = random_state_dict(CONFIG, seed=5)
VOCAB = CONFIG["vocab_size"]


def make_engine(tmp_path, spec=None, **options) -> Engine:
    if spec is not None:  # these tests check the verification machinery: verify every draft
        spec = {"draft_length_policy": "fixed", **spec}
    write_config(tmp_path, CONFIG)
    options = {"max_num_seqs": 4, "num_kv_blocks": 24, **options}
    return Engine(EngineConfig(model=str(tmp_path), dtype="float32", speculative_config=spec, **options),
                  weights=WEIGHTS)


def prompts(lengths, seed=0, repeat=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=generator).tolist() * repeat for n in lengths]


def generate(engine: Engine, token_prompts, max_tokens=10, **params) -> dict[str, list[int]]:
    outputs = serve(engine, token_prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))
    return {out.request_id: out for out in outputs}


def tokens(outputs) -> dict[str, list[list[int]]]:
    return {k: [c.token_ids for c in v.outputs] for k, v in outputs.items()}


class ScriptedDrafter:
    """Proposes the reference continuation (`offset` 0: always right) or a token that is never it
    (`offset` 1: always wrong), read from the outputs of a run without speculation."""

    def __init__(self, reference: dict[str, list[int]], offset: int) -> None:
        self.reference, self.offset = reference, offset

    def propose(self, seq, max_drafts):
        future = self.reference[seq.request_id][seq.num_output_tokens :][:max_drafts]
        return [(t + self.offset) % VOCAB for t in future], None


MIXED = prompts([3, 9, 26], seed=1, repeat=2)  # repeated halves: the n-gram drafter finds matches


@pytest.fixture(scope="module")
def greedy_reference(tmp_path_factory):
    return tokens(generate(make_engine(tmp_path_factory.mktemp("ref")), MIXED, temperature=0))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_ngram_greedy_equals_no_speculation_for_every_k(tmp_path, greedy_reference, k):
    engine = make_engine(tmp_path, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4})
    assert tokens(generate(engine, MIXED, temperature=0)) == greedy_reference
    stats = engine.stats()
    assert stats["spec_verified_tokens"] > 0 and stats["spec_accepted_tokens"] > 0  # it did speculate
    assert engine.block_manager.num_free_blocks == engine.executor.info.num_blocks


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_drafter_has_every_draft_accepted(tmp_path, greedy_reference, k):
    engine = make_engine(tmp_path, {"method": "ngram", "num_speculative_tokens": k})
    engine.speculator.drafter = ScriptedDrafter({str(i): v[0] for i, v in enumerate(greedy_reference.values())}, 0)
    outputs = generate(engine, MIXED, temperature=0)
    assert tokens(outputs) == greedy_reference
    for out in outputs.values():
        spec = out.metrics.spec_decode
        assert spec.num_verified_tokens > 0 and spec.num_accepted_tokens == spec.num_verified_tokens
        assert spec.mean_acceptance_length > 1


def test_always_wrong_drafter_costs_one_position_per_draft_and_changes_nothing(tmp_path, greedy_reference):
    engine = make_engine(tmp_path, {"method": "ngram", "num_speculative_tokens": 3})
    engine.speculator.drafter = ScriptedDrafter({str(i): v[0] for i, v in enumerate(greedy_reference.values())}, 1)
    outputs = generate(engine, MIXED, temperature=0)
    assert tokens(outputs) == greedy_reference
    stats = engine.stats()
    assert stats["spec_verified_tokens"] > 0 and stats["spec_accepted_tokens"] == 0
    # every verify step emitted exactly one token: decodes = generated tokens after the first of each
    assert stats["spec_acceptance_histogram"] == [stats["spec_verify_steps"]]


def test_confidence_policy_stops_verifying_an_always_wrong_drafter(tmp_path, greedy_reference):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_length_policy": "confidence",
            "verify_cost_per_token": 0.2}
    engine = make_engine(tmp_path, spec)
    engine.speculator.drafter = ScriptedDrafter({str(i): v[0] for i, v in enumerate(greedy_reference.values())}, 1)
    outputs = generate(engine, MIXED, temperature=0)
    assert tokens(outputs) == greedy_reference
    stats = engine.stats()
    assert stats["spec_drafted_tokens"] > stats["spec_verified_tokens"]  # it declined most drafts


@pytest.mark.parametrize("policy", ["fixed", "confidence"])
@pytest.mark.parametrize("k", [2, 5])
def test_seeded_sampling_is_identical_with_speculation(tmp_path, k, policy):
    params = {"temperature": 0.8, "top_k": 50, "n": 2, "seed": 7, "logprobs": 2}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reference = generate(make_engine(tmp_path / "a"), MIXED, **params)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "draft_length_policy": policy}
    engine = make_engine(tmp_path / "b", spec)
    # an oracle of the sampled run makes drafts get accepted, so sampled rows run through verification
    engine.speculator.drafter = ScriptedDrafter(
        {f"{key}#{i}": c.token_ids for key, v in reference.items() for i, c in enumerate(v.outputs)}, 0)
    outputs = generate(engine, MIXED, **params)
    assert tokens(outputs) == tokens(reference)
    assert engine.stats()["spec_accepted_tokens"] > 0
    for key, out in outputs.items():  # the target's logprobs for every accepted token
        for mine, theirs in zip(out.outputs[1].logprobs, reference[key].outputs[1].logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            assert max(abs(mine[t].logprob - theirs[t].logprob) for t in mine) < 1e-4


def test_preemption_and_prefix_hits_with_speculation(tmp_path):
    batch = prompts([125, 125], seed=4, repeat=2)  # two blocks each and a third to decode: four in the pool
    options = {"num_kv_blocks": 4, "enable_prefix_caching": True, "max_num_batched_tokens": 64}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reference = make_engine(tmp_path / "a", **options)
    expected = [tokens(generate(reference, batch, temperature=0)) for _ in range(2)]  # cold, then hits
    engine = make_engine(tmp_path / "b", {"method": "ngram", "num_speculative_tokens": 4}, **options)
    assert [tokens(generate(engine, batch, temperature=0)) for _ in range(2)] == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_verified_tokens"] > 0
    assert engine.block_manager.num_free_blocks == 4


def test_stop_token_and_max_tokens_inside_an_accepted_run(tmp_path, greedy_reference):
    first = greedy_reference["2"][0]
    stop = first[6]
    engine = make_engine(tmp_path, {"method": "ngram", "num_speculative_tokens": 5})
    engine.speculator.drafter = ScriptedDrafter({"0": greedy_reference["2"][0], "1": greedy_reference["2"][0]}, 0)
    stopped, cut = serve(engine, [MIXED[2], MIXED[2]], [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    assert stopped.outputs[0].token_ids == first[: first.index(stop) + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].token_ids == first[:4]


def test_deterministic_mode_gives_bitwise_equal_logprobs_with_speculation(tmp_path):
    """Under `deterministic=True` (batch-invariant kernels) a (k + 1)-token verify step computes each
    position exactly as a 1-token decode does, so in bf16 too the emitted tokens and every logprob are
    bitwise those of decoding without speculation (default mode promises equal greedy tokens only)."""
    write_config(tmp_path, CONFIG)

    def engine(spec=None):
        return Engine(EngineConfig(model=str(tmp_path), dtype="bfloat16", deterministic=True, max_num_seqs=4,
                                   num_kv_blocks=24, speculative_config=spec), weights=WEIGHTS)

    reference = generate(engine(), MIXED, temperature=0, logprobs=3)
    spec = engine({"method": "ngram", "num_speculative_tokens": 3})
    spec.speculator.drafter = ScriptedDrafter({k: v.outputs[0].token_ids for k, v in reference.items()}, 0)
    outputs = generate(spec, MIXED, temperature=0, logprobs=3)
    assert tokens(outputs) == tokens(reference) and spec.stats()["spec_accepted_tokens"] > 0
    for key, out in outputs.items():
        got = [{t: lp.logprob for t, lp in entry.items()} for entry in out.outputs[0].logprobs]
        assert got == [{t: lp.logprob for t, lp in entry.items()} for entry in reference[key].outputs[0].logprobs]


def count_overlapped(engine) -> list[int]:
    """A list that gains one entry per step the engine leaves in flight (overlapped decode)."""
    launched, settle = [], engine.steps.settle

    def record_settle(in_flight, touched):
        launched.append(len(in_flight.seqs))
        return settle(in_flight, touched)

    engine.steps.settle = record_settle
    return launched


def test_overlapped_decode_resumes_once_confidence_declines_every_draft(tmp_path, greedy_reference):
    """An always-wrong drafter under the confidence policy: once the requests' histories say no draft
    pays (the sync cost included), plain decode steps are left in flight again; the output is unchanged."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_length_policy": "confidence",
            "verify_cost_per_token": 0.05, "sync_cost": 0.3}
    engine = make_engine(tmp_path, spec, async_scheduling=True)
    engine.speculator.drafter = ScriptedDrafter({str(i): v[0] for i, v in enumerate(greedy_reference.values())}, 1)
    engine.speculator.drafter.has_confidences = False  # its confidences are the requests' histories
    overlapped = count_overlapped(engine)
    assert tokens(generate(engine, MIXED, max_tokens=16, temperature=0)) == tokens(
        generate(make_engine(tmp_path), MIXED, max_tokens=16, temperature=0))
    stats = engine.stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] == 0 and len(overlapped) > 3


def test_overlap_never_displaces_drafts_that_pay(tmp_path, greedy_reference):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_length_policy": "confidence"}
    engine = make_engine(tmp_path, spec, async_scheduling=True)
    engine.speculator.drafter = ScriptedDrafter({str(i): v[0] for i, v in enumerate(greedy_reference.values())}, 0)
    engine.speculator.drafter.has_confidences = False
    overlapped = count_overlapped(engine)
    assert tokens(generate(engine, MIXED, temperature=0)) == greedy_reference
    stats = engine.stats()  # every draft right: the histories keep verifying
    assert stats["spec_accepted_tokens"] == stats["spec_verified_tokens"] > 0
    # 10 tokens: the prefill's, two steps of four, and the last one, which may not carry drafts: only
    # that step (one, of all three requests) was left in flight
    assert overlapped == [3] and stats["spec_verify_steps"] == 6


class PhasedDrafter(ScriptedDrafter):
    """Always wrong for a request's first `switch` output tokens, always right afterwards."""

    def __init__(self, reference: dict[str, list[int]], switch: int) -> None:
        super().__init__(reference, 0)
        self.switch = switch

    def propose(self, seq, max_drafts):
        future = self.reference[seq.request_id][seq.num_output_tokens :][:max_drafts]
        offset = 1 if seq.num_output_tokens < self.switch else 0
        return [(t + offset) % VOCAB for t in future], None


def record_steps(engine) -> list[tuple[bool, list[int], list[int] | None]]:
    """A list that gains, per step, whether it was left in flight, its drafts per request and their
    accepted counts (None: nothing verified)."""
    steps, record = [], engine.speculator.record

    def recorded(plan, num_accepted, is_overlapped=False):
        steps.append((is_overlapped, [r.num_draft_tokens for r in plan.requests], num_accepted))
        return record(plan, num_accepted, is_overlapped)

    engine.speculator.record = recorded
    return steps


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.8, "top_k": 50, "seed": 3}])
def test_gated_drafting_returns_to_overlap_and_resumes_when_acceptance_comes_back(tmp_path, params):
    """Drafts always rejected for the first 10 tokens, then always right: the confidence policy stops
    drafting (decode steps are left in flight again), a probe finds the drafts accepted again and drafting
    resumes; the tokens are those of no speculation throughout."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reference = tokens(generate(make_engine(tmp_path / "a"), MIXED, max_tokens=48, **params))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_length_policy": "confidence"}
    engine = make_engine(tmp_path / "b", spec, async_scheduling=True)
    engine.speculator.drafter = PhasedDrafter({k: v[0] for k, v in reference.items()}, 10)
    engine.speculator.drafter.has_confidences = False
    steps = record_steps(engine)
    assert tokens(generate(engine, MIXED, max_tokens=48, **params)) == reference
    rejected = [i for i, (_, drafts, accepted) in enumerate(steps) if any(drafts) and not any(accepted)]
    overlapped = [i for i, (is_overlapped, _, _) in enumerate(steps) if is_overlapped]
    resumed = [i for i, (_, drafts, accepted) in enumerate(steps) if any(drafts) and any(accepted)]
    assert rejected and overlapped and resumed
    assert max(rejected) < min(overlapped) < min(resumed)  # stopped drafting, then came back to it
    assert len(overlapped) >= 8 and len(resumed) >= 3
    probe = next(i for i in range(min(overlapped), len(steps)) if any(steps[i][1]))
    assert max(steps[probe][1]) == 1  # a probe verifies one draft a request, not k
    stats = engine.stats()
    assert stats["spec_overlapped_steps"] == len(overlapped) and stats["spec_probe_steps"] >= 1
    assert engine.block_manager.num_free_blocks == engine.executor.info.num_blocks


def test_ngram_drafter_keeps_overlapped_decode_where_it_finds_little(tmp_path):
    """The real n-gram drafter under the confidence policy: most decode steps stay overlapped (its lookups
    rarely pay), the probes still verify what it finds, and the output is that of no speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_length_policy": "confidence"}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reference = tokens(generate(make_engine(tmp_path / "a"), MIXED, max_tokens=48, temperature=0))
    engine = make_engine(tmp_path / "b", spec, async_scheduling=True)
    steps = record_steps(engine)
    assert tokens(generate(engine, MIXED, max_tokens=48, temperature=0)) == reference
    stats = engine.stats()
    assert stats["spec_overlapped_steps"] > len(steps) / 2
    assert stats["spec_probe_steps"] >= 1 and stats["spec_verified_tokens"] > 0
    fixed = make_engine(tmp_path / "b", {**spec, "draft_length_policy": "fixed"}, async_scheduling=True)
    assert tokens(generate(fixed, MIXED, max_tokens=48, temperature=0)) == reference
    assert fixed.stats()["spec_overlapped_steps"] == 0  # fixed k: every step waits for its tokens
