"""`MultiprocExecutor` ("mp"): one worker process per rank, started by the engine, joined in a
`torch.distributed` group (gloo on CPU, NCCL on CUDA). Every rank gets every step through its own
pipe as two messages, the plan (`execute_model`) then the grammar rows (`sample`, a pickled array),
and answers the second; rank 0's answer carries the result. A rank that raises, dies, stops beating
while it works for `worker_heartbeat_timeout_s` (hung, or stopped: `worker.Heartbeat`) or takes longer
than `worker_timeout_s` over a step ends the executor with a `WorkerError` naming the rank and the cause.

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

import torch

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.executor.protocol import (
    ModelSideInfo,
    WorkerError,
    dp_leaders,
    dp_rank_of,
    signalled_peer,
)
from deepinfer_core.plan import StepPlan, StepResult


class MultiprocExecutor:
    """`world_size` worker processes, one per rank (see the module docstring).

    Workers are fresh interpreters (`python -m deepinfer_core.executor.worker`), each holding one end of
    a socket pair: nothing of the caller's `__main__` is re-imported, so no `if __name__ == "__main__"`
    guard is needed around `LLM(...)`."""

    is_in_process = False

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        self.world_size = engine_config.num_ranks
        self.timeout_s = engine_config.worker_timeout_s
        self.heartbeat_timeout_s = engine_config.worker_heartbeat_timeout_s
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
        self.execute_model_all(plans)
        return self._sample_all(None)

    def execute_model(self, plan: StepPlan) -> None:
        if len(self.leaders) != 1:
            raise RuntimeError("a data-parallel world runs one plan per DP rank: call execute_all")
        self.execute_model_all([plan])

    def execute_model_all(self, plans: list[StepPlan]) -> None:
        """Send each data-parallel rank's plan to its ranks (`Executor.execute_model`); nothing waits."""
        if len(plans) != len(self.leaders):
            raise ValueError(f"{len(plans)} plans for {len(self.leaders)} data-parallel ranks")
        data = [pickle.dumps(("model", plan), protocol=pickle.HIGHEST_PROTOCOL) for plan in plans]
        self._send([data[dp_rank_of(self.layout, rank)] for rank in range(self.world_size)], is_first=True)

    def sample(self, grammar_rows=None, *, late: bool = False):
        result = self._sample_all(grammar_rows)[0]
        return (lambda: result) if late else result

    def _sample_all(self, grammar_rows) -> list[StepResult]:
        """Send the step's grammar rows (one pickled array, the same to every rank) and collect the answers."""
        data = pickle.dumps(("sample", grammar_rows), protocol=pickle.HIGHEST_PROTOCOL)
        self._send([data] * self.world_size, is_first=False)
        answers = self._collect(timeout_s=self.timeout_s, what="a step")
        self.rank_reports = [report for _, report in answers]
        return [answers[rank][0] for rank in self.leaders]

    def _send(self, data: list[bytes], *, is_first: bool) -> None:
        """Send `data[rank]` to each rank. A closed pipe ends the executor at a step's first message; at
        its second, the rank may have raised at the first: `_collect` then reads its report."""
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data[rank])
            except OSError as err:
                if is_first:
                    self._fail(rank, f"its pipe is closed ({err}); exit code {self._procs[rank].poll()}")

    @property
    def eplb_stats(self) -> dict | None:
        """Rank 0's latest EPLB figures (`eplb_state.BalanceStats` as a dict), None without EPLB."""
        return self.rank_reports[0]["eplb"] if self.rank_reports[0] else None

    def _collect(self, timeout_s: float | None, what: str) -> list:
        """One answer from every rank; `WorkerError` on an error report, a dead rank or a timeout."""
        answers: dict[int, object] = {}
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        heard = [start] * self.world_size  # the last message of each rank: an answer or a heartbeat
        while len(answers) < self.world_size:
            waiting = [rank for rank in range(self.world_size) if rank not in answers]
            remaining = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if deadline is not None:  # steps only: start-up loads weights with no heartbeat
                self._check_heartbeats(waiting, heard, what)
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
                    heard[rank] = time.monotonic()
                    if kind == "alive":
                        continue
                    if kind == "error":
                        self._fail_dead_peer(rank, what, f"raised during {what}: {payload}")
                        self._fail(rank, f"raised during {what}: {payload}")
                    answers[rank] = payload
                elif self._procs[rank].poll() is not None:
                    self._fail(rank, f"exited during {what} (exit code {self._procs[rank].returncode})")
        return [answers[rank] for rank in range(self.world_size)]

    def _check_heartbeats(self, waiting: list[int], heard: list[float], what: str) -> None:
        """Fail the first waiting rank silent for `heartbeat_timeout_s` (a dead one is named as such)."""
        now = time.monotonic()
        silent = [rank for rank in waiting if now - heard[rank] > self.heartbeat_timeout_s]
        for rank in silent:
            if self._procs[rank].poll() is not None:
                self._fail(rank, f"exited during {what} (exit code {self._procs[rank].returncode})")
        if silent:
            self._fail(silent[0], f"hung: no answer and no heartbeat for {self.heartbeat_timeout_s:g} s during "
                                  f"{what} (worker_heartbeat_timeout_s); ranks silent: {silent}")

    def _fail_dead_peer(self, rank: int, what: str, cause: str, grace_s: float = 1.0) -> None:
        """`rank` failed with `cause`: if another rank was killed by a signal (`signalled_peer`), name that
        one, with `rank`'s cause after it (a rank that raised exits with 1 after its report)."""
        peers = {peer: proc for peer, proc in enumerate(self._procs) if peer != rank}
        found = signalled_peer(peers, grace_s)
        if found is not None:
            self._fail(found[0], f"exited during {what} (exit code {found[1]}); worker rank {rank} then {cause}")

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
