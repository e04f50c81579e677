"""Context-parallel step layout: balanced pieces, which steps split, and the logits rows' order."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.distributed.context_parallel import StepLayout, balanced_pieces, piece_owner
from deepinfer_core.plan import ScheduledRequest, StepPlan
from deepinfer_core.worker.input_batch import RequestState


@pytest.mark.parametrize("size", [2, 3, 4])
def test_each_rank_gets_an_early_and_a_late_piece_of_equal_causal_work(size):
    pieces = balanced_pieces(1000, size)
    assert pieces[0][0] == 0 and pieces[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in pairwise(pieces))
    assert max(b - a for a, b in pieces) - min(b - a for a, b in pieces) <= 1
    owned = [[k for k in range(2 * size) if piece_owner(k, size) == r] for r in range(size)]
    assert owned == [[r, 2 * size - 1 - r] for r in range(size)]
    # causal work of a piece ~ its queries x the keys before them: the pairs even it out
    work = [sum(b * b - a * a for a, b in (pieces[k] for k in ks)) for ks in owned]
    assert max(work) / min(work) < 1.01
    early_only = [sum(b * b - a * a for a, b in (pieces[r],)) for r in range(size)]
    assert max(early_only) / min(early_only) > 2  # what a plain contiguous split would give


def _state(slot, prompt_len, prompt_logprobs=None):
    return RequestState(slot, [slot], prompt_len, SamplingParams(prompt_logprobs=prompt_logprobs), 0)


def test_only_prefill_steps_that_give_every_rank_tokens_split():
    decodes = StepPlan((ScheduledRequest("a", 5, (1,), True), ScheduledRequest("b", 9, (2,), True)))
    assert not StepLayout(decodes, [_state(0, 5), _state(1, 9)], 2).is_split
    prefill = StepPlan((ScheduledRequest("a", 0, tuple(range(3)), True),))
    layout = StepLayout(prefill, [_state(0, 3)], 2)
    # 3 tokens in 4 pieces: piece 0 is empty, rank 1 owns pieces 1 and 2, rank 0 piece 3
    assert layout.is_split and [[(p.offset, p.length) for p in ps] for ps in layout.pieces] == [[(2, 1)], [(0, 1), (1, 1)]]
    assert not StepLayout(StepPlan((ScheduledRequest("a", 0, (4,), True),)), [_state(0, 1)], 2).is_split


def test_the_gathered_logits_rows_follow_the_whole_plans_order():
    plan = StepPlan((ScheduledRequest("a", 0, tuple(range(10)), True), ScheduledRequest("b", 4, (3,), True),
                     ScheduledRequest("c", 0, tuple(range(8)), False)))
    states = [_state(0, 10, prompt_logprobs=1), _state(1, 4), _state(2, 20, prompt_logprobs=0)]
    layout = StepLayout(plan, states, 2)
    local_plan, local_states = layout.local_plan(1)
    assert [(r.start, r.num_tokens, r.is_sampled) for r in local_plan.requests] == [(2, 3, False), (5, 2, False), (2, 2, False), (4, 2, False)]
    assert [s.slot for s in local_states] == [0, 1, 2, 3]  # each piece its own scratch ring
    order, sampled, spans = layout.gather_order()
    assert sampled == [0, 1]  # "c" ends short of its prompt: not sampled
    # rows: a's and b's samples, then a's 9 prompt rows (positions 0..8), then c's 8 (positions 0..7)
    assert spans == {0: (1, 2, 9), 2: (1, 11, 8)}
    width = max(len(layout.logits_rows(r)) for r in range(2))
    labels = {r * width + j: row for r in range(2) for j, row in enumerate(layout.logits_rows(r))}
    assert [labels[i] for i in order] == ([("sample", 0, 0), ("sample", 1, 0)] + [("prompt", 0, p) for p in range(9)]
                                          + [("prompt", 2, p) for p in range(8)])


def test_a_piece_shorter_than_the_ring_reads_the_pieces_before_it():
    plan = StepPlan((ScheduledRequest("a", 6, tuple(range(8)), True),))  # positions 6..13, pieces of 2
    layout = StepLayout(plan, [_state(3, 14)], 2)  # rank 0: 6..7 and 12..13; rank 1: 8..9 and 10..11
    ring = layout.ring_plan(1, 4, torch.device("cpu"))
    # gathered tails: flat (rank * 2 + piece) * 4 + row; the request's ring: slot 3 * 4 + position % 4
    # rank 1's piece 0 (before position 8: 4..7) reads 4, 5 from the request's ring and 6, 7 from rank 0's
    assert (ring.scratch_from_ring.tolist(), ring.ring_src.tolist()) == ([0, 1], [12, 13])
    # piece 1 (before 10: 6..9) reads rank 0's 6, 7 and its own piece 0's 8, 9, all from the gathered tails
    assert ring.scratch_from_gathered.tolist() == [2, 3, 4 + 2, 4 + 3, 4 + 0, 4 + 1]
    assert ring.gathered_src.tolist() == [0, 1, 0, 1, 8, 9]
    # every rank writes positions 10..13 into the request's ring: rank 1's piece 1, then rank 0's piece 1
    assert (ring.ring_dst.tolist(), ring.ring_from_gathered.tolist()) == ([14, 15, 12, 13], [12, 13, 4, 5])
    assert (ring.tail_src.tolist(), ring.tail_dst.tolist()) == ([0, 1, 2, 3], [0, 1, 4, 5])
