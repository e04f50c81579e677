"""Heartbeats of torch.distributed ranks, through the world's store: a rank that follows a leader
(`broadcast.serve_plans` under torchrun) adds 1 to its counter every quarter of
`worker_heartbeat_timeout_s`; the leader, while it waits for a step, reads the counters and names a rank
whose counter stood still for the whole timeout (stopped, or stuck holding its interpreter).

The mp executor's ranks beat through their pipes (`worker.Heartbeat`) and data-parallel cores through
their sockets (`dp_core.CoreHeartbeat`); torchrun ranks have only the group, whose collectives block
and cannot be watched, and its store (a TCP key-value server every rank reaches), which can.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

PREFIX = "deepinfer/heartbeat/"


def world_store() -> dist.Store:
    """The store the world was joined through, under this module's key prefix."""
    return dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())


class StoreHeartbeat:
    """Add 1 to `rank`'s counter in `store` every `interval_s`, from a daemon thread, until `stop`."""

    def __init__(self, store: dist.Store, rank: int, interval_s: float) -> None:
        self.store, self.key = store, str(rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="deepinfer-rank-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 -- the store (rank 0) is gone: nobody to tell
                return
            if self._stop.wait(interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class HeartbeatWatch:
    """The leader's view of `ranks`' counters: `silent()` lists those that stood still for `timeout_s`
    since the last `reset()` (call it when a wait begins, as the mp executor does per step)."""

    def __init__(self, store: dist.Store, ranks: list[int], timeout_s: float) -> None:
        self.store, self.ranks, self.timeout_s = store, ranks, timeout_s
        self.interval_s = timeout_s / 4
        self._counts: dict[int, int | None] = {}
        self._heard: dict[int, float] = {}
        self.reset()

    def reset(self) -> None:
        now = time.monotonic()
        self._counts = dict.fromkeys(self.ranks)
        self._heard = dict.fromkeys(self.ranks, now)

    def silent(self) -> list[int]:
        """The ranks whose counter has not moved for `timeout_s` (reading each counter once)."""
        now = time.monotonic()
        for rank in self.ranks:
            count = self.store.add(str(rank), 0)
            if count != self._counts[rank]:
                self._counts[rank], self._heard[rank] = count, now
        return [rank for rank in self.ranks if now - self._heard[rank] > self.timeout_s]
