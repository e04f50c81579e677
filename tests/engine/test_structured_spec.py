"""Structured output under speculative decoding (the embedded tiny model, fp32 CPU, the real V4
tokenizer): each draft position gets its own mask and the matchers roll back past the drafts, so
constrained requests give token for token the output they give without speculation, greedy and seeded,
whatever the drafter proposes (n-gram, the right tokens, grammar-invalid ones), beside free requests."""

from __future__ import annotations

import json
import re

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.engine import Engine
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir
from tests.engine.test_structured_output import CONSTRAINTS, REGEX, SCHEMA, run_engine, summary

jsonschema = pytest.importorskip("jsonschema")

K = 4


def make_engine(spec: dict | None, async_scheduling: bool = False) -> Engine:
    if spec is not None:  # these tests check the verification machinery: verify every draft
        spec = {"draft_length_policy": "fixed", **spec}
    return LLM(str(embedded_tiny_model_dir()), max_model_len=256, max_num_seqs=16, num_kv_blocks=40, device="cpu",
               async_scheduling=async_scheduling, speculative_config=spec).engine


@pytest.fixture(scope="module")
def plain() -> Engine:
    return make_engine(None)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "read-late"])
def speculative(request) -> Engine:
    """Verify steps read at once, or read late (`async_scheduling`: the outputs of a step are built after
    the next one launches, the matchers advanced before it is scheduled)."""
    return make_engine({"method": "ngram", "num_speculative_tokens": K}, async_scheduling=request.param)


REQUESTS = {
    "json-greedy": SamplingParams(max_tokens=60, temperature=0, structured_outputs=CONSTRAINTS["json"]),
    "json-seeded": SamplingParams(max_tokens=60, seed=4, structured_outputs=CONSTRAINTS["json"]),
    "regex-greedy": SamplingParams(max_tokens=30, temperature=0, structured_outputs=CONSTRAINTS["regex"]),
    "regex-seeded": SamplingParams(max_tokens=30, seed=9, structured_outputs=CONSTRAINTS["regex"]),
    "ebnf-seeded": SamplingParams(max_tokens=30, seed=2, structured_outputs=CONSTRAINTS["ebnf"]),
    "free-greedy": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    "free-seeded": SamplingParams(max_tokens=20, seed=5, ignore_eos=True),
}


@pytest.fixture(scope="module")
def reference(plain: Engine) -> dict:
    done = run_engine(plain, REQUESTS)
    for name in ("json-greedy", "json-seeded"):
        assert done[name].finish_reason == "stop"
        jsonschema.validate(json.loads(done[name].text), SCHEMA)
    for name in ("regex-greedy", "regex-seeded"):
        assert done[name].finish_reason == "stop" and re.fullmatch(REGEX, done[name].text)
    return done


class ScriptedDrafter:
    """Proposes the reference run's next tokens (`offset` 0: always accepted) or each shifted by
    `offset` (wrong, and mostly tokens the grammar rejects)."""

    def __init__(self, reference: dict, offset: int, vocab: int) -> None:
        self.reference, self.offset, self.vocab = reference, offset, vocab

    def propose(self, seq, max_drafts):
        future = list(self.reference[seq.request_id].token_ids[seq.num_output_tokens :][:max_drafts])
        return [(t + self.offset) % self.vocab for t in future], None


def count_constrained_drafts(engine: Engine, monkeypatch) -> list[int]:
    """Per constrained request of each plan, the drafts it verified (plans read at once or late)."""
    counts, run = [], engine.executor.execute_model

    def record(plan):
        counts.extend(r.num_draft_tokens for r in plan.requests if r.grammar_row is not None)
        return run(plan)
    monkeypatch.setattr(engine.executor, "execute_model", record)
    return counts


