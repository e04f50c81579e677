"""Worker ranks: the process side of `MultiprocExecutor`, and what every rank does to join (shared with
`torchrun.py`).

A worker joins the torch.distributed group (`cpu:gloo`, plus `cuda:nccl` on GPUs), builds its
`ModelRunner` (the ranks agree on the smallest cache that fits every one), then runs steps until told
to stop: each step is two messages, `("model", plan)` (the forward, no answer) and `("sample",
grammar_rows)` (sampling with the grammar rows the engine filled meanwhile; the answer). While a step is
under way a `Heartbeat` thread sends `("alive", None)` every quarter of `worker_heartbeat_timeout_s`, so
the engine tells a rank that is slow (still beating) from one that hangs or is stopped (silent).
Under `torchrun` every rank runs the same script: rank 0's `LLM(...)`/`Engine(...)`
returns an engine whose `TorchrunExecutor` broadcasts each plan; on every other rank that call serves
plans and exits the process when rank 0 shuts down.
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
import traceback
from dataclasses import asdict, fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer_core.backends.parallel import build_groups
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.executor.protocol import runner_info
from deepinfer_core.plan import StepPlan, StepResult

logger = logging.getLogger(__name__)


_ACCELERATOR_BACKENDS = {"cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl"}
"""torch.distributed backend per device type: gloo for host tensors, the vendor's library for device ones."""


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Rank `local_rank`'s device: its own accelerator (GPU, NPU), else `device` itself (the CPU)."""
    return torch.device(device.type, local_rank) if device.type in _ACCELERATOR_BACKENDS else device


MIN_COLLECTIVE_TIMEOUT_S = 60.0
"""Floor of the rendezvous and collective timeout: a loaded machine may take seconds to start a rank,
and a rank that fails is ended by the executor (`worker_timeout_s`) long before its collectives time out."""


