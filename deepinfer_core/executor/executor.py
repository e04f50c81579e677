"""Executors: run a `StepPlan` on the model side and return rank 0's `StepResult`.

- `UniExecutor` ("uni", the default): one `ModelRunner` in the engine's own process.
- `MultiprocExecutor` ("mp"): one worker process per rank, started by the engine, joined in a
  `torch.distributed` group (gloo on CPU, NCCL on CUDA). Every rank gets every plan through its own
  pipe and answers it; rank 0's answer carries the result. A rank that raises, dies or stays silent
  past `worker_timeout_s` ends the executor with a `WorkerError` naming the rank and the cause.
- Under `torchrun` (see `deepinfer_core.executor.worker`), rank 0's process hosts the engine and its own
  runner, and sends plans to the other ranks over torch.distributed.

Today every rank holds the whole model (a replica) and computes the same plan; sharding the model
across ranks plugs in behind the runner without changing this protocol.
"""

from __future__ import annotations

import multiprocessing.connection as mp_connection
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer_core.backends.attention import BLOCK_SIZE
from deepinfer_core.backends.parallel import ParallelConfig
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.distributed import context_parallel
from deepinfer_core.models import tensor_parallel
from deepinfer_core.plan import StepPlan, StepResult


class WorkerError(RuntimeError):
    """A worker rank failed, died or hung; the engine cannot continue."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's share of the model and its cache, in bytes."""

    rank: int
    weights_bytes: int
    """Parameters and buffers this rank holds (its experts only, under expert parallelism)."""
    cache_bytes: int
    """Its KV cache and per-request state (sized from its own device's free memory)."""
    num_blocks: int


@dataclass(frozen=True)
class ModelSideInfo:
    """What the engine learns from the model side at start-up."""

    num_blocks: int
    num_slots: int
    block_size: int
    cache_fingerprint: bytes
    device: torch.device
    memory: RankMemory | None = None
    block_layout: tuple = ()
    """`kv_blocks.block_layout` of the model: what a cache block's bytes are (the prefix tiers' unit)."""


class Executor(Protocol):
    """Runs plans. `info` is fixed once built; `execute` is called once per step, in order."""

    info: ModelSideInfo

    def execute(self, plan: StepPlan) -> StepResult:
        """Run `plan` on every rank; return rank 0's result."""

    def execute_all(self, plans: list[StepPlan]) -> list[StepResult]:
        """Run one plan per data-parallel rank at once (each on that DP rank's ranks); their results."""

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""


def runner_info(runner, rank: int = 0) -> ModelSideInfo:
    """What `runner` tells the engine, with its memory share."""
    weights = sum(t.numel() * t.element_size() for t in (*runner.model.parameters(), *runner.model.buffers()))
    cache = sum(t.numel() * t.element_size() for layer in runner.kv_cache.layers
                for t in vars(layer).values() if isinstance(t, torch.Tensor))
    memory = RankMemory(rank, weights, cache, runner.num_blocks)
    return ModelSideInfo(runner.num_blocks, runner.num_slots, BLOCK_SIZE, runner.cache_fingerprint, runner.device,
                         memory, runner.block_layout)


