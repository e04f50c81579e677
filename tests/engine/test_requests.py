"""The request registry: seeds, sequence owners, and what removing a request forgets."""

from __future__ import annotations

import random

from deepinfer_core.engine.requests import RequestRegistry
from deepinfer_core.sampling_params import SamplingParams


class _Recorder:
    """Stands in for the structured-output manager and the speculator: records what is tracked."""

    def __init__(self) -> None:
        self.tracked: dict[str, object] = {}

    def track(self, seq_id, *args) -> None:
        self.tracked[seq_id] = args

    def remove(self, seq_id) -> None:
        self.tracked.pop(seq_id, None)

    forget = remove


def test_seeds_come_from_the_engine_seed_and_count_up_per_completion():
    registry = RequestRegistry(7, _Recorder(), None)
    request = registry.create("a", None, [1, 2, 3], SamplingParams(n=3), defers_grammar_mask=False)
    base = random.Random(7).getrandbits(63)
    assert [c.seq.seed for c in request.completions] == [base, base + 1, base + 2]
    assert request.seq_ids == ["a#0", "a#1", "a#2"]
    given = registry.create("b", None, [1], SamplingParams(seed=5), defers_grammar_mask=False)
    assert [c.seq.seed for c in given.completions] == [5]
    after = registry.create("c", None, [1], SamplingParams(), defers_grammar_mask=False)
    rng = random.Random(7)
    rng.getrandbits(63)
    assert after.completions[0].seq.seed == rng.getrandbits(63)  # a given seed draws nothing


def test_remove_forgets_owners_grammars_and_drafts():
    grammars, speculator = _Recorder(), _Recorder()
    registry = RequestRegistry(0, grammars, speculator)
    request = registry.create("r", "hi", [4, 5], SamplingParams(n=2, logprobs=1, prompt_logprobs=0),
                              defers_grammar_mask=False)
    registry.register(request, grammar="compiling")
    assert registry.request_of("r#1") is request and set(grammars.tracked) == set(speculator.tracked) == {"r#0", "r#1"}
    assert request.prompt_logprobs == [None, None] and request.completions[0].logprobs == []
    assert request.metrics.spec_decode is not None
    assert registry.remove("r") is request
    assert not registry.requests and not registry.seq_owner and not grammars.tracked and not speculator.tracked
    assert registry.remove("r") is None
