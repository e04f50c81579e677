"""ReferenceSampler: greedy, filters, batch-invariant seeded draws, distribution, logprobs, bans, and
the logit adjustments (allowed ids, logit bias, penalties)."""

import dataclasses

import pytest
import torch

from deepinfer_core.backends.sampling import (
    SamplingBackend,
    SamplingSpec,
    SamplingTensors,
    SparseTokenValues,
    TokenPenalties,
)
from deepinfer_core.backends.sampling_ops import apply_penalties
from deepinfer_core.reference.sampling import ReferenceSampler, seeded_uniforms

VOCAB = 8
MASK_64 = (1 << 64) - 1


def make_params(
    num_rows,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seeds=None,
    steps=None,
    num_logprobs=0,
    banned=None,
):
    def column(value, dtype):
        if isinstance(value, (list, tuple)):
            return torch.tensor(value, dtype=dtype)
        return torch.full((num_rows,), value, dtype=dtype)

    return SamplingTensors(
        temperature=column(temperature, torch.float32),
        top_k=column(top_k, torch.int64),
        top_p=column(top_p, torch.float32),
        min_p=column(min_p, torch.float32),
        seeds=column(list(range(num_rows)) if seeds is None else seeds, torch.int64),
        steps=column(0 if steps is None else steps, torch.int64),
        num_logprobs=num_logprobs,
        banned_token_ids=banned,
    )


@pytest.fixture
def sampler():
    return ReferenceSampler(SamplingSpec(vocab_size=VOCAB), torch.device("cpu"))


def random_logits(num_rows, seed=0):
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def frequencies(token_ids):
    return torch.bincount(token_ids, minlength=VOCAB).double() / token_ids.numel()


def test_satisfies_the_protocol(sampler):
    assert isinstance(sampler, SamplingBackend)


def test_greedy_rows_take_the_argmax(sampler):
    logits = random_logits(16)
    out = sampler.sample(logits, make_params(16, temperature=0.0))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_one_equals_greedy_for_any_seed(sampler):
    logits = random_logits(64)
    out = sampler.sample(logits, make_params(64, temperature=1.3, top_k=1))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_tiny_top_p_keeps_only_the_top_token(sampler):
    logits = random_logits(64)
    out = sampler.sample(logits, make_params(64, temperature=2.0, top_p=1e-6))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_draws_only_from_the_k_most_likely(sampler):
    logits = random_logits(1).repeat(2000, 1)
    out = sampler.sample(logits, make_params(2000, temperature=5.0, top_k=3))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(out.token_ids.tolist()) == allowed


def test_top_p_keeps_the_nucleus_renormalised(sampler):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0], dtype=torch.float64)
    logits = probs.clamp(min=1e-9).log().float().repeat(20000, 1)
    out = sampler.sample(logits, make_params(20000, top_p=0.75))
    observed = frequencies(out.token_ids)
    assert observed[2:].sum() == 0
    assert abs(observed[0] - 0.5 / 0.8) < 0.02 and abs(observed[1] - 0.3 / 0.8) < 0.02


def test_min_p_drops_tokens_below_the_fraction_of_the_top(sampler):
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01], dtype=torch.float64)
    logits = probs.log().float().repeat(20000, 1)
    out = sampler.sample(logits, make_params(20000, min_p=0.3))  # keeps p >= 0.12
    observed = frequencies(out.token_ids)
    assert observed[3:].sum() == 0
    expected = probs[:3] / probs[:3].sum()
    assert torch.allclose(observed[:3], expected, atol=0.02)


