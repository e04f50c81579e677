"""Overlapped decode (`async_scheduling`): the same outputs as step-by-step decoding, and the next
step really launches before the host reads the last one's tokens."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.plan import PENDING_TOKEN
from deepinfer_core.sched.sequence import Sequence
from deepinfer_core.worker.input_batch import CarriedTokens
from tests.engine.test_engine import CONFIG, WEIGHTS, assert_matches_oracle, make_engine, random_prompts, run
from tests.oracle import hf_model


@pytest.fixture(scope="module")
def oracle():
    return hf_model(CONFIG, WEIGHTS)


def run_streaming(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, object]:
    """Every request to the end; checks that no intermediate output shows a pending token."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for completion in out.outputs:
                assert PENDING_TOKEN not in completion.token_ids
            if out.finished:
                done[out.request_id] = out
    return done


def mixed_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = random_prompts([5, 40, 17, 130, 9, 60], seed=21)
    return {
        "greedy": (prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)),
        "sampled-n": (prompts[1], SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True)),
        "stop-token": (prompts[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[])),
        "min-tokens": (prompts[3], SamplingParams(temperature=1.0, seed=3, max_tokens=7, min_tokens=5)),
        "one-token": (prompts[4], SamplingParams(temperature=0, max_tokens=1, logprobs=1)),
        "eos": (prompts[5], SamplingParams(temperature=1.0, seed=11, max_tokens=20)),
    }


def summary(done) -> dict:
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs] for rid, out in done.items()}


def logprob_table(done) -> dict:
    """(request, completion, step, token) -> logprob, over every reported logprob."""
    return {
        (rid, c.index, step, token): lp.logprob
        for rid, out in done.items() for c in out.outputs for step, entry in enumerate(c.logprobs or [])
        for token, lp in entry.items()
    }


def test_overlapped_outputs_equal_step_by_step(tmp_path):
    requests = mixed_requests()
    sync = run_streaming(make_engine(tmp_path, max_num_seqs=8, num_kv_blocks=16, async_scheduling=False), requests)
    # stop on a token the step-by-step run produced mid-way, so one completion stops early
    stop_at = sync["stop-token"].outputs[0].token_ids[4]
    requests["stop-token"] = (requests["stop-token"][0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at]))
    sync = run_streaming(make_engine(tmp_path, max_num_seqs=8, num_kv_blocks=16, async_scheduling=False), requests)
    engine = make_engine(tmp_path, max_num_seqs=8, num_kv_blocks=16, async_scheduling=True)
    overlapped = run_streaming(engine, requests)
    assert sync["stop-token"].outputs[0].finish_reason == "stop"
    assert summary(overlapped) == summary(sync)
    mine, theirs = logprob_table(overlapped), logprob_table(sync)
    assert mine.keys() == theirs.keys() and len(mine) > 12
    assert max(abs(mine[k] - theirs[k]) for k in mine) < 1e-4  # batches differ, so fp32 sums may too
    assert engine.block_manager.num_free_blocks == 16
    assert engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0


def test_overlapped_decode_matches_transformers_under_preemption(tmp_path, oracle):
    lengths = [1, 3, 17, 118, 120, 122, 124, 126, 129, 200, 333, 520]
    max_tokens = [6, 9, 4, 14, 14, 12, 12, 10, 3, 6, 5, 3]
    prompts = random_prompts(lengths)
    engine = make_engine(tmp_path, max_num_seqs=6, max_num_batched_tokens=96, num_kv_blocks=7, async_scheduling=True)
    done = run(engine, prompts, max_tokens)
    assert engine.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    for i, prompt in enumerate(prompts):
        assert_matches_oracle(oracle, prompt, done[str(i)].outputs[0])
    assert engine.block_manager.num_free_blocks == 7


