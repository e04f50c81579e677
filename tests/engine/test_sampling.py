"""Per-step sampling helpers: tensors for the sampler, stop decisions, logprob entries."""

import dataclasses

import pytest
import torch

from deepinfer_core.backends.sampling import SamplerOutput, SamplingSpec
from deepinfer_core.engine.sampling import (
    banned_token_ids,
    build_logprobs_entry,
    check_stop,
    prepare_sampling_tensors,
)
from deepinfer_core.outputs import Logprob
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.sampling_params import MAX_SEED, SamplingParams

EOS = [1]
CPU = torch.device("cpu")


def test_tensors_hold_each_rows_parameters():
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, logprobs=4),
        SamplingParams(temperature=1e-7),
    ]
    tensors = prepare_sampling_tensors(params, [3, 4, MAX_SEED], [0, 5, 9], EOS, CPU)
    assert tensors.temperature.tolist() == pytest.approx([0.0, 0.7, 0.0])
    assert tensors.top_k.tolist() == [0, 5, 0]
    assert tensors.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert tensors.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert tensors.seeds.tolist() == [3, 4, -1]  # 2**64 - 1 keeps its bits as int64
    assert tensors.steps.tolist() == [0, 5, 9]
    assert tensors.num_logprobs == 4
    assert tensors.banned_token_ids is None


def test_host_flags_say_which_filters_some_drawing_row_uses():
    greedy = SamplingParams(temperature=0.0, top_k=5, min_p=0.5)  # greedy rows never filter
    assert prepare_sampling_tensors([greedy], [0], [0], EOS, CPU).host_flags is None  # no vocab: no flags
    assert prepare_sampling_tensors([greedy], [0], [0], EOS, CPU, 100).host_flags == (False, False, False)
    whole_vocab = SamplingParams(temperature=1.0, top_k=100)
    assert prepare_sampling_tensors([greedy, whole_vocab], [0, 1], [0, 0], EOS, CPU, 100).host_flags == (
        True, False, False)
    nucleus = SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1)
    assert prepare_sampling_tensors([whole_vocab, nucleus], [0, 1], [0, 0], EOS, CPU, 100).host_flags == (
        True, True, True)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[7, 8])
    assert sorted(banned_token_ids(params, 0, EOS)) == [1, 7, 8]
    assert sorted(banned_token_ids(params, 1, EOS)) == [1, 7, 8]
    assert banned_token_ids(params, 2, EOS) == []
    tensors = prepare_sampling_tensors([params, SamplingParams()], [0, 0], [1, 1], EOS, CPU)
    assert sorted(tensors.banned_token_ids[0]) == [1, 7, 8] and tensors.banned_token_ids[1] == []


def test_ignore_eos_does_not_ban_eos_but_still_bans_stop_ids():
    params = SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[7])
    assert banned_token_ids(params, 0, EOS) == [7]


def test_min_tokens_ban_reaches_the_sampler():
    logits = torch.zeros(1, 4)
    logits[0, 1] = 50.0  # EOS is overwhelmingly likely
    sampler = ReferenceSampler(SamplingSpec(vocab_size=4), CPU)
    params = [SamplingParams(temperature=0.0, min_tokens=1)]
    first = sampler.sample(logits, prepare_sampling_tensors(params, [0], [0], EOS, CPU))
    later = sampler.sample(logits, prepare_sampling_tensors(params, [0], [1], EOS, CPU))
    assert first.token_ids.item() != 1 and later.token_ids.item() == 1


def test_mismatched_row_counts_raise():
    with pytest.raises(ValueError, match="one entry per row"):
        prepare_sampling_tensors([SamplingParams()], [0, 1], [0], EOS, CPU)


def test_eos_stops_unless_ignored():
    assert check_stop(SamplingParams(), 1, 3, EOS, False) == "stop"
    assert check_stop(SamplingParams(ignore_eos=True), 1, 3, EOS, False) is None
    assert check_stop(SamplingParams(), 5, 3, EOS, False) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    params = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    assert check_stop(params, 9, 2, EOS, False) == "stop"


def test_stops_do_not_count_before_min_tokens():
    params = SamplingParams(min_tokens=3, stop_token_ids=[9])
    assert check_stop(params, 1, 2, EOS, False) is None
    assert check_stop(params, 9, 2, EOS, False) is None
    assert check_stop(params, 9, 3, EOS, False) == "stop"


def test_length_from_max_tokens_or_a_full_context():
    assert check_stop(SamplingParams(max_tokens=4), 5, 3, EOS, False) is None
    assert check_stop(SamplingParams(max_tokens=4), 5, 4, EOS, False) == "length"
    assert check_stop(SamplingParams(max_tokens=None), 5, 10_000, EOS, False) is None
    assert check_stop(SamplingParams(max_tokens=None), 5, 7, EOS, True) == "length"
    assert check_stop(SamplingParams(min_tokens=8, max_tokens=8), 5, 3, EOS, True) == "length"


def test_stop_wins_over_length_on_the_same_token():
    assert check_stop(SamplingParams(max_tokens=4), 1, 4, EOS, True) == "stop"


def sampler_output():
    return SamplerOutput(
        token_ids=torch.tensor([4, 2]),
        logprobs=torch.tensor([-2.5, -0.1]),
        ranks=torch.tensor([3, 1]),
        top_token_ids=torch.tensor([[0, 7, 4], [2, 5, 6]]),
        top_logprobs=torch.tensor([[-0.5, -1.0, -2.5], [-0.1, -3.0, -4.0]]),
    )


def test_logprobs_entry_puts_the_sampled_token_first_then_the_top_k():
    entry = build_logprobs_entry(sampler_output(), 0, 2, decode=lambda t: f"<{t}>")
    assert list(entry) == [4, 0, 7]
    assert entry[4] == Logprob(logprob=-2.5, rank=3, decoded_token="<4>")
    assert entry[0] == Logprob(logprob=-0.5, rank=1, decoded_token="<0>")
    assert entry[7].rank == 2


def test_logprobs_entry_lists_a_sampled_top_token_once():
    entry = build_logprobs_entry(sampler_output(), 1, 3)
    assert list(entry) == [2, 5, 6]
    assert entry[2] == Logprob(logprob=pytest.approx(-0.1), rank=1, decoded_token=None)


def test_logprobs_entry_with_zero_top_holds_only_the_sampled_token():
    entry = build_logprobs_entry(sampler_output(), 0, 0)
    assert list(entry) == [4] and entry[4].rank == 3


def test_logprobs_entry_requires_enough_top_logprobs():
    with pytest.raises(ValueError, match="fewer than"):
        build_logprobs_entry(sampler_output(), 0, 5)


def test_logprobs_entry_reads_host_lists_like_tensors():
    output = sampler_output()
    lists = dataclasses.replace(output, **{f.name: getattr(output, f.name).tolist() for f in dataclasses.fields(output)})
    for row, num_logprobs in ((0, 2), (1, 3), (0, 0)):
        assert build_logprobs_entry(lists, row, num_logprobs) == build_logprobs_entry(output, row, num_logprobs)
    with pytest.raises(ValueError, match="fewer than"):
        build_logprobs_entry(lists, 0, 5)
