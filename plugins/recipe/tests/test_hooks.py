from __future__ import annotations

from pathlib import Path

import pluggy
from deepinfer_recipe import hooks
from deepinfer_recipe.encoding import RecipeChatEncoding
from deepinfer_recipe.tokenizer import DeepseekTokenizer

from deepinfer_core import hookspecs


def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(hooks, name="recipe")
    return pm


def test_tokenizer_loader_is_registered_and_loads_v4(tmp_path: Path) -> None:
    registered = []
    plugin_manager().hook.register_tokenizers(register=lambda *a, **kw: registered.append((a, kw)))
    (name, loader), kwargs = registered[0]
    assert name == "recipe" and kwargs["priority"] > 0
    assert isinstance(loader(tmp_path, {"model_type": "deepseek_v4"}), DeepseekTokenizer)
    assert loader(tmp_path, {"model_type": "other"}) is None


def test_chat_encodings_cover_v4_and_v41(v4_tokenizer: DeepseekTokenizer) -> None:
    factories = {}
    plugin_manager().hook.register_chat_encodings(register=lambda t, f: factories.setdefault(t, f))
    assert sorted(factories) == ["deepseek_v4", "deepseek_v41"]
    encoding = factories["deepseek_v4"](v4_tokenizer, {"model_type": "deepseek_v4"})
    assert isinstance(encoding, RecipeChatEncoding) and encoding.model_names[0] == "DeepSeek-V4-Flash"
    # A tokenizer the plugin did not load carries no recipe tokenizer: decline.
    assert factories["deepseek_v4"](object(), {"model_type": "deepseek_v4"}) is None


def test_entry_point_is_declared() -> None:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points.deepinfer]\nrecipe = "deepinfer_recipe.hooks"' in text