@pytest.mark.parametrize("drafter", ["ngram", "oracle", "wrong", "grammar-invalid"])
def test_constrained_output_is_identical_with_speculation(speculative, reference, drafter, monkeypatch) -> None:
    vocab = speculative.model_config.vocab_size
    if drafter != "ngram":
        offset = {"oracle": 0, "wrong": 1, "grammar-invalid": vocab // 2}[drafter]
        monkeypatch.setattr(speculative.speculator, "drafter", ScriptedDrafter(reference, offset, vocab))
    counts = count_constrained_drafts(speculative, monkeypatch)
    accepted_before = speculative.speculator.totals.num_accepted_tokens
    done = run_engine(speculative, REQUESTS)
    assert summary(done) == summary(reference)  # free batch-mates included
    assert any(counts)  # constrained requests verified drafts
    if drafter == "oracle":  # drafts of constrained rows are accepted: the rows after them were masked right
        assert speculative.speculator.totals.num_accepted_tokens - accepted_before >= sum(counts) > 0


def test_matchers_continue_identically_over_many_steps(plain, speculative, monkeypatch) -> None:
    """Long answers (any JSON object, whitespace free) whose n-gram drafts repeat: every step's
    matcher state is the one without speculation, so the outputs never part and `accept` never raises."""
    params = {f"obj{i}": SamplingParams(max_tokens=120, seed=i, structured_outputs=CONSTRAINTS["json"])
              for i in range(3)}
    params["obj-greedy"] = SamplingParams(max_tokens=120, temperature=0,
                                          structured_outputs=CONSTRAINTS["json"])
    alone = run_engine(plain, params)
    counts = count_constrained_drafts(speculative, monkeypatch)
    together = run_engine(speculative, params)
    assert summary(together) == summary(alone)
    assert all(c.finish_reason != "error" for c in together.values()) and any(counts)


def test_draft_rows_are_the_masks_after_each_draft(plain: Engine) -> None:
    """`next_token_bitmask` with drafts: row j is the mask after drafts 0 .. j - 1 (a fresh matcher
    stepped by hand), the rows after a rejected draft are free, and the matcher is where it started."""
    manager, tokenizer = plain.structured_output, plain.tokenizer.hf
    xgr = pytest.importorskip("xgrammar")
    manager.track("d", manager.submit(CONSTRAINTS["regex"]), [0, 5])
    compiled = manager.wait(CONSTRAINTS["regex"])
    manager.pop_failed()
    good = tokenizer.encode("ab-12", add_special_tokens=False).ids
    bad = tokenizer.encode("!", add_special_tokens=False).ids[0]
    assert manager.accept("d", good[0], 0) is False
    before = manager.next_token_bitmask(["d"])
    drafts = (*good[1:], bad, good[-1])
    masks = manager.next_token_bitmask(["d"], [drafts])
    assert masks.shape[0] == len(drafts) + 1
    hand = xgr.GrammarMatcher(compiled)
    hand.accept_token(good[0])
    expected = xgr.allocate_token_bitmask(len(drafts) + 1, manager.vocab_size)
    for j, token in enumerate(drafts[: len(good)]):  # through the rejected draft's row
        hand.fill_next_token_bitmask(expected, j)
        if token != bad:
            assert hand.accept_token(token)
    assert torch.equal(masks, expected)
    assert torch.equal(masks[len(good) :], masks.new_full(masks[len(good) :].shape, -1))
    assert torch.equal(manager.next_token_bitmask(["d"]), before)  # rolled back
    batch = [f"b{i}" for i in range(8)]  # enough rows for xgrammar's batch fill
    for seq_id in batch:
        manager.track(seq_id, manager.submit(CONSTRAINTS["regex"]), [0, 5])
    manager.pop_failed()
    for seq_id in batch:
        manager.accept(seq_id, good[0], 0)
    assert torch.equal(manager.next_token_bitmask(batch, [drafts] * 8), masks.repeat(8, 1))
    assert manager.accept("d", good[1], 1) is False  # and it continues from there
    for seq_id in ["d", *batch]:
        manager.remove(seq_id)


def test_a_think_end_draft_starts_the_grammar_on_the_rows_after_it(plain: Engine) -> None:
    manager, tokenizer = plain.structured_output, plain.tokenizer.hf
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    manager.track("t", manager.submit(CONSTRAINTS["regex"]), [0, 5, think])
    manager.wait(CONSTRAINTS["regex"])
    manager.pop_failed()
    good = tokenizer.encode("ab", add_special_tokens=False).ids
    masks = manager.next_token_bitmask(["t"], [(7, end, *good)])
    free_rows, start = masks[:2], masks[2]
    assert torch.equal(free_rows, free_rows.new_full(free_rows.shape, -1))  # still thinking
    manager.track("r", manager.submit(CONSTRAINTS["regex"]), [0, 5])
    manager.pop_failed()
    assert torch.equal(start, manager.next_token_bitmask(["r"])[0])  # the grammar's start
    assert torch.equal(masks[2:], manager.next_token_bitmask(["r"], [tuple(good)]))
    for position, token in enumerate((7, end, *good)):  # the matcher was not advanced by the fill
        manager.accept("t", token, position)
    for seq_id in ("t", "r"):
        manager.remove(seq_id)
