"""Per-step sampling helpers: tensors for the sampler, stop decisions, logprob entries."""

import dataclasses

import pytest
import torch

from deepinfer_core.backends.sampling import SamplerOutput, SamplingSpec
from deepinfer_core.backends.sampling_tensors import banned_token_ids, prepare_sampling_tensors
from deepinfer_core.engine.input import bad_words_token_ids, check_sampling_params
from deepinfer_core.engine.output import build_logprobs_entry, check_stop
from deepinfer_core.outputs import Logprob
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.sampling_params import MAX_SEED, SamplingParams, needs_token_history

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


# -- vLLM's logit adjustments: what the runner hands the sampler, and checks against the model -------------

VOCAB = 10


class WordTokenizer:
    """Each character is a token (id = its letter's place, a space is 9): "ab" -> [0, 1], " ab" -> [9, 1]."""

    def encode(self, text: str) -> list[int]:
        ids = [9 if c == " " else ord(c) - ord("a") for c in text]
        return [ids[1]] + ids[2:] if ids[:1] == [9] else ids  # a leading space merges into the first token

    def decode(self, ids, skip_special_tokens=False):
        return "".join(" " if t == 9 else chr(ord("a") + t) for t in ids)


def test_penalty_tensors_hold_padded_ids_of_penalised_rows_only():
    params = [SamplingParams(presence_penalty=0.5), SamplingParams(), SamplingParams(repetition_penalty=1.2)]
    tensors = prepare_sampling_tensors(params, [0, 1, 2], [2, 1, 3], EOS, CPU, VOCAB,
                                       output_token_ids=[[4, 4], [3], [1, 2, 3]], prompt_token_ids=[[5], [6], [7, 8]])
    p = tensors.penalties
    assert p.presence.tolist() == [0.5, 0.0, 0.0] and p.repetition.tolist() == pytest.approx([1.0, 1.0, 1.2])
    assert p.output_token_ids.tolist() == [[4, 4, VOCAB], [VOCAB] * 3, [1, 2, 3]]
    assert p.prompt_token_ids.tolist() == [[VOCAB, VOCAB], [VOCAB, VOCAB], [7, 8]]
    assert prepare_sampling_tensors(params[1:2], [0], [0], EOS, CPU, VOCAB).penalties is None
    with pytest.raises(ValueError, match="output_token_ids"):
        prepare_sampling_tensors(params, [0, 1, 2], [0, 0, 0], EOS, CPU, VOCAB)


def test_penalties_reach_the_sampler_from_the_runners_ids():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    sampler = ReferenceSampler(SamplingSpec(vocab_size=VOCAB), CPU)
    params = [SamplingParams(temperature=0, frequency_penalty=0.075)]
    once = prepare_sampling_tensors(params, [0], [1], EOS, CPU, VOCAB, output_token_ids=[[0]])
    assert sampler.sample(logits, once).token_ids.item() == 0  # 3.0 - 0.075 > 2.9
    twice = prepare_sampling_tensors(params, [0], [2], EOS, CPU, VOCAB, output_token_ids=[[0, 0]])
    assert sampler.sample(logits, twice).token_ids.item() == 1  # 3.0 - 0.15 < 2.9


def test_logit_bias_and_allowed_ids_become_sparse_rows():
    params = [SamplingParams(logit_bias={3: 1.5, 8: -2.0}), SamplingParams(allowed_token_ids=[2, 5]),
              SamplingParams(logit_bias={1: 0.5})]
    tensors = prepare_sampling_tensors(params, [0, 1, 2], [0, 0, 0], EOS, CPU, VOCAB)
    bias = tensors.logit_bias
    assert list(zip(bias.rows.tolist(), bias.token_ids.tolist(), bias.values.tolist())) == [
        (0, 3, 1.5), (0, 8, -2.0), (2, 1, 0.5)]
    allowed = tensors.allowed_token_ids
    assert (allowed.rows.tolist(), allowed.token_ids.tolist(), allowed.values) == ([1, 1], [2, 5], None)
    plain = prepare_sampling_tensors([SamplingParams()], [0], [0], EOS, CPU, VOCAB)
    assert plain.logit_bias is None and plain.allowed_token_ids is None and plain.penalties is None


def test_bad_words_are_tokenized_alone_and_after_a_space():
    assert bad_words_token_ids(["ab", " c"], WordTokenizer()) == [[0, 1], [2]]  # " ab" merges to [0, 1]


def test_bad_words_ban_the_last_token_after_the_rest_of_the_word():
    params = SamplingParams(bad_words=["abc", "h"])
    check_sampling_params(params, VOCAB, WordTokenizer(), EOS, token_history=True)
    assert params.bad_words_token_ids == [[0, 1, 2], [7]]
    assert banned_token_ids(params, 5, EOS, [4, 0, 1]) == [2, 7]  # output ends "ab": "c" is banned
    assert banned_token_ids(params, 5, EOS, [0, 1, 4]) == [7]
    tensors = prepare_sampling_tensors([params], [0], [3], EOS, CPU, VOCAB, output_token_ids=[[4, 0, 1]])
    assert tensors.banned_token_ids == [[2, 7]]
    with pytest.raises(ValueError, match="several tokens need output_token_ids"):
        prepare_sampling_tensors([params], [0], [3], EOS, CPU, VOCAB)
    single = SamplingParams(bad_words=["h"])
    check_sampling_params(single, VOCAB, WordTokenizer(), EOS)  # one token: no history needed
    assert prepare_sampling_tensors([single], [0], [0], EOS, CPU, VOCAB).banned_token_ids == [[7]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stop_token_ids": [3, VOCAB]}, r"stop_token_ids has ids \[10\] outside the vocabulary \[0, 10\)"),
        ({"allowed_token_ids": [2**31 - 1]}, "allowed_token_ids has ids"),
        ({"logit_bias": {12: 1.0}}, "logit_bias has ids"),
        ({"allowed_token_ids": [1], "min_tokens": 2}, "banned until min_tokens"),
    ],
)
def test_ids_the_model_cannot_have_are_rejected_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_sampling_params(SamplingParams(**kwargs), VOCAB, None, EOS)


def test_bad_words_need_a_tokenizer():
    with pytest.raises(ValueError, match="need the checkpoint's tokenizer"):
        check_sampling_params(SamplingParams(bad_words=["x"]), VOCAB, None, EOS)


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 0.1}, {"frequency_penalty": -1}, {"repetition_penalty": 1.1},
                                    {"bad_words": ["ab"]}])
def test_fields_that_need_generated_ids_say_so_until_the_runner_passes_them(kwargs):
    with pytest.raises(NotImplementedError, match=next(iter(kwargs)).split("_")[0]):
        check_sampling_params(SamplingParams(**kwargs), VOCAB, WordTokenizer(), EOS)
    params = SamplingParams(**kwargs)
    check_sampling_params(params, VOCAB, WordTokenizer(), EOS, token_history=True)
    assert needs_token_history(params)
    single_word = SamplingParams(bad_words=["h"], logit_bias={1: 2.0}, allowed_token_ids=[1, 2])
    check_sampling_params(single_word, VOCAB, WordTokenizer(), EOS)
    assert not needs_token_history(single_word)
