"""Backend contracts: one Protocol and one frozen Spec per domain.

A Spec says what the engine needs built; a Protocol says what the built object must do. Factory hooks
(`make_attention(spec, device)` and friends, see `deepinfer_core.hookspecs`) turn a Spec into an object
satisfying the Protocol. The pure-PyTorch implementations in `deepinfer_core.reference` are the oracle
every other implementation is tested against (`deepinfer_core.testing`).

The names below load on first use (PEP 562), so that `deepinfer_core.backends.parallel` - the parallel
layout the engine's config is typed with - imports without torch, and `deepinfer --help` stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from deepinfer_core.backends.attention import (
        AttentionBackend,
        AttentionMetadata,
        AttentionSpec,
        IndexScorer,
    )
    from deepinfer_core.backends.eplb import EplbBackend, EplbSpec
    from deepinfer_core.backends.graphs import GraphApi, GraphCapturable, supports_cuda_graphs
    from deepinfer_core.backends.layer_ops import (
        CompressorWeights,
        HostRowGather,
        HyperWeights,
        LayerOps,
        LayerOpsSpec,
        SinglePassMixing,
    )
    from deepinfer_core.backends.linear import LinearBackend, LinearSpec
    from deepinfer_core.backends.memory import MemoryCounters
    from deepinfer_core.backends.moe import MoEBackend, MoESpec, MoEWeights
    from deepinfer_core.backends.sampling import SamplerOutput, SamplingBackend, SamplingSpec, SamplingTensors
    from deepinfer_core.backends.verify import VerifyBackend, VerifyOutput, VerifySpec

_SUBMODULE_OF = {
    "AttentionBackend": "attention", "AttentionMetadata": "attention", "AttentionSpec": "attention",
    "IndexScorer": "attention", "EplbBackend": "eplb", "EplbSpec": "eplb", "GraphApi": "graphs",
    "GraphCapturable": "graphs", "supports_cuda_graphs": "graphs", "CompressorWeights": "layer_ops",
    "HostRowGather": "layer_ops", "HyperWeights": "layer_ops", "LayerOps": "layer_ops", "LayerOpsSpec": "layer_ops",
    "SinglePassMixing": "layer_ops", "LinearBackend": "linear", "LinearSpec": "linear", "MoEBackend": "moe",
    "MemoryCounters": "memory",
    "MoESpec": "moe", "MoEWeights": "moe", "SamplerOutput": "sampling", "SamplingBackend": "sampling",
    "SamplingSpec": "sampling", "SamplingTensors": "sampling", "VerifyBackend": "verify",
    "VerifyOutput": "verify", "VerifySpec": "verify",
}


__getattr__, __dir__ = lazy_exports(__name__, _SUBMODULE_OF)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "CompressorWeights",
    "EplbBackend",
    "EplbSpec",
    "GraphApi",
    "GraphCapturable",
    "HostRowGather",
    "HyperWeights",
    "IndexScorer",
    "LayerOps",
    "LayerOpsSpec",
    "LinearBackend",
    "LinearSpec",
    "MemoryCounters",
    "MoEBackend",
    "MoESpec",
    "MoEWeights",
    "SamplerOutput",
    "SamplingBackend",
    "SamplingSpec",
    "SamplingTensors",
    "SinglePassMixing",
    "VerifyBackend",
    "VerifyOutput",
    "VerifySpec",
    "supports_cuda_graphs",
]
