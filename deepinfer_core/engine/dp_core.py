"""One data-parallel rank's engine core, in that rank's own process.

The core is an `Engine` (scheduler, block manager, output processing) over a `CoreExecutor`: the rank's
own `ModelRunner`, in the same process. `EngineCore.run` is the core's loop: it takes requests, aborts
and stats queries from the front end's socket, steps while it has work and sends each step's outputs
back. Nothing of another rank's work passes through it.

The one coupling between cores is the MoE lockstep under expert parallelism: every rank must join
each step's expert collectives. The cores agree on every model step with one all-reduce of two flags
over the data-parallel group (`StepRounds`, vLLM's "has work" reduction): a core about to run a plan
offers 1; a core that has finished its own step offers 0 and keeps joining rounds, running a dummy
step (an empty plan: the collectives only) for each round another core ran a plan in, until a round
where every core offers 0 ends the iteration for all of them at once. Without expert parallelism
there is no collective inside the model and the cores step on their own, with no reduction at all.

Addressing: a core connects to two pyzmq addresses it is given, a PULL socket for the front end's
messages (`dp_protocol.ToCore`) and a PUSH socket for its answers (`dp_protocol.FromCore`), and it
learns its DP rank and torch.distributed rendezvous from its start-up message. Any process of the
rank's machine can host a core (`core_main(IN, OUT, DP_RANK)` in a fresh process here, a torchrun
rank on another machine with tcp:// addresses): the front end needs only the two addresses.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import traceback

import torch
import torch.distributed as dist
import zmq

from deepinfer_core.engine import dp_protocol as proto
from deepinfer_core.engine.engine import Engine
from deepinfer_core.executor import worker
from deepinfer_core.executor.broadcast import StepLeader, serve_plans
from deepinfer_core.executor.protocol import runner_info
from deepinfer_core.plan import StepPlan, StepResult

IDLE_POLL_S = 0.02
"""How long an idle core of a lockstep group waits for a message before the next round: a request
landing on another core starts its step within this time."""


class StepRounds:
    """The lockstep agreement of the cores of one expert-parallel world (see the module docstring)."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.num_rounds = 0

    def agree(self, runs_plan: bool, stopping: bool) -> tuple[bool, bool]:
        """Offer this core's flags; whether any core runs a plan this round, and whether all stop."""
        flags = torch.tensor([int(runs_plan), int(not stopping)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.num_rounds += 1
        return bool(flags[0]), not bool(flags[1])


class CoreExecutor:
    """The executor of one core: its DP rank's runner in this process, and with tensor parallelism the
    DP rank's other ranks, fed each step over their group (`broadcast.StepLeader`). Steps are answered
    whole (no late read); grammar rows come as `sample`'s data."""

    is_in_process = False
    """Steps are answered whole (`Executor.is_in_process`)."""

    def __init__(self, runner, rank: int, rounds: StepRounds | None, peers: DpRankGroup | None = None) -> None:
        self.runner, self.rounds = runner, rounds
        self.report = worker.RankReport(runner, rank)
        self.driver = StepLeader(self.report, peers.group, rank, peers.ranks) if peers is not None else None
        self.info = runner_info(runner, rank)
        self.infos, self.memory = [self.info], [self.info.memory]
        self.rank_reports: list[dict | None] = [None]
        self.is_closing = False
        """Set for the final cache flush at shutdown: cache ops only, no model step (no collective)."""

    def execute(self, plan: StepPlan) -> StepResult:
        self.execute_model(plan)
        return self.sample(None)

    def execute_model(self, plan: StepPlan) -> None:
        """`Executor.execute_model`; while closing, only the plan's states (no model step; no lockstep
        round: the other cores have stopped)."""
        if self.is_closing and self.driver is None:
            self.runner.update_states(plan)
            return
        if self.rounds is not None and not self.is_closing:
            self.rounds.agree(True, False)
        self._execute_model(plan)

    def sample(self, grammar_rows=None, *, late: bool = False):
        """`Executor.sample` (`late`: the result, already read, behind a function)."""
        if self.is_closing and self.driver is None:
            result = StepResult([], None)
        else:  # the DP rank's other ranks apply a closing plan's cache ops too
            result = self._sample(grammar_rows)
        return (lambda: result) if late else result

    def dummy_step(self) -> None:
        """Join a round another core runs a plan in: the MoE layers' collectives, no request."""
        self._execute_model(StepPlan(()))
        self._sample(None)

    def _execute_model(self, plan: StepPlan) -> None:
        if self.driver is None:
            self.report.execute_model(plan)
        else:
            self.driver.execute_model([plan])

    def _sample(self, grammar_rows) -> StepResult:
        if self.driver is None:
            result = self.report.sample(grammar_rows)
            self.rank_reports = [self.report.as_dict()]
        else:
            result, _ = self.driver.sample(grammar_rows)
            self.rank_reports = self.driver.rank_reports
        return worker.host_result(result)

    @property
    def eplb_stats(self) -> dict | None:
        return self.rank_reports[0]["eplb"] if self.rank_reports[0] else None

    def shutdown(self) -> None:
        if self.driver is not None:
            self.driver.stop()
        self.runner.close()


class CoreHeartbeat:
    """While `busy` is set, send `Alive` every `interval_s` from a daemon thread, on a socket of its own
    (pyzmq sockets are not shared between threads). A core stopped, or stuck holding the interpreter,
    stops beating; one inside a long device call or a collective releases it and keeps beating."""

    def __init__(self, outbox, dp_rank: int, interval_s: float) -> None:
        self.busy, self._stop = threading.Event(), threading.Event()
        address = outbox.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._socket = outbox.context.socket(zmq.PUSH)
        self._socket.connect(address)
        self._message = proto.encode(proto.Alive(dp_rank))
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="deepinfer-core-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if self.busy.is_set():
                self._socket.send(self._message)
        self._socket.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class EngineCore:
    """The loop of one DP rank's core: messages in, steps, outputs out (see the module docstring)."""

    def __init__(self, engine: Engine, executor: CoreExecutor, dp_rank: int, inbox, outbox) -> None:
        self.engine, self.executor, self.dp_rank = engine, executor, dp_rank
        self.rounds = executor.rounds
        self.inbox, self.outbox = inbox, outbox
        self.is_stopping = False
        self._parent = os.getppid()
        self.heartbeat = CoreHeartbeat(outbox, dp_rank, engine.config.worker_heartbeat_timeout_s / 4)

    def run(self) -> None:
        """Serve until the front end says `Stop` (every core of a lockstep group leaves together)."""
        try:
            self._run()
        finally:
            self.heartbeat.stop()

    def _run(self) -> None:
        while True:
            self._receive(self._wait_s())
            if self.engine.has_unfinished_requests():
                self.heartbeat.busy.set()
            else:
                self.heartbeat.busy.clear()
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                if outputs:
                    self._send(proto.Outputs(self.dp_rank, self.engine.block_manager.num_free_blocks, outputs))
            if self.rounds is None:
                if self.is_stopping:
                    return
                continue
            while True:  # join the rounds of cores still in their step; a round of all zeros ends it
                any_plan, all_stop = self.rounds.agree(False, self.is_stopping)
                if not any_plan:
                    break
                self.executor.dummy_step()
            if all_stop:
                return

    def _wait_s(self) -> float | None:
        if self.engine.has_unfinished_requests() or self.is_stopping:
            return 0.0
        return IDLE_POLL_S if self.rounds is not None else None

    def _receive(self, wait_s: float | None) -> None:
        """Handle every message waiting; with none, wait up to `wait_s` (None: until one comes)."""
        while not self.inbox.poll(1000 if wait_s is None else int(wait_s * 1000)):
            if wait_s is not None:
                return
            if os.getppid() != self._parent:  # the front end is gone
                raise SystemExit(1)
        while self.inbox.poll(0):
            self._handle(proto.decode_to_core(self.inbox.recv()))

    def _handle(self, message) -> None:
        if isinstance(message, proto.AddRequest):
            self.engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                                    prompt=message.prompt)
        elif isinstance(message, proto.Abort):
            self.engine.abort(message.request_id)
        elif isinstance(message, proto.QueryStats):
            self._send(proto.Stats(self.dp_rank, self.engine.stats()))
        else:
            self.is_stopping = True

    def _send(self, message) -> None:
        self.outbox.send(proto.encode(message))

    def close(self) -> None:
        """Flush the prefix tiers (cache ops only: the other cores have stopped stepping) and stop."""
        self.executor.is_closing = True
        self.engine.shutdown()


class DpRankGroup:
    """The global ranks of one DP rank (its tensor-parallel ranks) and their gloo group."""

    def __init__(self, ranks: list[int], group) -> None:
        self.ranks, self.group = ranks, group

    @classmethod
    def build(cls, layout, rank: int) -> DpRankGroup | None:
        """This rank's DP-rank group, None when every DP rank is one rank. Collective: every rank of the
        world calls it, in the same order (each `new_group` is)."""
        size = layout.tensor_parallel_size * layout.context_parallel_size
        if size == 1:
            return None
        mine = None
        for dp in range(layout.data_parallel_size):
            ranks = list(range(dp * size, (dp + 1) * size))
            group = dist.new_group(ranks, backend="gloo")  # objects cross it: host tensors
            if rank in ranks:
                mine = cls(ranks, group)
        return mine


def build_core(engine_config, model_config, runner, rank: int, dp_rank: int, inbox, outbox,
               peers: DpRankGroup | None = None) -> EngineCore:
    """The core of DP rank `dp_rank` over `runner` (built collectively, with its groups), driving the
    DP rank's other ranks (`peers`) when it has more than one."""
    rounds = None
    if runner.experts is not None:  # only EP has collectives in the model that cross DP ranks
        if peers is not None:  # internal: tensor with expert parallelism is refused before any rank starts
            raise NotImplementedError("expert parallelism over data-parallel ranks of several ranks each")
        rounds = StepRounds()
    executor = CoreExecutor(runner, rank, rounds, peers)
    engine = Engine(engine_config, executor=executor)
    return EngineCore(engine, executor, dp_rank, inbox, outbox)


def serve_rank(model_config, engine_config, runner, rank: int, dp_rank: int, inbox, outbox) -> bool:
    """Run this rank's part, given its runner, until the front end stops: the core of its DP rank when it
    leads it (its first rank), else its leader's plans. Whether it ran a core."""
    layout = engine_config.parallel_config
    peers = DpRankGroup.build(layout, rank)
    if peers is not None and rank != peers.ranks[0]:
        serve_plans(runner, rank, False, 0, group=peers.group, src=peers.ranks[0])
        return False
    core = build_core(engine_config, model_config, runner, rank, dp_rank, inbox, outbox, peers)
    outbox.send(proto.encode(proto.Ready(dp_rank, core.engine.block_manager.num_free_blocks)))
    core.run()
    core.close()
    return True


def core_main(in_address: str, out_address: str, dp_rank: int) -> None:
    """A rank's process started by the front end: start-up arguments, runner, then its core (`Ready`,
    the loop) or, for a DP rank's later ranks, its leader's plans."""
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(in_address)
    outbox.connect(out_address)
    rank = None
    try:
        rank, world_size, init_method, model_config, engine_config, device, weights = pickle.loads(inbox.recv())
        local_device = worker.rank_device(torch.device(device), rank)
        worker.set_device(local_device)
        worker.init_group(local_device, rank, world_size, init_method, engine_config.worker_timeout_s)
        runner = worker.build_runner(model_config, engine_config, local_device, weights)
        del weights
        serve_rank(model_config, engine_config, runner, rank, dp_rank, inbox, outbox)
    except Exception as err:  # noqa: BLE001 -- reported to the front end, which names the rank
        traceback.print_exc()
        outbox.send(proto.encode(proto.Failed(dp_rank, f"{type(err).__name__}: {err}", rank)))
        outbox.close(linger=2000)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    outbox.close(linger=2000)
    inbox.close(linger=0)
