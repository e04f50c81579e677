"""The offline API: vLLM's shapes, DeepInfer 0.1's spellings, and validation before any work."""

from __future__ import annotations

import pytest

from deepinfer_core import LLM, RequestOutput, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.sampling_params import MAX_N
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir, tiny_config, write_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config(), seed=1)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=4, num_kv_blocks=16)


def test_generate_token_prompts_in_order_with_vllm_shapes(llm):
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(2, 40))}]
    outs = llm.generate(prompts, [GREEDY, SamplingParams(temperature=0, max_tokens=3, logprobs=2)], use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    assert outs[0].prompt_token_ids == [5, 6, 7] and len(outs[0].outputs[0].token_ids) == 5
    second = outs[1].outputs[0]
    assert len(second.token_ids) == 3 and second.finish_reason == "length"
    assert len(second.logprobs) == 3 and all(t in step for t, step in zip(second.token_ids, second.logprobs))
    assert second.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(second.token_ids, second.logprobs)))
    # the same prompt alone gives the same greedy tokens (batch composition does not matter)
    alone = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_text_prompts_use_the_tokenizer_with_bos():
    llm = LLM(str(embedded_tiny_model_dir()), max_model_len=128, num_kv_blocks=4, max_num_seqs=2)
    [out] = llm.generate("Hello, world", GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert out.prompt == "Hello, world" and out.prompt_token_ids == [0, *tokenizer.encode("Hello, world")]
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_deepinfer_01_spellings(model_dir):
    legacy = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=8, decode_sequence=True,
                 trust_remote_code=False)
    texts = legacy.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        temperature=0.7, seq_seed=3, top_logprobs=2, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert isinstance(texts, list) and isinstance(texts[0], str)


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ("", GREEDY, "empty"),
        ({"prompt_token_ids": [1, 512]}, GREEDY, "outside the vocabulary"),
        ({"prompt_token_ids": [3] * 256}, GREEDY, "max_model_len"),
        ([{"prompt_token_ids": [3]}] * 2, [GREEDY] * 3, "one per prompt"),
        ({"tokens": [3]}, GREEDY, "prompt_token_ids"),
    ],
)
def test_bad_input_raises_before_any_work(llm, prompts, params, message):
    good = {"prompt_token_ids": [4, 5]}
    batch = [good, prompts] if isinstance(prompts, (dict, str)) else prompts
    with pytest.raises(ValueError, match=message):
        llm.generate(batch, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.num_waiting == 0


def test_bad_options_are_clear(model_dir, monkeypatch):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(TypeError, match="unknown options"):
        LLM(str(model_dir), not_an_option=1)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    with pytest.raises(ValueError, match="DEEPINFER_HF_MODEL_DIR"):
        LLM()


def test_official_quantised_layout_generates_like_transformers_layout(model_dir, tmp_path):
    official = write_checkpoint(tmp_path / "official", tiny_config(), seed=1, layout="official")
    a = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=8)
    b = LLM(str(official), dtype="float32", max_model_len=256, num_kv_blocks=8)
    prompt = {"prompt_token_ids": list(range(3, 60))}
    assert a.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        b.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    fp8 = LLM(str(write_checkpoint(tmp_path / "fp8", tiny_config(), seed=1, layout="official", quant="fp8+fp4")),
              dtype="float32", max_model_len=256, num_kv_blocks=8)
    assert len(fp8.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 5


def test_interrupted_generate_leaves_nothing_queued(llm, monkeypatch):
    real_step, calls = llm.engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
    free = llm.engine.block_manager.num_free_blocks
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": list(range(2, 50))}] * 3, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == free


# -- the offline API a vLLM user expects ------------------------------------------------------------------

BOS = 0  # <｜begin▁of▁sentence｜>, a special token of the embedded model's vocabulary
BOS_TEXT = "<｜begin▁of▁sentence｜>"


@pytest.fixture(scope="module")
def embedded():
    return LLM(str(embedded_tiny_model_dir()), max_model_len=128, num_kv_blocks=4, max_num_seqs=4)


def test_text_prompt_dicts_are_tokenized_like_strings(embedded):
    [as_string] = embedded.generate("Hello, world", GREEDY, use_tqdm=False)
    [as_dict] = embedded.generate({"prompt": "Hello, world"}, GREEDY, use_tqdm=False)
    assert as_dict.prompt == "Hello, world" and as_dict.prompt_token_ids == as_string.prompt_token_ids
    assert as_dict.outputs[0].token_ids == as_string.outputs[0].token_ids


def test_vllm_engine_spellings(model_dir):
    half = LLM(str(model_dir), dtype="half", seed=None, tensor_parallel_size=1, max_model_len=64, num_kv_blocks=4)
    assert half.engine.config.dtype == "float16" and isinstance(half.engine.config.seed, int)
    [out] = half.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not fit .*num_attention_heads \(4\)"):
        LLM(str(model_dir), tensor_parallel_size=3)  # refused before any worker rank starts


def test_tokenize_and_the_deprecated_encode_alias(embedded):
    ids = embedded.tokenize("Hello")
    assert ids == [0, *embedded.get_tokenizer().encode("Hello")]
    with pytest.warns(DeprecationWarning, match="pooling"):
        assert embedded.encode("Hello") == ids
    with pytest.raises(NotImplementedError, match="pooling"):
        embedded.encode(["Hello"], pooling_params=None)


def test_truncate_prompt_tokens_keeps_the_last_ids(llm):
    prompt = {"prompt_token_ids": list(range(2, 42))}
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=5), use_tqdm=False)
    assert out.prompt_token_ids == list(range(37, 42))
    [whole] = llm.generate({"prompt_token_ids": [3] * 300}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                           use_tqdm=False)
    assert len(whole.prompt_token_ids) == 255  # max_model_len 256 leaves room for one new token


