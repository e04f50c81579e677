"""Paged-cache addressing every backend and model shares: entries read back from block tables, the static
bound of a step's sequence lengths, and the per-request rings (window, compressor tails) written each step.

Plain tensor code, the one definition of these rules (the reference backends and the models import it).
"""

from __future__ import annotations

import torch

from deepinfer_core.backends.attention import AttentionMetadata


def gather_entries(pool: torch.Tensor, block_table: torch.Tensor, count: int, entries_per_block: int) -> torch.Tensor:
    """A request's first `count` paged entries, in order: `[count, width]`."""
    ids = torch.arange(count, device=pool.device)[None]
    return gather_rows(pool, block_table[None], ids, entries_per_block)[0]


def gather_rows(pool: torch.Tensor, block_tables: torch.Tensor, ids: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """Rows of per-request entry numbers `ids` `[B, n]` (>= 0) -> `[B, n, width]`; pages past a request's
    table read its first block (callers mask them)."""
    pages = block_tables.gather(1, (ids // entries_per_block).clamp(max=block_tables.shape[1] - 1)).clamp(min=0)
    return pool[pages * entries_per_block + ids % entries_per_block]


def max_seq_len(metadata: AttentionMetadata) -> int:
    """The static bound when set, else the batch's own (host lists are valid outside graphs)."""
    if metadata.max_seq_len or metadata.needs_static_shapes:
        return metadata.max_seq_len
    return max(a + n for a, n in zip(metadata.start_positions_host, metadata.query_lens))


def write_rings(metadata: AttentionMetadata, *rings_and_rows: torch.Tensor) -> None:
    """Store this step's rows in per-request rings (`ring[slot, position % len]`), given as pairs
    `ring, rows` of equal ring length; only each request's last `len` rows are written, so no two rows
    target one ring slot (and decode steps need no masking, which keeps them graph-safe)."""
    ring = rings_and_rows[0].shape[1]
    positions, slots = metadata.positions, metadata.slots
    live = None
    if metadata.needs_static_shapes and not metadata.is_decode_only:
        # a verification step under CUDA graphs: k + 1 rows a request, no more than any ring holds
        # (`check_ring_sizes`), so every row is written, without a mask
        slots = slots.repeat_interleave(len(positions) // metadata.num_seqs)
    elif not metadata.is_decode_only:
        lens = metadata.query_start_loc.diff()
        live = positions >= (metadata.start_positions + lens).repeat_interleave(lens) - ring
        positions, slots = positions[live], slots.repeat_interleave(lens)[live]
    for target, rows in zip(rings_and_rows[::2], rings_and_rows[1::2]):
        target[slots, positions % ring] = (rows if live is None else rows[live]).to(target.dtype)
