"""The built-in reference plugin: pure-PyTorch backends for every factory hook, on any device.

A spec with `deterministic=True` gets the batch-invariant variant (`deepinfer_core.reference.invariant`).
Every implementation is `trylast`, so an installed hardware plugin is always asked first and the
reference serves only what the others decline. Backend modules are imported when a backend is built.
"""

from __future__ import annotations

import torch

from deepinfer_core.backends import (
    AttentionSpec,
    EplbSpec,
    LayerOpsSpec,
    LinearSpec,
    MoESpec,
    SamplingSpec,
    VerifySpec,
)
from deepinfer_core.hookspecs import hookimpl


@hookimpl(trylast=True)
def platforms() -> list[str]:
    return ["cpu"]


@hookimpl(trylast=True)
def detect_device() -> torch.device:
    return torch.device("cpu")


@hookimpl(trylast=True)
def make_attention(spec: AttentionSpec, device: torch.device):
    if spec.deterministic:
        from deepinfer_core.reference.invariant_attention import InvariantAttention

        return InvariantAttention(spec, device)
    from deepinfer_core.reference.attention import ReferenceAttention

    return ReferenceAttention(spec, device)


@hookimpl(trylast=True)
def make_moe(spec: MoESpec, device: torch.device):
    if spec.deterministic:
        from deepinfer_core.reference.invariant_moe import InvariantMoE

        return InvariantMoE(spec, device)
    from deepinfer_core.reference.moe import ReferenceMoE

    return ReferenceMoE(spec, device)


@hookimpl(trylast=True)
def make_layer_ops(spec: LayerOpsSpec, device: torch.device):
    if spec.deterministic:
        from deepinfer_core.reference.invariant import InvariantLayerOps

        return InvariantLayerOps(spec)
    from deepinfer_core.reference.layer_ops import ReferenceLayerOps

    return ReferenceLayerOps(spec)


@hookimpl(trylast=True)
def make_linear(spec: LinearSpec, device: torch.device):
    from deepinfer_core.reference.linear import ReferenceLinear

    return ReferenceLinear(spec, device)


@hookimpl(trylast=True)
def make_eplb(spec: EplbSpec, device: torch.device):
    from deepinfer_core.reference.eplb import ReferenceEplb

    return ReferenceEplb(spec, device)


@hookimpl(trylast=True)
def make_sampler(spec: SamplingSpec, device: torch.device):
    from deepinfer_core.reference.sampling import ReferenceSampler

    return ReferenceSampler(spec, device)


@hookimpl(trylast=True)
def make_verifier(spec: VerifySpec, device: torch.device):
    from deepinfer_core.reference.verify import ReferenceVerifier

    return ReferenceVerifier(spec, device)


@hookimpl(trylast=True)
def graph_api(device: torch.device, decline):
    if device.type != "cuda":
        decline(f"the reference captures graphs only on CUDA devices, not {device.type!r}")
        return None
    from deepinfer_core.backends import GraphApi

    return GraphApi(Graph=torch.cuda.CUDAGraph, graph=torch.cuda.graph, Stream=torch.cuda.Stream,
                    stream=torch.cuda.stream, current_stream=torch.cuda.current_stream,
                    synchronize=torch.cuda.synchronize)


@hookimpl(trylast=True)
def memory_counters(device: torch.device, decline) -> None:
    decline("the reference reads no allocator counters (a hardware plugin offers its device's)")
