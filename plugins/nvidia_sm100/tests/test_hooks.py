"""Hook behaviour that holds on any machine: platform name, entry point, and declining with a reason."""

from __future__ import annotations

from pathlib import Path

import pluggy
import pytest
import torch
from deepinfer_nvidia_sm100 import hooks
from deepinfer_nvidia_sm100.platform import device_problem, dtype_problem

from deepinfer_core import hookspecs
from deepinfer_core.backends import AttentionSpec, LayerOpsSpec, MoESpec, SamplingSpec

ATTENTION = AttentionSpec(
    num_heads=64, head_dim=512, sliding_window=128, compress_rate=128, dtype=torch.bfloat16
)
MOE = MoESpec(
    hidden_size=4096,
    intermediate_size=2048,
    num_experts=256,
    top_k=6,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    dtype=torch.bfloat16,
)
SAMPLING = SamplingSpec(vocab_size=129280)
LAYER_OPS = LayerOpsSpec(hidden_size=4096, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                         dtype=torch.bfloat16)


def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(hooks, name="nvidia_sm100")
    return pm


def test_platform_is_nvidia() -> None:
    assert plugin_manager().hook.platforms() == [["nvidia"]]


def test_entry_point_is_declared() -> None:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points.deepinfer]\nnvidia_sm100 = "deepinfer_nvidia_sm100.hooks"' in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks declining on a machine without CUDA")
def test_every_factory_declines_without_cuda() -> None:
    pm = plugin_manager()
    reasons: list[str] = []
    assert pm.hook.detect_device(decline=reasons.append) is None
    device = torch.device("cpu")
    assert pm.hook.make_attention(spec=ATTENTION, device=device, decline=reasons.append) is None
    assert pm.hook.make_moe(spec=MOE, device=device, decline=reasons.append) is None
    assert pm.hook.make_sampler(spec=SAMPLING, device=device, decline=reasons.append) is None
    assert pm.hook.make_layer_ops(spec=LAYER_OPS, device=device, decline=reasons.append) is None
    assert pm.hook.memory_counters(device=device, decline=reasons.append) is None
    assert reasons[0] == "no CUDA device (torch.cuda.is_available() is False)"
    assert reasons[1:] == ["device cpu is not a CUDA device"] * 5


def test_unsupported_dtype_is_named() -> None:
    assert dtype_problem(torch.bfloat16) is None
    assert "float64" in dtype_problem(torch.float64)


def test_old_gpu_is_declined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    assert device_problem() == "compute capability 8.0 < 9.0"
    assert device_problem(torch.device("cuda", 0)) == "compute capability 8.0 < 9.0"


def test_kernel_cache_defaults_under_deepinfers_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from deepinfer_nvidia_sm100.platform import use_kernel_cache

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert use_kernel_cache() == tmp_path / "deepinfer" / "triton"
    assert Path(__import__("os").environ["TRITON_CACHE_DIR"]) == tmp_path / "deepinfer" / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert use_kernel_cache() == tmp_path / "mine"  # the user's choice stands


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_specs_get_the_invariant_backends(monkeypatch: pytest.MonkeyPatch, deterministic: bool) -> None:
    """Where the device passes, a deterministic spec is served by the plugin's batch-invariant variant."""
    import dataclasses

    monkeypatch.setattr(hooks, "device_problem", lambda device=None: None)
    monkeypatch.setattr(hooks, "use_kernel_cache", lambda: None)
    pm, reasons = plugin_manager(), []
    device = torch.device("cpu")
    built = [pm.hook.make_attention(spec=dataclasses.replace(ATTENTION, deterministic=deterministic), device=device,
                                    decline=reasons.append),
             pm.hook.make_moe(spec=dataclasses.replace(MOE, deterministic=deterministic), device=device,
                              decline=reasons.append),
             pm.hook.make_layer_ops(spec=dataclasses.replace(LAYER_OPS, deterministic=deterministic), device=device,
                                    decline=reasons.append)]
    assert reasons == []
    names = [type(backend).__name__ for backend in built]
    expected = ["TritonAttention", "TritonMoE", "TritonLayerOps"]
    assert names == (["Invariant" + name for name in expected] if deterministic else expected)
    assert all(backend.supports_cuda_graphs for backend in built)