class UniExecutor:
    """The model runner in this process. Its plans are handed over as they are, so a plan's grammar
    bitmask may be a function filled once the step's forward is launched (`can_defer_bitmask`)."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        from deepinfer_core.worker.runner import ModelRunner

        self.runner = ModelRunner(model_config, engine_config, device, weights=weights)
        self.info = runner_info(self.runner)
        self.infos = [self.info]
        self.execute = self.runner.execute
        self.launch = self.runner.launch

    def execute_all(self, plans: list[StepPlan]) -> list[StepResult]:
        return [self.runner.execute(plan) for plan in plans]

    def shutdown(self) -> None:
        self.runner.close()


class MultiprocExecutor:
    """`world_size` worker processes, one per rank (see the module docstring).

    Workers are fresh interpreters (`python -m deepinfer_core.executor.worker`), each holding one end of
    a socket pair: nothing of the caller's `__main__` is re-imported, so no `if __name__ == "__main__"`
    guard is needed around `LLM(...)`."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        self.world_size = engine_config.num_ranks
        self.timeout_s = engine_config.worker_timeout_s
        self.layout = engine_config.parallel_config
        self.rank_reports: list[dict | None] = [None] * self.world_size
        """Per rank, its latest `worker.RankReport`: steps, step and dispatch seconds, EPLB figures."""
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._conns, self._procs = [], []
        self._is_shut_down = False
        for rank in range(self.world_size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.executor.worker", str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()])
            theirs.close()
            conn = mp_connection.Connection(ours.detach())
            self._conns.append(conn)
            self._procs.append(proc)
            args = (rank, self.world_size, init_method, model_config, engine_config, str(device), weights)
            conn.send_bytes(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        infos = self._collect(timeout_s=None, what="start-up")
        self.leaders = dp_leaders(self.layout)
        self.infos: list[ModelSideInfo] = [infos[rank] for rank in self.leaders]
        """Per data-parallel rank, its first rank's info (each DP rank sizes its own cache)."""
        self.memory = [info.memory for info in infos]
        self.info = self.infos[0]

    def execute(self, plan: StepPlan) -> StepResult:
        if len(self.leaders) != 1:
            raise RuntimeError("a data-parallel world runs one plan per DP rank: call execute_all")
        return self.execute_all([plan])[0]

    def execute_all(self, plans: list[StepPlan]) -> list[StepResult]:
        if len(plans) != len(self.leaders):
            raise ValueError(f"{len(plans)} plans for {len(self.leaders)} data-parallel ranks")
        data = [pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL) for plan in plans]
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data[dp_rank_of(self.layout, rank)])
            except OSError as err:
                self._fail(rank, f"its pipe is closed ({err}); exit code {self._procs[rank].poll()}")
        answers = self._collect(timeout_s=self.timeout_s, what="a step")
        self.rank_reports = [report for _, report in answers]
        return [answers[rank][0] for rank in self.leaders]

    @property
    def eplb_stats(self) -> dict | None:
        """Rank 0's latest EPLB figures (`eplb_state.BalanceStats` as a dict), None without EPLB."""
        return self.rank_reports[0]["eplb"] if self.rank_reports[0] else None

    def _collect(self, timeout_s: float | None, what: str) -> list:
        """One answer from every rank; `WorkerError` on an error report, a dead rank or a timeout."""
        answers: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(answers) < self.world_size:
            waiting = [rank for rank in range(self.world_size) if rank not in answers]
            remaining = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if remaining <= 0:
                for rank in waiting:  # a dead rank is the cause, not the silence it left behind
                    if self._procs[rank].poll() is not None:
                        self._fail(rank, f"exited during {what} (exit code {self._procs[rank].returncode})")
                self._fail(waiting[0], f"sent nothing for {timeout_s:g} s during {what} "
                                       f"(worker_timeout_s); ranks still silent: {waiting}")
            ready = mp_connection.wait([self._conns[r] for r in waiting], timeout=remaining)
            for rank in waiting:
                conn = self._conns[rank]
                if conn in ready:
                    try:
                        kind, payload = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        code = self._procs[rank].wait(5)
                        cause = f"exited during {what} (exit code {code})"
                        if code >= 0:  # not killed by a signal: a peer's death may be the cause
                            self._fail_dead_peer(rank, what, cause)
                        self._fail(rank, cause)
                    if kind == "error":
                        self._fail_dead_peer(rank, what, f"raised during {what}: {payload}")
                        self._fail(rank, f"raised during {what}: {payload}")
                    answers[rank] = payload
                elif self._procs[rank].poll() is not None:
                    self._fail(rank, f"exited during {what} (exit code {self._procs[rank].returncode})")
        return [answers[rank] for rank in range(self.world_size)]

    def _fail_dead_peer(self, rank: int, what: str, cause: str, grace_s: float = 1.0) -> None:
        """`rank` failed with `cause`; that is most often the echo of another rank's death (a collective
        lost its peer): if another rank is killed by a signal within `grace_s`, name that one, with
        `rank`'s cause after it (a rank that raised exits with 1 after its report). Returns once every
        other rank has exited otherwise, or the time is up."""
        deadline = time.monotonic() + grace_s
        while True:
            codes = {peer: self._procs[peer].poll() for peer in range(self.world_size) if peer != rank}
            for peer, code in codes.items():
                if code is not None and code < 0:
                    self._fail(peer, f"exited during {what} (exit code {code}); worker rank {rank} then {cause}")
            if all(code is not None for code in codes.values()) or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _fail(self, rank: int, cause: str):
        self.shutdown()
        raise WorkerError(f"worker rank {rank} {cause}")

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for conn in self._conns:
            conn.close()

    def __del__(self) -> None:
        if hasattr(self, "_procs"):
            self.shutdown()


