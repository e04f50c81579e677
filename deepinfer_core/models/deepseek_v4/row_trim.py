"""Cutting a step down to the rows later layers still need, and the rules that say which rows.

Two models drop rows part-way through a prefill step: DeepSeek-V4.1's decoder-side trimming
(`v41_trim`, approximate, an option) and V4's exact replay after a prefix-cache hit
(`replay_keep_from`, exact, always on). Both hand `TrimmedStep.build` a per-request first kept position.
A request's rows before it never reach the later layers, so their window keys there are never written;
kept rows' window attention starts at the kept position (raised window start).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.models.interface import ForwardContext


def replay_keep_from(hits: list[int], layer: int, num_layers: int, sliding_window: int) -> list[int]:
    """Exact SWA replay's rows per layer ("triangular" replay). A hit at H replays from
    `H - num_layers * sliding_window`, because layer 0's window keys below H feed layer 1's through one
    window, and so on up. Layer `l` itself needs its input only from `H - (num_layers - l) * sliding_window`
    on: its window keys from there, and the outputs from one window higher, which layer `l + 1` reads.
    Per request (hit 0: no replay), the first position layer `layer` must run."""
    reach = (num_layers - layer) * sliding_window
    return [max(0, hit - reach) if hit else 0 for hit in hits]


def drops_rows(metadata: AttentionMetadata, keep_from: list[int]) -> bool:
    """True when some request of the step has rows before its first kept position."""
    return any(keep > start for keep, start in zip(keep_from, metadata.start_positions_host))


@dataclass
class TrimmedStep:
    """The kept rows of one step: `rows` (flat indices of the step it was cut from), the requests that
    keep any (`seqs`, and `kept` on the host) and the `ForwardContext` of only those rows."""

    rows: torch.Tensor
    seqs: torch.Tensor
    kept: list[int]
    ctx: ForwardContext
    num_tokens: int
    """Rows of the step it was cut from (to map its logits rows)."""

    @classmethod
    def build(cls, ctx: ForwardContext, keep_from: list[int]) -> TrimmedStep:
        """Cut `ctx` to the kept rows: a request keeps its positions from `max(start, keep_from)` to the
        end of its step; one keeping none leaves the step. Reads host lists only (no device sync)."""
        meta = ctx.metadata
        offsets = [0, *accumulate(meta.query_lens)]
        shifts, kept, lens, firsts, window_firsts = [], [], [], [], []
        num_kept = 0
        for i, (start, num, keep) in enumerate(zip(meta.start_positions_host, meta.query_lens, keep_from)):
            first = max(start, keep)
            if first >= start + num:
                continue
            kept.append(i)
            shifts.append(offsets[i] + first - start - num_kept)  # kept row j sits at full row j + shift
            lens.append(start + num - first)
            num_kept += lens[-1]
            firsts.append(first)
            window_start = meta.window_start_positions_host[i] if meta.window_start_positions_host else 0
            window_firsts.append(max(window_start, keep))  # no window key below it was written there
        device = meta.positions.device
        shift_t, len_t, seq_t = (torch.tensor(v, dtype=torch.long).to(device, non_blocking=True)
                                 for v in (shifts, lens, kept))
        row_t = torch.arange(num_kept, device=device) + torch.repeat_interleave(shift_t, len_t, output_size=num_kept)
        has_window_starts = any(window_firsts)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, *accumulate(lens)], dtype=torch.long).to(device),
            start_positions=torch.tensor(firsts, dtype=torch.long).to(device),
            positions=meta.positions[row_t], slots=meta.slots[seq_t], block_tables=meta.block_tables[seq_t],
            query_lens=lens, start_positions_host=firsts,
            window_start_positions_host=window_firsts if has_window_starts else None,
            window_starts=torch.tensor(window_firsts, dtype=torch.long).to(device) if has_window_starts else None,
            max_seq_len=meta.max_seq_len,
        )
        trimmed = ForwardContext(
            metadata=metadata, input_ids=ctx.input_ids[row_t],
            rope={name: tuple(t[row_t] for t in tables) for name, tables in ctx.rope.items()},
            num_entries={rate: n[seq_t] for rate, n in ctx.num_entries.items()},
            no_write_before=ctx.no_write_before[seq_t], parallel=ctx.parallel,
            replay_hits=[ctx.replay_hits[i] for i in kept] if ctx.replay_hits is not None else None,
        )
        return cls(row_t, seq_t, kept, trimmed, len(meta.positions))

    @property
    def is_empty(self) -> bool:
        """No request keeps a row: the later layers have nothing to run."""
        return not self.kept

    def take(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """A per-row tensor's kept rows."""
        return None if tensor is None else tensor[self.rows]

    def logits_rows(self, logits_indices: torch.Tensor) -> torch.Tensor:
        """Rows of the step it was cut from as rows of the kept step; every one must have been kept."""
        return kept_logits_rows(self.rows, self.num_tokens, logits_indices)


def no_logits(logits_indices: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The logits of a step whose every row was dropped before the last layer: it may ask for none."""
    if len(logits_indices):
        raise RuntimeError("a trimmed step dropped every row, yet it computes logits")
    return torch.empty(0, vocab_size, dtype=torch.float32, device=device)


def kept_logits_rows(rows: torch.Tensor, num_tokens: int, logits_indices: torch.Tensor) -> torch.Tensor:
    """`logits_indices` (rows of a `num_tokens`-row step) as indices into its kept `rows`. Raises when a
    logits row was dropped (a rule above kept too little)."""
    kept = torch.full((num_tokens,), -1, dtype=torch.long, device=rows.device)
    kept[rows] = torch.arange(len(rows), device=rows.device)
    mapped = kept[logits_indices]
    if bool((mapped < 0).any()):
        raise RuntimeError("a trimmed step dropped a row it computes logits for")
    return mapped
