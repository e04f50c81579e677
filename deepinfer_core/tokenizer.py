"""Tokenizer lookup: plugin loaders first (highest priority first), then the checkpoint's tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import tokenizers

from deepinfer_core import plugins


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class TokenizerJson:
    """A plain `tokenizer.json`, through the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.hf = tokenizers.Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str | Path, config: Any) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has none (then only token-id prompts work)."""
    for loader in plugins.tokenizer_loaders():
        tokenizer = loader.load(Path(model_dir), config)
        if tokenizer is not None:
            return tokenizer
    path = Path(model_dir) / "tokenizer.json"
    return TokenizerJson(path) if path.is_file() else None
