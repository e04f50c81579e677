"""pytest plugin (entry point `pytest11`): fixtures for testing DeepInfer plugins.

    def test_my_plugin_wins(isolated_plugin_manager):
        isolated_plugin_manager.register(my_hooks, name="mine")
        assert isinstance(plugins.make_attention(spec, device), MyAttention)
"""

from __future__ import annotations

from collections.abc import Iterator

import pluggy
import pytest

from deepinfer_core import plugins


@pytest.fixture
def isolated_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[pluggy.PluginManager]:
    """A fresh manager holding only the reference plugin, used by every `deepinfer_core.plugins` call.

    Register the plugins under test on it with `register(module_or_object, name=...)`, then call
    `plugins.check_plugins(manager)` to validate hook names as loading does. The plugin environment
    variables are unset for the test; set them with `monkeypatch.setenv`.
    """
    for variable in plugins.ENV_VARS:
        monkeypatch.delenv(variable, raising=False)
    manager = plugins.build_plugin_manager(entry_points=[])
    monkeypatch.setattr(plugins, "get_plugin_manager", lambda: manager)
    yield manager
