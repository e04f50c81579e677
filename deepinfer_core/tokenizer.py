"""Tokenizer lookup: plugin loaders first (highest priority first), then the checkpoint's tokenizer.json.

Loading checks that the tokenizer fits the model: its vocabulary is no larger than the model's, and it
has the model's BOS and EOS ids; the checkpoint's own `tokenizer.json` that does not fit is an error.
A tokenizer that is not the checkpoint's own (a plugin's fallback) is reported with a logged warning,
which also says if it does not fit. Every load error is a `CheckpointError` naming the file.
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
    Raises `CheckpointError` naming the file when a tokenizer cannot be loaded, or when the checkpoint's
    own `tokenizer.json` does not fit the model. A plugin's fallback for a checkpoint without one is
    logged (with why, if it does not fit the model: tiny test models use the real V4 tokenizer).
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
        tokenizer = _load(partial(TokenizerJson, own), own, "tokenizers")
    if tokenizer is None:
        return None
    misfit = tokenizer_misfit(tokenizer, config) if isinstance(config, ModelConfig) else None
    if own.is_file():
        if misfit:
            raise CheckpointError(f"{own}: {misfit}")
        return tokenizer
    logger.warning("%s has no %s: using %s, %r%s", model_dir, TOKENIZER_FILE, source, tokenizer,
                   f"; it does not fit the model ({misfit}): text prompts may be refused" if misfit else "")  # fmt: skip
    return tokenizer


def _load(load, path: Path, by: str):
    try:
        return load()
    except CheckpointError:
        raise
    except Exception as err:  # tokenizers raises bare `Exception`s for malformed files
        where = path if path.is_file() else path.parent
        raise CheckpointError(f"{where}: cannot load a tokenizer ({by}): {err}") from err


def tokenizer_misfit(tokenizer: Tokenizer, config: ModelConfig) -> str | None:
    """Why `tokenizer`'s ids do not fit the model of `config` (more ids than its `vocab_size`, the
    embedding's rows; or no id for its BOS/EOS), or None when they fit."""
    if tokenizer.vocab_size > config.vocab_size:
        return (
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {config.vocab_size}; "
            f"it is not this model's tokenizer"
        )
    for name, ids in (("bos_token_id", [config.bos_token_id]), ("eos_token_id", config.eos_token_ids)):
        outside = [i for i in ids if i is not None and i >= tokenizer.vocab_size]
        if outside:
            return (
                f"config.json's {name} {outside} is not an id of this tokenizer ({tokenizer.vocab_size} ids); "
                f"it is not this model's tokenizer"
            )
    return None
