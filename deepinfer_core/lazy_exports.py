"""PEP 562 lazy exports: a package names what it exports and the submodule each name lives in, and
each loads on first use (so `import deepinfer_core` or `deepinfer_core.backends` imports no torch)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, module_of: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package` (a module being run: `lazy_exports(__name__, ...)`),
    loading each name of `module_of` from `package.<module_of[name]>` on first use."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *module_of])

    return __getattr__, __dir__