def make_executor(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                  weights: dict[str, torch.Tensor] | None = None) -> Executor:
    """The executor `engine_config.distributed_executor_backend` names (torchrun's when launched by it)."""
    from deepinfer_core.executor import worker

    engine_config.parallel_config.check_implemented()
    # refused before any rank starts
    tensor_parallel.check_tensor_parallel(model_config, engine_config.tensor_parallel_size)
    context_parallel.check_context_parallel(model_config, engine_config)
    if worker.launched_by_torchrun():
        return worker.TorchrunExecutor(model_config, engine_config, device, weights)
    parallel = engine_config.parallel_config
    if engine_config.distributed_executor_backend == "mp" or parallel.world_size > 1 or parallel.enable_expert_parallel:
        return MultiprocExecutor(model_config, engine_config, device, weights)  # a layout needs its ranks
    if engine_config.num_ranks != 1:
        raise ValueError(f"world_size={engine_config.num_ranks} needs distributed_executor_backend='mp'")
    return UniExecutor(model_config, engine_config, device, weights)


def can_defer_bitmask(executor: Executor) -> bool:
    """Whether `executor` takes plans whose grammar bitmask is filled late, by a function of the engine's
    (`StructuredOutputManager.fill_bitmask`): only the in-process runner does. Plans sent to worker
    ranks (multi-process and torchrun executors: tensor, data, expert and context parallelism) must
    pickle, so there a constrained request keeps sitting out the step launched while its last token is
    still on the device (`Sequence.waits_for_host`), and decodes every other step."""
    return isinstance(executor, UniExecutor)


def can_launch(executor: Executor) -> bool:
    """Whether `executor` can queue a step and be read later (`launch`, `ModelRunner.launch`): only the
    in-process runner can; worker ranks answer each plan whole."""
    return isinstance(executor, UniExecutor)


def parallel_stats(executor) -> dict:
    """Per-rank memory and rank 0's EPLB figures, as far as `executor` knows them (for `stats()`)."""
    stats = {}
    memory = getattr(executor, "memory", None)
    if memory:
        stats["rank_memory"] = [vars(m) for m in memory if m is not None]
    eplb = getattr(executor, "eplb_stats", None)
    if eplb:
        stats["eplb"] = dict(eplb)
    reports = getattr(executor, "rank_reports", None)
    if reports and all(r is not None for r in reports):
        stats["ranks"] = [{k: v for k, v in r.items() if k != "eplb"} for r in reports]
    return stats


def dp_rank_of(layout: ParallelConfig, rank: int) -> int:
    """The data-parallel rank whose plans global `rank` runs (0 for a world of replicas)."""
    return layout.coordinates(rank)[0] if layout.world_size > 1 else 0


def dp_leaders(layout: ParallelConfig) -> list[int]:
    """Per data-parallel rank, the global rank that answers its steps."""
    return [layout.dp_leader(dp) for dp in range(layout.data_parallel_size)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
