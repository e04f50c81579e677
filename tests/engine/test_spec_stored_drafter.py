"""A model-side drafter that pauses and gives raw confidences (DSpark's shape: drafts come back with a
step's result, `StepPlan.propose_drafts` says whether to draft, the confidences are raw scores the engine
calibrates): never a loss, and its metrics per slot."""

from __future__ import annotations

import pytest

from deepinfer_core.speculative.proposer import StoredDrafter
from tests.engine.test_spec_decode import (  # noqa: F401 (fixture)
    MIXED,
    VOCAB,
    generate,
    greedy_reference,
    make_engine,
    record_steps,
    tokens,
)


class FakeRunnerDrafter:
    """Stands for the runner side of a pausable drafter: after every step whose plan asks for drafts and
    that sampled, each sampled request gets `draft(request_id, num_tokens)` (its drafts and raw
    confidences; `num_tokens`: the request's tokens once the step's are in). `runs`: steps it drafted."""

    def __init__(self, engine, draft) -> None:
        self.runs, self.skipped, runner = 0, 0, engine.runner
        complete = runner._complete

        def drafting(plan, *args):
            result = complete(plan, *args)
            if result.output is None:
                return result
            if not plan.propose_drafts:
                self.skipped += 1
                return result
            self.runs += 1
            sampled = [plan.requests[i] for i in dict.fromkeys(result.sampled)]
            accepted = result.num_accepted or [0] * len(sampled)
            result.drafts = [draft(r.request_id, r.start + a + 2) for r, a in zip(sampled, accepted, strict=True)]
            return result

        runner._complete = drafting


def pausable_engine(path, policy: str, **spec):
    engine = make_engine(path, {"method": "ngram", "num_speculative_tokens": 3, "draft_length_policy": policy, **spec},
                         async_scheduling=True)
    engine.speculator.drafter = StoredDrafter(has_raw_confidences=True, is_pausable=True)
    return engine


