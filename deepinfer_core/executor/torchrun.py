"""Under `torchrun` every rank runs the same script: rank 0's `LLM(...)`/`Engine(...)` returns an engine
whose `TorchrunExecutor` broadcasts each step (the plan, then the grammar rows); on every other rank that call serves plans
(`broadcast.serve_plans`) and exits the process when rank 0 shuts down.

The other ranks beat through the world's store (`rank_heartbeat`) while they serve. Rank 0 runs its
share of each step (its collectives block) on a thread of its own and waits for it reading their
beats, so a rank stopped or hung is named within `worker_heartbeat_timeout_s`, as under the mp
executor, not after `worker_timeout_s`."""

from __future__ import annotations

import atexit
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.executor.broadcast import StepLeader, serve_plans
from deepinfer_core.executor.protocol import ModelSideInfo, WorkerError, dp_leaders, dp_rank_of, runner_info
from deepinfer_core.executor.rank_heartbeat import HeartbeatWatch, StoreHeartbeat, world_store
from deepinfer_core.executor.worker import (
    RankReport,
    build_runner,
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
    """Rank 0's executor under torchrun: its own runner, plans broadcast to the other ranks
    (`broadcast.StepLeader` over the whole world)."""

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
        layout = engine_config.parallel_config
        heartbeat_timeout_s = engine_config.worker_heartbeat_timeout_s
        if rank != 0:
            heartbeat = StoreHeartbeat(world_store(), rank, heartbeat_timeout_s / 4)
            try:
                serve_plans(runner, rank, is_dp_leader(engine_config, rank), dp_rank_of(layout, rank))
            finally:
                heartbeat.stop()
            dist.destroy_process_group()
            raise SystemExit(0)
        self.runner, self.world_size, self.layout = runner, world_size, layout
        self.leaders = dp_leaders(self.layout)
        self.infos: list[ModelSideInfo] = [infos[r] for r in self.leaders]
        self.memory = [info.memory for info in infos]
        self.info: ModelSideInfo = self.infos[0]
        self.driver = StepLeader(RankReport(runner, 0), None, 0, list(range(world_size)))
        self.watch = HeartbeatWatch(world_store(), list(range(1, world_size)), heartbeat_timeout_s)
        # One thread runs rank 0's share of every step, so its device state stays on one thread.
        self._steps = ThreadPoolExecutor(1, "deepinfer-torchrun-step", initializer=set_device, initargs=(local_device,))
        self._failure: str | None = None
        self._is_shut_down = False
        atexit.register(self.shutdown)

    @property
    def rank_reports(self) -> list[dict | None]:
        """Per rank, its latest `worker.RankReport` as a dict."""
        return self.driver.rank_reports

    def execute(self, plan) -> StepResult:
        return self.execute_all([plan] * len(self.leaders))[0]

    def execute_all(self, plans: list) -> list[StepResult]:
        self.execute_model_all(plans)
        return self._sample_all(None)

    def execute_model(self, plan) -> None:
        self.execute_model_all([plan] * len(self.leaders))

    def execute_model_all(self, plans: list) -> None:
        """Broadcast the plans (each rank runs its DP rank's) and run rank 0's forward."""
        self._watched(self.driver.execute_model, plans)

    def sample(self, grammar_rows=None, *, late: bool = False):
        result = self._sample_all(grammar_rows)[0]
        return (lambda: result) if late else result

    def _sample_all(self, grammar_rows) -> list[StepResult]:
        """Broadcast the grammar rows, sample rank 0's step and gather every rank's answer."""
        try:
            result, answers = self._watched(self.driver.sample, grammar_rows)
        except WorkerError:
            self.shutdown()
            raise
        return [result if rank == 0 else answers[rank] for rank in self.leaders]

    def _watched(self, call, arg):
        """`call(arg)` on the step thread, while the other ranks' heartbeats are read every quarter of
        their timeout: a rank silent for all of it ends the executor with a `WorkerError` naming it."""
        if self._failure is not None:
            raise WorkerError(self._failure)
        future = self._steps.submit(call, arg)
        self.watch.reset()
        while True:
            try:
                return future.result(timeout=self.watch.interval_s)
            except FutureTimeout:
                silent = self.watch.silent()
            if silent:
                # The step thread stays blocked in a collective with the silent rank; nothing joins it.
                self._failure = (f"worker rank {silent[0]} hung: no answer and no heartbeat for "
                                 f"{self.watch.timeout_s:g} s during a step (worker_heartbeat_timeout_s); "
                                 f"ranks silent: {silent}")
                self.shutdown()
                raise WorkerError(self._failure)

    @property
    def eplb_stats(self) -> dict | None:
        return self.rank_reports[0]["eplb"] if self.rank_reports[0] else None

    def shutdown(self) -> None:
        if self._is_shut_down or not dist.is_initialized():
            return
        self._is_shut_down = True
        if self._failure is not None:
            # A rank is silent and the step thread is blocked in a collective with it: stopping the
            # others, closing the runner or destroying the group would block or race that thread.
            logger.error("the torchrun executor stopped: %s", self._failure)
            return
        self._steps.shutdown()
        try:
            self.driver.stop()
        except Exception:  # noqa: BLE001 -- a rank already gone; the others time out on their own
            logger.warning("could not tell every worker rank to stop")
        finally:
            self.runner.close()
            dist.destroy_process_group()
