"""The verification rules on a tiny vocabulary: the seeded-draw rule gives exactly the tokens of
sampling without speculation, rejection sampling their distribution (a chi-square test with fixed
seeds), both with a deliberately bad drafter."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backends.sampling import SamplerOutput, SamplingSpec
from deepinfer_core.backends.sampling_tensors import prepare_sampling_tensors
from deepinfer_core.backends.verify import VerifySpec
from deepinfer_core.plan import ScheduledRequest, StepPlan
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.reference.verify import ReferenceVerifier
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.speculative import verify

VOCAB, NUM_SEEDS = 4, 6000
FIRST = torch.tensor([1.2, 0.3, -0.5, 0.0])  # logits of the first generated token
SECOND = torch.tensor([[0.0, 1.0, 0.5, -1.0], [1.5, 0.0, 0.0, 0.2], [-0.3, 0.4, 1.1, 0.0], [0.2, 0.2, -0.8, 0.9]])
"""Logits of the second token, by the first."""
BAD_DRAFT = int(FIRST.argmin())  # the bad drafter always proposes the least likely first token
DEVICE = torch.device("cpu")


def sample(params: list[SamplingParams], seeds: list[int], steps: list[int], logits: torch.Tensor) -> torch.Tensor:
    tensors = prepare_sampling_tensors(params, seeds, steps, [], DEVICE, VOCAB)
    return ReferenceSampler(SamplingSpec(VOCAB), DEVICE).sample(logits, tensors).token_ids


def no_speculation(params: SamplingParams) -> list[tuple[int, int]]:
    seeds = list(range(NUM_SEEDS))
    first = sample([params] * NUM_SEEDS, seeds, [0] * NUM_SEEDS, FIRST.expand(NUM_SEEDS, -1))
    second = sample([params] * NUM_SEEDS, seeds, [1] * NUM_SEEDS, SECOND[first])
    return list(zip(first.tolist(), second.tolist()))


def with_speculation(params: SamplingParams, rejection: bool) -> list[tuple[int, int]]:
    """One verify step per seed with the bad draft, then (if it was rejected) the next ordinary step."""
    plan = StepPlan(tuple(ScheduledRequest(str(s), 4, (9, BAD_DRAFT), True, num_draft_tokens=1)
                          for s in range(NUM_SEEDS)))
    rows = verify.logits_row_requests(plan, list(range(NUM_SEEDS)))
    offsets = verify.row_token_offsets(plan, rows)
    steps = [1 + j for j in offsets]  # the request has generated 0 tokens before this step
    tensors = prepare_sampling_tensors([params] * len(rows), rows, steps, [], DEVICE, VOCAB)
    logits = torch.stack([FIRST, SECOND[BAD_DRAFT]]).repeat(NUM_SEEDS, 1)
    output = ReferenceSampler(SamplingSpec(VOCAB), DEVICE).sample(logits, tensors)
    results = None
    if rejection:
        verifier = ReferenceVerifier(VerifySpec(VOCAB, 1), DEVICE)
        results = verify.rejection_verify(verifier, plan, rows, set(range(NUM_SEEDS)), logits, tensors.temperature,
                                          torch.Generator().manual_seed(0))
        output = verify.merge_rejection(output, logits, tensors, rows, results)
    verified = verify.accept_drafts(plan, rows, output, results)
    emitted: dict[int, list[int]] = {}
    for i, token in zip(verified.sampled, verified.output.token_ids.tolist()):
        emitted.setdefault(i, []).append(token)
    rejected = [seed for seed in range(NUM_SEEDS) if len(emitted[seed]) == 1]  # their next step draws token 1
    firsts = torch.tensor([emitted[seed][0] for seed in rejected])
    seconds = dict(zip(rejected, sample([params] * len(rejected), rejected, [1] * len(rejected), SECOND[firsts]).tolist()))
    pairs = [(emitted[seed][0], emitted[seed][1] if seed not in seconds else seconds[seed]) for seed in range(NUM_SEEDS)]
    return pairs, sum(verified.num_accepted)


def chi_square(pairs: list[tuple[int, int]], params: SamplingParams) -> float:
    p_first = torch.softmax(FIRST / params.temperature, -1)
    p_second = torch.softmax(SECOND / params.temperature, -1)
    counts = torch.zeros(VOCAB, VOCAB)
    for a, b in pairs:
        counts[a, b] += 1
    expected = NUM_SEEDS * p_first[:, None] * p_second
    return float(((counts - expected) ** 2 / expected).sum())


def critical_value(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square quantile at p = 0.001 (z of 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


PARAMS = SamplingParams(temperature=0.9)


def test_seeded_rule_draws_exactly_the_tokens_of_no_speculation():
    pairs, accepted = with_speculation(PARAMS, rejection=False)
    assert pairs == no_speculation(PARAMS)
    assert 0 < accepted < NUM_SEEDS  # the bad draft is sometimes the draw, so both paths are exercised


@pytest.mark.parametrize("rejection", [False, True])
def test_distribution_of_the_first_two_tokens_matches_the_target(rejection):
    pairs, _ = with_speculation(PARAMS, rejection)
    assert chi_square(pairs, PARAMS) < critical_value(VOCAB * VOCAB - 1)


def test_chi_square_detects_a_biased_sampler():
    """The test has power: emitting the bad draft whenever it was proposed fails it."""
    biased = [(BAD_DRAFT, b) if seed % 3 == 0 else (a, b) for seed, (a, b) in enumerate(no_speculation(PARAMS))]
    assert chi_square(biased, PARAMS) > critical_value(VOCAB * VOCAB - 1)


def test_both_rules_accept_a_one_hot_draft_as_often_as_the_target_draws_it():
    """For a drafter without probabilities (q one-hot) rejection sampling accepts with p(d), exactly the
    seeded rule's rate: each within 4 standard deviations of N p(d)."""
    p_bad = float(torch.softmax(FIRST / PARAMS.temperature, -1)[BAD_DRAFT])
    sigma = math.sqrt(NUM_SEEDS * p_bad * (1 - p_bad))
    for rejection in (False, True):
        _, accepted = with_speculation(PARAMS, rejection)
        assert abs(accepted - NUM_SEEDS * p_bad) < 4 * sigma


