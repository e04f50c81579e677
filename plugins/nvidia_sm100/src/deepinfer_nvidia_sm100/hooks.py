"""Hook implementations of the NVIDIA (compute capability >= 9.0) plugin.

Every factory checks the device, Triton and the spec, and declines with a reason when one does not fit,
so the reference backends (or another plugin) serve instead. Kernel modules are imported only after
the checks pass: Triton is never imported on machines without a suitable GPU. Deterministic specs
(`EngineConfig.deterministic`) get the batch-invariant variants (`invariant_attention`, `invariant_moe`,
`invariant_layer_ops`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from deepinfer_core.hookspecs import hookimpl
from deepinfer_nvidia_sm100.platform import (
    cuda_memory_counters,
    device_problem,
    dtype_problem,
    linear_problem,
    use_kernel_cache,
)

if TYPE_CHECKING:
    from deepinfer_core.backends import (
        AttentionBackend,
        AttentionSpec,
        LayerOps,
        LayerOpsSpec,
        LinearBackend,
        LinearSpec,
        MemoryCounters,
        MoEBackend,
        MoESpec,
        SamplingBackend,
        SamplingSpec,
    )

PLATFORM = "nvidia"


@hookimpl
def platforms() -> list[str]:
    return [PLATFORM]


@hookimpl
def detect_device(decline: Callable[[str], None]) -> torch.device | None:
    problem = device_problem()
    if problem is not None:
        decline(problem)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _spec_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why kernels cannot serve `dtype` on `device`, or None; when they can, Triton's kernel cache is set
    up first (`platform.use_kernel_cache`), before any kernel module imports Triton."""
    problem = device_problem(device) or dtype_problem(dtype)
    if problem is None:
        use_kernel_cache()
    return problem


@hookimpl
def make_attention(
    spec: AttentionSpec, device: torch.device, decline: Callable[[str], None]
) -> AttentionBackend | None:
    problem = _spec_problem(device, spec.dtype)
    if problem is not None:
        decline(problem)
        return None
    if spec.deterministic:
        from deepinfer_nvidia_sm100.invariant_attention import InvariantTritonAttention

        return InvariantTritonAttention(spec)
    from deepinfer_nvidia_sm100.attention import TritonAttention

    return TritonAttention(spec)


@hookimpl
def make_moe(spec: MoESpec, device: torch.device, decline: Callable[[str], None]) -> MoEBackend | None:
    problem = _spec_problem(device, spec.dtype)
    if problem is None and spec.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        problem = f"scoring_func {spec.scoring_func!r} not supported"
    if problem is None and spec.expert_format not in ("dense", "fp4"):
        problem = f"expert_format {spec.expert_format!r} not supported"
    if problem is None and spec.expert_format == "fp4" and (spec.hidden_size % 32 or spec.intermediate_size % 32):
        problem = "FP4 experts need hidden and intermediate sizes divisible by 32"
    if problem is None and spec.expert_parallel:
        problem = "expert parallelism: no dispatch of its own (the reference's all-to-all serves it)"
    if problem is not None:
        decline(problem)
        return None
    if spec.deterministic:
        from deepinfer_nvidia_sm100.invariant_moe import InvariantTritonMoE

        return InvariantTritonMoE(spec)
    from deepinfer_nvidia_sm100.moe import TritonMoE

    return TritonMoE(spec)


@hookimpl
def make_layer_ops(spec: LayerOpsSpec, device: torch.device, decline: Callable[[str], None]) -> LayerOps | None:
    problem = _spec_problem(device, spec.dtype)
    if problem is None and spec.hc_mult > 8:
        problem = f"hc_mult {spec.hc_mult} > 8 not supported"
    if problem is not None:
        decline(problem)
        return None
    if spec.deterministic:
        from deepinfer_nvidia_sm100.invariant_layer_ops import InvariantTritonLayerOps

        return InvariantTritonLayerOps(spec, device)
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    return TritonLayerOps(spec, device)


@hookimpl
def make_linear(spec: LinearSpec, device: torch.device, decline: Callable[[str], None]) -> LinearBackend | None:
    problem = _spec_problem(device, spec.dtype) or linear_problem(spec)
    if problem is not None:
        decline(problem)
        return None
    from deepinfer_nvidia_sm100.linear import TritonFP8Linear

    return TritonFP8Linear(spec, torch.cuda.get_device_properties(device).multi_processor_count)


@hookimpl
def make_sampler(
    spec: SamplingSpec, device: torch.device, decline: Callable[[str], None]
) -> SamplingBackend | None:
    problem = _spec_problem(device, torch.float32)
    if problem is not None:
        decline(problem)
        return None
    from deepinfer_nvidia_sm100.sampling import CudaSampler

    return CudaSampler(spec)


@hookimpl
def memory_counters(device: torch.device, decline: Callable[[str], None]) -> MemoryCounters | None:
    counters, problem = cuda_memory_counters(device)
    if problem is not None:
        decline(problem)
    return counters
