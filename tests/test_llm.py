"""The offline API: vLLM's shapes, DeepInfer 0.1's spellings, and validation before any work."""

from __future__ import annotations

import pytest

from deepinfer_core import LLM, RequestOutput, SamplingParams
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