DRAFTER = torch.softmax(torch.tensor([0.2, 1.0, -0.4, 0.6]), -1)
"""A drafter's distribution of the first token, unlike the target's."""


def with_draft_distribution(params: SamplingParams, pass_q: bool) -> tuple[list[tuple[int, int]], int]:
    """One verify step per seed whose draft is drawn from `DRAFTER` (the verifier told q when `pass_q`),
    then (if it was rejected) the next ordinary step."""
    drafts = torch.multinomial(DRAFTER, NUM_SEEDS, replacement=True, generator=torch.Generator().manual_seed(1))
    plan = StepPlan(tuple(ScheduledRequest(str(s), 4, (9, int(drafts[s])), True, num_draft_tokens=1)
                          for s in range(NUM_SEEDS)))
    rows = verify.logits_row_requests(plan, list(range(NUM_SEEDS)))
    steps = [1 + j for j in verify.row_token_offsets(plan, rows)]
    tensors = prepare_sampling_tensors([params] * len(rows), rows, steps, [], DEVICE, VOCAB)
    logits = torch.stack([torch.stack([FIRST, SECOND[d]]) for d in drafts.tolist()]).view(-1, VOCAB)
    output = ReferenceSampler(SamplingSpec(VOCAB), DEVICE).sample(logits, tensors)
    verifier = ReferenceVerifier(VerifySpec(VOCAB, 1), DEVICE)
    q = {s: DRAFTER[None] for s in range(NUM_SEEDS)} if pass_q else None
    results = verify.rejection_verify(verifier, plan, rows, set(range(NUM_SEEDS)), logits, tensors.temperature,
                                      torch.Generator().manual_seed(0), q)
    verified = verify.accept_drafts(plan, rows, verify.merge_rejection(output, logits, tensors, rows, results), results)
    emitted: dict[int, list[int]] = {}
    for i, token in zip(verified.sampled, verified.output.token_ids.tolist()):
        emitted.setdefault(i, []).append(token)
    rejected = [seed for seed in range(NUM_SEEDS) if len(emitted[seed]) == 1]
    firsts = torch.tensor([emitted[seed][0] for seed in rejected])
    seconds = dict(zip(rejected, sample([params] * len(rejected), rejected, [1] * len(rejected), SECOND[firsts]).tolist()))
    pairs = [(emitted[seed][0], emitted[seed][1] if seed not in seconds else seconds[seed]) for seed in range(NUM_SEEDS)]
    return pairs, sum(verified.num_accepted)


def test_rejection_with_the_drafters_distribution_is_lossless_and_accepts_min_p_q():
    """Told the q its drafts came from, rejection sampling keeps the target's distribution and accepts
    with probability sum min(p, q), more than the sum q p of treating the drafts as one-hot."""
    p = torch.softmax(FIRST / PARAMS.temperature, -1)
    for pass_q, rate in ((True, float(torch.minimum(p, DRAFTER).sum())), (False, float((p * DRAFTER).sum()))):
        pairs, accepted = with_draft_distribution(PARAMS, pass_q)
        assert chi_square(pairs, PARAMS) < critical_value(VOCAB * VOCAB - 1)
        sigma = math.sqrt(NUM_SEEDS * rate * (1 - rate))
        assert abs(accepted - NUM_SEEDS * rate) < 4 * sigma, (pass_q, accepted, NUM_SEEDS * rate)


def test_accepting_without_logprobs_emits_the_same_tokens_and_gathers_nothing():
    """With no request reading logprobs the emitted rows are the same, their logprobs NaN and ranks 0
    on the host; asked for, each emitted row keeps its sampled row's logprob and rank."""
    plan = StepPlan((ScheduledRequest("a", 4, (9, 1, 2), True, num_draft_tokens=2),
                     ScheduledRequest("b", 7, (3,), True), ScheduledRequest("c", 5, (9, 0), True, num_draft_tokens=1)))
    rows = verify.logits_row_requests(plan, [0, 1, 2])
    output = SamplerOutput(token_ids=torch.tensor([1, 3, 0, 2, 0, 1]), logprobs=torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]),
                           ranks=torch.tensor([1, 2, 3, 4, 5, 6]))
    read = verify.accept_drafts(plan, rows, output)
    unread = verify.accept_drafts(plan, rows, output, needs_logprobs=False)
    assert read.num_accepted == unread.num_accepted == [1, 0, 1]
    assert read.sampled == unread.sampled == [0, 0, 1, 2, 2]
    assert read.output.token_ids.tolist() == unread.output.token_ids.tolist() == [1, 3, 2, 0, 1]
    assert read.output.logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.4, -0.5, -0.6])
    assert read.output.ranks.tolist() == [1, 2, 4, 5, 6]
    assert unread.output.logprobs.isnan().all() and unread.output.ranks.tolist() == [0] * 5
