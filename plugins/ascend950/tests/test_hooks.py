"""The plugin's hooks: installed, lazily importing, declining with accurate reasons, building on an NPU.

"An NPU" here is the `npu_doubles` stand-in for torch_npu (SoC 260) and cann_ops_transformer; the
device object `npu` is only passed around (no tensor is allocated on it).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from deepinfer_ascend950 import hooks
from deepinfer_ascend950.attention import AscendAttention
from deepinfer_ascend950.layer_ops import AscendLayerOps
from deepinfer_ascend950.moe import AscendMoE

from deepinfer_core import plugins
from deepinfer_core.backends import AttentionSpec, LayerOpsSpec, MoESpec, SamplingSpec
from deepinfer_core.plugin_report import plugin_report
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.moe import ReferenceMoE
from deepinfer_core.reference.sampling import ReferenceSampler

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
needs_no_torch_npu = pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed: the no-NPU path cannot run")
CPU, NPU = torch.device("cpu"), torch.device("npu")
ATTENTION = AttentionSpec(num_heads=64, head_dim=512, sliding_window=128, compress_rate=4, index_n_heads=64,
                          index_head_dim=128, index_topk=512, dtype=torch.bfloat16)
MOE = MoESpec(hidden_size=4096, intermediate_size=2048, num_experts=256, top_k=6, scoring_func="sqrtsoftplus",
              routed_scaling_factor=1.5, swiglu_limit=10.0, dtype=torch.bfloat16)
LAYER_OPS = LayerOpsSpec(hidden_size=4096, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)


def ask(hook, *args):
    reasons = []
    return hook(*args, reasons.append), reasons


def test_entry_point_is_installed_and_imports_no_vendor_module():
    pm = plugins.build_plugin_manager(allow=["ascend950"])
    assert pm.get_plugin("ascend950") is hooks
    code = ("import sys, deepinfer_ascend950.hooks, deepinfer_ascend950.attention, deepinfer_ascend950.moe, "
            "deepinfer_ascend950.check; print(sorted(m for m in sys.modules if m in ('torch_npu', "
            "'cann_ops_transformer')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_lists_the_ascend_platform(isolated_plugin_manager):
    isolated_plugin_manager.register(hooks, name="ascend950")
    plugins.check_plugins(isolated_plugin_manager)
    assert plugins.platforms()["ascend950"] == ["ascend"]


@needs_no_torch_npu
def test_without_torch_npu_every_hook_declines_saying_why():
    device, reasons = ask(hooks.detect_device)
    assert device is None and reasons[0].startswith("torch_npu is not importable (ModuleNotFoundError")
    backend, reasons = ask(hooks.make_attention, ATTENTION, NPU)
    assert backend is None and "torch_npu is not importable" in reasons[0]
    assert reasons[0].endswith("attention falls back to the reference (PyTorch on the device)")
    for hook, spec in ((hooks.make_moe, MOE), (hooks.make_layer_ops, LAYER_OPS), (hooks.make_sampler, SamplingSpec(8))):
        backend, reasons = ask(hook, spec, NPU)
        assert backend is None and "torch_npu is not importable" in reasons[0]


def test_a_cpu_device_is_declined_even_with_an_npu(npu_doubles_installed):
    backend, reasons = ask(hooks.make_moe, MOE, CPU)
    assert backend is None and reasons == ["device cpu is not an NPU"]


def test_on_an_ascend_950_the_plugin_builds_every_backend(npu_doubles_installed):
    assert ask(hooks.detect_device) == (NPU, [])
    assert isinstance(ask(hooks.make_attention, ATTENTION, NPU)[0], AscendAttention)
    assert isinstance(ask(hooks.make_moe, MOE, NPU)[0], AscendMoE)
    assert isinstance(ask(hooks.make_layer_ops, LAYER_OPS, NPU)[0], AscendLayerOps)


def test_another_npu_is_declined(monkeypatch, doubles):
    monkeypatch.setitem(sys.modules, "torch_npu", doubles.torch_npu_module(soc_version=223))
    device, reasons = ask(hooks.detect_device)
    assert device is None and "targets the Ascend 950 (SoC version 260); this NPU reports 223" in reasons[0]


def test_missing_cann_ops_transformer_declines_attention_only(monkeypatch, doubles):
    monkeypatch.setitem(sys.modules, "torch_npu", doubles.torch_npu_module())
    monkeypatch.setitem(sys.modules, "cann_ops_transformer", None)  # import then raises ImportError
    backend, reasons = ask(hooks.make_attention, ATTENTION, NPU)
    assert backend is None and reasons[0].startswith("cann_ops_transformer not importable (ModuleNotFoundError")
    assert "attention falls back to the reference" in reasons[0]
    assert isinstance(ask(hooks.make_moe, MOE, NPU)[0], AscendMoE)


def test_a_spec_outside_the_op_constraints_declines_with_the_constraint(npu_doubles_installed):
    backend, reasons = ask(hooks.make_attention, AttentionSpec(num_heads=8, head_dim=64, sliding_window=16,
                                                               compress_rate=0, dtype=torch.bfloat16), NPU)
    assert backend is None and reasons == [("cann_ops_transformer.sparse_flash_mla: head_dim is 64; only 512 is "
                                            "supported; attention falls back to the reference (PyTorch on the NPU)")]
    backend, reasons = ask(hooks.make_moe, MoESpec(**{**MOE.__dict__, "dtype": torch.float32}), NPU)
    assert backend is None and "npu_grouped_matmul: x/weight dtype is torch.float32" in reasons[0]


def test_on_a_cpu_box_the_report_shows_the_reference_and_each_reason(isolated_plugin_manager):
    isolated_plugin_manager.register(hooks, name="ascend950")
    assert type(plugins.make_attention(ATTENTION, CPU)) is ReferenceAttention
    assert type(plugins.make_moe(MOE, CPU)) is ReferenceMoE
    assert type(plugins.make_sampler(SamplingSpec(vocab_size=8), CPU)) is ReferenceSampler
    report = plugin_report(CPU, {"make_attention": [ATTENTION], "make_moe": [MOE]})
    detect, *factories = report.choices
    assert detect.winner == "reference" and detect.declines["ascend950"].startswith(
        "torch_npu is not importable" if not HAS_TORCH_NPU else "")
    assert [c.winner for c in factories] == ["reference", "reference"]
    assert factories[0].declines["ascend950"] == "device cpu is not an NPU; attention falls back to the reference " \
                                                 "(PyTorch on the device)"
    assert factories[1].declines["ascend950"] == "device cpu is not an NPU"


def test_ascend_accelerator_needs_torch_npu(isolated_plugin_manager, monkeypatch):
    isolated_plugin_manager.register(hooks, name="ascend950")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    if HAS_TORCH_NPU:
        assert plugins.select_device().type == "npu"
    else:
        with pytest.raises(plugins.PluginError, match="cannot run 'npu' devices: .*No module named 'torch_npu'"):
            plugins.select_device()


def test_graph_api_is_torch_npus_on_a_950_and_declined_elsewhere(monkeypatch, doubles):
    graph, reasons = ask(hooks.graph_api, CPU)
    assert graph is None and reasons == ["device cpu is not an NPU"]
    module = doubles.torch_npu_module()
    names = ("NPUGraph", "graph", "Stream", "stream", "current_stream", "synchronize")
    for name in names:
        setattr(module.npu, name, object())
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    api, reasons = ask(hooks.graph_api, NPU)
    assert reasons == [] and api.Graph is module.npu.NPUGraph and api.synchronize is module.npu.synchronize
    delattr(module.npu, "NPUGraph")
    api, reasons = ask(hooks.graph_api, NPU)
    assert api is None and "torch_npu.npu has no NPUGraph" in reasons[0]


def test_memory_counters_are_torch_npus_on_a_950_and_declined_elsewhere(monkeypatch, doubles):
    counters, reasons = ask(hooks.memory_counters, CPU)
    assert counters is None and reasons == ["device cpu is not an NPU"]
    module = doubles.torch_npu_module()
    asked = []
    names = ("mem_get_info", "memory_allocated", "memory_reserved", "max_memory_allocated",
             "reset_peak_memory_stats", "synchronize", "empty_cache")
    for name in names:
        setattr(module.npu, name, lambda *args, name=name: asked.append((name, *args)) or 7)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    counters, reasons = ask(hooks.memory_counters, NPU)
    assert reasons == [] and counters.peak_allocated() == 7 and counters.reset_peak() == 7
    assert asked == [("max_memory_allocated", NPU), ("reset_peak_memory_stats", NPU)]
    delattr(module.npu, "max_memory_allocated")
    counters, reasons = ask(hooks.memory_counters, NPU)
    assert counters is None and "torch_npu.npu has no max_memory_allocated" in reasons[0]


def test_deterministic_specs_are_declined_so_the_reference_serves_them(npu_doubles_installed):
    import dataclasses

    for hook, spec in ((hooks.make_attention, ATTENTION), (hooks.make_moe, MOE), (hooks.make_layer_ops, LAYER_OPS),
                       (hooks.make_sampler, SamplingSpec(8))):
        backend, reasons = ask(hook, dataclasses.replace(spec, deterministic=True), NPU)
        assert backend is None and "not batch-invariant" in reasons[0], hook.__name__
