"""Incremental text equals a full decode at every step, UTF-8 split across tokens included."""

from __future__ import annotations

import random

from deepinfer_core.engine.detokenizer import IncrementalText
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
