"""Sequence: token counts, prefill/decode state, seeds, and resetting cache state."""

import pytest

from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sched.sequence import Sequence, SequenceStatus


def make_seq(prompt=(1, 2, 3), **kwargs) -> Sequence:
    return Sequence("r", list(prompt), SamplingParams(), **kwargs)


def test_counts_follow_appended_tokens():
    seq = make_seq([5, 6, 7])
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    seq.append_token(9)
    seq.append_token(8)
    assert seq.token_ids == [5, 6, 7, 9, 8]
    assert seq.prompt_token_ids == [5, 6, 7]
    assert seq.output_token_ids == [9, 8]
    assert (seq.num_tokens, seq.num_output_tokens, seq.last_token_id) == (5, 2, 8)


def test_prompt_list_is_copied():
    prompt = [1, 2]
    seq = Sequence("r", prompt, SamplingParams())
    seq.append_token(3)
    prompt.append(99)
    assert seq.prompt_token_ids == [1, 2]
    assert seq.token_ids == [1, 2, 3]


def test_is_prefill_until_one_token_is_left():
    seq = make_seq([1, 2, 3, 4])
    assert seq.is_prefill and seq.num_uncomputed_tokens == 4
    seq.num_computed_tokens = 2
    assert seq.is_prefill
    seq.num_computed_tokens = 3  # a chunk stopped one short: the last token is a decode
    assert not seq.is_prefill
    seq.num_computed_tokens = 4
    seq.append_token(7)
    assert not seq.is_prefill and seq.num_uncomputed_tokens == 1


def test_single_token_prompt_is_not_prefill():
    assert not make_seq([42]).is_prefill


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence("r", [], SamplingParams())


def test_seed_explicit_then_params_then_random():
    assert make_seq(seed=7).seed == 7
    assert Sequence("r", [1], SamplingParams(seed=11)).seed == 11
    assert Sequence("r", [1], SamplingParams(seed=11), seed=3).seed == 3
    seeds = {make_seq().seed for _ in range(8)}
    assert len(seeds) > 1  # random when nobody chose one
    assert all(0 <= s < 2**64 for s in seeds)


def test_new_sequence_holds_nothing():
    seq = make_seq(arrival_time=12.5)
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert seq.arrival_time == 12.5
    assert (seq.num_computed_tokens, seq.block_table, seq.slot) == (0, [], None)
    assert (seq.num_cached_tokens, seq.replay_start, seq.no_write_before) == (0, 0, 0)


@pytest.mark.parametrize("status", list(SequenceStatus))
def test_is_finished_only_for_finished_states(status):
    seq = make_seq()
    seq.status = status
    assert seq.is_finished == status.name.startswith("FINISHED_")
    assert status.is_finished == (status not in (SequenceStatus.WAITING, SequenceStatus.RUNNING))


def test_reset_cache_state_keeps_tokens():
    seq = make_seq([1, 2, 3])
    seq.append_token(4)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens, seq.slot = 3, 2
    seq.num_cached_tokens = seq.no_write_before = 128
    seq.replay_start = 0
    seq.reset_cache_state()
    assert seq.status is SequenceStatus.WAITING
    assert (seq.num_computed_tokens, seq.slot, seq.num_cached_tokens, seq.no_write_before) == (0, None, 0, 0)
    assert seq.token_ids == [1, 2, 3, 4] and seq.output_token_ids == [4]


def test_a_grammar_waits_for_the_host_unless_its_mask_is_deferred():
    from deepinfer_core.plan import PENDING_TOKEN
    from deepinfer_core.sampling_params import StructuredOutputsParams

    shaped = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    penalised = SamplingParams(presence_penalty=1.0, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    waits = {}
    for name, params, defers in (("shaped", shaped, False), ("deferred", shaped, True), ("penalised", penalised, True)):
        seq = Sequence("r", [1, 2], params, defers_grammar_mask=defers)
        seq.append_token(PENDING_TOKEN)
        waits[name] = seq.waits_for_host
    assert waits == {"shaped": True, "deferred": False, "penalised": True}  # penalties read the ids themselves
