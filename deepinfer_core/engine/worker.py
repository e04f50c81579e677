"""Worker ranks: the process side of `MultiprocExecutor`, and the `torchrun` launch.

A worker joins the torch.distributed group (`cpu:gloo`, plus `cuda:nccl` on GPUs), builds its
`ModelRunner` (the ranks agree on the smallest cache that fits every one), then answers plans until
told to stop. Under `torchrun` every rank runs the same script: rank 0's `LLM(...)`/`Engine(...)`
returns an engine whose `TorchrunExecutor` broadcasts each plan; on every other rank that call serves
plans and exits the process when rank 0 shuts down.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import sys
import traceback
from dataclasses import fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.engine.executor import ModelSideInfo, WorkerError, runner_info
from deepinfer_core.engine.parallel import build_groups
from deepinfer_core.engine.plan import StepResult

logger = logging.getLogger(__name__)


_ACCELERATOR_BACKENDS = {"cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl"}
"""torch.distributed backend per device type: gloo for host tensors, the vendor's library for device ones."""


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Rank `local_rank`'s device: its own accelerator (GPU, NPU), else `device` itself (the CPU)."""
    return torch.device(device.type, local_rank) if device.type in _ACCELERATOR_BACKENDS else device


def init_group(device: torch.device, rank: int, world_size: int, init_method: str, timeout_s: float) -> None:
    backend = _ACCELERATOR_BACKENDS.get(device.type, "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _set_device(device: torch.device) -> None:
    if device.type in _ACCELERATOR_BACKENDS:  # torch.cuda / torch.npu (torch_npu registers the latter)
        getattr(torch, device.type).set_device(device)


def build_runner(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device, weights):
    """This rank's `ModelRunner`, with its parallel groups (built here, collectively, on every rank)."""
    from deepinfer_core.engine.runner import ModelRunner

    groups = build_groups(engine_config.parallel_config, dist.get_rank(), engine_config.worker_timeout_s)

    def agree(num_blocks: int) -> int:  # every rank must allocate the same pool
        value = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value)

    return ModelRunner(model_config, engine_config, device, weights=weights, agree_num_blocks=agree,
                       parallel=groups)


def host_result(result: StepResult) -> StepResult:
    """`result` with every tensor on the host (what crosses a process boundary)."""
    if result.output is not None:
        values = {f.name: getattr(result.output, f.name) for f in fields(result.output)}
        result.output = replace(result.output, **{name: value.cpu() for name, value in values.items()
                                                  if isinstance(value, torch.Tensor)})
    result.prompt_logits = {i: (first, logits.cpu()) for i, (first, logits) in result.prompt_logits.items()}
    return result


def worker_main(conn) -> None:
    """A rank started by `MultiprocExecutor`: read its start-up arguments from `conn`, build the runner,
    report, then answer plans from `conn` until `None`."""

    def send(kind: str, payload) -> None:
        conn.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        rank, world_size, init_method, model_config, engine_config, device, weights = pickle.loads(conn.recv_bytes())
        local_device = rank_device(torch.device(device), rank)
        _set_device(local_device)
        init_group(local_device, rank, world_size, init_method, engine_config.worker_timeout_s)
        runner = build_runner(model_config, engine_config, local_device, weights)
        del weights
        send("ready", runner_info(runner))
        while (plan := pickle.loads(conn.recv_bytes())) is not None:
            result = runner.execute(plan)
            send("result", host_result(result) if rank == 0 else None)
    except Exception as err:  # noqa: BLE001 -- reported to the engine, which names the rank
        traceback.print_exc()
        try:
            send("error", f"{type(err).__name__}: {err}")
        except OSError:
            pass
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":  # python -m deepinfer_core.engine.worker <fd of its socket>
    from multiprocessing.connection import Connection

    worker_main(Connection(int(sys.argv[1])))


# -- torchrun ---------------------------------------------------------------------------------------


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a `torchrun` launch (its environment says so)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


class TorchrunExecutor:
    """Rank 0's executor under torchrun: its own runner, plans broadcast to the other ranks."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights=None) -> None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_device = rank_device(device, int(os.environ["LOCAL_RANK"]))
        _set_device(local_device)
        init_group(local_device, rank, world_size, "env://", engine_config.worker_timeout_s)
        runner = build_runner(model_config, engine_config, local_device, weights)
        if rank != 0:
            serve_plans(runner)
            raise SystemExit(0)
        self.runner, self.world_size = runner, world_size
        self.info: ModelSideInfo = runner_info(runner)
        self._is_shut_down = False
        atexit.register(self.shutdown)

    def execute(self, plan) -> StepResult:
        dist.broadcast_object_list([plan], src=0)
        error = None
        try:
            result = self.runner.execute(plan)
        except Exception as err:  # noqa: BLE001 -- the other ranks' answers are still collected
            error, result = f"{type(err).__name__}: {err}", None
        statuses = [None] * self.world_size
        try:
            dist.gather_object(error, statuses, dst=0)
        except Exception as err:
            raise WorkerError(f"a worker rank did not answer a step: {err}") from err
        for rank, status in enumerate(statuses):
            if status is not None:
                self.shutdown()
                raise WorkerError(f"worker rank {rank} raised during a step: {status}")
        return result

    def shutdown(self) -> None:
        if self._is_shut_down or not dist.is_initialized():
            return
        self._is_shut_down = True
        try:
            dist.broadcast_object_list([None], src=0)
        except Exception:  # noqa: BLE001 -- a rank already gone; the others time out on their own
            logger.warning("could not tell every worker rank to stop")
        finally:
            dist.destroy_process_group()


def serve_plans(runner) -> None:
    """A torchrun rank other than 0: run every broadcast plan, report errors, stop at `None`."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        error = None
        try:
            runner.execute(box[0])
        except Exception as err:  # noqa: BLE001 -- reported to rank 0
            traceback.print_exc()
            error = f"{type(err).__name__}: {err}"
        dist.gather_object(error, None, dst=0)  # after an error rank 0 stops everyone with `None`
    dist.destroy_process_group()
