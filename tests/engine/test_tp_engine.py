"""Tensor parallelism over two gloo ranks gives the single-process engine's outputs, with the MTP drafter too."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from deepinfer_core.executor.mp import MultiprocExecutor
from tests.engine import parallel_workload as workload
from tests.engine.test_spec_decode import MIXED, generate, tokens
from tests.engine.test_spec_mtp import echo_weights
from tests.engine.test_spec_mtp import make_engine as mtp_engine

WEIGHTS_SEED = 11


def test_two_tensor_parallel_ranks_give_the_single_process_outputs(tmp_path):
    # each rank sums half the heads' and half the expert width's contributions, so the fp32 sums round
    # differently from one rank's: identical tokens, logprobs equal to ~1e-6
    workload.check_two_ranks_match_one(tmp_path, WEIGHTS_SEED, tensor_parallel_size=2)



PROMPTS, MAX_TOKENS = MIXED[1:], 5  # 18 and 52 tokens: prefill over several windows, then decode


def run_mtp(engine) -> tuple[dict, list, dict]:
    """Greedy tokens, every proposal the MTP drafter sent to the scheduler (request, tokens so far,
    drafts) and the engine's counters; the engine is shut down."""
    proposals, drafter = [], engine.speculator.drafter
    propose = drafter.propose

    def recorded(seq, max_drafts):
        drafts, confidences = propose(seq, max_drafts)
        proposals.append((seq.request_id, seq.num_output_tokens, list(drafts)))
        return drafts, confidences

    drafter.propose = recorded
    try:
        return tokens(generate(engine, PROMPTS, MAX_TOKENS, temperature=0)), proposals, engine.stats()
    finally:
        engine.shutdown()


@functools.cache
def single_process_mtp(k: int | None) -> tuple[dict, list, dict]:
    """`run_mtp` on one process, with the MTP drafter at `k` (None: without speculation), once a session."""
    with tempfile.TemporaryDirectory() as directory:
        if k is None:
            return tokens(generate(mtp_engine(Path(directory)), PROMPTS, MAX_TOKENS, temperature=0)), [], {}
        return run_mtp(mtp_engine(Path(directory), {"method": "mtp", "num_speculative_tokens": k}))


SPEC_COUNTERS = ("spec_drafted_tokens", "spec_verified_tokens", "spec_accepted_tokens", "spec_verify_steps",
                 "spec_acceptance_histogram", "spec_mean_acceptance_length")


@pytest.mark.parametrize("k", [1, 3])
def test_the_mtp_drafter_under_two_tensor_parallel_ranks(tmp_path, k):
    """Each rank holds half the MTP layer's heads, groups and expert width and its partial sums are
    all-reduced: the drafts the scheduler gets are the single process's, draft for draft, and greedy
    output equals decoding without speculation."""
    want, want_proposals, want_stats = single_process_mtp(k)
    engine = mtp_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": k}, tensor_parallel_size=2)
    assert isinstance(engine.executor, MultiprocExecutor) and engine.executor.world_size == 2
    got, proposals, stats = run_mtp(engine)
    assert got == want == single_process_mtp(None)[0]
    assert proposals == want_proposals and any(drafts for _, _, drafts in proposals)
    assert {c: stats[c] for c in SPEC_COUNTERS} == {c: want_stats[c] for c in SPEC_COUNTERS}
    assert stats["spec_verified_tokens"] >= stats["spec_verify_steps"] > 0  # every draft was verified


def test_accepted_mtp_drafts_under_two_tensor_parallel_ranks(tmp_path):
    """An MTP layer that predicts the target exactly (`echo_weights`): under two ranks every draft is
    accepted too, and the tokens, drafts and counters are the single process's."""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    weights = echo_weights()
    want, want_proposals, want_stats = run_mtp(mtp_engine(tmp_path / "one", spec, weights=weights))
    got, proposals, stats = run_mtp(mtp_engine(tmp_path / "two", spec, weights=weights, tensor_parallel_size=2))
    assert got == want and proposals == want_proposals
    assert {c: stats[c] for c in SPEC_COUNTERS} == {c: want_stats[c] for c in SPEC_COUNTERS}
    assert stats["spec_accepted_tokens"] == stats["spec_verified_tokens"] > 2 * stats["spec_verify_steps"] > 0


def test_mtp_with_tensor_and_expert_parallelism_is_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(NotImplementedError, match=r"tensor_parallel_size=2 with enable_expert_parallel=True"):
        mtp_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": 1}, tensor_parallel_size=2,
                   enable_expert_parallel=True)
