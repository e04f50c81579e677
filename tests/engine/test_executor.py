"""Executors: worker processes (mp, torchrun) give the in-process outputs; a failing rank is named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.executor.mp import MultiprocExecutor
from deepinfer_core.executor.protocol import WorkerError
from deepinfer_core.plan import ScheduledRequest, StepPlan
from deepinfer_core.testing.checkpoints import write_checkpoint
from deepinfer_core.testing.serving import serve
from tests.engine.parallel_workload import run_batch
from tests.oracle import parity_config, random_state_dict, write_config

CONFIG = parity_config("hca128")
WEIGHTS = random_state_dict(CONFIG, seed=11)
LENGTHS, MAX_TOKENS = [3, 118, 124, 126, 129, 200], [6, 14, 12, 10, 3, 6]


def make_engine(directory, **options) -> Engine:
    write_config(directory, CONFIG)
    options = {"max_num_seqs": 5, "max_num_batched_tokens": 96, "num_kv_blocks": 7, **options}
    return Engine(EngineConfig(model=str(directory), dtype="float32", **options), weights=WEIGHTS)


def prompts(lengths=LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


def generate(engine: Engine) -> dict[str, tuple[list[int], list[float]]]:
    return run_batch(engine, prompts(), MAX_TOKENS, "")


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    engine = make_engine(tmp_path_factory.mktemp("uni"))
    return generate(engine), engine.stats()["num_preemptions"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_worker_ranks_give_the_in_process_outputs_bit_for_bit(tmp_path, in_process, world_size):
    expected, preemptions = in_process
    assert preemptions > 0, "the pool was meant to force preemption (freed and readmitted requests)"
    engine = make_engine(tmp_path, distributed_executor_backend="mp", world_size=world_size,
                         enable_prefix_caching=False)
    try:
        assert isinstance(engine.executor, MultiprocExecutor)
        assert generate(engine) == expected
        with pytest.raises(AttributeError, match="worker processes"):
            engine.runner  # noqa: B018 -- the model lives in the workers
    finally:
        engine.shutdown()
    assert all(proc.poll() is not None for proc in engine.executor._procs)


@pytest.fixture
def two_ranks(tmp_path):
    # generous for the steps that should answer (a loaded machine is slow); the hang test shortens it
    engine = make_engine(tmp_path, distributed_executor_backend="mp", world_size=2, worker_timeout_s=120)
    yield engine
    engine.shutdown()


def test_a_rank_that_raises_is_named_with_its_error(two_ranks):
    bogus = StepPlan((ScheduledRequest("never-admitted", 0, (5,), True),))
    with pytest.raises(WorkerError, match=r"worker rank \d raised during a step: RuntimeError: .*never-admitted"):
        two_ranks.executor.execute(bogus)
    assert all(proc.poll() is not None for proc in two_ranks.executor._procs)  # nothing left running


def test_a_rank_that_dies_ends_the_engine_with_its_exit_code(two_ranks):
    two_ranks.add_request("a", prompts([20])[0], SamplingParams(max_tokens=8))
    two_ranks.step()
    os.kill(two_ranks.executor._procs[1].pid, signal.SIGKILL)
    two_ranks.executor._procs[1].wait(10)
    with pytest.raises(WorkerError, match=r"worker rank 1 (exited|.*pipe is closed).*-9"):
        two_ranks.step()


def test_a_rank_that_hangs_times_out(two_ranks):
    two_ranks.add_request("a", prompts([20])[0], SamplingParams(max_tokens=8))
    two_ranks.executor.timeout_s = 3
    os.kill(two_ranks.executor._procs[1].pid, signal.SIGSTOP)
    with pytest.raises(WorkerError, match=r"sent nothing for 3 s during a step .*silent: \[1\]"):
        two_ranks.step()
    assert all(proc.poll() is not None for proc in two_ranks.executor._procs)  # the stopped rank was killed


def test_a_start_up_failure_names_the_rank_and_cause(tmp_path):
    write_config(tmp_path, CONFIG)  # a config but no weights
    with pytest.raises(WorkerError, match=r"worker rank \d raised during start-up: .*safetensors"):
        Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=4,
                            distributed_executor_backend="mp", world_size=2))


def test_world_size_needs_the_mp_executor(tmp_path):
    with pytest.raises(ValueError, match="distributed_executor_backend='mp'"):
        make_engine(tmp_path, world_size=2)


TORCHRUN_SCRIPT = """
import json, sys
import torch
from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine

engine = Engine(EngineConfig(model=sys.argv[1], dtype="float32", max_num_seqs=2, num_kv_blocks=8,
                             distributed_executor_backend="mp"))
# only rank 0 gets here: the other ranks serve plans inside Engine(...) and exit when it shuts down
for i, prompt in enumerate(json.loads(sys.argv[2])):
    engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
done = {}
while engine.has_unfinished_requests():
    done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
print("TOKENS " + json.dumps(done), flush=True)
"""


def torchrun_env() -> dict[str, str]:
    """This environment without a torchrun rank's variables, importing this tree's deepinfer_core (the
    script runs from its own directory, where the installed copy would come first)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    return env


