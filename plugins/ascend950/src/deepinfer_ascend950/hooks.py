"""Ascend 950 hooks: the platform and device detection; every backend factory declines for now.

Until Ascend kernels exist, the reference plugin serves every backend on the NPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_core.backends import AttentionSpec, EplbSpec, LayerOpsSpec, MoESpec, SamplingSpec, VerifySpec
from deepinfer_core.hookspecs import hookimpl

NOT_IMPLEMENTED = "Ascend kernels are not implemented yet; the reference serves this"


@hookimpl
def platforms() -> list[str]:
    return ["ascend"]


@hookimpl
def detect_device(decline: Callable[[str], None]) -> torch.device | None:
    try:
        import torch_npu
    except ImportError as err:
        decline(f"torch_npu is not installed ({err})")
        return None
    if not torch_npu.npu.is_available():
        decline("torch_npu found no NPU on this machine")
        return None
    return torch.device("npu")


@hookimpl
def make_attention(spec: AttentionSpec, device: torch.device, decline: Callable[[str], None]) -> None:
    decline(NOT_IMPLEMENTED)


@hookimpl
def make_moe(spec: MoESpec, device: torch.device, decline: Callable[[str], None]) -> None:
    decline(NOT_IMPLEMENTED)


@hookimpl
def make_layer_ops(spec: LayerOpsSpec, device: torch.device, decline: Callable[[str], None]) -> None:
    decline(NOT_IMPLEMENTED)


@hookimpl
def make_eplb(spec: EplbSpec, device: torch.device, decline: Callable[[str], None]) -> None:
    decline(NOT_IMPLEMENTED)


@hookimpl
def make_sampler(spec: SamplingSpec, device: torch.device, decline: Callable[[str], None]) -> None:
    decline(NOT_IMPLEMENTED)


@hookimpl
def make_verifier(spec: VerifySpec, device: torch.device, decline: Callable[[str], None]) -> None:
    decline(NOT_IMPLEMENTED)
