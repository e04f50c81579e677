"""`UniExecutor` ("uni", the default): one `ModelRunner` in the engine's own process."""

from __future__ import annotations

import torch

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.executor.protocol import runner_info
from deepinfer_core.plan import StepPlan, StepResult
from deepinfer_core.worker.runner import ModelRunner


class UniExecutor:
    """The model runner in this process: `sample(..., late=True)` returns the runner's completion, read
    after the device has run (`Executor.is_in_process`)."""

    is_in_process = True

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        self.runner = ModelRunner(model_config, engine_config, device, weights=weights)
        self.info = runner_info(self.runner)
        self.infos = [self.info]
        self.memory = [self.info.memory]  # stats()' rank_memory: its share and the measured step peak
        self.execute_model = self.runner.execute_model
        self.execute = self.runner.execute

    def sample(self, grammar_rows=None, *, late: bool = False):
        complete = self.runner.sample_late(grammar_rows)
        return complete if late else complete()

    def execute_all(self, plans: list[StepPlan]) -> list[StepResult]:
        return [self.runner.execute(plan) for plan in plans]

    def shutdown(self) -> None:
        self.runner.close()