def test_seeded_draws_do_not_depend_on_batch_composition_or_order(sampler):
    logits = random_logits(6)
    params = make_params(
        6, temperature=1.0, top_p=0.9, seeds=[11, 12, 13, 14, 15, 16], steps=[0, 3, 5, 7, 9, 2]
    )
    full = sampler.sample(logits, params).token_ids
    order = torch.tensor([4, 1, 5])
    subset = make_params(
        3,
        temperature=1.0,
        top_p=[0.9, 0.9, 0.9],
        seeds=params.seeds[order].tolist(),
        steps=params.steps[order].tolist(),
    )
    alone = sampler.sample(logits[order], subset).token_ids
    assert torch.equal(alone, full[order])
    again = sampler.sample(logits, params).token_ids
    assert torch.equal(again, full)


def test_draws_change_with_seed_and_step(sampler):
    logits = torch.zeros(400, VOCAB)
    by_seed = sampler.sample(logits, make_params(400, seeds=list(range(400)))).token_ids
    by_step = sampler.sample(logits, make_params(400, seeds=7, steps=list(range(400)))).token_ids
    assert len(set(by_seed.tolist())) == VOCAB and len(set(by_step.tolist())) == VOCAB
    assert not torch.equal(by_seed, by_step)


@pytest.mark.parametrize("vary", ["seed", "step"])
def test_empirical_distribution_matches_softmax_over_temperature(sampler, vary):
    num_draws, temperature = 40000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    seeds = list(range(num_draws)) if vary == "seed" else 12345
    steps = list(range(num_draws)) if vary == "step" else 0
    params = make_params(num_draws, temperature=temperature, seeds=seeds, steps=steps)
    observed = frequencies(sampler.sample(logits.repeat(num_draws, 1), params).token_ids)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    tolerance = 5 * (expected * (1 - expected) / num_draws).sqrt() + 1e-4
    assert ((observed - expected).abs() < tolerance).all(), (observed, expected)


def test_logprobs_and_ranks_are_those_of_the_raw_log_softmax(sampler):
    logits = random_logits(12)
    banned = [[int(logits[i].argmax())] if i % 2 else [] for i in range(12)]
    params = make_params(12, temperature=[0.0] * 6 + [0.8] * 6, top_k=2, num_logprobs=3, banned=banned)
    out = sampler.sample(logits, params)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    expected_ranks = (raw > out.logprobs[:, None]).sum(-1) + 1
    assert torch.equal(out.ranks, expected_ranks)
    # A banned argmax pushes the chosen token to rank >= 2.
    assert (out.ranks[1::2] >= 2).all()
    top_values, top_ids = raw.topk(3, dim=-1)
    assert torch.equal(out.top_token_ids, top_ids) and torch.allclose(out.top_logprobs, top_values)


def test_no_top_logprobs_when_none_requested(sampler):
    out = sampler.sample(random_logits(2), make_params(2))
    assert out.top_token_ids is None and out.top_logprobs is None


def test_banned_ids_are_never_chosen(sampler):
    logits = torch.zeros(3000, VOCAB)
    logits[:, 5] = 10.0
    banned = [[5, 0, 1] for _ in range(3000)]
    greedy = sampler.sample(logits, make_params(3000, temperature=0.0, banned=banned)).token_ids
    sampled = sampler.sample(logits, make_params(3000, temperature=1.0, banned=banned)).token_ids
    assert not set(greedy.tolist()) & {5, 0, 1}
    assert not set(sampled.tolist()) & {5, 0, 1}
    assert len(set(sampled.tolist())) == VOCAB - 3
    assert logits[0, 5] == 10.0  # the caller's logits are left untouched


def test_mixed_batch_rows_follow_their_own_parameters(sampler):
    logits = random_logits(4)
    params = make_params(4, temperature=[0.0, 1.0, 0.0, 1.0], top_k=[0, 1, 0, 0], seeds=[1, 2, 3, 4])
    out = sampler.sample(logits, params).token_ids
    assert out[0] == logits[0].argmax() and out[1] == logits[1].argmax() and out[2] == logits[2].argmax()
    alone = sampler.sample(logits[3:], make_params(1, seeds=[4])).token_ids
    assert out[3] == alone[0]


