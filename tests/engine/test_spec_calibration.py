"""Raw confidence -> acceptance probability, per slot, learnt online (`speculative/calibration.py`)."""

from __future__ import annotations

import itertools
import math

from deepinfer_core.speculative.calibration import (
    MAX_COUNT,
    NUM_BINS,
    ConfidenceCalibration,
    bin_centre,
    bin_of,
    sigmoid,
)


def test_before_any_observation_the_map_is_the_sigmoid_of_the_bin_centre():
    calibration = ConfidenceCalibration(3)
    for raw in (-20.0, -3.1, 0.2, 2.0, 7.9, 50.0):
        expected = sigmoid(bin_centre(bin_of(raw)))
        assert calibration.probabilities([raw, raw, raw]) == [expected] * 3
    assert bin_of(-20.0) == 0 and bin_of(50.0) == NUM_BINS - 1 and bin_of(math.nan) == 0
    assert bin_centre(bin_of(0.2)) == 0.5 and sigmoid(-1000.0) == 0.0 and sigmoid(1000.0) == 1.0


def test_observed_acceptance_moves_each_slot_to_what_verification_shows():
    calibration = ConfidenceCalibration(2)
    for _ in range(200):  # slot 0 at raw 3 always accepted, slot 1 at raw 3 always rejected
        calibration.observe([3.0, 3.0], 1)
    first, second = calibration.probabilities([3.0, 3.0])
    assert first > 0.99 and second < 0.05
    # slot 1's bin fell below the priors of the bins under it: isotonic pooling joins it with those above
    # the pooled rate (2 pseudo-observations each at the sigmoid of their centre); lower ones keep theirs
    values = [calibration.slots[1].probability(bin_centre(b)) for b in range(NUM_BINS)]
    start = values.index(second)
    pooled = range(start, bin_of(3.0) + 1)
    assert 0 < start < bin_of(3.0) and all(v == second for v in values[start : bin_of(3.0) + 1])
    assert math.isclose(second, sum(2 * sigmoid(bin_centre(b)) for b in pooled) / (2 * len(pooled) + 200))
    assert all(values[b] == sigmoid(bin_centre(b)) < second for b in range(start))


def test_only_drafts_up_to_the_first_rejection_are_counted():
    calibration = ConfidenceCalibration(3)
    calibration.observe([1.0, 1.0, 1.0], 0)  # slot 0 rejected: slots 1 and 2 were not tested
    slots = calibration.slots
    assert sum(slots[0].tested) == 1 and sum(slots[0].accepted) == 0
    assert sum(slots[1].tested) == 0 and sum(slots[2].tested) == 0
    calibration.observe([1.0, 1.0, 1.0], 3)  # all accepted
    assert [sum(s.accepted) for s in slots] == [1, 1, 1] and [sum(s.tested) for s in slots] == [2, 1, 1]


def test_the_map_never_decreases_with_the_raw_score():
    calibration = ConfidenceCalibration(1)
    for _ in range(50):  # inverted evidence: low scores accepted, high scores rejected
        calibration.observe([-4.0], 1)
        calibration.observe([4.0], 0)
    values = [calibration.probabilities([bin_centre(b)])[0] for b in range(NUM_BINS)]
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(values))
    assert values[bin_of(-4.0)] == values[bin_of(4.0)]  # pooled into one block


def test_counts_stay_bounded_and_the_same_history_gives_the_same_map():
    a, b = ConfidenceCalibration(1), ConfidenceCalibration(1)
    for i in range(3000):
        for calibration in (a, b):
            calibration.observe([0.5 + (i % 7) * 0.3], i % 3)
    assert max(a.slots[0].tested) < MAX_COUNT
    grid = [x / 4 for x in range(-40, 41)]
    assert a.probabilities(grid[:1]) == b.probabilities(grid[:1])
    assert [a.probabilities([x]) for x in grid] == [b.probabilities([x]) for x in grid]
