"""The sampler steps every sampler shares: which optional passes a batch needs, and the drawn rows' filters."""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_core.backends.sampling import SamplingTensors
from deepinfer_core.backends.sampling_ops import (
    apply_min_p,
    apply_top_k_top_p,
    filter_sampled,
    sampling_flags,
)

VOCAB = 16


def params(temperature, top_k, top_p, min_p) -> SamplingTensors:
    n = len(temperature)
    return SamplingTensors(
        temperature=torch.tensor(temperature), top_k=torch.tensor(top_k), top_p=torch.tensor(top_p),
        min_p=torch.tensor(min_p), seeds=torch.arange(n), steps=torch.zeros(n, dtype=torch.long), num_logprobs=0)


def test_flags_count_only_drawn_rows_and_host_flags_win():
    p = params([0.0, 1.0], [3, 0], [1.0, 1.0], [0.5, 0.0])  # the filters are asked only by the greedy row
    assert sampling_flags(p, p.temperature > 0, VOCAB) == [True, False, False]
    p = params([0.0, 0.7], [0, VOCAB], [1.0, 0.9], [0.0, 0.1])  # top_k = vocab is no filter; top_p is
    assert sampling_flags(p, p.temperature > 0, VOCAB) == [True, True, True]
    given = dataclasses.replace(p, host_flags=[True, False, True])
    assert sampling_flags(given, given.temperature > 0, VOCAB) is given.host_flags


def test_drawn_rows_are_scaled_and_filtered_each_on_its_own_and_greedy_rows_are_left_alone():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    p = params([0.5, 0.0, 2.0], [4, 2, 0], [1.0, 0.1, 0.8], [0.0, 0.9, 0.05])
    is_sampled = p.temperature > 0
    scaled = filter_sampled(logits, p, is_sampled, sampling_flags(p, is_sampled, VOCAB))
    for row in (0, 2):  # what the row gets alone, whatever the others ask
        alone = logits[row:row + 1] / p.temperature[row]
        alone = apply_top_k_top_p(alone, p.top_k[row:row + 1], p.top_p[row:row + 1])
        alone = apply_min_p(alone, p.min_p[row:row + 1])
        assert torch.equal(scaled[row:row + 1], alone)
    assert torch.equal(scaled[1], logits[1])  # greedy: divided by 1, not filtered
    assert int(torch.isfinite(scaled[0]).sum()) == 4  # top-k 4 kept exactly 4
