"""Data parallelism under torchrun: every rank's process hosts its own engine core; rank 0 also fronts.

Each rank joins the world and builds its runner; the first rank of each DP rank builds its core
(`dp_core.build_core`), which drives the DP rank's other (tensor-parallel) ranks, and connects the
core to the front end's tcp:// sockets, which rank 0 binds on every interface and announces (at
`MASTER_ADDR`) with one broadcast. A rank other than 0 then runs its core's loop until the front end
says stop, and exits; rank 0 runs its own core's loop on a thread beside the front end, which returns
to the caller. Each machine's ranks thus schedule themselves, across machines too: the front end
only routes requests and merges outputs.
"""

from __future__ import annotations

import os
import subprocess
import threading
import traceback

import torch
import torch.distributed as dist
import zmq

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.engine import dp_core
from deepinfer_core.engine import dp_protocol as proto
from deepinfer_core.engine.dp_client import CoreClient
from deepinfer_core.executor import worker
from deepinfer_core.executor.broadcast import serve_plans


class CoreThread:
    """Rank 0's core loop on a thread, with `Popen`'s `poll`/`wait`/`kill` (what `CoreClient` reads)."""

    def __init__(self, core: dp_core.EngineCore) -> None:
        self.core, self.returncode = core, None
        self.thread = threading.Thread(target=self._serve, name="deepinfer-dp-core-0", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.core.run()
            self.core.close()
            self.returncode = 0
        except Exception as err:  # noqa: BLE001 -- reported to the front end, which names the rank
            traceback.print_exc()
            self.core.outbox.send(proto.encode(proto.Failed(self.core.dp_rank, f"{type(err).__name__}: {err}")))
            self.returncode = 1

    def poll(self) -> int | None:
        return None if self.thread.is_alive() else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise subprocess.TimeoutExpired("deepinfer-dp-core-0", timeout)
        return self.returncode

    def kill(self) -> None:
        """A thread cannot be killed; the daemon thread ends with the process."""


def start_cores(model_config: ModelConfig, config: EngineConfig, device: torch.device, weights=None) -> CoreClient:
    """This rank's part: the core of its DP rank when it leads it, else its leader's plans; on rank 0 the
    front end's `CoreClient`, on every other rank only after its part has stopped (the process then exits)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    layout = config.parallel_config
    if world_size != layout.world_size:
        raise ValueError(f"torchrun started {world_size} ranks for a layout of {layout.world_size} "
                         f"(data_parallel_size={layout.data_parallel_size} x tensor_parallel_size="
                         f"{layout.tensor_parallel_size}); start one rank per rank of the layout")
    local_device = worker.rank_device(device, int(os.environ["LOCAL_RANK"]))
    worker.set_device(local_device)
    worker.init_group(local_device, rank, world_size, "env://", config.worker_timeout_s)
    runner = worker.build_runner(model_config, config, local_device, weights)
    peers = dp_core.DpRankGroup.build(layout, rank)
    dp = layout.coordinates(rank)[0]
    context = zmq.Context()
    box = [None]
    if rank == 0:
        outbox = context.socket(zmq.PULL)
        inboxes = [context.socket(zmq.PUSH) for _ in range(layout.data_parallel_size)]
        host = os.environ["MASTER_ADDR"]
        box = [([f"tcp://{host}:{sock.bind_to_random_port('tcp://*')}" for sock in inboxes],
                f"tcp://{host}:{outbox.bind_to_random_port('tcp://*')}")]
    dist.broadcast_object_list(box, src=0)
    if rank != layout.dp_leader(dp):  # a DP rank's later rank: its leader's plans, then exit
        serve_plans(runner, rank, False, 0, group=peers.group, src=peers.ranks[0])
        dist.destroy_process_group()
        raise SystemExit(0)
    in_addresses, out_address = box[0]
    inbox, answers = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(in_addresses[dp])
    answers.connect(out_address)
    core = dp_core.build_core(config, model_config, runner, rank, dp, inbox, answers, peers)
    answers.send(proto.encode(proto.Ready(dp, core.engine.block_manager.num_free_blocks)))
    if rank != 0:
        try:
            core.run()
            core.close()
        except Exception as err:
            answers.send(proto.encode(proto.Failed(dp, f"{type(err).__name__}: {err}", rank)))
            raise
        finally:
            answers.close(linger=2000)
            dist.destroy_process_group()
        raise SystemExit(0)
    thread = CoreThread(core)

    def cleanup() -> None:
        thread.wait(30)
        dist.destroy_process_group()

    return CoreClient(context, outbox, inboxes, [thread] + [None] * (layout.data_parallel_size - 1),
                      config.worker_timeout_s, cleanup=cleanup,
                      ranks_per_core=layout.world_size // layout.data_parallel_size)
