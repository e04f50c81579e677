"""Backends declare whether their decode path may be captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import plugins
from deepinfer_core.backends import (
    AttentionBackend,
    AttentionSpec,
    GraphCapturable,
    LayerOps,
    LayerOpsSpec,
    MoEBackend,
    MoESpec,
    supports_cuda_graphs,
)
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.layer_ops import ReferenceLayerOps
from deepinfer_core.reference.moe import ReferenceMoE

CPU = torch.device("cpu")
ATTENTION = AttentionSpec(num_heads=2, head_dim=8, sliding_window=4, compress_rate=0)
MOE = MoESpec(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2, scoring_func="sigmoid",
              routed_scaling_factor=1.0, swiglu_limit=0.0)
LAYER_OPS = LayerOpsSpec(hidden_size=8, hc_mult=2, hc_sinkhorn_iters=3, hc_eps=1e-6, rms_norm_eps=1e-6)


class UndeclaredAttention:
    """Everything an attention backend does, but silent on CUDA graphs."""

    def __init__(self, spec):
        self.spec = spec

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def indexer_topk(self, *args, **kwargs):
        raise NotImplementedError


def test_reference_backends_declare_it():
    assert supports_cuda_graphs(ReferenceAttention(ATTENTION, CPU)) is True
    assert supports_cuda_graphs(ReferenceLayerOps(LAYER_OPS)) is True
    # the grouped expert path reads expert counts on the host
    assert supports_cuda_graphs(ReferenceMoE(MOE, CPU)) is False


@pytest.mark.parametrize("protocol", [AttentionBackend, MoEBackend, LayerOps])
def test_the_protocols_require_the_declaration(protocol):
    assert GraphCapturable in protocol.__mro__
    assert not isinstance(UndeclaredAttention(ATTENTION), AttentionBackend)
    assert isinstance(ReferenceAttention(ATTENTION, CPU), AttentionBackend)


def test_an_undeclared_backend_is_named():
    with pytest.raises(TypeError, match="UndeclaredAttention does not declare supports_cuda_graphs"):
        supports_cuda_graphs(UndeclaredAttention(ATTENTION))


def test_only_true_counts_as_support():
    backend = ReferenceAttention(ATTENTION, CPU)
    backend.supports_cuda_graphs = "yes"
    assert supports_cuda_graphs(backend) is False


def test_a_plugin_backend_without_the_declaration_is_rejected(isolated_plugin_manager):
    class Chip:
        @hookimpl
        def make_attention(self, spec):
            return UndeclaredAttention(spec)

    isolated_plugin_manager.register(Chip(), name="chip")
    with pytest.raises(plugins.PluginError, match="'chip' returned UndeclaredAttention .* AttentionBackend"):
        plugins.make_attention(ATTENTION, CPU)
