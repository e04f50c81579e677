"""When a compressed entry closes, and which rows it pools: the one statement of the rule, shared by the
reference layer ops' compressor (V4) and DeepSeek-V4.1's (`models/deepseek_v41/compressor.py`).

Entry `e` of a layer of compress rate `r` stands for positions `[e * r, (e + 1) * r)`; the token at
position `(e + 1) * r - 1` closes it. An entry whose window ends at or before the request's
`no_write_before` is already cached and is not rewritten. Its rows are the `span` positions ending at the
closing token (`r`, or `2 * r` for V4's overlapping CSA windows): this step's rows where the step holds
them, else the request's tail ring (`ring[slot, position % len]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.backends.attention import AttentionMetadata


@dataclass(frozen=True)
class ClosingEntries:
    """The entries a step closes, one row per closing token (`token` indexes the step's tokens)."""

    token: torch.Tensor
    """`[E]` the closing tokens; under static shapes every token of the step."""
    entry: torch.Tensor
    """`[E]` each one's entry number (-1 for a token before the first window ends, static shapes only)."""
    seq: torch.Tensor
    """`[E]` each one's request (row of the step's metadata)."""
    keep: torch.Tensor
    """`[E]` bool: the entry closes here and is not cached yet; False rows go to the pool's scratch row."""

    def window_rows(self, metadata: AttentionMetadata, span: int,
                    ring: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Where each entry's `span` rows are: `(in_step [E, span, 1] bool, flat [E, span] step rows,
        ring_at (slot [E, 1], ring row [E, span]))`; a row is read from the step where `in_step`, else the ring."""
        positions = metadata.positions
        row_pos = positions[self.token, None] - span + 1 + torch.arange(span, device=positions.device)
        in_step = (row_pos >= metadata.start_positions[self.seq, None])[..., None]
        flat = (self.token[:, None] - (positions[self.token, None] - row_pos)).clamp(min=0)
        ring_at = (metadata.slots[self.seq, None], row_pos % ring)
        return in_step, flat, ring_at


def closing_entries(metadata: AttentionMetadata, rate: int, no_write_before: torch.Tensor) -> ClosingEntries:
    """The entries of rate `rate` this step closes (see the module docstring). Under CUDA graphs
    (`needs_static_shapes`) every token yields a row, those closing nothing with `keep` False, so the
    step reads no device value on the host; otherwise only the closing tokens, found on the host."""
    positions = metadata.positions
    lens = metadata.query_start_loc.diff()
    seq = torch.repeat_interleave(torch.arange(len(lens), device=positions.device), lens,
                                  output_size=len(positions))
    entry = (positions + 1) // rate - 1
    keep = ((positions + 1) % rate == 0) & ((entry + 1) * rate > no_write_before[seq])
    if metadata.needs_static_shapes:
        return ClosingEntries(torch.arange(len(positions), device=positions.device), entry, seq, keep)
    token = keep.nonzero().squeeze(1)
    return ClosingEntries(token, entry[token], seq[token], keep[token])
