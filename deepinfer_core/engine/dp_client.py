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
    """One engine core process per DP rank (tensor and context parallel size 1: DP rank = global rank)."""

    def __init__(self, context, outbox, inboxes: list, procs: list, timeout_s: float, cleanup=None) -> None:
        """Over bound sockets: `outbox` (every core's answers), `inboxes` (one per core); `procs`, per core,
        something with `poll()` and `returncode` (a `Popen`, or a thread's stand-in) or None (a remote core)."""
        self._context, self.outbox, self.inboxes, self.procs = context, outbox, inboxes, procs
        self.num_cores, self.timeout_s, self._cleanup = len(inboxes), timeout_s, cleanup
        self.is_shut_down, self.waited_s = False, 0.0
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
        """One core process per DP rank on this machine, over ipc:// sockets in a fresh folder."""
        context, folder = zmq.Context(), tempfile.mkdtemp(prefix="deepinfer-dp-")
        outbox = context.socket(zmq.PULL)
        outbox.bind(f"ipc://{folder}/out")
        inboxes, procs = [], []
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for dp in range(config.data_parallel_size):
            inbox = context.socket(zmq.PUSH)
            inbox.bind(f"ipc://{folder}/in-{dp}")
            inboxes.append(inbox)
            addresses = f"'ipc://{folder}/in-{dp}', 'ipc://{folder}/out', {dp}"
            procs.append(subprocess.Popen([sys.executable, "-c", _CORE_MAIN.format(addresses)]))
            args = (dp, config.data_parallel_size, init_method, model_config, config, str(device), weights)
            inbox.send(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        return cls(context, outbox, inboxes, procs, config.worker_timeout_s,
                   cleanup=lambda: shutil.rmtree(folder, ignore_errors=True))

    def send(self, dp_rank: int, message) -> None:
        try:
            self.inboxes[dp_rank].send(proto.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self.receive(0.0)  # names a core that failed or died
            self._fail(dp_rank, "does not take messages (its socket has no reader)")

    def receive(self, wait_s: float, what: str = "a step") -> list:
        """Every message the cores sent, waiting up to `wait_s` for the first; `WorkerError` if a core
        failed or died. The time spent waiting is added to `waited_s`."""
        start = time.perf_counter()
        ready = self.outbox.poll(int(wait_s * 1000))
        self.waited_s = time.perf_counter() - start
        messages = []
        while ready or self.outbox.poll(0):
            ready = False
            message = proto.decode_from_core(self.outbox.recv())
            if isinstance(message, proto.Failed):
                self._fail_dead_peer(message.dp_rank, what, f"raised during {what}: {message.message}")
                self._fail(message.dp_rank, f"raised during {what}: {message.message}")
            messages.append(message)
        if not messages:
            for dp, proc in enumerate(self.procs):
                if proc is not None and proc.poll() is not None:
                    self._fail_dead_peer(dp, what, f"exited during {what} (exit code {proc.returncode})")
                    self._fail(dp, f"exited during {what} (exit code {proc.returncode})")
        return messages

    def _fail_dead_peer(self, rank: int, what: str, cause: str, grace_s: float = 1.0) -> None:
        """`rank` failed with `cause`: if another core was killed by a signal (`signalled_peer`), name
        that one, `rank`'s cause after."""
        peers = {peer: proc for peer, proc in enumerate(self.procs) if peer != rank and proc is not None}
        found = signalled_peer(peers, grace_s)
        if found is not None:
            self._fail(found[0], f"exited during {what} (exit code {found[1]}); worker rank {rank} then {cause}")

    def _fail(self, rank: int, cause: str):
        self.shutdown(wait_s=0.5)
        raise WorkerError(f"worker rank {rank} {cause} (the engine core of DP rank {rank})")

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
        for proc in self.procs:
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
