"""Structured output on the embedded tiny model (random weights, the real V4 tokenizer): every sampled
answer follows its grammar and ends by itself; unconstrained batch-mates are untouched; thinking is free;
bad grammars, slow compiles and matcher errors end cleanly."""

from __future__ import annotations

import ast
import json
import re
import threading
from dataclasses import replace

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.engine import Engine
from deepinfer_core.plan import PENDING_TOKEN
from deepinfer_core.sampling_params import StructuredOutputsParams
from deepinfer_core.structured_output.manager import GrammarError, StructuredOutputManager
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir

jsonschema = pytest.importorskip("jsonschema")

NUM_SAMPLES = 50
SCHEMA = {  # nested objects, an array, enums, bounded integer and number, required and optional fields
    "type": "object",
    "properties": {
        "k": {"enum": ["cat", "dog"]},
        "p": {"type": "object", "required": ["x"], "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "n": {"type": "number", "minimum": -1, "maximum": 1}}},
        "t": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["k", "p", "t"],
}
REGEX = r"[a-z]{2,4}-[0-9]{2}"
EBNF = 'root ::= "(" num (("+" | "*") num)? ")"\nnum ::= [0-9] | [1-9] [0-9]'
CHOICES = ["red", "green", "blue"]
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "ebnf": StructuredOutputsParams(grammar=EBNF),
    "choice": StructuredOutputsParams(choice=CHOICES),
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    """One engine for the module (its vocabulary is indexed for xgrammar once); decode overlapped, as on CUDA."""
    return LLM(str(embedded_tiny_model_dir()), max_model_len=256, max_num_seqs=256, num_kv_blocks=260, device="cpu",
               async_scheduling=True)


@pytest.fixture(scope="module")
def answers(llm: LLM) -> dict[str, list]:
    """NUM_SAMPLES answers per constraint, sampled at temperature 1 (one seed and prompt each), in one batch."""
    prompts, params = [], []
    for k, constraint in enumerate(CONSTRAINTS.values()):
        for i in range(NUM_SAMPLES):
            prompts.append({"prompt_token_ids": [0, 1000 + NUM_SAMPLES * k + i]})
            params.append(SamplingParams(max_tokens=80, seed=i, structured_outputs=constraint))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {name: [o.outputs[0] for o in outputs[NUM_SAMPLES * k : NUM_SAMPLES * (k + 1)]]
            for k, name in enumerate(CONSTRAINTS)}


def completed_texts(outputs: list) -> list[str]:
    assert [o.finish_reason for o in outputs] == ["stop"] * NUM_SAMPLES  # each ended by its grammar
    return [o.text for o in outputs]


def test_json_schema_answers_validate(answers) -> None:
    texts = completed_texts(answers["json"])
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1


def test_regex_answers_fully_match(answers) -> None:
    assert all(re.fullmatch(REGEX, text) for text in completed_texts(answers["regex"]))


def test_ebnf_answers_parse(answers) -> None:
    for text in completed_texts(answers["ebnf"]):
        tree = ast.parse(text, mode="eval").body
        numbers = [tree.left, tree.right] if isinstance(tree, ast.BinOp) else [tree]
        assert isinstance(tree, ast.BinOp | ast.Constant) and re.fullmatch(r"\(.*\)", text)
        assert all(isinstance(n, ast.Constant) and 0 <= n.value <= 99 for n in numbers)


def test_choice_answers_are_choices(answers) -> None:
    assert set(completed_texts(answers["choice"])) <= set(CHOICES)


def test_bad_constraints_are_value_errors_with_xgrammars_message(llm: LLM) -> None:
    bad = {"Unclosed '['": StructuredOutputsParams(regex="[a-"),
           'Rule "foo" is not defined': StructuredOutputsParams(grammar="root ::= foo"),
           "Type should be a string": StructuredOutputsParams(json={"type": 5})}
    for message, constraint in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate([{"prompt_token_ids": [0, 5]}], SamplingParams(structured_outputs=constraint))
        with pytest.raises(GrammarError, match=re.escape(message)):
            llm.engine.add_request("bad", [0, 5], SamplingParams(structured_outputs=constraint))
    assert not llm.engine.has_unfinished_requests()


def run_engine(engine: Engine, requests: dict[str, SamplingParams], prompt=(0, 7), gains: list | None = None,
               compile_first: bool = True) -> dict:
    """Every request to the end; `gains` gets, per step, the tokens each request decoding at its start had
    gained by its end (a pending one included). With `compile_first` the grammars are compiled before the
    requests are added, so every request is admitted at the first step whatever the machine's load (the
    steps then depend on the tokens only)."""
    if compile_first:
        engine.structured_output.wait_all([params.structured_outputs for params in requests.values()])
    for request_id, params in requests.items():
        engine.add_request(request_id, list(prompt) + [len(request_id)], params)
    done = {}
    while engine.has_unfinished_requests():
        before = {s.request_id: s.num_tokens for s in engine.scheduler.running if not s.is_prefill}
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        if gains is not None:
            gains.append({s.request_id: s.num_tokens - before[s.request_id] for s in engine.scheduler.running
                          if s.request_id in before})
    return done


@pytest.fixture(scope="module")
def overlapped_engine(llm: LLM) -> Engine:
    return llm.engine


@pytest.fixture(scope="module")
def step_by_step() -> Engine:
    """The reference: decode not overlapped, every mask filled before its step."""
    return LLM(str(embedded_tiny_model_dir()), max_model_len=256, max_num_seqs=16, num_kv_blocks=20, device="cpu",
               async_scheduling=False).engine


def free(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, seed=seed, ignore_eos=True, logprobs=2)


def count_deferred(engine: Engine, monkeypatch) -> list[str]:
    """The ids of the constrained requests of each plan whose input is the step in flight's token (their
    rows filled once that step's tokens are accepted, after `execute_model`), in order."""
    execute, deferred = engine.executor.execute_model, []

    def record(plan):
        deferred.extend(r.request_id for r in plan.requests
                        if r.grammar_row is not None and r.token_ids[-1] == PENDING_TOKEN)
        return execute(plan)

    monkeypatch.setattr(engine.executor, "execute_model", record)
    return deferred


def summary(done: dict) -> dict:
    return {request_id: (c.token_ids, c.text, c.finish_reason) for request_id, c in done.items()}


def test_overlapped_constrained_rows_decode_every_step_as_step_by_step(overlapped_engine, step_by_step,
                                                                       monkeypatch) -> None:
    requests = {"json-greedy": SamplingParams(max_tokens=60, temperature=0, structured_outputs=CONSTRAINTS["json"]),
                "json-seeded": SamplingParams(max_tokens=60, seed=4, structured_outputs=CONSTRAINTS["json"]),
                "regex-greedy": SamplingParams(max_tokens=60, temperature=0, structured_outputs=CONSTRAINTS["regex"]),
                "regex-seeded": SamplingParams(max_tokens=60, seed=9, structured_outputs=CONSTRAINTS["regex"]),
                "free": SamplingParams(max_tokens=40, seed=2, ignore_eos=True)}
    reference = run_engine(step_by_step, requests)
    deferred, gains = count_deferred(overlapped_engine, monkeypatch), []
    done = run_engine(overlapped_engine, requests, gains=gains)
    assert summary(done) == summary(reference)
    assert all(gain == 1 for step in gains for gain in step.values())  # no request sits a step out
    assert sum(len(step) for step in gains) > 60
    assert {"json-greedy", "json-seeded", "regex-greedy", "regex-seeded"} <= set(deferred)
    for name in ("json-greedy", "json-seeded"):  # each token accepted once: the answers validate
        assert done[name].finish_reason == "stop"
        jsonschema.validate(json.loads(done[name].text), SCHEMA)
    for name in ("regex-greedy", "regex-seeded"):  # complete mid-batch, while the free row goes on
        assert done[name].finish_reason == "stop" and re.fullmatch(REGEX, done[name].text)
    assert done["free"].finish_reason == "length" and len(done["free"].token_ids) == 40


def test_a_token_rejected_under_overlap_ends_that_request_alone(overlapped_engine, step_by_step, monkeypatch) -> None:
    end = overlapped_engine.tokenizer.hf.token_to_id("</think>")  # never continues the pattern
    requests = {"bad": SamplingParams(max_tokens=16, seed=5, logit_bias={end: 100.0}, structured_outputs=CONSTRAINTS["regex"]),
                "good": SamplingParams(max_tokens=16, seed=5, structured_outputs=CONSTRAINTS["regex"]),
                "free": free(0)}
    reference = run_engine(step_by_step, requests)
    manager, unmasked = overlapped_engine.structured_output, []
    plan_rows = manager.plan_rows

    def unmask_third(plan):  # "bad" samples its third token without its mask: `</think>`
        plan, grammar = plan_rows(plan)
        requests = list(plan.requests)
        for i, r in enumerate(requests):
            if r.request_id == "bad" and r.start == 4:  # its prompt has 3 tokens
                unmasked.append(grammar.is_pending)
                requests[i] = replace(r, grammar_row=None)
        return replace(plan, requests=tuple(requests)), grammar

    monkeypatch.setattr(manager, "plan_rows", unmask_third)
    done = run_engine(overlapped_engine, requests)
    assert unmasked == [True]  # the overlapped path: its mask was to be filled after launch
    assert len(reference["bad"].token_ids) > 2
    assert done["bad"].finish_reason == "error" and done["bad"].token_ids == reference["bad"].token_ids[:2]
    assert summary({k: done[k] for k in ("good", "free")}) == summary({k: reference[k] for k in ("good", "free")})


def test_thinking_ends_on_a_pending_token_under_overlap(overlapped_engine, step_by_step, monkeypatch) -> None:
    tokenizer = overlapped_engine.tokenizer.hf
    think = tokenizer.token_to_id("<think>")
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=CONSTRAINTS["choice"])
    thinking = run_engine(step_by_step, {"think": params}, prompt=(0, 5, think))["think"]
    assert thinking.finish_reason == "length"  # the model never closes its reasoning by itself
    ender = next(t for i, t in enumerate(thinking.token_ids) if i >= 3 and t not in thinking.token_ids[:i])
    cut = thinking.token_ids.index(ender) + 1
    for engine in (step_by_step, overlapped_engine):  # the reasoning ends with that token, a decode's
        monkeypatch.setattr(engine.structured_output, "_think", (think, ender))
    deferred = count_deferred(overlapped_engine, monkeypatch)
    reference = run_engine(step_by_step, {"think": params}, prompt=(0, 5, think))["think"]
    done = run_engine(overlapped_engine, {"think": params}, prompt=(0, 5, think))["think"]
    assert done.token_ids[:cut] == thinking.token_ids[:cut] and "think" in deferred
    assert done.finish_reason == "stop" and tokenizer.decode(done.token_ids[cut:]) in CHOICES
    assert summary({"think": done}) == summary({"think": reference})


def test_accept_is_idempotent_by_position(llm: LLM) -> None:
    manager, tokenizer = llm.engine.structured_output, llm.get_tokenizer()
    for seq_id in ("x", "y"):
        manager.track(seq_id, manager.submit(CONSTRAINTS["regex"]), [0, 5])
    manager.wait(CONSTRAINTS["regex"])
    manager.pop_failed()  # starts their matchers
    tokens = tokenizer.encode("ab-12") + [llm.engine.eos_token_ids[0]]
    assert manager.accept("x", tokens[0], 0) is False
    once = manager.next_token_bitmask(["x"])
    assert manager.accept("x", tokens[0], 0) is False  # already accepted: the matcher stays
    assert torch.equal(manager.next_token_bitmask(["x"]), once) and not torch.equal(once, once.new_full(once.shape, -1))
    with pytest.raises(RuntimeError, match="accepted before token 1"):
        manager.accept("x", tokens[1], 2)
    results = [manager.accept("x", token, i) for i, token in enumerate(tokens)]
    assert results == [False] * (len(tokens) - 1) + [True] and manager.accept("x", tokens[-1], len(tokens) - 1)
    for _ in range(2):  # a rejection is raised again, and the row is left free
        with pytest.raises(GrammarError, match="does not continue"):
            manager.accept("y", tokenizer.encode("!")[0], 0)
    assert torch.equal(manager.next_token_bitmask(["y", "x"]), once.new_full((2, once.shape[1]), -1))
    manager.remove("x")
    manager.remove("y")


def test_accept_many_advances_matchers_as_accept_does(llm: LLM) -> None:
    manager, tokenizer, count = llm.engine.structured_output, llm.get_tokenizer(), 4
    one, many = [f"one{i}" for i in range(count)], [f"many{i}" for i in range(count)]
    for seq_id in one + many:
        manager.track(seq_id, manager.submit(CONSTRAINTS["regex"]), [0, 5])
    manager.wait(CONSTRAINTS["regex"])
    manager.pop_failed()
    good, bad = tokenizer.encode("ab-12") + [llm.engine.eos_token_ids[0]], tokenizer.encode("!")[0]
    for position, token in enumerate(good):
        tokens = [bad if i == 1 and position == 2 else token for i in range(count)]  # row 1 is rejected
        for seq_id, t in zip(one, tokens):
            try:
                manager.accept(seq_id, t, position)
            except GrammarError:
                pass
        manager.accept_many(many, tokens, [position] * count)
        manager.accept_many(many, tokens, [position] * count)  # already accepted: skipped
        assert torch.equal(manager.next_token_bitmask(many), manager.next_token_bitmask(one))
    with pytest.raises(GrammarError, match=f"token {bad} does not continue"):
        manager.accept(many[1], bad, 2)
    assert [manager.accept(s, good[-1], len(good) - 1) for s in many if s != many[1]] == [True] * (count - 1)
    with pytest.raises(RuntimeError, match="accepted before token"):
        manager.accept_many([many[0]], [good[0]], [len(good) + 1])
    for seq_id in one + many:
        manager.remove(seq_id)


def test_a_constrained_rows_mask_row_is_its_logits_row(overlapped_engine: Engine, monkeypatch) -> None:
    """Mixed batches: each constrained request's mask row is its logits row, so the runner applies the
    mask without rearranging it (and reads only the constrained rows)."""
    from deepinfer_core.worker import runner as runner_module

    seen, apply = [], runner_module.apply_bitmask

    def spy(logits, plan, sampled, bitmask):
        seen.append([(k, plan.requests[i].grammar_row) for k, i in enumerate(sampled)
                     if plan.requests[i].grammar_row is not None])
        return apply(logits, plan, sampled, bitmask)

    monkeypatch.setattr(runner_module, "apply_bitmask", spy)
    mixed = {f"free{i}": free(i) for i in range(3)}
    mixed |= {f"re{i}": SamplingParams(max_tokens=8, seed=i, structured_outputs=CONSTRAINTS["regex"]) for i in range(3)}
    run_engine(overlapped_engine, dict(sorted(mixed.items(), key=lambda item: item[0][-1])))
    assert seen and any(pairs and pairs[0][0] > 0 for pairs in seen)  # some constrained row after a free one
    assert all(row == grammar_row for pairs in seen for row, grammar_row in pairs)


def test_unconstrained_rows_are_identical_with_constrained_batch_mates(overlapped_engine: Engine) -> None:
    alone = run_engine(overlapped_engine, {f"free{i}": free(i) for i in range(3)})
    mixed = {f"free{i}": free(i) for i in range(3)}
    mixed |= {f"re{i}": SamplingParams(max_tokens=16, seed=i, structured_outputs=CONSTRAINTS["regex"]) for i in range(3)}
    together = run_engine(overlapped_engine, dict(sorted(mixed.items(), key=lambda item: item[0][-1])))
    for i in range(3):
        assert together[f"free{i}"].token_ids == alone[f"free{i}"].token_ids
        assert together[f"free{i}"].logprobs == alone[f"free{i}"].logprobs
        assert together[f"re{i}"].finish_reason == "stop" and re.fullmatch(REGEX, together[f"re{i}"].text)


def test_thinking_is_free_and_the_grammar_constrains_the_answer(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    # the bias makes the model end its thinking at once: possible only while the grammar is off
    params = SamplingParams(max_tokens=12, seed=3, logit_bias={end: 100.0}, structured_outputs=CONSTRAINTS["choice"])
    thinking, closed, plain = (o.outputs[0] for o in llm.generate(
        [{"prompt_token_ids": ids} for ids in ([0, 5, think], [0, 5, think, 7, end], [0, 5])], params, use_tqdm=False))
    assert thinking.token_ids[0] == end and tokenizer.decode(thinking.token_ids[1:], skip_special_tokens=True) in CHOICES
    for answer in (closed, plain):  # thinking over (or off): constrained from the first token
        assert end not in answer.token_ids and answer.text in CHOICES
    assert thinking.finish_reason == closed.finish_reason == plain.finish_reason == "stop"


def test_a_matcher_error_ends_that_request_alone(overlapped_engine: Engine, monkeypatch) -> None:
    manager = overlapped_engine.structured_output
    plan_rows = manager.plan_rows

    def unmask_bad(plan):  # the request "bad" samples without its mask: the matcher rejects it
        plan, grammar = plan_rows(plan)
        return replace(plan, requests=tuple(replace(r, grammar_row=None) if r.request_id == "bad" else r
                                            for r in plan.requests)), grammar

    monkeypatch.setattr(manager, "plan_rows", unmask_bad)
    choice = CONSTRAINTS["choice"]
    done = run_engine(overlapped_engine, {"bad": SamplingParams(max_tokens=8, seed=1, structured_outputs=choice),
                                          "good": SamplingParams(max_tokens=8, seed=1, structured_outputs=choice),
                                          "free": free(0)})
    assert done["bad"].finish_reason == "error" and done["bad"].token_ids == []
    assert done["good"].finish_reason == "stop" and done["good"].text in CHOICES
    assert done["free"].finish_reason == "length" and len(done["free"].token_ids) == 8


@pytest.fixture
def stalled_compiler(overlapped_engine: Engine, monkeypatch):
    """The engine's grammar compiles block until the test ends; the timeout is 0.1 s."""
    manager = overlapped_engine.structured_output
    release = threading.Event()
    compiler = manager._get_compiler()
    monkeypatch.setattr(manager, "compile_timeout_s", 0.1)
    monkeypatch.setattr(manager, "_get_compiler", lambda: release.wait() and compiler)
    yield manager
    release.set()


def test_a_compile_timeout_ends_the_request_with_an_error(overlapped_engine: Engine, stalled_compiler) -> None:
    with pytest.raises(GrammarError, match="took longer than 0.1 s"):
        stalled_compiler.wait(StructuredOutputsParams(regex="[0-9]{3}"))
    slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    done = run_engine(overlapped_engine, {"slow": slow, "free": free(0)}, compile_first=False)
    assert done["slow"].finish_reason == "error" and done["slow"].token_ids == []
    assert done["free"].finish_reason == "length"


def test_compiles_are_cached_by_key_under_a_byte_cap(llm: LLM) -> None:
    manager = StructuredOutputManager(llm.get_tokenizer(), llm.engine.model_config.vocab_size, [1],
                                      cache_limit_bytes=1)
    first = manager.submit(StructuredOutputsParams(choice=["a", "b"]))
    assert manager.submit(StructuredOutputsParams(choice=["a", "b"])) is first  # while it is the newest
    first.result()
    manager.wait(StructuredOutputsParams(choice=["c"]))
    assert manager.submit(StructuredOutputsParams(choice=["a", "b"])) is not first  # evicted: over the cap
    manager.shutdown()
