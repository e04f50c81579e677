"""The data-parallel front end over engine cores in their own processes (engine/data_parallel.py,
dp_client.py, dp_core.py): routing, merging, aborts, a core's error, and the MoE lockstep's dummy steps."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepinfer_core import SamplingParams
from deepinfer_core.engine import dp_protocol as proto
from deepinfer_core.engine.data_parallel import DataParallelEngine, merge_stats
from deepinfer_core.executor.protocol import WorkerError
from deepinfer_core.testing.serving import serve
from tests.engine.test_ep_engine import make_engine, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    engine = make_engine(tmp_path_factory.mktemp("single"), num_kv_blocks=8)
    try:
        return {out.request_id: out.outputs[0].token_ids for out in serve(engine, prompts(), GREEDY)}
    finally:
        engine.shutdown()


def test_requests_spread_over_the_cores_and_outputs_merge(tmp_path, single):
    engine = make_engine(tmp_path, data_parallel_size=2, num_kv_blocks=8)
    try:
        assert isinstance(engine, DataParallelEngine)
        got = {out.request_id: out.outputs[0].token_ids for out in serve(engine, prompts(), GREEDY)}
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert got == single  # each request's tokens, whichever core ran it
    assert all(rank["num_prefill_tokens"] > 0 for rank in stats["data_parallel"]), "one core got nothing"
    assert stats["num_prefill_tokens"] == sum(rank["num_prefill_tokens"] for rank in stats["data_parallel"])


def test_data_parallel_ranks_of_two_tensor_parallel_ranks_each(tmp_path, single):
    """DP 2 x TP 2: each core drives its DP rank's second rank over their group; the tokens are the
    single process's (split sums round differently, but not enough to flip a greedy token here)."""
    engine = make_engine(tmp_path, data_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=8)
    try:
        got = {out.request_id: out.outputs[0].token_ids for out in serve(engine, prompts(), GREEDY)}
        stats = engine.stats()
        followers = dict(engine.cores.workers)
        assert sorted(followers) == [1, 3]  # each DP rank's second rank, in a process of its own
        for dp in (0, 1):  # work on both cores, then the death of DP rank 1's second rank
            engine.add_request(f"late-{dp}", prompts()[dp], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        followers[3].kill()
        with pytest.raises(WorkerError, match=r"worker rank 3 exited .*-9.* \(DP rank 1\)"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.shutdown()
    assert got == single
    assert all(proc.poll() is not None for proc in (*engine.cores.procs, *followers.values()))
    steps = {report["rank"]: report["num_steps"] for report in stats["ranks"]}
    assert sorted(steps) == [0, 1, 2, 3]
    assert steps[0] == steps[1] > 0 and steps[2] == steps[3] > 0  # a follower runs every step of its core


def test_prefix_affinity_abort_and_a_core_error(tmp_path):
    engine = make_engine(tmp_path, data_parallel_size=2, num_kv_blocks=8)
    try:
        long = prompts()[4]  # 260 tokens: two whole blocks
        engine.add_request("a", long, GREEDY)
        engine.add_request("b", prompts()[1] + prompts()[3], GREEDY)  # the other core: fewer tokens in flight
        engine.add_request("c", long[:200], GREEDY)  # same first block as "a": a's core, though busier
        assert engine._owner["a"] == engine._owner["c"] != engine._owner["b"]
        # a's core now carries 468 tokens, b's 248: more than one step's budget (64) busier, so the
        # affinity yields and the least loaded core takes a prompt with the same first block
        engine.add_request("d", long[:150], GREEDY)
        assert engine._owner["d"] == engine._owner["b"]
        rank = engine._owner["d"]  # the last core to take the block
        engine.abort("b")
        assert sorted(engine.unfinished_request_ids()) == ["a", "c", "d"]
        seen = set()
        while engine.has_unfinished_requests():
            seen.update(out.request_id for out in engine.step())
        assert seen == {"a", "c", "d"}  # nothing of the aborted request comes back
        hits = [core["prefix_cache_hit_tokens"] for core in engine.stats()["data_parallel"]]
        engine.add_request("e", long[:140], GREEDY)  # idle cores: the one that last took the block (d's) wins
        assert engine._owner["e"] == rank
        while engine.has_unfinished_requests():
            engine.step()
        after = [core["prefix_cache_hit_tokens"] for core in engine.stats()["data_parallel"]]
        assert after[rank] - hits[rank] == 128 and after[1 - rank] == hits[1 - rank]  # its first block, cached
        bad = SamplingParams(temperature=0, max_tokens=4)
        bad.max_tokens = -1  # past the front end's checks: the core raises
        engine.cores.send(1, proto.AddRequest("x", [1, 2, 3], bad))
        engine._owner["x"], engine._request_tokens["x"] = 1, 0
        with pytest.raises(WorkerError, match=r"worker rank 1 raised .*max_tokens must be an integer"):
            while engine.has_unfinished_requests():
                engine.step()
        assert all(proc.poll() is not None for proc in engine.cores.procs)
    finally:
        engine.shutdown()


def test_a_stopped_core_is_named_within_the_heartbeat_timeout(tmp_path):
    """A core stopped mid-request (SIGSTOP: alive, but silent) is named after `worker_heartbeat_timeout_s`,
    not after `worker_timeout_s`; a busy core that keeps beating is not."""
    engine = make_engine(tmp_path, data_parallel_size=2, num_kv_blocks=8, worker_heartbeat_timeout_s=3)
    stopped = None
    try:
        for dp in (0, 1):
            engine.add_request(f"r{dp}", prompts()[dp], SamplingParams(max_tokens=400, ignore_eos=True))
        engine.step()
        stopped = engine.cores.procs[engine._owner["r1"]]
        os.kill(stopped.pid, signal.SIGSTOP)
        dp = engine._owner["r1"]
        start = time.monotonic()
        with pytest.raises(WorkerError, match=rf"worker rank {dp} hung: no output and no heartbeat for 3 s.*"
                                              rf"\(DP rank {dp}\)"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 30  # worker_timeout_s is 60 here
    finally:
        if stopped is not None and stopped.poll() is None:  # the failure's shutdown normally killed it
            os.kill(stopped.pid, signal.SIGCONT)
        engine.shutdown()


def test_an_idle_core_runs_dummy_steps_under_expert_parallelism(tmp_path):
    engine = make_engine(tmp_path, data_parallel_size=2, enable_expert_parallel=True, num_kv_blocks=8)
    try:
        out, = serve(engine, [prompts()[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert len(out.outputs[0].token_ids) == 6
    idle = min(stats["data_parallel"], key=lambda s: s["num_prefill_tokens"])
    assert idle["num_prefill_tokens"] == idle["num_decode_tokens"] == 0
    steps = {report["rank"]: report["num_steps"] for report in stats["ranks"]}
    assert steps[0] == steps[1] > 0  # every step of the busy core was joined by a dummy step of the idle one


def test_merge_stats_sums_counters_and_keeps_per_rank_lists():
    ranks = [{"num_running": 1, "prefix_cache_hit_tokens": 2, "prefix_cache_queried_tokens": 4,
              "prefix_cache_hit_rate": 0.5, "rank_memory": [{"rank": r}], "eplb": {"rank": r}, "hist": [1, r]}
             for r in (0, 1)]
    total = merge_stats(ranks)
    assert total["num_running"] == 2 and total["hist"] == [2, 1] and total["prefix_cache_hit_rate"] == 0.5
    assert total["rank_memory"] == [{"rank": 0}, {"rank": 1}] and total["eplb"] == {"rank": 0}
    assert total["data_parallel"] == ranks
