"""Draft-length policies, the n-gram drafter and the speculative config's validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deepinfer_core.config.speculative import SpeculativeConfig
from deepinfer_core.speculative.ngram import propose_ngram
from deepinfer_core.speculative.policy import confidence_draft_lengths, fixed_draft_lengths


def test_fixed_lengths_take_every_proposal_within_the_budget():
    assert fixed_draft_lengths([3, 0, 2], 10) == [3, 0, 2]
    assert fixed_draft_lengths([3, 3, 3], 4) == [3, 1, 0]


def test_confidence_lengths_verify_likely_drafts_and_skip_unlikely_ones():
    # request 0 is confident, request 1 is nearly always wrong: only request 0's drafts pay for themselves
    lengths = confidence_draft_lengths([[0.9, 0.9, 0.9], [0.01, 0.01, 0.01]], budget=16, cost_per_token=0.05)
    assert lengths == [3, 0]


def test_confidence_lengths_stop_where_survival_no_longer_pays():
    # survival 0.8, 0.4, 0.04: the third adds less than its cost
    assert confidence_draft_lengths([[0.8, 0.5, 0.1]], budget=16, cost_per_token=0.1) == [2]


def test_confidence_lengths_respect_the_budget_and_prefixes():
    lengths = confidence_draft_lengths([[1.0, 1.0, 1.0], [0.95, 0.95]], budget=3, cost_per_token=0.01)
    assert sum(lengths) == 3 and lengths[0] >= 2
    assert confidence_draft_lengths([[1.0]] * 3, budget=0, cost_per_token=0.01) == [0, 0, 0]


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [5, 7]  # "1 2 3" last seen before "5 7"
    assert propose_ngram([5, 6, 7], 3, 1, 3) == []  # nothing recurs
    assert propose_ngram([4, 8, 4], 3, 1, 2) == [8, 4]  # falls back to the 1-gram "4"
    assert propose_ngram([4, 8, 4], 3, 2, 2) == []


@pytest.mark.parametrize("options, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "at most 16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
])
def test_bad_speculative_configs_are_clear_errors(options, message):
    with pytest.raises(ValidationError, match=message):
        SpeculativeConfig.model_validate(options)


def test_confidence_lengths_decline_drafts_that_do_not_pay_for_the_round_trip():
    # one request, a weak draft: worth a token of work, not a host round trip
    assert confidence_draft_lengths([[0.1]], budget=4, cost_per_token=0.02) == [1]
    assert confidence_draft_lengths([[0.1]], budget=4, cost_per_token=0.02, sync_cost=0.3) == [0]
    # many confident requests share one round trip: verified
    assert confidence_draft_lengths([[0.9]] * 64, budget=64, cost_per_token=0.02, sync_cost=0.3) == [1] * 64
