"""Cutting a step to the rows later layers need (`models/row_trim.py`): the rows, metadata and rules."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.models.deepseek_v4.row_trim import (
    TrimmedStep,
    drops_rows,
    kept_logits_rows,
    replay_keep_from,
)
from deepinfer_core.models.interface import ForwardContext


def step(starts: list[int], lens: list[int], window_starts: list[int] | None = None) -> ForwardContext:
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    metadata = AttentionMetadata(
        query_start_loc=offsets, start_positions=torch.tensor(starts), positions=positions,
        slots=torch.arange(len(lens)) + 10, block_tables=torch.arange(len(lens)).view(-1, 1),
        query_lens=lens, start_positions_host=starts, window_start_positions_host=window_starts,
        window_starts=torch.tensor(window_starts) if window_starts else None, max_seq_len=max(s + n for s, n in zip(starts, lens)))
    return ForwardContext(metadata=metadata, input_ids=positions + 1000, rope={"main": (positions.float(),) * 3},
                          num_entries={4: torch.tensor(starts) // 4}, no_write_before=torch.tensor(starts) * 2,
                          replay_hits=[7, 8, 9])


def test_replay_keeps_one_window_less_a_layer_and_nothing_without_a_hit():
    assert replay_keep_from([512, 0, 100], 0, 3, 128) == [128, 0, 0]
    assert replay_keep_from([512, 0, 300], 1, 3, 128) == [256, 0, 44]
    assert replay_keep_from([512, 0, 300], 2, 3, 128) == [384, 0, 172]


def test_a_trimmed_step_keeps_each_request_tail_and_drops_requests_keeping_nothing():
    ctx = step([100, 0, 50], [20, 5, 10], window_starts=[90, 0, 0])
    keep = [110, 5, 40]  # request 1 keeps nothing (its rows end at 4); request 2 keeps all
    assert drops_rows(ctx.metadata, keep) and not drops_rows(ctx.metadata, [0, 0, 50])
    trim = TrimmedStep.build(ctx, keep)
    assert trim.kept == [0, 2] and trim.seqs.tolist() == [0, 2]
    expected_rows = list(range(10, 20)) + list(range(25, 35))
    assert trim.rows.tolist() == expected_rows
    meta = trim.ctx.metadata
    assert meta.query_lens == [10, 10] and meta.start_positions_host == [110, 50]
    assert meta.query_start_loc.tolist() == [0, 10, 20] and meta.positions.tolist() == [*range(110, 120), *range(50, 60)]
    assert meta.window_start_positions_host == [110, 40] and meta.window_starts.tolist() == [110, 40]
    assert meta.slots.tolist() == [10, 12] and meta.block_tables.view(-1).tolist() == [0, 2]
    assert trim.ctx.input_ids.tolist() == (ctx.input_ids[expected_rows]).tolist()
    assert trim.ctx.replay_hits == [7, 9] and trim.ctx.no_write_before.tolist() == [200, 100]
    assert trim.ctx.num_entries[4].tolist() == [25, 12]
    assert trim.take(torch.arange(35) * 2).tolist() == [2 * r for r in expected_rows]
    assert trim.logits_rows(torch.tensor([19, 34])).tolist() == [9, 19]


def test_logits_of_a_dropped_row_are_an_error_not_a_wrong_row():
    rows = torch.tensor([3, 4, 5])
    assert kept_logits_rows(rows, 6, torch.tensor([5])).tolist() == [2]
    with pytest.raises(RuntimeError, match="dropped a row"):
        kept_logits_rows(rows, 6, torch.tensor([1]))
