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
    assert tokens(generate(engine, MIXED, max_tokens=48, temperature=0)) == reference
    stats = engine.stats()
    assert stats["spec_verified_tokens"] > 0 and stats["spec_accepted_tokens"] == 0
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
