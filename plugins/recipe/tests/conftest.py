"""Shared fixtures: the V4 tokenizer, and a V4.1-shaped tokenizer.json built from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepinfer_recipe.tokenizer import DeepseekTokenizer, bundled_v4_tokenizer_file

V41_SYSTEM_ID = 128799


@pytest.fixture(scope="session")
def v4_tokenizer() -> DeepseekTokenizer:
    return DeepseekTokenizer(bundled_v4_tokenizer_file())


@pytest.fixture(scope="session")
def v41_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a V4.1-style tokenizer.json: the V4 file with id 128799 spelled <｜System｜>."""
    data = json.loads(bundled_v4_tokenizer_file().read_text(encoding="utf-8"))
    for token in data["added_tokens"]:
        if token["id"] == V41_SYSTEM_ID:
            old, token["content"] = token["content"], "<｜System｜>"
    vocab = data["model"]["vocab"]
    if old in vocab:
        vocab["<｜System｜>"] = vocab.pop(old)
    directory = tmp_path_factory.mktemp("v41")
    (directory / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (directory / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}), encoding="utf-8")
    return directory