def test_next_step_launches_before_the_last_is_read(tmp_path):
    engine = make_engine(tmp_path, max_num_seqs=4, num_kv_blocks=8, async_scheduling=True)
    events = []
    execute, settle = engine.executor.execute_model, engine.steps.settle

    def record_execute(plan):
        events.append(("launch", any(PENDING_TOKEN in r.token_ids for r in plan.requests)))
        return execute(plan)

    def record_settle(in_flight, touched):
        events.append(("settle", None))
        return settle(in_flight, touched)

    engine.executor.execute_model, engine.steps.settle = record_execute, record_settle
    run(engine, random_prompts([10, 12]), [6, 6])
    launches = [carried for kind, carried in events if kind == "launch"]
    # prefill, first decode (nothing in flight), then every decode launches from carried tokens
    assert launches[0] is False and launches.count(True) >= 4
    # one prefill step + 5 decode steps, as step by step: the batch ends by length together, so the
    # step after the last token is not launched for nothing
    assert len(launches) == 6
    for i, (kind, carried) in enumerate(events):
        if kind == "launch" and carried:
            assert events[i + 1][0] == "settle", "the step in flight is read only after the next launch"


def test_abort_while_a_step_is_in_flight_frees_everything(tmp_path):
    engine = make_engine(tmp_path, max_num_seqs=4, num_kv_blocks=8, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("keep", random_prompts([30])[0], params)
    engine.add_request("drop", random_prompts([50], seed=1)[0], params)
    for _ in range(4):
        engine.step()
    assert engine.steps.in_flight is not None and any(s.request_id == "drop" for s in engine.steps.in_flight.seqs)
    engine.abort("drop")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert set(outputs) == {"keep"} and len(outputs["keep"].outputs[0].token_ids) == 20
    assert engine.block_manager.num_free_blocks == 8


def test_prefix_cache_hits_with_overlap_equal_a_cold_run(tmp_path):
    shared = random_prompts([300], seed=42)[0]
    prompts = [shared + s for s in random_prompts([20, 35], seed=43)]
    cold = run(make_engine(tmp_path, max_num_seqs=4, num_kv_blocks=24, async_scheduling=False), prompts, [6, 6])
    engine = make_engine(tmp_path, max_num_seqs=4, max_num_batched_tokens=128, num_kv_blocks=24,
                         enable_prefix_caching=True, swa_replay="exact", async_scheduling=True)
    run(engine, [shared + [9, 9]], [3])
    warm = run(engine, prompts, [6, 6])
    for i in range(2):
        assert warm[str(i)].num_cached_tokens >= 256
        assert warm[str(i)].outputs[0].token_ids == cold[str(i)].outputs[0].token_ids


def test_carried_tokens_fill_by_request_and_reject_unknown_pending():
    carried = CarriedTokens(torch.tensor([70, 80, 90]), ["c", "x", "a"])
    ids = torch.tensor([0, 5, 0, 6, 0])
    carried.fill(ids, [(0, "a"), (4, "c")])
    assert ids.tolist() == [90, 5, 0, 6, 70]
    same = CarriedTokens(torch.tensor([7, 8]), ["a", "c"])
    ids = torch.zeros(2, dtype=torch.long)
    same.fill(ids, [(0, "a"), (1, "c")])
    assert ids.tolist() == [7, 8]
    with pytest.raises(RuntimeError, match="did not sample"):
        CarriedTokens(torch.tensor([1]), ["b"]).fill(torch.zeros(3, dtype=torch.long), [(0, "a")])
    seq = Sequence("a", [1, 2], SamplingParams())
    seq.append_token(PENDING_TOKEN)
    assert seq.output_token_ids == []
    seq.resolve_pending(42)
    assert seq.output_token_ids == [42]
    with pytest.raises(RuntimeError, match="no pending token"):
        seq.resolve_pending(43)


def test_a_step_that_schedules_nothing_still_settles_the_step_in_flight(tmp_path):
    engine = make_engine(tmp_path, max_num_seqs=4, num_kv_blocks=8, async_scheduling=True)
    reference = run(make_engine(tmp_path, max_num_seqs=4, num_kv_blocks=8, async_scheduling=False), random_prompts([12]), [8])
    engine.add_request("0", random_prompts([12])[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))
    for _ in range(3):
        engine.step()
    assert engine.steps.in_flight is not None
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: None  # as when every running sequence had to be preempted
    progressed = engine.step()
    engine.scheduler.schedule = schedule
    assert engine.steps.in_flight is None and [len(o.outputs[0].token_ids) for o in progressed] == [3]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["0"].outputs[0].token_ids == reference["0"].outputs[0].token_ids