def test_rejects_wrong_width_and_too_many_logprobs(sampler):
    with pytest.raises(ValueError, match="logits must be"):
        sampler.sample(torch.zeros(2, VOCAB + 1), make_params(2))
    with pytest.raises(ValueError, match="max_logprobs"):
        sampler.sample(torch.zeros(2, VOCAB), make_params(2, num_logprobs=21))


def _splitmix_finaliser(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    return z ^ (z >> 31)


def test_seeded_uniforms_follow_the_documented_function():
    """Plugins reproduce this function to draw the reference's tokens; it must not drift."""
    seed, step = 2**64 - 12345, 41
    key = _splitmix_finaliser(_splitmix_finaliser(seed) ^ step)
    expected = [
        ((_splitmix_finaliser((key + 0x9E3779B97F4A7C15 * (v + 1)) & MASK_64) >> 11) + 0.5) / 2**53
        for v in range(VOCAB)
    ]
    got = seeded_uniforms(torch.tensor([seed - 2**64]), torch.tensor([step]), VOCAB)[0].tolist()
    assert got == expected
    assert all(0 < u < 1 for u in got)


def test_logprobs_can_be_skipped_without_changing_tokens(sampler):
    logits = random_logits(6, seed=4)
    params = make_params(6, temperature=[0.0, 0.7, 1.0, 0.0, 1.3, 0.5], seeds=[1, 2, 3, 4, 5, 6])
    full = sampler.sample(logits, params)
    params.needs_logprobs = False
    lean = sampler.sample(logits, params)
    assert torch.equal(full.token_ids, lean.token_ids)
    assert torch.isnan(lean.logprobs).all() and not torch.isnan(full.logprobs).any()


# -- logit adjustments (vLLM's allowed ids, logit bias and penalties), shared by every sampler -----------


PAD = VOCAB  # ids past the vocabulary pad the penalty id rows


def penalties(presence, frequency, repetition, outputs, prompts=None):
    def padded(rows):
        width = max(map(len, rows))
        return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])

    return TokenPenalties(
        presence=torch.tensor(presence), frequency=torch.tensor(frequency), repetition=torch.tensor(repetition),
        output_token_ids=padded(outputs), prompt_token_ids=None if prompts is None else padded(prompts))


def test_penalties_follow_vllms_formula_by_hand():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    # outputs: token 0 twice, token 2 once; the prompt holds token 3
    adjusted = apply_penalties(logits, penalties([0.5], [0.25], [2.0], [[0, 0, 2]], [[3]]))
    # repetition: 2.0/2, -1.0*2, 0.5/2 on seen ids; then frequency 0.25 x count; then presence 0.5 if generated
    expected = [2.0 / 2 - 0.25 * 2 - 0.5, 1.0, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2, 0.0, 0.0, 0.0, 0.0]
    assert adjusted[0].tolist() == pytest.approx(expected)


def test_penalties_change_the_greedy_choice_but_not_the_raw_logprobs(sampler):
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0]] * 2)
    plain = make_params(2, temperature=0.0, num_logprobs=1)
    penalised = dataclasses.replace(plain, penalties=penalties([0.5, 0.0], [0.25, 0.0], [2.0, 1.0],
                                                               [[0, 0, 2], [0, 0, 2]], [[3], [3]]))
    out = sampler.sample(logits, penalised)
    assert out.token_ids.tolist() == [1, 0]  # row 1 has no penalty (0, 0, 1): still the argmax
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.tolist() == pytest.approx([raw[0, 1].item(), raw[1, 0].item()])