@pytest.mark.parametrize("policy", ["confidence", "fixed"])
def test_an_always_wrong_confident_drafter_pauses_and_decode_stays_overlapped(tmp_path, policy):
    """Drafts never accepted, raw confidences high (sigmoid 0.95): the calibration learns they fail, the
    gate pauses the drafter (no drafting pass, no wait) and steps are left in flight after a short probe
    period, probed now and then; "fixed" drafts and verifies every step. Tokens: those of no speculation."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reference = tokens(generate(make_engine(tmp_path / "a"), MIXED, max_tokens=48, temperature=0))
    never = {key: min(set(range(VOCAB)) - set(out[0])) for key, out in reference.items()}
    engine = pausable_engine(tmp_path / "b", policy)
    fake = FakeRunnerDrafter(engine, lambda request_id, n: ([never[request_id]] * 3, [3.0] * 3))
    steps = record_steps(engine)
    outputs = generate(engine, MIXED, max_tokens=48, temperature=0)
    assert tokens(outputs) == reference
    stats = engine.stats()
    assert stats["spec_verified_tokens"] > 0 and stats["spec_accepted_tokens"] == 0
    # per slot: every verified draft carried raw confidence 3.0 and none was accepted; requests sum to stats
    slots = len(stats["spec_verified_per_slot"])
    assert stats["spec_mean_confidence_per_slot"] == [3.0] * slots and stats["spec_acceptance_rate_per_slot"] == [0.0] * slots
    per_request = [out.metrics.spec_decode.num_verified_per_slot for out in outputs.values()]
    assert [sum(v[j] if j < len(v) else 0 for v in per_request) for j in range(slots)] == stats["spec_verified_per_slot"]
    if policy == "fixed":
        assert fake.skipped == 0 and stats["spec_overlapped_steps"] == 0
        return
    overlapped = [i for i, (is_overlapped, _, _) in enumerate(steps) if is_overlapped]
    verified = [i for i, (_, drafts, _) in enumerate(steps) if any(drafts)]
    assert overlapped and min(overlapped) < 12  # a short probe period
    later = steps[min(overlapped):]
    assert sum(is_overlapped for is_overlapped, _, _ in later) >= 0.75 * len(later)
    assert len([i for i in verified if i > min(overlapped)]) <= 3  # probes only
    assert fake.runs < fake.skipped and fake.runs <= 12
    assert stats["spec_probe_steps"] >= 1 and stats["spec_overlapped_steps"] == len(overlapped)


def test_metrics_per_slot_equal_the_hand_computed_ones():
    """Two requests, two steps of known drafts, raw confidences and acceptance (a pausable drafter that
    skipped request b's second step): acceptance length, per-slot acceptance rates and mean raw confidence
    per slot, per request and summed; a calibrated probability under its own name."""
    from deepinfer_core import SamplingParams
    from deepinfer_core.config.speculative import SpeculativeConfig
    from deepinfer_core.outputs import SpecDecodeMetrics
    from deepinfer_core.plan import ScheduledRequest, StepPlan
    from deepinfer_core.sched.sequence import Sequence
    from deepinfer_core.speculative.calibration import bin_centre, bin_of, sigmoid
    from deepinfer_core.speculative.proposer import Speculator

    speculator = Speculator.from_config(SpeculativeConfig(method="dspark", num_speculative_tokens=3,
                                                          draft_length_policy="fixed"))
    a, b = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=50)), Sequence("b", [4, 5], SamplingParams(max_tokens=50))
    metrics = {"a": SpecDecodeMetrics(), "b": SpecDecodeMetrics()}
    for key, m in metrics.items():
        speculator.track(key, m)

    def step(drafts, accepted):
        for seq, (ids, raw) in zip((a, b), drafts, strict=True):
            seq.draft_token_ids, seq.draft_confidences = ids, raw
        chosen = speculator.choose_drafts([a, b], 10)
        assert chosen == [tuple(ids) for ids, _ in drafts] and a.draft_token_ids == b.draft_token_ids == []
        plan = StepPlan(tuple(ScheduledRequest(seq.request_id, seq.num_tokens - 1, (seq.token_ids[-1], *d), True,
                                               num_draft_tokens=len(d)) for seq, d in zip((a, b), chosen)))
        speculator.record(plan, accepted)

    step([([7, 8, 9], [0.5, -1.0, 2.0]), ([7, 8], [1.0, 3.0])], [1, 2])
    step([([1, 1, 1], [-2.0, 0.0, 4.0]), ([], None)], [3, 0])  # b: the drafter was paused
    ma, mb, total = metrics["a"], metrics["b"], speculator.totals
    assert (ma.num_drafted_tokens, ma.num_verified_tokens, ma.num_accepted_tokens) == (6, 6, 4)
    assert ma.mean_acceptance_length == (4 + 2) / 2 and ma.acceptance_rate_per_slot == [1.0, 0.5, 0.5]
    assert ma.mean_confidence_per_slot == [(0.5 - 2.0) / 2, (-1.0 + 0.0) / 2, (2.0 + 4.0) / 2]
    assert (mb.num_drafted_tokens, mb.num_verified_tokens, mb.num_accepted_tokens, mb.num_verify_steps) == (2, 2, 2, 1)
    assert mb.acceptance_rate_per_slot == [1.0, 1.0] and mb.mean_confidence_per_slot == [1.0, 3.0]
    # the first step's probabilities are the calibration's prior: the sigmoid of the raw score's bin centre
    assert mb.mean_calibrated_confidence_per_slot == [sigmoid(bin_centre(bin_of(1.0))), sigmoid(bin_centre(bin_of(3.0)))]
    assert total.num_verified_per_slot == [3, 3, 2] and total.num_accepted_per_slot == [3, 2, 1]
    assert total.mean_acceptance_length == (6 + 3) / 3 and total.acceptance_rate_per_slot == [1.0, 2 / 3, 0.5]
    assert total.mean_confidence_per_slot == pytest.approx([(0.5 - 2.0 + 1.0) / 3, (-1.0 + 0.0 + 3.0) / 3, 3.0])
    assert speculator._estimates["b"].asked == 1.0  # paused: not counted as asked and proposing nothing
