"""Per-request draft estimates and the probe schedule (`deepinfer_core.engine.spec.gate`)."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.spec.gate import MAX_PROBE_INTERVAL, PROBE_INTERVAL, DraftEstimate


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