def test_torchrun_ranks_serve_rank_zeros_engine(tmp_path):
    model_dir = write_checkpoint(tmp_path / "model", CONFIG, WEIGHTS)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    batch = prompts([9, 40])
    expected = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=2, num_kv_blocks=8))
    outputs = serve(expected, batch, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    want = {o.request_id: o.outputs[0].token_ids for o in outputs}
    env = torchrun_env()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         str(model_dir), json.dumps(batch)],
        check=False, capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, proc.stdout  # rank 0 alone returned from Engine(...)
    assert json.loads(lines[0].removeprefix("TOKENS ")) == want


class _Proc:
    def __init__(self, returncode):
        self.returncode = returncode

    def poll(self):
        return self.returncode


@pytest.mark.parametrize(("returncodes", "named"), [((None, -9), 1), ((None, 1), None), ((None, None), None)])
def test_a_peer_killed_by_a_signal_is_named_instead_of_the_rank_whose_collective_failed(returncodes, named):
    """Rank 0 reports an error: a peer killed by a signal is the cause and is named, rank 0's report after
    it; a peer that exited with 1 raised itself (its own report names it; no wait for the grace time),
    and a live peer is no cause."""
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.world_size, executor._procs = 2, [_Proc(code) for code in returncodes]
    executor.shutdown = lambda: None
    cause = "raised during a step: RuntimeError: gloo connection closed"
    if named is None:
        start = time.monotonic()
        assert executor._fail_dead_peer(0, "a step", cause, grace_s=2.0) is None
        assert (time.monotonic() - start < 1.0) == (returncodes[1] is not None)
    else:
        with pytest.raises(WorkerError, match=rf"worker rank {named} exited during a step \(exit code -9\); "
                                              r"worker rank 0 then raised during a step: .*connection closed"):
            executor._fail_dead_peer(0, "a step", cause, grace_s=0.1)


def test_a_stopped_rank_is_named_hung_within_its_heartbeat_timeout_not_the_step_timeout(tmp_path):
    """Rank 1 stopped mid-work: rank 0 waits in a collective but keeps beating, rank 1 falls silent and
    is named within `worker_heartbeat_timeout_s` (4 s), long before `worker_timeout_s` (600 s)."""
    engine = make_engine(tmp_path, distributed_executor_backend="mp", world_size=2, worker_heartbeat_timeout_s=4)
    try:
        engine.add_request("a", prompts([20])[0], SamplingParams(max_tokens=8))
        engine.step()  # a step answered while both ranks beat
        os.kill(engine.executor._procs[1].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker rank 1 hung: no answer and no heartbeat for 4 s during a "
                                              r"step \(worker_heartbeat_timeout_s\); ranks silent: \[1\]"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 60
    finally:
        engine.shutdown()
    assert all(proc.poll() is not None for proc in engine.executor._procs)  # the stopped rank was killed


def test_the_heartbeat_beats_only_while_the_rank_works():
    from deepinfer_core.executor.worker import Heartbeat

    beats = []
    heartbeat = Heartbeat(lambda kind, payload: beats.append(kind), 0.02)
    try:
        time.sleep(0.2)
        assert beats == []  # idle: nothing piles up in the pipe
        heartbeat.busy.set()
        time.sleep(0.3)
        assert len(beats) >= 3 and set(beats) == {"alive"}
    finally:
        heartbeat.stop()


TORCHRUN_STOPPED_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.executor.protocol import WorkerError

Path(sys.argv[2], f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
engine = Engine(EngineConfig(model=sys.argv[1], dtype="float32", max_num_seqs=2, num_kv_blocks=8,
                             distributed_executor_backend="mp", worker_heartbeat_timeout_s=2.0,
                             worker_timeout_s=60))
engine.add_request("a", list(range(2, 22)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
engine.step()  # a step answered while both ranks beat
stopped = int(Path(sys.argv[2], "pid-1").read_text())
os.kill(stopped, signal.SIGSTOP)
start = time.monotonic()
try:
    while engine.has_unfinished_requests():
        engine.step()
    print("FINISHED", flush=True)
except WorkerError as err:
    print(f"ERROR {time.monotonic() - start:.1f} {err}", flush=True)
os.kill(stopped, signal.SIGKILL)
os._exit(0)  # the step thread is still blocked in a collective with the stopped rank
"""


def test_a_stopped_torchrun_rank_is_named_within_its_heartbeat_timeout(tmp_path):
    """Issue 43 item 6: under torchrun without data parallelism, rank 1 stopped mid-request (SIGSTOP) is
    named by rank 0 within `worker_heartbeat_timeout_s` (2 s), not after `worker_timeout_s` (60 s)."""
    model_dir = write_checkpoint(tmp_path / "model", CONFIG, WEIGHTS)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(TORCHRUN_STOPPED_SCRIPT))
    env = torchrun_env()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
             str(model_dir), str(tmp_path)],
            check=False, capture_output=True, text=True, timeout=200, env=env,
        )
    finally:  # never leave a stopped rank behind
        pid = tmp_path / "pid-1"
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ERROR ", "FINISHED"))]
    assert len(lines) == 1, proc.stdout + "\n".join(line for line in proc.stderr.splitlines() if "rank0" in line)[-3000:]
    _, seconds, message = lines[0].split(" ", 2)
    assert message == ("worker rank 1 hung: no answer and no heartbeat for 2 s during a step "
                       "(worker_heartbeat_timeout_s); ranks silent: [1]")
    assert float(seconds) < 10
