"""Fixtures: the NPU op doubles of `npu_doubles` injected as `torch_npu` / `cann_ops_transformer`.

Every test starts and ends with the plugin's module loaders forgotten, so a double never leaks into
another test (or into the no-NPU path the other tests check).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from deepinfer_ascend950 import platform

# the suite imports test modules with --import-mode=importlib, so the doubles are loaded by path
_spec = importlib.util.spec_from_file_location("ascend950_npu_doubles", Path(__file__).with_name("npu_doubles.py"))
npu_doubles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(npu_doubles)
npu_doubles.register_npu_device_name()  # so that tests (and the hooks) can name torch.device("npu")


@pytest.fixture(autouse=True)
def fresh_loaders():
    platform.load_torch_npu.cache_clear()
    platform.load_cann_ops.cache_clear()
    yield
    platform.load_torch_npu.cache_clear()
    platform.load_cann_ops.cache_clear()


@pytest.fixture
def npu_doubles_installed(monkeypatch):
    """`torch_npu` (an Ascend 950, SoC 260) and `cann_ops_transformer` as test doubles in sys.modules."""
    monkeypatch.setitem(sys.modules, "torch_npu", npu_doubles.torch_npu_module())
    monkeypatch.setitem(sys.modules, "cann_ops_transformer", npu_doubles.cann_ops_module())
    return npu_doubles


@pytest.fixture
def doubles():
    """The `npu_doubles` module (its ops and `DocumentedConstraintError`), without installing anything."""
    return npu_doubles
