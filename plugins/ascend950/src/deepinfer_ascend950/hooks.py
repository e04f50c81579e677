"""Hook implementations of the Ascend 950 plugin.

Every factory first checks the device (an NPU, torch_npu importable, SoC 950), then the ops it needs
and the spec against their documented constraints; whatever does not fit declines with the reason, so
the reference backends serve that family in PyTorch on the NPU (that is each family's fallback, and
`deepinfer plugins` shows why). torch_npu and cann_ops_transformer are imported only here, lazily,
once an NPU is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from deepinfer_ascend950.constraints import AscendConstraintError
from deepinfer_ascend950.platform import (
    cann_problem,
    load_cann_ops,
    load_torch_npu,
    npu_memory_counters,
    npu_problem,
)
from deepinfer_core.backends.deterministic import deterministic_problem
from deepinfer_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from deepinfer_core.backends import (
        AttentionBackend,
        AttentionSpec,
        EplbSpec,
        GraphApi,
        LayerOps,
        LayerOpsSpec,
        MemoryCounters,
        MoEBackend,
        MoESpec,
        SamplingBackend,
        SamplingSpec,
        VerifySpec,
    )

PLATFORM = "ascend"
NO_NPU_KERNEL = "no NPU-specific kernel for this family: the reference (PyTorch, on the NPU too) serves it"


@hookimpl
def platforms() -> list[str]:
    return [PLATFORM]


@hookimpl
def detect_device(decline: Callable[[str], None]) -> torch.device | None:
    problem = npu_problem()
    if problem is not None:
        decline(problem)
        return None
    return torch.device("npu")


def _build(decline: Callable[[str], None], build: Callable[[], object], fallback: str) -> object | None:
    """`build()`, or None after declining with the violated constraint and what serves instead."""
    try:
        return build()
    except AscendConstraintError as err:
        decline(f"{err}; {fallback}")
        return None


@hookimpl
def make_attention(spec: AttentionSpec, device: torch.device, decline: Callable[[str], None]) -> AttentionBackend | None:
    problem = npu_problem(device) or cann_problem() or deterministic_problem(spec)
    if problem is not None:
        decline(f"{problem}; attention falls back to the reference (PyTorch on the device)")
        return None
    from deepinfer_ascend950.attention import AscendAttention

    return _build(decline, lambda: AscendAttention(spec, device, load_cann_ops()),
                  "attention falls back to the reference (PyTorch on the NPU)")


@hookimpl
def make_moe(spec: MoESpec, device: torch.device, decline: Callable[[str], None]) -> MoEBackend | None:
    problem = npu_problem(device) or deterministic_problem(spec)
    if problem is None and spec.expert_parallel:
        problem = "expert parallelism: no dispatch of its own (the reference's all-to-all serves it)"
    if problem is not None:
        decline(problem)
        return None
    from deepinfer_ascend950.moe import AscendMoE

    return _build(decline, lambda: AscendMoE(spec, device, load_torch_npu()),
                  "MoE falls back to the reference (PyTorch on the NPU)")


@hookimpl
def make_layer_ops(spec: LayerOpsSpec, device: torch.device, decline: Callable[[str], None]) -> LayerOps | None:
    problem = npu_problem(device) or deterministic_problem(spec)
    if problem is not None:
        decline(problem)
        return None
    from deepinfer_ascend950.layer_ops import AscendLayerOps

    return AscendLayerOps(spec, load_torch_npu())


@hookimpl
def make_sampler(spec: SamplingSpec, device: torch.device, decline: Callable[[str], None]) -> SamplingBackend | None:
    problem = npu_problem(device) or deterministic_problem(spec)
    if problem is not None:
        decline(problem)
        return None
    from deepinfer_ascend950.sampling import AscendSampler

    return AscendSampler(spec, device)


@hookimpl
def make_eplb(spec: EplbSpec, device: torch.device, decline: Callable[[str], None]) -> None:
    decline(NO_NPU_KERNEL)  # placement is a small host-side computation; no NPU op helps


@hookimpl
def make_verifier(spec: VerifySpec, device: torch.device, decline: Callable[[str], None]) -> None:
    decline(NO_NPU_KERNEL)


@hookimpl
def graph_api(device: torch.device, decline: Callable[[str], None]) -> GraphApi | None:
    problem = npu_problem(device)
    if problem is not None:
        decline(problem)
        return None
    from deepinfer_ascend950.graphs import npu_graph_api

    try:
        return npu_graph_api(load_torch_npu())
    except AttributeError as err:
        decline(f"{err}; decode runs eagerly")
        return None


@hookimpl
def memory_counters(device: torch.device, decline: Callable[[str], None]) -> MemoryCounters | None:
    problem = npu_problem(device)
    if problem is not None:
        decline(problem)
        return None
    try:
        return npu_memory_counters(device)
    except AttributeError as err:
        decline(f"{err}; the KV cache is sized without a measured peak")
        return None
