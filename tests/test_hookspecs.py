"""Every hook is documented and exercised by the plugin tests."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from deepinfer_core import hookspecs, plugins

HOOKS = sorted(name for name, value in vars(hookspecs).items() if hasattr(value, "deepinfer_spec"))
PLUGIN_TESTS = (Path(__file__).parent / "test_plugins.py").read_text()


def test_hookspecs_are_found():
    assert {"platforms", "detect_device", "graph_api", "memory_counters", "register_tokenizers", "register_chat_encodings", "register_models",
            "register_prefix_stores",
            *plugins.FACTORY_PROTOCOLS} == set(HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented(name):
    hook = getattr(hookspecs, name)
    doc = inspect.getdoc(hook) or ""
    assert len(doc.splitlines()[0]) > 20, f"{name} needs a one-line summary"
    for parameter in inspect.signature(hook).parameters:
        assert f":param {parameter}:" in doc, f"{name}'s docstring does not describe {parameter!r}"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_exercised_by_a_plugin_test(name):
    assert f"def {name}(" in PLUGIN_TESTS, f"no test plugin in test_plugins.py implements {name}"


@pytest.mark.parametrize("name", plugins.FACTORY_PROTOCOLS)
def test_factory_hooks_are_first_result_and_take_a_decline_callback(name):
    hook = getattr(hookspecs, name)
    assert hook.deepinfer_spec["firstresult"] is True
    assert list(inspect.signature(hook).parameters) == ["spec", "device", "decline"]
    assert callable(getattr(plugins, name)), f"plugins.py has no typed function for {name}"