def init_group(device: torch.device, rank: int, world_size: int, init_method: str, timeout_s: float) -> None:
    """Join the world; collectives time out after `timeout_s` (at least `MIN_COLLECTIVE_TIMEOUT_S`)."""
    backend = _ACCELERATOR_BACKENDS.get(device.type, "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=max(timeout_s, MIN_COLLECTIVE_TIMEOUT_S)))


def set_device(device: torch.device) -> None:
    """Make `device` this process's current accelerator (nothing on the CPU)."""
    if device.type in _ACCELERATOR_BACKENDS:  # torch.cuda / torch.npu (torch_npu registers the latter)
        getattr(torch, device.type).set_device(device)


def build_runner(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device, weights):
    """This rank's `ModelRunner`, with its parallel groups (built here, collectively, on every rank)."""
    from deepinfer_core.worker.runner import ModelRunner

    groups = build_groups(engine_config.parallel_config, dist.get_rank(),
                          max(engine_config.worker_timeout_s, MIN_COLLECTIVE_TIMEOUT_S))

    def agree(num_blocks: int) -> int:  # the ranks of one plan (a DP rank's TP x CP ranks) share one pool
        value = torch.tensor([num_blocks], dtype=torch.int64)
        for info in (groups.tp, groups.cp):  # a world of replicas: group None, i.e. every rank
            if info.size > 1 or info.group is None:
                dist.all_reduce(value, op=dist.ReduceOp.MIN, group=info.group)
        return int(value)

    return ModelRunner(model_config, engine_config, device, weights=weights, agree_num_blocks=agree,
                       parallel=groups)


def run_model(runner, plan: StepPlan) -> None:
    """A step's first phase on this rank (`ModelRunner.execute_model`), or with no requests a dummy step
    that still joins the MoE layers' collectives (a data-parallel rank with nothing to do)."""
    if plan.requests:
        runner.execute_model(plan)
    else:
        runner.update_states(plan)
        if runner.experts is not None:  # only expert parallelism has collectives inside the model
            runner.model.forward_idle()


def run_sample(runner, plan: StepPlan, grammar_rows) -> StepResult:
    """A step's second phase on this rank (`ModelRunner.sample`, masked by `grammar_rows`), then the
    EPLB bookkeeping."""
    result = runner.sample(grammar_rows) if plan.requests else StepResult([], None)
    if runner.experts is not None:
        runner.experts.after_step(runner.model.moe_weights)
    return result


def run_plan(runner, plan: StepPlan) -> StepResult:
    """One step with no grammar on this rank: `run_model`, then `run_sample`."""
    run_model(runner, plan)
    return run_sample(runner, plan, None)


class RankReport:
    """What a rank tells the engine after each step: its step count and time (the device synchronised
    only when `time_ep_dispatch` is on), time in the expert-parallel dispatch, and its EPLB figures.
    A step is `execute_model(plan)` then `sample(grammar_rows)` (or `run` for both)."""

    def __init__(self, runner, rank: int) -> None:
        self.runner, self.rank = runner, rank
        self.num_steps, self.step_s = 0, 0.0
        self.is_timed = runner.engine_config.time_ep_dispatch and runner.device.type != "cpu"
        self._plan: StepPlan | None = None

    def execute_model(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        self._plan = plan
        run_model(self.runner, plan)
        self.step_s += time.perf_counter() - start

    def sample(self, grammar_rows) -> StepResult:
        start = time.perf_counter()
        plan, self._plan = self._plan, None
        if plan is None:
            raise RuntimeError("sample without execute_model before it")
        result = run_sample(self.runner, plan, grammar_rows)
        if self.is_timed:
            getattr(torch, self.runner.device.type).synchronize(self.runner.device)
        self.num_steps += 1
        self.step_s += time.perf_counter() - start
        return result

    def run(self, plan: StepPlan) -> StepResult:
        self.execute_model(plan)
        return self.sample(None)

    def as_dict(self) -> dict:
        experts = self.runner.experts
        return {"rank": self.rank, "num_steps": self.num_steps, "step_s": self.step_s,
                "dispatch_s": experts.dispatch_s if experts is not None else 0.0,
                "eplb": asdict(experts.stats) if experts is not None and experts.window is not None else None}


def is_dp_leader(engine_config: EngineConfig, rank: int) -> bool:
    """Whether `rank` answers for its data-parallel rank (rank 0 in a world of replicas)."""
    layout = engine_config.parallel_config
    return rank == 0 if layout.world_size == 1 else rank == layout.dp_leader(layout.coordinates(rank)[0])


def host_result(result: StepResult) -> StepResult:
    """`result` with every tensor on the host (what crosses a process boundary)."""
    if result.output is not None:
        values = {f.name: getattr(result.output, f.name) for f in fields(result.output)}
        result.output = replace(result.output, **{name: value.cpu() for name, value in values.items()
                                                  if isinstance(value, torch.Tensor)})
    result.prompt_logits = {i: (first, logits.cpu()) for i, (first, logits) in result.prompt_logits.items()}
    return result


class Heartbeat:
    """While `busy` is set, send `("alive", None)` every `interval_s` from a daemon thread (the step runs
    on the main thread; a rank stopped or stuck holding the interpreter stops beating)."""

    def __init__(self, send, interval_s: float) -> None:
        self.send, self.interval_s = send, interval_s
        self.busy, self._stop = threading.Event(), threading.Event()
        threading.Thread(target=self._run, name="deepinfer-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.busy.is_set():
                try:
                    self.send("alive", None)
                except OSError:  # the engine is gone: nobody to tell
                    return

    def stop(self) -> None:
        self._stop.set()


def worker_main(conn) -> None:
    """A rank started by `MultiprocExecutor`: read its start-up arguments from `conn`, build the runner,
    report, then run steps from `conn` (see the module docstring) until `None`."""
    lock = threading.Lock()  # the heartbeat thread and the step share the pipe: one message at a time

    def send(kind: str, payload) -> None:
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(data)

    runner, heartbeat = None, None
    try:
        rank, world_size, init_method, model_config, engine_config, device, weights = pickle.loads(conn.recv_bytes())
        local_device = rank_device(torch.device(device), rank)
        set_device(local_device)
        init_group(local_device, rank, world_size, init_method, engine_config.worker_timeout_s)
        runner = build_runner(model_config, engine_config, local_device, weights)
        del weights
        send("ready", runner_info(runner, rank))
        is_leader, report = is_dp_leader(engine_config, rank), RankReport(runner, rank)
        heartbeat = Heartbeat(send, engine_config.worker_heartbeat_timeout_s / 4)
        while (message := pickle.loads(conn.recv_bytes())) is not None:
            kind, payload = message  # ("model", plan), then ("sample", grammar rows)
            heartbeat.busy.set()
            if kind == "model":
                report.execute_model(payload)
                continue
            result = report.sample(payload)
            send("result", (host_result(result) if is_leader else None, report.as_dict()))
            heartbeat.busy.clear()
    except Exception as err:  # noqa: BLE001 -- reported to the engine, which names the rank
        traceback.print_exc()
        try:
            send("error", f"{type(err).__name__}: {err}")
        except OSError:
            pass
        sys.exit(1)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if runner is not None:
            runner.close()  # its model's worker threads (V4.1's Engram prefetch)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":  # python -m deepinfer_core.executor.worker <fd of its socket>
    from multiprocessing.connection import Connection

    worker_main(Connection(int(sys.argv[1])))
