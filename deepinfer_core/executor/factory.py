"""`make_executor`: the executor an `EngineConfig` names, after the layout checks that refuse it before
any rank starts."""

from __future__ import annotations

import torch

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.distributed import context_parallel
from deepinfer_core.executor.mp import MultiprocExecutor
from deepinfer_core.executor.protocol import Executor
from deepinfer_core.executor.torchrun import TorchrunExecutor, launched_by_torchrun
from deepinfer_core.executor.uni import UniExecutor
from deepinfer_core.models import tensor_parallel


def make_executor(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                  weights: dict[str, torch.Tensor] | None = None) -> Executor:
    """The executor `engine_config.distributed_executor_backend` names (torchrun's when launched by it)."""
    engine_config.parallel_config.check_implemented()
    # refused before any rank starts
    tensor_parallel.check_tensor_parallel(model_config, engine_config.tensor_parallel_size)
    context_parallel.check_context_parallel(model_config, engine_config)
    model_config.capabilities.check_parallel(model_config.model_type, "expert", engine_config.parallel_config.ep_size)
    if launched_by_torchrun():
        return TorchrunExecutor(model_config, engine_config, device, weights)
    parallel = engine_config.parallel_config
    if engine_config.distributed_executor_backend == "mp" or parallel.world_size > 1 or parallel.enable_expert_parallel:
        return MultiprocExecutor(model_config, engine_config, device, weights)  # a layout needs its ranks
    if engine_config.num_ranks != 1:
        raise ValueError(f"world_size={engine_config.num_ranks} needs distributed_executor_backend='mp'")
    return UniExecutor(model_config, engine_config, device, weights)
