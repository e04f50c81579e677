"""Incremental text equals a full decode at every step, UTF-8 split across tokens included."""

from __future__ import annotations

import random

from deepinfer_core.engine.output import IncrementalText, TokenTexts
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir
from deepinfer_core.tokenizer import load_tokenizer


def test_incremental_text_matches_full_decode():
    tokenizer = load_tokenizer(embedded_tiny_model_dir(), {"model_type": "deepseek_v4"})
    text = "Hello, 世界! Ünïcödé → emoji 🎉🎉 and code: x = {'a': 1}\n" * 3
    ids = tokenizer.encode(text) + random.Random(0).sample(range(128000), 40)  # arbitrary ids split UTF-8
    incremental = IncrementalText(tokenizer)
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        got = incremental.update(ids[:n])
        assert full.startswith(got)  # never ahead of, never different from, the full decode
        if not full.endswith("\ufffd"):
            assert got == full


class CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_shared_token_cache_leaves_one_decode_a_token_and_the_same_text():
    tokenizer = load_tokenizer(embedded_tiny_model_dir(), {"model_type": "deepseek_v4"})
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    counting, shared = CountingTokenizer(tokenizer), TokenTexts()
    texts = []
    for _ in range(2):  # the second completion finds every single-token decode cached
        incremental, counting.calls = IncrementalText(counting, shared), 0
        for n in range(1, len(ids) + 1):
            incremental.update(ids[:n])
            assert incremental.update(ids[:n]) == incremental.text  # no new id: no decode
        texts.append(incremental.text)
    assert texts[0] == texts[1] == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.calls == len(ids) + 1  # the first step also decodes the empty prefix


def test_the_token_text_cache_keeps_at_most_its_entries():
    """Issue 43 item 7: a server's single-token decodes do not pile up over its whole vocabulary."""
    texts = TokenTexts(max_entries=3)
    for token in range(10):
        assert texts.decoded(token, str) == str(token)
    assert dict(texts) == {7: "7", 8: "8", 9: "9"}  # the newest stay
    assert texts.decoded(9, lambda token: "decoded again") == "9"
