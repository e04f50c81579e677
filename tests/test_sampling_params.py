"""SamplingParams: vLLM defaults, DeepInfer 0.1 spellings, validation and clone; whatever it accepts runs."""

import json
import math

import numpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.llm import LLM
from deepinfer_core.sampling_params import MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_TOKEN_ID, SamplingParams
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir


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


# -- property: whatever SamplingParams accepts runs through the engine (or is refused before any work) ----

VOCAB = 129280  # the embedded model's
HUGE_INTS = st.one_of(st.integers(-(2**65), 2**65), st.integers(0, 2**64 - 1).map(numpy.uint64))
ANY_FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-1e30, 1e30))
JUNK = st.one_of(st.none(), st.text(max_size=3), st.integers(-1, 2), st.floats(), st.lists(st.none(), max_size=1))
SMALL_IDS = st.lists(st.integers(0, VOCAB - 1), max_size=3)


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    return valid, invalid


FIELDS = {  # per field: (values in range, numpy scalars too; then out-of-range values and bad types)
    "n": mostly(st.one_of(st.integers(1, 3), st.integers(1, 2).map(numpy.int64)),
                st.one_of(st.integers(-1, 0), st.just(MAX_N + 1), HUGE_INTS)),
    "temperature": mostly(st.one_of(st.floats(0, 2), st.just(0), st.floats(1e-6, 1e-4)), st.one_of(ANY_FLOAT, JUNK)),
    "top_p": mostly(st.floats(1e-9, 1.0), st.one_of(ANY_FLOAT, JUNK)),
    "top_k": mostly(st.one_of(st.integers(-1, 50), st.integers(0, 2**31 - 1), st.integers(0, 9).map(numpy.int32)),
                    st.one_of(HUGE_INTS, JUNK)),
    "min_p": mostly(st.floats(0, 1), st.one_of(ANY_FLOAT, JUNK)),
    "seed": mostly(st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(0, 9).map(numpy.int64)),
                   st.one_of(HUGE_INTS, st.floats())),
    "stop": mostly(st.one_of(st.none(), st.text(min_size=1, max_size=2), st.lists(st.text(min_size=1, max_size=2),
                                                                                  max_size=2)), JUNK),
    "stop_token_ids": mostly(SMALL_IDS, st.one_of(st.lists(st.one_of(st.integers(VOCAB, VOCAB + 2), HUGE_INTS),
                                                           min_size=1, max_size=2), JUNK)),
    "ignore_eos": mostly(st.booleans(), JUNK),
    "max_tokens": mostly(st.one_of(st.integers(1, 6), st.none(), st.integers(1, 4).map(numpy.int32)),
                         st.one_of(st.integers(-1, 0), JUNK)),
    "min_tokens": mostly(st.integers(0, 6), st.one_of(st.integers(-2, -1), HUGE_INTS, JUNK)),
    "logprobs": mostly(st.one_of(st.none(), st.booleans(), st.integers(0, MAX_LOGPROBS)),
                       st.one_of(st.integers(-2, -1), st.just(MAX_LOGPROBS + 1), JUNK)),
    "prompt_logprobs": mostly(st.one_of(st.none(), st.booleans(), st.integers(0, 3)), st.one_of(st.just(-1), JUNK)),
    "presence_penalty": mostly(st.just(0.0), st.one_of(st.floats(-2, 2), ANY_FLOAT, JUNK)),
    "frequency_penalty": mostly(st.just(0.0), st.one_of(st.floats(-2, 2), ANY_FLOAT, JUNK)),
    "repetition_penalty": mostly(st.just(1.0), st.one_of(st.floats(0.01, 100), ANY_FLOAT, JUNK)),
    "logit_bias": mostly(st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-200, 200),
                                                               max_size=3)),
                         st.one_of(st.dictionaries(st.integers(VOCAB, 2**40), st.floats(), min_size=1, max_size=1),
                                   st.dictionaries(st.integers(0, 9), ANY_FLOAT, min_size=1, max_size=1), JUNK)),
    "bad_words": mostly(st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=4), max_size=2)), JUNK),
    "allowed_token_ids": mostly(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)),
                                st.one_of(st.just([]), st.lists(HUGE_INTS, min_size=1, max_size=1), JUNK)),
    "include_stop_str_in_output": mostly(st.booleans(), JUNK),
    "skip_special_tokens": mostly(st.booleans(), JUNK),
    "truncate_prompt_tokens": mostly(st.one_of(st.none(), st.just(-1), st.integers(1, 6)),
                                     st.one_of(st.integers(-3, 0), JUNK)),
}


# Half the examples draw only values in range (most then reach the engine); half mix in anything.
IN_RANGE = st.fixed_dictionaries({}, optional={name: valid for name, (valid, _) in FIELDS.items()})
ANYTHING = st.fixed_dictionaries({}, optional={name: st.one_of(v, bad) for name, (v, bad) in FIELDS.items()})


@pytest.fixture(scope="module")
def embedded_llm():
    return LLM(str(embedded_tiny_model_dir()), max_model_len=8, num_kv_blocks=8, max_num_seqs=8)


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.one_of(IN_RANGE, ANYTHING))
def test_whatever_is_accepted_runs_through_the_engine(embedded_llm, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return  # refused on construction, saying what is allowed
    engine = embedded_llm.engine
    try:
        outputs = embedded_llm.generate(["Hello", "a longer one"], params, use_tqdm=False)
    except (ValueError, NotImplementedError):
        # refused before any work: nothing was queued
        assert not engine.has_unfinished_requests() and engine.scheduler.num_waiting == 0
        return
    for output in outputs:
        assert len(output.outputs) == params.n
        for completion in output.outputs:
            assert completion.finish_reason in ("stop", "length")
            assert params.max_tokens is None or len(completion.token_ids) <= params.max_tokens
            assert all(0 <= t < VOCAB for t in completion.token_ids)
            if params.allowed_token_ids:
                assert set(completion.token_ids) <= set(params.allowed_token_ids)
    assert not engine.has_unfinished_requests()


# -- structured outputs ----------------------------------------------------------------------------


def test_structured_outputs_take_exactly_one_kind_and_vllms_old_spelling() -> None:
    from deepinfer_core.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=json.dumps(schema)))
    assert params.structured_outputs == params.guided_decoding == StructuredOutputsParams(json=schema)
    assert params.structured_outputs.kind == "json"
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ["a", "b"]
    assert StructuredOutputsParams(regex="a+").key != StructuredOutputsParams(grammar="a+").key
    for fields in ({}, {"json": schema, "regex": "a"}, {"json_object": True, "choice": ["x"]}):
        with pytest.raises(ValueError, match="exactly one of"):
            StructuredOutputsParams(**fields)
    for fields in ({"json": 5}, {"json": "{nope"}, {"regex": ""}, {"grammar": 3}, {"choice": "ab"},
                   {"choice": []}, {"choice": ["a", 1]}, {"json_object": 1}, {"regex": "a", "disable_any_whitespace": 1}):
        with pytest.raises(ValueError):
            StructuredOutputsParams(**fields)
    for value in (5, "json", {"unknown": 1}):
        with pytest.raises(ValueError, match="structured_outputs"):
            SamplingParams(structured_outputs=value)
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=StructuredOutputsParams(regex="b"))
