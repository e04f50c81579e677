"""Backend contracts: one Protocol and one frozen Spec per domain.

A Spec says what the engine needs built; a Protocol says what the built object must do. Factory hooks
(`make_attention(spec, device)` and friends, see `deepinfer_core.hookspecs`) turn a Spec into an object
satisfying the Protocol. The pure-PyTorch implementations in `deepinfer_core.reference` are the oracle
every other implementation is tested against (`deepinfer_core.testing`).
"""

from deepinfer_core.backends.attention import AttentionBackend, AttentionMetadata, AttentionSpec, IndexScorer
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
from deepinfer_core.backends.moe import MoEBackend, MoESpec, MoEWeights
from deepinfer_core.backends.sampling import SamplerOutput, SamplingBackend, SamplingSpec, SamplingTensors
from deepinfer_core.backends.verify import VerifyBackend, VerifyOutput, VerifySpec

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
