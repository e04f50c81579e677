"""The compressed-entry closing rule: which tokens close which entries, and where each entry's rows are."""

from __future__ import annotations

import torch

from deepinfer_core.backends.attention import AttentionMetadata
from deepinfer_core.backends.compressed_entries import closing_entries


def metadata(starts: list[int], lens: list[int], slots: list[int], static: bool = False) -> AttentionMetadata:
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
        start_positions=torch.tensor(starts), positions=positions, slots=torch.tensor(slots),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.long), query_lens=lens, start_positions_host=starts,
        needs_static_shapes=static)


def test_the_token_ending_a_window_closes_its_entry_unless_it_is_cached():
    # request 0: positions 2..9 (rate 4 closes entries 0 at 3 and 1 at 7); request 1: 0..5, entry 0 cached
    meta = metadata([2, 0], [8, 6], [3, 5])
    closing = closing_entries(meta, 4, no_write_before=torch.tensor([0, 4]))
    assert closing.token.tolist() == [1, 5]  # request 1's position 3 closes an entry already cached
    assert closing.entry.tolist() == [0, 1] and closing.seq.tolist() == [0, 0] and closing.keep.all()


def test_static_shapes_give_every_token_a_row_and_keep_only_the_closing_ones():
    meta = metadata([2, 0], [8, 6], [3, 5], static=True)
    closing = closing_entries(meta, 4, no_write_before=torch.tensor([0, 4]))
    assert closing.token.tolist() == list(range(14))
    assert closing.token[closing.keep].tolist() == [1, 5]  # the same entries as found on the host
    assert closing.seq.tolist() == [0] * 8 + [1] * 6


def test_window_rows_read_the_step_where_it_holds_them_and_the_ring_before_it():
    meta = metadata([6], [4], [2])  # positions 6..9; rate 4 closes entry 1 at position 7 (rows 4..7)
    closing = closing_entries(meta, 4, no_write_before=torch.tensor([0]))
    in_step, flat, (slot, ring_row) = closing.window_rows(meta, 4, ring=8)
    assert in_step.squeeze(-1).tolist() == [[False, False, True, True]]  # 4 and 5 came before the step
    assert flat[0, 2:].tolist() == [0, 1]  # positions 6 and 7 are the step's rows 0 and 1
    assert slot.tolist() == [[2]] and ring_row.tolist() == [[4, 5, 6, 7]]
    # an overlapping span of 2 * rate reaches back one more window
    in_step, _, (_, ring_row) = closing.window_rows(meta, 8, ring=8)
    assert ring_row.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]] and int(in_step.sum()) == 2
