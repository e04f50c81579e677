"""Scheduler: budgets, chunked prefill, decode/prefill mixing, slots, preemption, abort, prefix caching.

`FakeRunner` is a test double for the model runner that sees only the step plans, as the real runner
does: it keeps each request's block table from them, writes every computed token into a fake paged
cache through that table, and "samples" a token that depends on the whole prefix as read back through
the table. So any schedule (chunked, preempted, recomputed, served from the prefix cache) must produce
exactly the tokens of a plain sequential run, and a wrong block id, start or chunk in a plan changes them.
"""

import pickle
import random

import pytest

from deepinfer_core.kv.cache import NULL_BLOCK
from deepinfer_core.kv.connector import KvConnector
from deepinfer_core.plan import StepPlan
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sched.block_pool import BlockPool
from deepinfer_core.sched.scheduler import Scheduler, SchedulerConfig
from deepinfer_core.sched.sequence import Sequence, SequenceStatus

BS = 4


def next_token(prefix: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(prefix)) % 997 + 1


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def make_seq(request_id: str, prompt, max_tokens: int = 4) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def make_scheduler(num_blocks=64, num_slots=8, prefix=False, **config) -> Scheduler:
    defaults = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 1024,
        "block_size": BS,
        "sliding_window": BS,
        "enable_prefix_caching": prefix,
    }
    manager = BlockPool(num_blocks, BS, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(**{**defaults, **config}), manager, num_slots)


def pool_snapshot(scheduler: Scheduler) -> tuple[int, list[int]]:
    manager = scheduler.block_pool
    return manager.num_free_blocks, [manager.ref_count(i) for i in range(1, manager.num_blocks + 1)]


def check_invariants(scheduler: Scheduler) -> None:
    manager = scheduler.block_pool
    holders = [0] * (manager.num_blocks + 1)  # ids 1 .. num_blocks; 0 is the null block
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING and seq.slot is not None
        for block_id in seq.block_table:
            holders[block_id] += 1
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.slot is None and seq.block_table == []
    assert holders[NULL_BLOCK] == 0, "the null block is never handed out"
    assert holders == [manager.ref_count(i) for i in range(manager.num_blocks + 1)]
    assert manager.num_free_blocks == holders[1:].count(0)
    slots = [seq.slot for seq in scheduler.running]
    assert len(set(slots)) == len(slots)


