"""Verification steps read late (`async_scheduling`, the in-process runner): `step()` reads the step the
call before launched, launches the next and only then builds the outputs of the one it read. Outputs
must equal those of decoding without speculation, through stop rules, preemption, aborts and shutdown."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.engine.engine import Engine
from deepinfer_core.testing.serving import serve
from tests.engine.test_spec_decode import VOCAB, ScriptedDrafter, make_engine

PROMPTS = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 12, 30)]


def spec_engine(path, reference, offset: int, k: int = 3, **options) -> Engine:
    """Overlapped scheduling on, fixed k, a drafter proposing the reference continuation shifted by
    `offset` (0: every draft right; 1: every draft wrong)."""
    engine = make_engine(path, {"method": "ngram", "num_speculative_tokens": k}, **{"async_scheduling": True, **options})
    engine.speculator.drafter = ScriptedDrafter(reference, offset)
    return engine


def count_launches(engine: Engine) -> tuple[list, list]:
    """Two lists gaining, per step launched ahead and per step that verified drafts, its plan."""
    launched, verified, record = [], [], engine.speculator.record
    execute_model, sample, plans = engine.executor.execute_model, engine.executor.sample, []

    def executed(plan):
        plans.append(plan)
        return execute_model(plan)

    def counted(grammar_rows=None, *, late=False):
        if late:
            launched.append(plans[-1])
        return sample(grammar_rows, late=late)

    def recorded(plan, num_accepted, is_overlapped=False):
        if any(r.num_draft_tokens for r in plan.requests):
            verified.append(plan)
        return record(plan, num_accepted, is_overlapped)
    engine.executor.execute_model, engine.executor.sample, engine.speculator.record = executed, counted, recorded
    return launched, verified


def run(engine: Engine, params: list[SamplingParams], abort_after: int | None = None) -> dict[str, list]:
    """Serve `PROMPTS` to the end; per request id, (token ids, logprobs) of each completion. With
    `abort_after`, request "1" is aborted on the first call after that many steps that leaves a
    verification step launched."""
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.logprobs) for c in out.outputs]
        steps += 1
        if abort_after is not None and steps > abort_after and engine.steps.launched is not None:
            engine.abort("1")
            abort_after = None
    return done


def same(result, reference) -> bool:
    """Equal token ids and logprob token sets, logprob values within fp32 rounding (a verification step
    computes k + 1 rows at once, a decode step one: not bitwise the same reductions)."""
    def tokens(r):
        return {k: [(ids, [sorted(e) for e in lps or []]) for ids, lps in v] for k, v in r.items()}

    def values(r):
        return [lp.logprob for v in r.values() for _, lps in v for e in lps or [] for lp in e.values()]
    return tokens(result) == tokens(reference) and values(result) == pytest.approx(values(reference), abs=1e-5)


GREEDY = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)] * 3
SEEDED = [SamplingParams(temperature=0.8, top_k=50, seed=s, n=2, max_tokens=12, ignore_eos=True, logprobs=2)
          for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {name: run(make_engine(tmp_path_factory.mktemp(name)), params)
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def continuations(result) -> dict[str, list[int]]:
    """Per sequence id (`request#i` for n > 1), its reference tokens, as the drafter looks them up."""
    return {(k if len(v) == 1 else f"{k}#{i}"): ids for k, v in result.items() for i, (ids, _) in enumerate(v)}


@pytest.mark.parametrize("offset", [0, 1], ids=["right", "wrong"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_launched_verification_gives_the_tokens_and_logprobs_of_no_speculation(tmp_path, references, kind, offset):
    reference = references[kind]
    engine = spec_engine(tmp_path, continuations(reference), offset)
    launched, verified = count_launches(engine)
    result = run(engine, GREEDY if kind == "greedy" else SEEDED)
    assert same(result, reference)
    stats = engine.stats()
    assert verified and launched == verified  # every verification step, and only those, launched ahead
    assert (stats["spec_accepted_tokens"] > 0) == (offset == 0)
    assert engine.steps.launched is None and engine.block_manager.num_free_blocks == engine.executor.info.num_blocks


def test_without_overlapped_scheduling_nothing_is_launched_ahead(tmp_path, references):
    engine = spec_engine(tmp_path, continuations(references["greedy"]), 0, async_scheduling=False)
    launched, verified = count_launches(engine)
    assert same(run(engine, GREEDY), references["greedy"])
    assert launched == [] and verified


def test_outputs_of_a_launched_step_come_with_the_next_call(tmp_path, references):
    """The call that launches the first verification step has nothing to report (the prefill's token came
    with the call before); the launched step's tokens come with the call after it, which launches the
    next verification step before it builds them."""
    engine = spec_engine(tmp_path, continuations(references["greedy"]), 0)
    events, sample, make_output = [], engine.executor.sample, engine.output.make_output
    engine.executor.sample = lambda rows=None, *, late=False: (late and events.append("launch")) or sample(rows, late=late)
    engine.output.make_output = lambda *args: events.append("output") or make_output(*args)
    engine.add_request("0", PROMPTS[0], GREEDY[0])
    seen = []
    while engine.has_unfinished_requests():
        before, events[:] = engine.steps.launched, []
        outputs = engine.step()
        seen.append((before is not None, engine.steps.launched is not None, len(outputs[0].outputs[0].token_ids)
                     if outputs else None))
        if before is not None and engine.steps.launched is not None:
            assert events == ["launch", "output"]  # the device computes while the host reports
    first_launch = next(i for i, (_, launched, _) in enumerate(seen) if launched)
    assert seen[first_launch - 1] == (False, False, 1) and seen[first_launch] == (False, True, None)
    assert seen[first_launch + 1] == (True, True, 1 + 4)  # every draft of 3 accepted, and the target's token
    assert seen[-1] == (True, False, 12)


def test_stop_tokens_and_max_tokens_inside_a_launched_accepted_run(tmp_path, references):
    """A stop token in the middle of an accepted run ends the request there (later tokens dropped), and
    max_tokens not a multiple of k + 1 ends it mid-run."""
    reference = references["greedy"]
    stop_at = {str(i): reference[str(i)][0][0][5] for i in range(3)}
    params = [SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=1,
                             stop_token_ids=[stop_at[str(i)]] if i != 2 else []) for i in range(3)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    expected = run(make_engine(tmp_path / "a"), params)
    engine = spec_engine(tmp_path / "b", continuations(reference), 0)
    launched, _ = count_launches(engine)
    assert same(run(engine, params), expected)
    assert launched and len(expected["2"][0][0]) == 11
    assert all(len(expected[str(i)][0][0]) <= 6 for i in range(2))  # ended by the stop token


def test_preemption_and_prefix_hits_with_launched_verification_steps(tmp_path):
    """Two 250-token prompts in a pool of four blocks: each needs a third block while decoding, so the
    scheduler preempts between launched steps; served twice, the second time from the prefix cache."""
    long = [torch.randint(2, VOCAB, (250,), generator=torch.Generator().manual_seed(s)).tolist() for s in (7, 8)]
    options = {"num_kv_blocks": 4, "enable_prefix_caching": True, "max_num_batched_tokens": 64}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def serve_twice(engine):
        runs = []
        for _ in range(2):
            for i, prompt in enumerate(long):
                engine.add_request(str(i), prompt, params)
            done = {}
            while engine.has_unfinished_requests():
                done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            runs.append(done)
        return runs

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    expected = serve_twice(make_engine(tmp_path / "a", **options))
    engine = spec_engine(tmp_path / "b", expected[0], 0, **options)
    launched, _ = count_launches(engine)
    assert serve_twice(engine) == expected
    stats = engine.stats()
    assert launched and stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert engine.block_manager.num_free_blocks == 4


def test_abort_while_a_verification_step_is_launched_leaks_nothing(tmp_path, references):
    reference = references["greedy"]
    engine = spec_engine(tmp_path, continuations(reference), 1)
    result = run(engine, GREEDY, abort_after=2)
    assert set(result) == {"0", "2"}  # the aborted request is never reported finished
    assert same(result, {k: v for k, v in reference.items() if k != "1"})
    assert engine.block_manager.num_free_blocks == engine.executor.info.num_blocks
    assert "1" not in engine.runner.requests  # a plan after the abort freed its state on the model side


def test_shutdown_reads_a_step_left_launched(tmp_path, references):
    """Every request aborted while a verification step is launched: nothing is unfinished, and
    shutdown reads the step (its rejected drafts rolled back) before the engine stops."""
    engine = spec_engine(tmp_path, continuations(references["greedy"]), 1)
    engine.add_request("0", PROMPTS[1], GREEDY[0])
    launch_one(engine)
    engine.abort("0")
    assert not engine.has_unfinished_requests() and engine.steps.launched is not None
    read = []
    launched = engine.steps.launched
    engine.steps.launched = (launched[0], launched[1], lambda: read.append(1) or launched[2]())
    engine.shutdown()
    assert read == [1] and engine.steps.launched is None


def launch_one(engine: Engine, max_steps: int = 8) -> None:
    """Step until a verification step is left launched (fails rather than spin if none is)."""
    for _ in range(max_steps):
        if engine.steps.launched is not None:
            return
        engine.step()
    assert engine.steps.launched is not None, f"no verification step launched in {max_steps} steps"


def test_cache_ops_read_a_launched_step_first_and_its_outputs_come_with_the_next_step(tmp_path):
    """`flush_cache_ops` between steps (a prefill instance exporting a prompt does this) reads the launched
    verify step before it runs its own plan: here reading it fills the prompt's first block, whose save
    the flush then runs. The tokens read are reported by the next `step()`."""
    prompt = torch.randint(2, VOCAB, (126,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    expected = [out.outputs[0].token_ids for out in serve(make_engine(tmp_path / "a"), [prompt], params)]
    engine = spec_engine(tmp_path / "b", {"0": expected[0]}, 0, enable_prefix_caching=True, host_cache_gib=0.01)
    engine.add_request("0", prompt, params)
    launch_one(engine)
    events, execute, (plan, seqs, complete) = [], engine.executor.execute, engine.steps.launched
    engine.steps.launched = plan, seqs, lambda: events.append("read") or complete()
    engine.executor.execute = lambda plan: events.append(("execute", bool(plan.cache_ops))) or execute(plan)
    engine.flush_cache_ops()  # position 126 and three drafts after it, all accepted: block 0 (0..127) is full
    assert engine.steps.launched is None and events == ["read", ("execute", True)]
    (out,) = engine.step()
    assert out.outputs[0].token_ids == expected[0][:5]  # the prefill's token, then the step the flush read
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.executor.info.num_blocks


def test_a_request_aborted_while_its_prefill_rides_a_launched_step_is_dropped(tmp_path, references):
    """A launched plan verifies "0"'s drafts beside "1"'s prefill with prompt logprobs; "1" is aborted and
    added again (the same id, another prompt) before the step is read: the old prompt's logprobs go
    nowhere, and the new "1" gets exactly what a fresh engine gives it."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    engine = spec_engine(tmp_path / "a", continuations(references["greedy"]), 0)
    engine.add_request("0", PROMPTS[0], GREEDY[0])
    launch_one(engine)
    engine.add_request("1", PROMPTS[2], params)
    engine.step()
    plan = engine.steps.launched[0]
    assert [r.request_id for r in plan.requests] == ["0", "1"] and plan.requests[0].num_draft_tokens
    engine.abort("1")
    engine.add_request("1", PROMPTS[1], params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    alone = serve(make_engine(tmp_path / "b"), [PROMPTS[1]], params)
    again = done["1"]
    assert again.outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert len(again.prompt_logprobs) == len(PROMPTS[1])
    for mine, theirs in zip(again.prompt_logprobs[1:], alone[0].prompt_logprobs[1:], strict=True):
        assert sorted(mine) == sorted(theirs)
        assert [mine[t].logprob for t in sorted(mine)] == pytest.approx([theirs[t].logprob for t in sorted(theirs)],
                                                                         abs=1e-5)
