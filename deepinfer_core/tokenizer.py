"""Tokenizer lookup: plugin loaders first (highest priority first), then the checkpoint's tokenizer.json.

Loading checks that the tokenizer fits the model: its vocabulary is no larger than the model's, and it
has the model's BOS and EOS ids. A tokenizer that is not the checkpoint's own `tokenizer.json` (a
plugin's fallback) is reported with a logged warning. Every load error is a `CheckpointError`.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import tokenizers

from deepinfer_core import plugins
from deepinfer_core.config import CheckpointError, ModelConfig

logger = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer."""

    vocab_size: int
    """Number of ids the tokenizer knows (added tokens included)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class TokenizerJson:
    """A plain `tokenizer.json`, through the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.hf = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size: int = self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"TokenizerJson({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(model_dir: str | Path, config: Any) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has none (then only token-id prompts work).

    `config` is a `ModelConfig` (then the tokenizer is checked against it) or a config.json dict.
    Raises `CheckpointError` naming the file when a tokenizer cannot be loaded or does not fit.
    """
    model_dir = Path(model_dir)
    own = model_dir / TOKENIZER_FILE
    tokenizer, source = None, ""
    for loader in plugins.tokenizer_loaders():
        tokenizer = _load(
            partial(loader.load, model_dir, config), own, f"the {loader.name!r} tokenizer loader"
        )
        if tokenizer is not None:
            source = f"the {loader.name!r} plugin's tokenizer"
            break
    if tokenizer is None and own.is_file():
        tokenizer, source = _load(partial(TokenizerJson, own), own, "tokenizers"), str(own)
    if tokenizer is None:
        return None
    if not own.is_file():
        logger.warning("%s has no %s: using %s, %r", model_dir, TOKENIZER_FILE, source, tokenizer)
    if isinstance(config, ModelConfig):
        check_tokenizer_fits(tokenizer, config, own if own.is_file() else repr(tokenizer))
    return tokenizer


def _load(load, path: Path, by: str):
    try:
        return load()
    except CheckpointError:
        raise
    except Exception as err:  # tokenizers raises bare `Exception`s for malformed files
        where = path if path.is_file() else path.parent
        raise CheckpointError(f"{where}: cannot load a tokenizer ({by}): {err}") from err


def check_tokenizer_fits(tokenizer: Tokenizer, config: ModelConfig, where: Path | str) -> None:
    """Raise `CheckpointError` unless `tokenizer`'s ids fit the model: no more ids than its
    `vocab_size` (embedding rows), and the model's BOS/EOS ids among them."""
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{where}: the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{config.vocab_size}; this tokenizer is not the model's"
        )
    for name, ids in (("bos_token_id", [config.bos_token_id]), ("eos_token_id", config.eos_token_ids)):
        outside = [i for i in ids if i is not None and i >= tokenizer.vocab_size]
        if outside:
            raise CheckpointError(
                f"{where}: config.json's {name} {outside} is not an id of this tokenizer "
                f"({tokenizer.vocab_size} ids); the tokenizer is not the model's"
            )