def test_logit_bias_and_allowed_ids_by_hand(sampler):
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(3, 1)  # argmax is the last id
    bias = SparseTokenValues(rows=torch.tensor([0, 0]), token_ids=torch.tensor([2, 7]),
                             values=torch.tensor([100.0, -1.5]))
    allowed = SparseTokenValues(rows=torch.tensor([1, 1]), token_ids=torch.tensor([1, 4]))
    params = dataclasses.replace(make_params(3, temperature=0.0), logit_bias=bias, allowed_token_ids=allowed)
    assert sampler.sample(logits, params).token_ids.tolist() == [2, 4, VOCAB - 1]
    drawn = dataclasses.replace(params, temperature=torch.ones(3), seeds=torch.arange(3))
    for step in range(20):  # a drawing row restricted to {1, 4} never leaves the set
        token = sampler.sample(logits, dataclasses.replace(drawn, steps=torch.full((3,), step))).token_ids[1]
        assert token.item() in (1, 4)


def test_adjusted_draws_do_not_depend_on_batch_order(sampler):
    logits = random_logits(4, seed=7)
    params = make_params(4, temperature=0.9, seeds=[5, 6, 7, 8], steps=[1, 2, 3, 4])
    params = dataclasses.replace(
        params, penalties=penalties([0.3, 0.0, -0.4, 1.0], [0.2, 0.5, 0.0, 0.0], [1.3, 1.0, 0.8, 1.0],
                                    [[1, 1, 2], [0], [5, 5, 5, 5], []], [[3], [4], [6, 6], [0]]),
        logit_bias=SparseTokenValues(rows=torch.tensor([0, 3]), token_ids=torch.tensor([4, 2]),
                                     values=torch.tensor([2.0, -3.0])),
        allowed_token_ids=SparseTokenValues(rows=torch.tensor([2, 2, 2]), token_ids=torch.tensor([0, 5, 6])))
    tokens = sampler.sample(logits, params).token_ids
    order = [3, 1, 0, 2]
    where = {row: i for i, row in enumerate(order)}

    def permute_sparse(sparse):
        return dataclasses.replace(sparse, rows=torch.tensor([where[r] for r in sparse.rows.tolist()]))

    p = params.penalties
    reordered = dataclasses.replace(
        params, **{name: getattr(params, name)[order] for name in ("temperature", "top_k", "top_p", "min_p",
                                                                    "seeds", "steps")},
        penalties=TokenPenalties(p.presence[order], p.frequency[order], p.repetition[order],
                                 p.output_token_ids[order], p.prompt_token_ids[order]),
        logit_bias=permute_sparse(params.logit_bias), allowed_token_ids=permute_sparse(params.allowed_token_ids))
    again = sampler.sample(logits[order], reordered).token_ids
    assert again.tolist() == tokens[order].tolist()
    assert tokens[2].item() in (0, 5, 6)


def test_rows_cut_to_a_few_tokens_draw_as_the_whole_vocabulary_would():
    """A row a grammar or filter cut to a few finite logits draws noise for those only (the sparse path);
    its token is the one the full-vocabulary draw gives, ties going to the lowest id either way."""
    from deepinfer_core.reference.sampling import _dense_gumbel_argmax, _gumbel_argmax

    width = 4096
    scaled = torch.full((6, width), float("-inf"))
    generator = torch.Generator().manual_seed(3)
    for row, allowed in enumerate([[7], [0, width - 1], list(range(100, 400)), [5, 9, 11]]):
        scaled[row, allowed] = torch.randn(len(allowed), generator=generator)
    scaled[3, [5, 9, 11]] = float("inf")  # a tie: the lowest id wins, as argmax's
    scaled[4] = torch.randn(width, generator=generator)  # dense: drawn over the whole vocabulary
    # row 5: no finite logit at all (argmax's answer, id 0)
    seeds, steps = torch.arange(6) * 7919 - 2**62, torch.arange(6) + 3
    for trial in range(20):
        got = _gumbel_argmax(scaled, seeds + trial, steps)
        assert torch.equal(got, _dense_gumbel_argmax(scaled, seeds + trial, steps))
    assert got[3] == 5 and got[5] == 0
    assert len({int(_gumbel_argmax(scaled[2:3], seeds[2:3] + t, steps[2:3])) for t in range(20)}) > 1
