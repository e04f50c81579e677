"""SamplingParams: vLLM defaults, DeepInfer 0.1 spellings, validation and clone."""

import math

import numpy
import pytest

from deepinfer_core.sampling_params import MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_TOKEN_ID, SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.seed, params.max_tokens, params.min_tokens, params.logprobs) == (None, 16, 0, None)
    assert params.stop_token_ids == [] and params.ignore_eos is False
    assert not params.is_greedy


@pytest.mark.parametrize(("temperature", "is_greedy"), [(0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_greedy_below_threshold(temperature, is_greedy):
    assert SamplingParams(temperature=temperature).is_greedy is is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens=17 exceeds max_tokens=16"),
        ({"n": 0}, "n must"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
        ({"top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
        ({"seed": -1}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"seed": 1, "seq_seed": 2}, "alias of seed"),
        ({"logprobs": 3, "top_logprobs": 5}, "alias of logprobs"),
    ],
)
def test_invalid_values_raise_with_the_field_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
        ({"stop_token_ids": ["3"]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
        ({"stop": 5}, "stop must be"),
        ({"stop": [b"x"]}, "stop must be"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"logit_bias": [(3, 1.0)]}, "logit_bias must be a dict"),
        ({"bad_words": "word"}, "bad_words must be a list"),
    ],
)
def test_wrong_types_raise_value_error_as_the_readme_promises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_are_normalised_and_checked():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=[]).stop is None
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": MAX_N + 1}, f"n must be an integer in \\[1, {MAX_N}\\]"),
        ({"n": 100000}, f"\\[1, {MAX_N}\\]"),
        ({"top_k": 2**63}, f"top_k must be an integer in \\[-1, {MAX_TOKEN_ID}\\]"),
        ({"stop_token_ids": [2**63]}, f"stop_token_ids entry must be an integer in \\[0, {MAX_TOKEN_ID}\\]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in \\[-2, 2\\]"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias key"),
        ({"logit_bias": {3: math.nan}}, "logit_bias\\[3\\]"),
        ({"allowed_token_ids": []}, "allowed_token_ids is empty"),
        ({"allowed_token_ids": [1, -4]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_bounds_are_checked_before_any_work_and_say_the_bound(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_numpy_integers_are_plain_ints():
    params = SamplingParams(seed=numpy.int64(3), top_k=numpy.int32(5), n=numpy.int64(2), max_tokens=numpy.uint8(9),
                            stop_token_ids=[numpy.int64(7)], logprobs=numpy.int16(1), presence_penalty=numpy.float32(0.5))
    assert params.seed == params.seq_seed == 3 and type(params.seed) is int
    assert [type(v) for v in (params.top_k, params.n, params.max_tokens, params.logprobs)] == [int] * 4
    assert type(params.stop_token_ids[0]) is int and type(params.presence_penalty) is float


def test_vllm_fields_default_off_and_normalise():
    params = SamplingParams()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.logit_bias is None and params.bad_words is None and params.allowed_token_ids is None
    assert not params.include_stop_str_in_output and params.skip_special_tokens
    assert params.truncate_prompt_tokens is None
    biased = SamplingParams(logit_bias={"5": 250, 7: -1}, truncate_prompt_tokens=-1)
    assert biased.logit_bias == {5: 100.0, 7: -1.0}  # JSON string keys read, clamped as vLLM does
    assert biased.truncate_prompt_tokens == -1


def test_edges_of_the_ranges_are_accepted():
    params = SamplingParams(
        top_p=1.0, top_k=-1, min_p=1.0, seed=MAX_SEED, logprobs=MAX_LOGPROBS, min_tokens=16, max_tokens=16
    )
    assert params.seed == MAX_SEED and params.logprobs == MAX_LOGPROBS
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_seq_seed_is_an_alias_of_seed():
    assert SamplingParams(seq_seed=7).seed == 7
    assert SamplingParams(seed=7).seq_seed == 7
    assert SamplingParams(seed=7, seq_seed=7).seed == 7


@pytest.mark.parametrize(
    ("kwargs", "logprobs"),
    [
        ({"logprobs": True}, 0),
        ({"logprobs": False}, None),
        ({"top_logprobs": 5}, 5),
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": False, "top_logprobs": 5}, 5),
        ({"logprobs": 5, "top_logprobs": 5}, 5),
        ({"logprobs": 2, "top_logprobs": 0}, 2),
        ({"top_logprobs": 0}, None),
    ],
)
def test_deepinfer_01_logprob_spellings(kwargs, logprobs):
    params = SamplingParams(**kwargs)
    assert params.logprobs == logprobs
    assert params.top_logprobs == (logprobs or 0)


def test_prompt_logprobs_bool_becomes_a_count():
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=False).prompt_logprobs is None
    assert SamplingParams(prompt_logprobs=3).prompt_logprobs == 3


def test_first_n_token_no_eos_raises_min_tokens():
    assert SamplingParams(first_n_token_no_eos=1).min_tokens == 1
    assert SamplingParams(first_n_token_no_eos=1, min_tokens=4).min_tokens == 4


def test_clone_is_independent_and_equal():
    params = SamplingParams(temperature=0.5, seq_seed=3, top_logprobs=4, stop_token_ids=[9])
    copy = params.clone()
    assert copy == params
    copy.stop_token_ids.append(10)
    assert params.stop_token_ids == [9]


def test_integer_like_floats_are_normalised():
    params = SamplingParams(temperature=1, top_p=1, min_p=0)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert isinstance(params.min_p, float)


def test_clone_keeps_attributes_changed_after_construction():
    params = SamplingParams(seed=3, top_logprobs=2)
    params.seed, params.logprobs = 9, 5
    copy = params.clone()
    assert (copy.seed, copy.logprobs) == (9, 5)