class FakeRunner:
    """Runs plans on a fake paged cache; returns {request_id: sampled token} for sampled requests."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.batches: list[list[tuple[str, int, int]]] = []  # (request_id, start, num_new_tokens)
        self.tables: dict[str, list[int]] = {}
        self.cache: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id

    def execute(self, plan: StepPlan) -> dict[str, int]:
        config = self.scheduler.config
        plan = pickle.loads(pickle.dumps(plan))  # a plan crosses to worker processes as it is
        assert 0 < plan.num_tokens <= config.max_num_batched_tokens
        assert len(plan.requests) <= config.max_num_seqs
        assert len({r.request_id for r in plan.requests}) == len(plan.requests)
        for request_id in plan.freed_request_ids:
            del self.tables[request_id]
        for new in plan.new_requests:
            assert new.request_id not in self.tables
            self.tables[new.request_id] = list(new.block_ids)
        sampled = {}
        for r in plan.requests:
            table = self.tables[r.request_id]
            table.extend(r.new_block_ids)
            assert r.num_tokens >= 1 and len(table) * BS >= r.end
            for position, token in enumerate(r.token_ids, start=r.start):
                where = (table[position // BS], position % BS)
                if position < r.no_write_before:
                    assert self.cache[where] == token, "a shared cached block must already hold the token"
                else:
                    self.cache[where] = token
            if r.is_sampled:
                prefix = [self.cache[(table[p // BS], p % BS)] for p in range(r.end)]
                sampled[r.request_id] = next_token(prefix)
        self.batches.append([(r.request_id, r.start, r.num_tokens) for r in plan.requests])
        return sampled


def step(scheduler: Scheduler, runner: FakeRunner, finished: dict[str, Sequence]) -> StepPlan | None:
    """One engine step, as the engine loop runs it."""
    plan = scheduler.schedule()
    for seq in scheduler.pop_finished():
        assert seq.request_id not in finished
        finished[seq.request_id] = seq
    check_invariants(scheduler)
    if plan is None:
        return None
    seqs = {seq.request_id: seq for seq in scheduler.running}
    sampled = runner.execute(plan)
    scheduler.postprocess(plan)
    for request_id, token in sampled.items():
        seq = seqs[request_id]
        seq.append_token(token)
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
            assert seq.request_id not in finished
            finished[seq.request_id] = seq
    check_invariants(scheduler)
    return plan


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 2000) -> dict[str, Sequence]:
    finished: dict[str, Sequence] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        batch = step(scheduler, runner, finished)
        assert batch is not None or not scheduler.has_unfinished(), "scheduler stalled with work left"
    raise AssertionError("did not finish")


# -- configuration and add ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_num_batched_tokens": 4}, "max_num_batched_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"sliding_window": -1}, "sliding_window"),
    ],
)
def test_config_validation(overrides, message):
    base = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128}
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{**base, **overrides})


def test_block_pool_must_match_config():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(config, BlockPool(8, block_size=8), num_slots=2)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Scheduler(config, BlockPool(8, BS, enable_prefix_caching=True), num_slots=2)
    with pytest.raises(ValueError, match="num_slots"):
        Scheduler(config, BlockPool(8, BS), num_slots=0)
    with pytest.raises(ValueError, match="KV connector"):
        Scheduler(config, BlockPool(8, BS), num_slots=2, connector=KvConnector(BlockPool(8, BS)))


def test_add_rejects_bad_requests():
    scheduler = make_scheduler(num_blocks=4, max_model_len=20)
    scheduler.add(make_seq("a", range(3)))
    with pytest.raises(ValueError, match="unique"):
        scheduler.add(make_seq("a", range(3)))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add(make_seq("long", range(21)))
    with pytest.raises(ValueError, match="cache has 4"):
        scheduler.add(make_seq("huge", range(17)))  # 5 blocks of 4
    used = make_seq("used", range(3))
    used.num_computed_tokens = 1
    with pytest.raises(ValueError, match="fresh"):
        scheduler.add(used)
    assert scheduler.num_waiting == 1


# -- budget, cap, chunking, mixing -----------------------------------------------------------------


def test_budget_and_seq_cap_are_respected():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    runner = FakeRunner(scheduler)
    for i in range(5):
        scheduler.add(make_seq(f"r{i}", range(i, i + 4)))
    step(scheduler, runner, {})
    assert runner.batches[-1] == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 2)]  # r2 cut by the budget
    assert (scheduler.num_running, scheduler.num_waiting) == (3, 2)
    step(scheduler, runner, {})
    # running is at max_num_seqs: nothing is admitted although budget is left
    assert runner.batches[-1] == [("r0", 4, 1), ("r1", 4, 1), ("r2", 2, 2)]
    assert scheduler.num_waiting == 2


def test_schedule_refuses_a_sampled_token_that_was_not_appended():
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", range(4)))
    scheduler.postprocess(scheduler.schedule())
    with pytest.raises(RuntimeError, match="append the sampled token"):
        scheduler.schedule()


def test_prompt_is_chunked_at_arbitrary_offsets():
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=7)
    runner = FakeRunner(scheduler)
    scheduler.add(make_seq("a", range(17), max_tokens=2))
    finished = run_to_completion(scheduler, runner)
    assert [b[0][1:] for b in runner.batches] == [(0, 7), (7, 7), (14, 3), (17, 1)]
    assert finished["a"].output_token_ids == reference_output(list(range(17)), 2)
    assert scheduler.stats.num_prefill_tokens == 17 and scheduler.stats.num_decode_tokens == 1


def test_decodes_come_first_and_mix_with_prefill_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(scheduler)
    finished: dict[str, Sequence] = {}
    scheduler.add(make_seq("a", range(3), max_tokens=5))
    step(scheduler, runner, finished)  # a prefilled and sampled
    scheduler.add(make_seq("b", range(20)))
    step(scheduler, runner, finished)
    assert runner.batches[-1] == [("a", 3, 1), ("b", 0, 7)]
    step(scheduler, runner, finished)
    assert runner.batches[-1] == [("a", 4, 1), ("b", 7, 7)]


def test_running_prefill_is_served_before_new_arrivals():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner(scheduler)
    scheduler.add(make_seq("a", range(25)))
    step(scheduler, runner, {})
    scheduler.add(make_seq("b", range(5)))
    step(scheduler, runner, {})
    assert runner.batches[-1] == [("a", 10, 10)]
    step(scheduler, runner, {})
    assert runner.batches[-1] == [("a", 20, 5), ("b", 0, 5)]


def test_slots_are_allocated_and_reused():
    scheduler = make_scheduler(num_slots=2)
    runner = FakeRunner(scheduler)
    for name in "abc":
        scheduler.add(make_seq(name, range(3), max_tokens=1 if name == "a" else 3))
    finished: dict[str, Sequence] = {}
    step(scheduler, runner, finished)  # only two slots: c waits
    assert [s.slot for s in scheduler.running] == [1] and finished["a"].slot is None
    assert scheduler.num_waiting == 1
    step(scheduler, runner, finished)
    c = scheduler.running[-1]
    assert c.request_id == "c" and c.slot == 0  # a's slot
    run_to_completion(scheduler, runner)


# -- preemption ------------------------------------------------------------------------------------


def test_newest_sequence_is_preempted_and_requeued_first():
    scheduler = make_scheduler(num_blocks=4)
    runner = FakeRunner(scheduler)
    finished: dict[str, Sequence] = {}
    a, b, c = make_seq("a", range(7), 8), make_seq("b", range(10, 17), 8), make_seq("c", range(3), 8)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, runner, finished)  # a and b prefilled: 2 blocks each, pool full
    scheduler.add(c)
    step(scheduler, runner, finished)  # decodes at position 7 still fit; c cannot be admitted
    assert scheduler.num_waiting == 1
    step(scheduler, runner, finished)  # a's position 8 needs a third block: b (newest) is preempted
    assert runner.batches[-1] == [("a", 8, 1)]
    assert b.status is SequenceStatus.WAITING and list(scheduler.waiting) == [b, c]
    assert (b.num_computed_tokens, b.block_table, b.slot) == (0, [], None)
    assert b.output_token_ids == reference_output(list(range(10, 17)), 2)  # generated tokens kept
    assert scheduler.stats.num_preemptions == 1
    done = run_to_completion(scheduler, runner)
    assert done["b"].output_token_ids == reference_output(list(range(10, 17)), 8)


def test_decode_that_is_newest_preempts_itself():
    scheduler = make_scheduler(num_blocks=4)
    runner = FakeRunner(scheduler)
    finished: dict[str, Sequence] = {}
    a, b = make_seq("a", range(5), 8), make_seq("b", range(7), 8)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, runner, finished)
    step(scheduler, runner, finished)  # a at 6 tokens' worth, b at 8: both in 2 blocks
    step(scheduler, runner, finished)  # b's position 8 needs a block; a does not
    assert runner.batches[-1] == [("a", 6, 1)]
    assert b.status is SequenceStatus.WAITING and a.status is SequenceStatus.RUNNING
    assert scheduler.stats.num_preemptions == 1


def test_tiny_pool_gives_the_same_tokens_as_a_large_one():
    prompts = {f"r{i}": [(7 * i + j) % 50 for j in range(5 + 3 * i)] for i in range(5)}
    outputs = {}
    for num_blocks in (64, 6):
        scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=9)
        for name, prompt in prompts.items():
            scheduler.add(make_seq(name, prompt, max_tokens=6))
        finished = run_to_completion(scheduler, FakeRunner(scheduler))
        assert sorted(finished) == sorted(prompts)
        assert pool_snapshot(scheduler) == (num_blocks, [0] * num_blocks)
        outputs[num_blocks] = ({k: s.output_token_ids for k, s in finished.items()}, scheduler.stats)
    assert outputs[6][0] == outputs[64][0] == {k: reference_output(p, 6) for k, p in prompts.items()}
    assert outputs[64][1].num_preemptions == 0 and outputs[6][1].num_preemptions > 0


def test_prefill_chunk_of_the_newest_shrinks_then_waits_then_yields():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=8)
    runner = FakeRunner(scheduler)
    finished: dict[str, Sequence] = {}
    d, a = make_seq("d", range(5), max_tokens=10), make_seq("a", range(30, 50), max_tokens=2)
    scheduler.add(d)
    scheduler.add(a)
    step(scheduler, runner, finished)
    assert runner.batches[-1] == [("d", 0, 5), ("a", 0, 3)]
    step(scheduler, runner, finished)
    assert runner.batches[-1] == [("d", 5, 1), ("a", 3, 7)]
    step(scheduler, runner, finished)  # a's chunk of 7 needs 2 blocks, 1 is free: it shrinks to 6
    assert runner.batches[-1] == [("d", 6, 1), ("a", 10, 6)]
    step(scheduler, runner, finished)  # no block left and no newer sequence to preempt: a waits
    assert runner.batches[-1] == [("d", 7, 1)]
    assert a.status is SequenceStatus.RUNNING and scheduler.stats.num_preemptions == 0
    step(scheduler, runner, finished)  # d's position 8 needs a block: a, the newest, is preempted
    assert runner.batches[-1] == [("d", 8, 1)] and a.status is SequenceStatus.WAITING
    finished.update(run_to_completion(scheduler, runner))
    assert finished["a"].output_token_ids == reference_output(list(range(30, 50)), 2)
    assert finished["d"].output_token_ids == reference_output(list(range(5)), 10)


def test_no_admission_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=4)
    runner = FakeRunner(scheduler)
    a, b = make_seq("a", range(7), 8), make_seq("b", range(7), 8)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, runner, {})
    step(scheduler, runner, {})
    step(scheduler, runner, {})  # b preempted; freeing its blocks must not readmit it this step
    assert runner.batches[-1] == [("a", 8, 1)]
    assert scheduler.num_waiting == 1


def test_sequence_too_long_for_the_whole_cache_finishes_with_length():
    scheduler = make_scheduler(num_blocks=2)
    seq = make_seq("a", range(6), max_tokens=10)
    scheduler.add(seq)
    finished = run_to_completion(scheduler, FakeRunner(scheduler))
    assert finished["a"].status is SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == reference_output(list(range(6)), 3)  # 9 tokens need a third block
    assert pool_snapshot(scheduler) == (2, [0, 0])
    assert scheduler.pop_finished() == []


# -- abort and finish ------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_restores_the_pool(prefix, when):
    """After abort the pool matches a twin run that never saw the request: same free count and
    reference counts (blocks the request cached and left unreferenced count as free)."""
    steps = {"waiting": 0, "mid_prefill": 2, "mid_decode": 5}[when]
    snapshots = []
    for with_request in (True, False):
        scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=8, prefix=prefix)
        runner = FakeRunner(scheduler)
        other = make_seq("other", range(9), max_tokens=20)
        scheduler.add(other)
        step(scheduler, runner, {})
        step(scheduler, runner, {})
        seq = make_seq("x", list(range(9)) + [40] * 12, max_tokens=20)
        if with_request:
            scheduler.add(seq)
        for _ in range(steps):
            step(scheduler, runner, {})
        if with_request:
            assert seq.status is (SequenceStatus.WAITING if when == "waiting" else SequenceStatus.RUNNING)
            assert seq.is_prefill == (when != "mid_decode")
            if prefix and when != "waiting":
                assert seq.num_cached_tokens == 8  # shares other's two full blocks
            assert scheduler.abort("x") is seq
            assert seq.status is SequenceStatus.FINISHED_ABORTED
            assert (seq.slot, seq.block_table) == (None, [])
            assert scheduler.abort("x") is None
        assert [s.request_id for s in scheduler.running] == ["other"]
        free, refs = pool_snapshot(scheduler)
        snapshots.append((free, sorted(refs), other.num_tokens))
    assert snapshots[0] == snapshots[1]


def test_abort_unknown_request_returns_none():
    scheduler = make_scheduler()
    assert scheduler.abort("nope") is None


def test_finish_validates_status_and_membership():
    scheduler = make_scheduler()
    seq = make_seq("a", range(3))
    with pytest.raises(ValueError, match="not scheduled"):
        scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    scheduler.add(seq)
    with pytest.raises(ValueError, match="FINISHED"):
        scheduler.finish(seq, SequenceStatus.RUNNING)
    scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert seq.status is SequenceStatus.FINISHED_STOPPED and not scheduler.has_unfinished()


def test_postprocess_skips_sequences_aborted_after_scheduling():
    scheduler = make_scheduler()
    seq = make_seq("a", range(5))
    scheduler.add(seq)
    batch = scheduler.schedule()
    scheduler.abort("a")
    scheduler.postprocess(batch)
    assert seq.num_computed_tokens == 0


def test_schedule_returns_none_when_idle():
    assert make_scheduler().schedule() is None


# -- prefix caching --------------------------------------------------------------------------------


@pytest.mark.parametrize(("replay", "start"), [("bounded", 8), ("exact", 4)])
def test_prefix_hit_sets_replay_fields_and_stats(replay, start):
    scheduler = make_scheduler(prefix=True, swa_replay=replay, num_layers=2)
    runner = FakeRunner(scheduler)
    scheduler.add(make_seq("a", range(13), max_tokens=1))
    run_to_completion(scheduler, runner)
    b = make_seq("b", list(range(12)) + [90, 91], max_tokens=2)
    scheduler.add(b)
    step(scheduler, runner, {})
    assert runner.batches[-1] == [("b", start, 14 - start)]
    assert (b.num_cached_tokens, b.no_write_before, b.replay_start) == (12, 12, start)
    stats = scheduler.stats
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (13 + 14, 12)
    assert stats.hit_rate == pytest.approx(12 / 27)
    assert stats.num_prefill_tokens == 13 + 14 - start
    assert stats.num_replay_tokens == 12 - start
    done = run_to_completion(scheduler, runner)
    assert done["b"].output_token_ids == reference_output(b.prompt_token_ids, 2)
    assert done["b"].num_cached_tokens == 12  # still there for the final output


def test_concurrent_requests_share_cached_blocks():
    scheduler = make_scheduler(prefix=True)
    runner = FakeRunner(scheduler)
    scheduler.add(make_seq("a", range(9), max_tokens=1))
    run_to_completion(scheduler, runner)
    b, c = make_seq("b", list(range(8)) + [1], 3), make_seq("c", list(range(8)) + [2], 3)
    scheduler.add(b)
    scheduler.add(c)
    step(scheduler, runner, {})
    assert b.block_table[:2] == c.block_table[:2]
    assert scheduler.block_pool.ref_count(b.block_table[0]) == 2
    run_to_completion(scheduler, runner)
    assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks


def test_preempted_sequence_hits_its_own_cached_blocks():
    scheduler = make_scheduler(num_blocks=6, prefix=True, sliding_window=0)
    runner = FakeRunner(scheduler)
    a, b = make_seq("a", range(8), 8), make_seq("b", range(20, 28), 8)
    scheduler.add(a)
    scheduler.add(b)
    finished: dict[str, Sequence] = {}
    while scheduler.stats.num_preemptions == 0:
        step(scheduler, runner, finished)
    # a's position 12 needed a fifth block: b (13 tokens, 3 full blocks cached) was preempted and
    # a took b's least recently released block, its tail
    assert b.status is SequenceStatus.WAITING and b.num_tokens == 13
    assert scheduler.block_pool.num_cached_blocks == 3 + 2  # a's three full blocks, b's first two
    while b.status is SequenceStatus.WAITING:
        step(scheduler, runner, finished)
    assert b.num_cached_tokens == 8 and scheduler.stats.num_hit_tokens == 8
    assert runner.batches[-1][-1] == ("b", 8, 5)
    done = run_to_completion(scheduler, runner)
    assert done["b"].output_token_ids == reference_output(list(range(20, 28)), 8)
    assert scheduler.stats.num_preemptions == 1


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_completes_exactly(seed):
    rng = random.Random(seed)
    prefix = seed % 2 == 1
    num_blocks = rng.randint(6, 12)
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        num_slots=rng.randint(1, 4),
        prefix=prefix,
        max_num_seqs=4,
        max_num_batched_tokens=rng.randint(4, 20),
    )
    runner = FakeRunner(scheduler)
    shared = [rng.randrange(30) for _ in range(8)]
    expected, aborted, finished = {}, set(), {}
    for i in range(10):
        prompt = shared[: rng.randint(0, 8)] + [rng.randrange(30) for _ in range(rng.randint(1, 9))]
        max_tokens = rng.randint(1, num_blocks * BS - len(prompt))
        scheduler.add(make_seq(f"r{i}", prompt, max_tokens))
        expected[f"r{i}"] = reference_output(prompt, max_tokens)
        for _ in range(rng.randint(0, 3)):
            step(scheduler, runner, finished)
        if rng.random() < 0.2:
            victim = rng.choice(list(expected))
            if scheduler.abort(victim) is not None:
                aborted.add(victim)
    finished.update(run_to_completion(scheduler, runner))
    assert sorted(finished) == sorted(set(expected) - aborted)
    for name, seq in finished.items():
        assert seq.output_token_ids == expected[name]
    assert scheduler.block_pool.num_free_blocks == num_blocks


# -- the step plan ----------------------------------------------------------------------------------


def test_plan_carries_new_requests_once_then_appended_blocks_and_freed_ids():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=8, max_num_seqs=2)
    a, b = make_seq("a", range(1, 7), max_tokens=8), make_seq("b", range(1, 3), max_tokens=8)
    scheduler.add(a)
    first = scheduler.schedule()
    assert [n.request_id for n in first.new_requests] == ["a"]
    new = first.new_requests[0]
    assert (new.slot, new.block_ids, new.num_prompt_tokens) == (a.slot, tuple(a.block_table), 6)
    assert first.requests[0].token_ids == (1, 2, 3, 4, 5, 6) and first.requests[0].is_sampled
    assert pickle.loads(pickle.dumps(first)) == first  # plain values only: it crosses processes as is
    scheduler.postprocess(first)
    assert len(a.block_table) == 2
    for _ in range(3):  # three uncomputed tokens (as in a recompute): position 8 needs a third block
        a.append_token(9)
    second = scheduler.schedule()
    assert second.new_requests == () and second.requests[0].start == 6
    assert second.requests[0].new_block_ids == (a.block_table[2],) and second.requests[0].token_ids == (9, 9, 9)
    scheduler.postprocess(second)
    scheduler.add(b)
    scheduler.finish(a, SequenceStatus.FINISHED_STOPPED)
    third = scheduler.schedule()
    assert third.freed_request_ids == ("a",) and [n.request_id for n in third.new_requests] == ["b"]
    assert scheduler.schedule().freed_request_ids == ()  # said once


def test_a_preempted_request_comes_back_as_a_new_request_with_its_whole_table():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=16, max_num_seqs=2)
    runner = FakeRunner(scheduler)
    old, new = make_seq("old", range(1, 8), max_tokens=6), make_seq("new", range(1, 8), max_tokens=6)
    scheduler.add(old)
    scheduler.add(new)
    plans, finished = [], {}
    while scheduler.has_unfinished():
        plans.append(step(scheduler, runner, finished))
    assert scheduler.stats.num_preemptions > 0
    freed = [p for p in plans if p is not None and "new" in p.freed_request_ids and "new" not in
             {r.request_id for r in p.requests}]
    assert freed, "the preemption was announced to the runner"
    readmitted = [n for p in plans if p is not None for n in p.new_requests if n.request_id == "new"]
    assert len(readmitted) >= 2 and readmitted[-1].block_ids  # readmitted with a fresh full table
    assert finished["new"].output_token_ids == reference_output(list(range(1, 8)), 6)


def test_a_waiting_sequence_that_is_not_admissible_is_skipped_not_blocking() -> None:
    ready: set[str] = {"b"}
    manager = BlockPool(64, BS)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, block_size=BS,
                             sliding_window=BS)
    scheduler = Scheduler(config, manager, 8, is_admissible=lambda seq: seq.request_id in ready)
    for request_id in ("a", "b"):
        scheduler.add(make_seq(request_id, [1, 2, 3]))
    plan = scheduler.schedule()
    assert [r.request_id for r in plan.requests] == ["b"] and [s.request_id for s in scheduler.waiting] == ["a"]
    ready.add("a")
    scheduler.postprocess(plan)
    scheduler.running[0].append_token(7)
    assert sorted(r.request_id for r in scheduler.schedule().requests) == ["a", "b"]
