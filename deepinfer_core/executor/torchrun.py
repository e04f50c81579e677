"""Under `torchrun` every rank runs the same script: rank 0's `LLM(...)`/`Engine(...)` returns an engine
whose `TorchrunExecutor` broadcasts each step (the plan, then the grammar rows); on every other rank that call serves plans
(`serve_plans`) and exits the process when rank 0 shuts down."""

from __future__ import annotations

import atexit
import logging
import os
import traceback

import torch
import torch.distributed as dist

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.executor.protocol import ModelSideInfo, WorkerError, dp_leaders, dp_rank_of, runner_info
from deepinfer_core.executor.worker import (
    RankReport,
    build_runner,
    host_result,
    init_group,
    is_dp_leader,
    rank_device,
    set_device,
)
from deepinfer_core.plan import StepResult

logger = logging.getLogger(__name__)


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a `torchrun` launch (its environment says so)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


class TorchrunExecutor:
    """Rank 0's executor under torchrun: its own runner, plans broadcast to the other ranks."""

    is_in_process = False

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights=None) -> None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_device = rank_device(device, int(os.environ["LOCAL_RANK"]))
        set_device(local_device)
        init_group(local_device, rank, world_size, "env://", engine_config.worker_timeout_s)
        runner = build_runner(model_config, engine_config, local_device, weights)
        infos = [None] * world_size if rank == 0 else None
        dist.gather_object(runner_info(runner, rank), infos, dst=0)
        if rank != 0:
            serve_plans(runner, engine_config, rank)
            raise SystemExit(0)
        self.runner, self.world_size, self.layout = runner, world_size, engine_config.parallel_config
        self.leaders = dp_leaders(self.layout)
        self.infos: list[ModelSideInfo] = [infos[r] for r in self.leaders]
        self.memory = [info.memory for info in infos]
        self.info: ModelSideInfo = self.infos[0]
        self.report = RankReport(runner, 0)
        self.rank_reports: list[dict | None] = [None] * world_size
        self._error: str | None = None
        """Rank 0's error in the step's first phase, reported at its second."""
        self._is_shut_down = False
        atexit.register(self.shutdown)

    def execute(self, plan) -> StepResult:
        return self.execute_all([plan] * len(self.leaders))[0]

    def execute_all(self, plans: list) -> list[StepResult]:
        self.execute_model_all(plans)
        return self._sample_all(None)

    def execute_model(self, plan) -> None:
        self.execute_model_all([plan] * len(self.leaders))

    def execute_model_all(self, plans: list) -> None:
        """Broadcast the plans (each rank runs its DP rank's) and run rank 0's forward."""
        dist.broadcast_object_list([("model", plans)], src=0)
        self._error = None
        try:
            self.report.execute_model(plans[0])
        except Exception as err:  # noqa: BLE001 -- reported with the other ranks' answers at `sample`
            self._error = f"{type(err).__name__}: {err}"

    def sample(self, grammar_rows=None, *, late: bool = False):
        result = self._sample_all(grammar_rows)[0]
        return (lambda: result) if late else result

    def _sample_all(self, grammar_rows) -> list[StepResult]:
        """Broadcast the grammar rows, sample rank 0's step and gather every rank's answer."""
        dist.broadcast_object_list([("sample", grammar_rows)], src=0)
        error, result = self._error, None
        if error is None:
            try:
                result = self.report.sample(grammar_rows)
            except Exception as err:  # noqa: BLE001 -- the other ranks' answers are still collected
                error = f"{type(err).__name__}: {err}"
        answers = [None] * self.world_size
        try:
            dist.gather_object((error, None, self.report.as_dict()), answers, dst=0)
        except Exception as err:
            raise WorkerError(f"a worker rank did not answer a step: {err}") from err
        for rank, (status, _, _) in enumerate(answers):
            if status is not None:
                self.shutdown()
                raise WorkerError(f"worker rank {rank} raised during a step: {status}")
        self.rank_reports = [answer[2] for answer in answers]
        return [result if rank == 0 else answers[rank][1] for rank in self.leaders]

    @property
    def eplb_stats(self) -> dict | None:
        return self.rank_reports[0]["eplb"] if self.rank_reports[0] else None

    def shutdown(self) -> None:
        if self._is_shut_down or not dist.is_initialized():
            return
        self._is_shut_down = True
        try:
            dist.broadcast_object_list([None], src=0)
            dist.barrier()  # every rank has read the stop: no transfer is in flight when the group goes
        except Exception:  # noqa: BLE001 -- a rank already gone; the others time out on their own
            logger.warning("could not tell every worker rank to stop")
        finally:
            self.runner.close()
            dist.destroy_process_group()


def serve_plans(runner, engine_config: EngineConfig, rank: int) -> None:
    """A torchrun rank other than 0: run its DP rank's plan of every broadcast step (`("model", plans)`,
    then `("sample", grammar rows)`), report errors (and its result when it answers for its DP rank) at
    the second, stop at `None`."""
    is_leader, report = is_dp_leader(engine_config, rank), RankReport(runner, rank)
    dp = dp_rank_of(engine_config.parallel_config, rank)
    error = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        kind, payload = box[0]
        if kind == "model":
            error = _attempt(report.execute_model, payload[dp])[0]
            continue
        result = None
        if error is None:
            error, result = _attempt(report.sample, payload)
        answer = host_result(result) if is_leader and result is not None else None
        dist.gather_object((error, answer, report.as_dict()), None, dst=0)  # after an error rank 0 stops everyone with `None`
        error = None
    runner.close()
    dist.barrier()  # rank 0's shutdown waits here too, so neither side tears the group down mid-transfer
    dist.destroy_process_group()


def _attempt(call, arg) -> tuple[str | None, object]:
    """`(None, call(arg))`, or `(its error, None)` (printed here, reported to rank 0)."""
    try:
        return None, call(arg)
    except Exception as err:  # noqa: BLE001 -- reported to rank 0
        traceback.print_exc()
        return f"{type(err).__name__}: {err}", None
