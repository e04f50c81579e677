"""The Ascend 950 plugin is installed, lists its platform, and declines cleanly without an NPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_ascend950 import hooks

from deepinfer_core import plugins
from deepinfer_core.backends import AttentionSpec, MoESpec, SamplingSpec
from deepinfer_core.plugin_report import plugin_report
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.moe import ReferenceMoE
from deepinfer_core.reference.sampling import ReferenceSampler

HAS_NPU = importlib.util.find_spec("torch_npu") is not None
CPU = torch.device("cpu")


def test_entry_point_is_installed():
    pm = plugins.build_plugin_manager(allow=["ascend950"])
    assert pm.get_plugin("ascend950") is hooks


def test_lists_the_ascend_platform(isolated_plugin_manager):
    isolated_plugin_manager.register(hooks, name="ascend950")
    plugins.check_plugins(isolated_plugin_manager)
    assert plugins.platforms()["ascend950"] == ["ascend"]


@pytest.mark.skipif(HAS_NPU, reason="torch_npu is installed: the no-NPU path cannot be exercised")
def test_detect_device_declines_without_torch_npu():
    reasons = []
    assert hooks.detect_device(reasons.append) is None
    assert len(reasons) == 1
    assert reasons[0].startswith("torch_npu is not installed")


def test_factories_decline_so_the_reference_serves(isolated_plugin_manager):
    isolated_plugin_manager.register(hooks, name="ascend950")
    attention = AttentionSpec(num_heads=2, head_dim=8, sliding_window=4, compress_rate=0)
    moe = MoESpec(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2, scoring_func="sigmoid",
                  routed_scaling_factor=1.0, swiglu_limit=0.0)
    assert type(plugins.make_attention(attention, CPU)) is ReferenceAttention
    assert type(plugins.make_moe(moe, CPU)) is ReferenceMoE
    assert type(plugins.make_sampler(SamplingSpec(vocab_size=8), CPU)) is ReferenceSampler
    report = plugin_report(CPU, {"make_attention": [attention], "make_moe": [moe]})
    factory_choices = [c for c in report.choices if c.hook != "detect_device"]
    assert factory_choices and all(c.winner == "reference" for c in factory_choices)
    assert all(c.declines["ascend950"] == hooks.NOT_IMPLEMENTED for c in factory_choices)


def test_ascend_accelerator_needs_torch_npu(isolated_plugin_manager, monkeypatch):
    isolated_plugin_manager.register(hooks, name="ascend950")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    if HAS_NPU:
        assert plugins.select_device().type == "npu"
    else:
        with pytest.raises(plugins.PluginError, match="cannot run 'npu' devices: .*No module named 'torch_npu'"):
            plugins.select_device()
