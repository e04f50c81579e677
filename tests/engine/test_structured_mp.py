"""Structured output under worker processes: the grammar rows travel as `sample`'s data, so a
constrained request decodes every step of overlapped decode with the mp executor too, with and without
speculation, and gives the step-by-step in-process answers."""

from __future__ import annotations

import re

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.engine import Engine
from deepinfer_core.executor.mp import MultiprocExecutor
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir
from tests.engine.test_structured_output import CONSTRAINTS, REGEX, count_deferred, run_engine, summary

pytest.importorskip("xgrammar")


def make_engine(**options) -> Engine:
    return LLM(str(embedded_tiny_model_dir()), max_model_len=256, max_num_seqs=8, num_kv_blocks=40, device="cpu",
               **options).engine


@pytest.fixture(scope="module")
def step_by_step() -> Engine:
    """The reference: in-process, decode not overlapped, every mask filled before its step."""
    return make_engine(async_scheduling=False)


@pytest.fixture(scope="module")
def reference(step_by_step: Engine) -> dict:
    """`REQUESTS` answered step by step, once for the module (both parametrizations compare with it)."""
    return run_engine(step_by_step, REQUESTS)


REQUESTS = {"regex-greedy": SamplingParams(max_tokens=40, temperature=0, structured_outputs=CONSTRAINTS["regex"]),
            "regex-seeded": SamplingParams(max_tokens=40, seed=9, structured_outputs=CONSTRAINTS["regex"]),
            "choice": SamplingParams(max_tokens=40, seed=3, structured_outputs=CONSTRAINTS["choice"]),
            "free": SamplingParams(max_tokens=24, seed=2, ignore_eos=True)}
CONSTRAINED = {"regex-greedy", "regex-seeded", "choice"}


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 2}],
                         ids=["plain", "ngram"])
def test_a_constrained_request_decodes_every_step_under_worker_processes(reference, speculative,
                                                                         monkeypatch) -> None:
    engine = make_engine(async_scheduling=True, distributed_executor_backend="mp", world_size=1,
                         speculative_config=speculative)
    try:
        assert isinstance(engine.executor, MultiprocExecutor)
        deferred, gains = count_deferred(engine, monkeypatch), []
        done = run_engine(engine, REQUESTS, gains=gains)
    finally:
        engine.shutdown()
    assert summary(done) == summary(reference)
    # every step, every request decoding at its start gained a token: none sat a step out (more than
    # one: drafts accepted)
    assert all(gain >= 1 for step in gains for gain in step.values())
    if speculative is None:
        assert all(gain == 1 for step in gains for gain in step.values())
        for name in CONSTRAINED:  # steps against tokens: sitting out every other step would double them
            steps = sum(1 for step in gains if name in step)
            assert len(done[name].token_ids) - 2 <= steps <= len(done[name].token_ids)
    assert CONSTRAINED <= set(deferred)  # their input was the step in flight's token: rows filled after the forward
    for name in ("regex-greedy", "regex-seeded"):
        assert done[name].finish_reason == "stop" and re.fullmatch(REGEX, done[name].text)
    assert done["free"].finish_reason == "length" and len(done["free"].token_ids) == 24