def test_logit_bias_and_skip_special_tokens_end_to_end(embedded):
    biased = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={BOS: 100.0})
    [skipped] = embedded.generate("Hello", biased, use_tqdm=False)
    assert skipped.outputs[0].token_ids == [BOS] * 3 and skipped.outputs[0].text == ""
    biased.skip_special_tokens = False
    [kept] = embedded.generate("Hello", biased, use_tqdm=False)
    assert kept.outputs[0].text == BOS_TEXT * 3


def test_allowed_token_ids_end_to_end(embedded):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, allowed_token_ids=[5, 6])
    [out] = embedded.generate("Hello", params, use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= {5, 6} and len(out.outputs[0].token_ids) == 8


def test_single_token_bad_words_end_to_end(embedded):
    [plain] = embedded.generate("Hello, world", GREEDY, use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    word = embedded.get_tokenizer().decode([first])
    assert embedded.get_tokenizer().encode(word) == [first]  # the word is that one token
    [banned] = embedded.generate("Hello, world", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                                bad_words=[word]), use_tqdm=False)
    assert first not in banned.outputs[0].token_ids


def test_include_stop_str_in_output(embedded):
    [plain] = embedded.generate("Hello, world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)
    text = plain.outputs[0].text
    stop = text[4:7]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop)
    [cut] = embedded.generate("Hello, world", params, use_tqdm=False)
    params.include_stop_str_in_output = True
    [kept] = embedded.generate("Hello, world", params, use_tqdm=False)
    assert cut.outputs[0].text == text[: text.find(stop)] and kept.outputs[0].text == cut.outputs[0].text + stop
    assert kept.outputs[0].stop_reason == stop


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        ({"stop_token_ids": [129280], "min_tokens": 1}, ValueError, "outside the vocabulary"),
        ({"logit_bias": {10**6: 1.0}}, ValueError, "logit_bias has ids"),
    ],
)
def test_parameters_the_model_cannot_serve_fail_before_any_work(embedded, params, error, message):
    with pytest.raises(error, match=message):
        embedded.generate(["Hello", "world"], SamplingParams(**params), use_tqdm=False)
    assert not embedded.engine.has_unfinished_requests() and embedded.engine.scheduler.num_waiting == 0



def test_n_is_bounded_with_the_bound_in_the_error():
    with pytest.raises(ValueError, match=f"n must be an integer in \\[1, {MAX_N}\\]"):
        SamplingParams(n=100000)
