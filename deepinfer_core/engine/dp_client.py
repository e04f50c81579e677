"""The front end's side of the engine cores: their processes and sockets (see `engine.dp_core`).

`CoreClient` starts one core process per data-parallel rank, each with a PULL socket of its own for the
front end's messages; all cores answer on one PUSH socket into the front end, so reading what every
core sent is one poll of one socket, whatever the number of ranks. A core that reports an error, dies
or stays silent past `worker_timeout_s` while work is in flight ends every core with a `WorkerError`
naming the rank and the cause.
"""

from __future__ import annotations

import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch
import zmq

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.engine import dp_protocol as proto
from deepinfer_core.executor.protocol import WorkerError, signalled_peer

_CORE_MAIN = "from deepinfer_core.engine.dp_core import core_main; core_main({})"
"""A core process's program (a module run with -m would be imported twice: the package imports it)."""


class CoreClient:
    """One engine core per DP rank, in the process of the DP rank's first rank; a DP rank of several
    (tensor-parallel) ranks has its other ranks in processes of their own, driven by its core."""

    def __init__(self, context, outbox, inboxes: list, procs: list, timeout_s: float, cleanup=None,
                 workers: dict | None = None, ranks_per_core: int = 1) -> None:
        """Over bound sockets: `outbox` (every core's answers), `inboxes` (one per core); `procs`, per core,
        something with `poll()` and `returncode` (a `Popen`, or a thread's stand-in) or None (a remote core);
        `workers`, global rank -> `Popen` of each DP rank's later ranks started here (killed at shutdown);
        `ranks_per_core`, the ranks of one DP rank (core `dp` is global rank `dp * ranks_per_core`)."""
        self._context, self.outbox, self.inboxes, self.procs = context, outbox, inboxes, procs
        self.workers, self.ranks_per_core = workers or {}, ranks_per_core
        self.num_cores, self.timeout_s, self._cleanup = len(inboxes), timeout_s, cleanup
        self.is_shut_down, self.waited_s = False, 0.0
        self.last_heard = [time.monotonic()] * self.num_cores
        """Per core, when it last sent anything (a heartbeat included)."""
        ready: dict[int, proto.Ready] = {}
        while len(ready) < self.num_cores:
            for message in self.receive(1.0, what="start-up"):
                if not isinstance(message, proto.Ready):
                    raise WorkerError(f"engine core {message.dp_rank} sent {type(message).__name__} before it was ready")
                ready[message.dp_rank] = message
        self.num_free_blocks = [ready[dp].num_free_blocks for dp in range(self.num_cores)]

    @classmethod
    def spawn(cls, model_config: ModelConfig, config: EngineConfig, device: torch.device,
              weights: dict[str, torch.Tensor] | None = None) -> CoreClient:
        """One process per rank on this machine, over ipc:// sockets in a fresh folder: each DP rank's
        first rank hosts its core, its other ranks (tensor parallelism) follow it."""
        context, folder = zmq.Context(), tempfile.mkdtemp(prefix="deepinfer-dp-")
        outbox = context.socket(zmq.PULL)
        outbox.bind(f"ipc://{folder}/out")
        inboxes, procs, workers = [], [], {}
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        layout = config.parallel_config
        for rank in range(layout.world_size):
            dp = layout.coordinates(rank)[0]
            inbox = context.socket(zmq.PUSH)  # a later rank's socket carries only its start-up arguments
            inbox.bind(f"ipc://{folder}/in-{rank}")
            addresses = f"'ipc://{folder}/in-{rank}', 'ipc://{folder}/out', {dp}"
            proc = subprocess.Popen([sys.executable, "-c", _CORE_MAIN.format(addresses)])
            if rank == layout.dp_leader(dp):
                inboxes.append(inbox)
                procs.append(proc)
            else:
                workers[rank] = proc
            args = (rank, layout.world_size, init_method, model_config, config, str(device), weights)
            inbox.send(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))  # a later rank's: closed with the context
        return cls(context, outbox, inboxes, procs, config.worker_timeout_s,
                   cleanup=lambda: shutil.rmtree(folder, ignore_errors=True), workers=workers,
                   ranks_per_core=layout.world_size // layout.data_parallel_size)

    def send(self, dp_rank: int, message) -> None:
        try:
            self.inboxes[dp_rank].send(proto.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self.receive(0.0)  # names a core that failed or died
            self._fail(dp_rank, "does not take messages (its socket has no reader)")

    def receive(self, wait_s: float, what: str = "a step") -> list:
        """Every message the cores sent (heartbeats only noted in `last_heard`), waiting up to `wait_s` for
        the first; `WorkerError` if a core failed or died. The time spent waiting is added to `waited_s`."""
        start = time.perf_counter()
        ready = self.outbox.poll(int(wait_s * 1000))
        self.waited_s = time.perf_counter() - start
        messages = []
        while ready or self.outbox.poll(0):
            ready = False
            message = proto.decode_from_core(self.outbox.recv())
            self.last_heard[message.dp_rank] = time.monotonic()
            if isinstance(message, proto.Alive):
                continue
            if isinstance(message, proto.Failed):
                rank = message.rank if message.rank is not None else message.dp_rank
                self._fail_dead_peer(rank, what, f"raised during {what}: {message.message}")
                self._fail(rank, f"raised during {what}: {message.message}", message.dp_rank)
            messages.append(message)
        if not messages:
            for rank, proc in self._all_procs().items():
                if proc.poll() is not None:
                    self._fail_dead_peer(rank, what, f"exited during {what} (exit code {proc.returncode})")
                    self._fail(rank, f"exited during {what} (exit code {proc.returncode})")
        return messages

    def check_heartbeats(self, working: set[int], timeout_s: float) -> None:
        """`WorkerError` naming the first of the `working` cores (those with requests) silent for
        `timeout_s`: no output and no heartbeat, so hung or stopped."""
        now = time.monotonic()
        silent = [dp for dp in sorted(working) if now - self.last_heard[dp] > timeout_s]
        if silent:
            self._fail(silent[0] * self.ranks_per_core, f"hung: no output and no heartbeat for {timeout_s:g} s "
                       f"with requests in flight (worker_heartbeat_timeout_s); cores silent: {silent}", silent[0])

    def _all_procs(self) -> dict:
        """Global rank -> process, for every rank started here (a remote core's is unknown)."""
        leaders = {dp * self.ranks_per_core: proc for dp, proc in enumerate(self.procs) if proc is not None}
        return {**leaders, **self.workers}

    def _fail_dead_peer(self, rank: int, what: str, cause: str, grace_s: float = 1.0) -> None:
        """`rank` failed with `cause`: if another core was killed by a signal (`signalled_peer`), name
        that one, `rank`'s cause after."""
        peers = {peer: proc for peer, proc in self._all_procs().items() if peer != rank}
        found = signalled_peer(peers, grace_s)
        if found is not None:
            self._fail(found[0], f"exited during {what} (exit code {found[1]}); worker rank {rank} then {cause}")

    def _fail(self, rank: int, cause: str, dp_rank: int | None = None):
        """End every core with a `WorkerError` naming global `rank` and its DP rank."""
        self.shutdown(wait_s=0.5)
        dp = dp_rank if dp_rank is not None else rank // self.ranks_per_core
        raise WorkerError(f"worker rank {rank} {cause} (DP rank {dp})")

    def shutdown(self, wait_s: float = 30.0) -> None:
        """Tell every core to stop; kill one still running after `wait_s` (idempotent)."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        for inbox in self.inboxes:
            try:  # a dead core's socket has no peer: never block on it
                inbox.send(proto.encode(proto.Stop()), zmq.NOBLOCK)
            except zmq.Again:
                pass
        deadline = time.monotonic() + wait_s
        for proc in (*self.procs, *self.workers.values()):  # a core stops its DP rank's later ranks
            if proc is None:
                continue
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for sock in (*self.inboxes, self.outbox):
            sock.close(linger=0)
        if self._cleanup is not None:  # a core on a thread of this process (torchrun's rank 0) ends first
            self._cleanup()
        self._context.destroy(linger=0)  # also closes that core's own sockets, which `term` would wait on

    def __del__(self) -> None:
        if hasattr(self, "num_free_blocks"):
            self.shutdown(wait_s=5.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
