"""The end-of-sequence ids a checkpoint names: config.json's, generation_config.json's and the tokenizer's.

vLLM stops on the tokenizer's EOS and on every id of generation_config.json's `eos_token_id` (an int or
a list); config.json's own `eos_token_id` is what transformers falls back on. A checkpoint may name its
EOS in any of the three, so the model's EOS ids are the union, config.json's first. When none of them
names one, the config class's default stays (transformers' `eos_token_id=1`).

The tokenizer's EOS is `tokenizer_config.json`'s `eos_token` (a string or an `AddedToken` object), looked
up in `added_tokens_decoder` there, else in `tokenizer.json`'s `added_tokens` (parsed alone: the whole
file is megabytes and is read on every config load), else in its vocabulary.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from deepinfer_core.config.family import ConfigError, read_json_object

logger = logging.getLogger(__name__)
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"


def with_checkpoint_eos(data: dict[str, Any], model_dir: str | Path) -> dict[str, Any]:
    """config.json's dictionary `data` with `eos_token_id` set to every EOS id the checkpoint in
    `model_dir` names (see the module docstring); `data` itself when only config.json names any, or none
    does. Raises `ConfigError` naming a file that is not valid JSON or names an id that is not an int."""
    model_dir = Path(model_dir)
    ids = _as_ids(data.get("eos_token_id"), model_dir / "config.json")
    more = _generation_config_eos(model_dir) + _tokenizer_eos(model_dir)
    merged = list(dict.fromkeys(ids + [token_id for token_id, _ in more]))
    if merged == ids:
        return data
    vocab = data.get("vocab_size")
    for token_id, path in more:
        if isinstance(vocab, int) and not 0 <= token_id < vocab:
            raise ConfigError(f"{path}: end-of-sequence id {token_id} is outside the model's vocabulary [0, {vocab})")
    logger.info("%s: end-of-sequence ids %s (config.json: %s; the others from %s or the tokenizer)",
                model_dir, merged, ids or "none", GENERATION_CONFIG)
    return data | {"eos_token_id": merged[0] if len(merged) == 1 else merged}


def _as_ids(value: Any, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(values)


def _read_json(path: Path) -> dict[str, Any] | None:
    return read_json_object(path) if path.is_file() else None


def _generation_config_eos(model_dir: Path) -> list[tuple[int, Path]]:
    path = model_dir / GENERATION_CONFIG
    data = _read_json(path) or {}
    return [(token_id, path) for token_id in _as_ids(data.get("eos_token_id"), path)]


def _tokenizer_eos(model_dir: Path) -> list[tuple[int, Path]]:
    """The id of tokenizer_config.json's `eos_token` (with the file it came from), or [] when it names
    none (or no id is found)."""
    path = model_dir / TOKENIZER_CONFIG
    data = _read_json(path) or {}
    token = data.get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if not isinstance(token, str):
        return []
    for token_id, added in (data.get("added_tokens_decoder") or {}).items():
        if isinstance(added, dict) and added.get("content") == token and str(token_id).isdigit():
            return [(int(token_id), path)]
    token_id = _tokenizer_json_id(model_dir / TOKENIZER_FILE, token)
    if token_id is None:
        logger.warning("%s names eos_token %r but %s has no such token; it is not used as an end of sequence",
                       path, token, TOKENIZER_FILE)
        return []
    return [(token_id, model_dir / TOKENIZER_FILE)]


def _tokenizer_json_id(path: Path, token: str) -> int | None:
    """`token`'s id in tokenizer.json: its `added_tokens` (special tokens live there), else its vocabulary."""
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
        key = text.find('"added_tokens"')
        added = json.JSONDecoder().raw_decode(text, text.find("[", key))[0] if key >= 0 else []
        for entry in added if isinstance(added, list) else []:
            if isinstance(entry, dict) and entry.get("content") == token and isinstance(entry.get("id"), int):
                return entry["id"]
        vocab = json.loads(text).get("model", {}).get("vocab")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from err
    token_id = vocab.get(token) if isinstance(vocab, dict) else None
    return token_id if isinstance(token_id, int) else None
