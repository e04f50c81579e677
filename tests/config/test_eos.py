"""End-of-sequence ids from every file a checkpoint names them in (config.json, generation_config.json,
the tokenizer), as vLLM reads them; a checkpoint whose config.json lacks its EOS still stops."""

from __future__ import annotations

import json

import pytest
import tokenizers
from deepinfer_recipe.tokenizer import EOS_TOKEN, V4_CHAT_TOKENS

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError, ModelConfig
from deepinfer_core.testing.checkpoints import tiny_config, write_checkpoint

VOCAB = 512


def config_without_eos() -> dict:
    config = tiny_config()
    del config["eos_token_id"]
    return config


def write_json(path, data) -> None:
    path.write_text(json.dumps(data))


def write_tokenizer(directory, eos_id: int, added: bool = True) -> None:
    """A word-level tokenizer.json of the model's 512 ids whose id `eos_id` is DeepSeek's EOS (an added
    special token when `added`; the other chat tokens take the last ids, as the recipe plugin needs),
    and a tokenizer_config.json naming it the EOS."""
    others = [token for token in V4_CHAT_TOKENS if token != EOS_TOKEN]
    free = [i for i in range(VOCAB - 1, 0, -1) if i != eos_id][: len(others)]
    names = {eos_id: EOS_TOKEN} | dict(zip(free, others))
    vocab = {names.get(i, f"w{i}"): i for i in range(VOCAB)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.add_special_tokens(others + ([EOS_TOKEN] if added else []))
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {"eos_token": {"__type": "AddedToken", "content": EOS_TOKEN}})


def test_generation_config_list_joins_config_json(tmp_path):
    write_json(tmp_path / "config.json", tiny_config())  # eos_token_id 1
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [9, 1, 7]})
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [1, 9, 7]


def test_a_config_without_eos_takes_the_others_not_the_default(tmp_path):
    write_json(tmp_path / "config.json", config_without_eos())
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [1]  # named nowhere: transformers' default
    write_tokenizer(tmp_path, 300)
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [300]
    write_tokenizer(tmp_path, 301, added=False)  # found in the vocabulary, not among the added tokens
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [301]
    write_json(tmp_path / "generation_config.json", {"eos_token_id": 5})
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [5, 301]
    (tmp_path / "tokenizer.json").unlink()
    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<e>", "added_tokens_decoder": {"44": {"content": "<e>"}}})
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [5, 44]


@pytest.mark.parametrize(("name", "text", "message"), [
    ("generation_config.json", '{"eos_token_id": 600}',
     r"generation_config.json: end-of-sequence id 600 is outside the model's vocabulary \[0, 512\)"),
    ("generation_config.json", '{"eos_token_id": "</s>"}', "generation_config.json: eos_token_id must be a token id"),
    ("generation_config.json", "{not json", "generation_config.json is not valid JSON"),
    ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json must hold a JSON object"),
])
def test_bad_files_are_named(tmp_path, name, text, message):
    write_json(tmp_path / "config.json", config_without_eos())
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dir(tmp_path)


def greedy(model_dir, ignore_eos: bool):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=4, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=ignore_eos)
    return llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("where", ["generation_config", "tokenizer"])
def test_a_checkpoint_whose_config_lacks_the_eos_stops_at_the_one_named_elsewhere(tmp_path, where):
    model_dir = write_checkpoint(tmp_path, config_without_eos(), seed=3)
    tokens = greedy(model_dir, ignore_eos=True).token_ids
    # the first token after the first two that is new and not the default EOS (1) becomes the checkpoint's EOS
    stop = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i] and 1 not in tokens[: i + 1])
    if where == "generation_config":
        write_json(model_dir / "generation_config.json", {"eos_token_id": [VOCAB - 1, tokens[stop]]})
    else:
        write_tokenizer(model_dir, tokens[stop])
    out = greedy(model_dir, ignore_eos=False)
    assert out.token_ids == tokens[: stop + 1] and out.finish_reason == "stop"
