"""Per-request draft estimates and the probe schedule (`deepinfer_core.speculative.gate`)."""

from __future__ import annotations

import pytest

from deepinfer_core.speculative.gate import MAX_PROBE_INTERVAL, PROBE_INTERVAL, DraftEstimate


def test_rejected_drafts_lower_the_confidence_and_accepted_ones_raise_it():
    estimate = DraftEstimate()
    assert estimate.confidence == 0.5
    estimate.record(3, 3, 0)
    low = estimate.confidence
    assert low < 0.5
    estimate.record(3, 3, 3)
    assert estimate.confidence > low


def test_steps_without_proposals_lower_the_first_drafts_expected_survival():
    estimate = DraftEstimate()
    for _ in range(5):
        estimate.record(0, 0, None)  # asked, proposed nothing
    assert estimate.confidence == 0.5  # nothing was verified: the survival of a draft is unknown
    first, second = estimate.expected_confidences(2)
    assert first == pytest.approx(estimate.proposal_rate * 0.5) and first < 0.2 and second == 0.5
    assert estimate.expected_confidences(0) == []


def test_a_pending_token_is_no_step_asked():
    estimate = DraftEstimate()
    estimate.record(None, 0, None)
    assert estimate.asked == 0 and estimate.num_idle_steps == 1


def test_probes_fall_due_after_idle_steps_and_back_off_while_they_fail():
    estimate = DraftEstimate()
    for _ in range(PROBE_INTERVAL - 1):
        estimate.record(None, 0, None)
    assert not estimate.is_probe_due
    estimate.record(3, 0, None)  # asked, its drafts not verified: still idle
    assert estimate.is_probe_due
    intervals = []
    for _ in range(4):
        estimate.record(3, 3, 0, is_probe=True)
        intervals.append(estimate.probe_interval)
        assert estimate.num_idle_steps == 0
    assert intervals == [2 * PROBE_INTERVAL, 4 * PROBE_INTERVAL, MAX_PROBE_INTERVAL, MAX_PROBE_INTERVAL]
    estimate.record(0, 0, None, is_probe=True)  # a probe whose drafter proposed nothing failed too
    assert estimate.probe_interval == MAX_PROBE_INTERVAL
    estimate.record(3, 3, 1)  # an accepted draft: probing is frequent again
    assert estimate.probe_interval == PROBE_INTERVAL and estimate.num_idle_steps == 0


def test_a_request_half_way_to_its_probe_may_join_another_ones():
    estimate = DraftEstimate()
    for _ in range(PROBE_INTERVAL // 2 - 1):
        estimate.record(None, 0, None)
    assert not estimate.may_join_probe
    estimate.record(None, 0, None)
    assert estimate.may_join_probe and not estimate.is_probe_due


class _AlwaysProposes:
    has_confidences = False  # gated: the requests' estimates decide

    def propose(self, seq, max_drafts):
        return [7] * max_drafts, None


def test_a_probe_step_takes_the_requests_half_way_to_theirs_and_no_others():
    """Requests that started decoding on different steps: when one falls due, those at least half way
    probe with it (one wait for all), the one that just started does not, and nothing probes before."""
    from deepinfer_core.config.speculative import SpeculativeConfig
    from deepinfer_core.outputs import SpecDecodeMetrics
    from deepinfer_core.sampling_params import SamplingParams
    from deepinfer_core.sched.sequence import Sequence
    from deepinfer_core.speculative.proposer import Speculator

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    speculator = Speculator(config, _AlwaysProposes())
    seqs = [Sequence(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=64)) for i in range(3)]
    for seq, idle in zip(seqs, (PROBE_INTERVAL - 1, PROBE_INTERVAL // 2, 1), strict=True):
        seq.append_token(5)
        speculator.track(seq.request_id, SpecDecodeMetrics())
        estimate = speculator._estimates[seq.request_id]
        estimate.tested, estimate.num_idle_steps = 20.0, idle  # its drafts have been failing
    assert speculator.choose_drafts(seqs, budget=64) == [(), (), ()]  # none due: gated, nothing verified
    speculator._asked.clear()
    speculator._estimates["r0"].num_idle_steps = PROBE_INTERVAL
    assert speculator.choose_drafts(seqs, budget=64) == [(7,), (7,), ()]


def test_a_new_requests_estimates_start_from_every_requests_recent_record():
    """A drafter that has been failing is not verified for a new request's first step (the default
    costs, one request), one that has been right is, and with no record a new request starts even."""
    from deepinfer_core.config.speculative import SpeculativeConfig
    from deepinfer_core.speculative.policy import confidence_draft_lengths

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert DraftEstimate.seeded(DraftEstimate()).confidence == 0.5
    failing, right = DraftEstimate(), DraftEstimate()
    for _ in range(30):
        failing.record(3, 3, 0)
        right.record(3, 3, 3)
    chosen = {}
    for name, population in (("failing", failing), ("right", right), ("none", DraftEstimate())):
        estimate = DraftEstimate.seeded(population)
        chosen[name] = confidence_draft_lengths([estimate.expected_confidences(3)], 3,
                                                config.verify_cost_per_token, config.sync_cost)[0]
    assert chosen["failing"] == 0 and chosen["right"] == 3 and chosen["none"] > 0
    assert DraftEstimate.seeded(failing).confidence < 0.2 and DraftEstimate.seeded(right).confidence > 0.8
