"""DeepSeek-V4.1's decoder-side trimming (research-v41.md §6), an option that is off by default.

Once the trim point (the candidate source layer: 20 in the release) has written its compressed entries
and index keys for every row of a prefill step, the rest of that layer and every later layer run only
on the rows the request will need again: its last `sliding_window` prompt positions (the window the
first decode token reads) and everything after them. A request's rows before its `keep_from` position
never reach those layers, so their window keys there are never written; kept rows' window attention in
those layers therefore starts at `keep_from` (raised window start), which makes the outcome the same
however the prompt is chunked, preempted and recomputed, or hit in the prefix cache. Not exact: kept
rows lose the receptive field the dropped rows gave them in the later layers.

`trim_layer` checks a layer plan can be trimmed, `first_kept_positions` is the runner's per-request
rule, and `TrimmedStep` cuts a step's flat tensors and metadata down to the kept rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.config import ConfigError
from deepinfer_core.models.interface import ForwardContext
from deepinfer_core.models.v41_plan import V41LayerPlan


def trim_layer(plans: Sequence[V41LayerPlan]) -> int:
    """The layer after whose compressor the step keeps only the kept rows: the candidate source.

    Raises `ConfigError` naming `decoder_trimming` when the plan has no candidate source, or when a later
    layer owns state that every row must write (a compressor, Engram, the token-id pool)."""
    sources = [p.index for p in plans if getattr(p, "is_candidate_source", False)]
    if not sources:
        raise ConfigError("decoder_trimming=True needs a DeepSeek-V4.1 layer plan with a candidate source layer "
                          "(candidate_source_layer_id >= 0): it is where trimming starts; leave decoder_trimming off")
    layer = sources[0]
    for plan in plans[layer + 1 :]:
        owned = [name for name, has in (("a compressor", plan.role == "full"), ("Engram", plan.has_engram),
                                        ("the token-id pool", plan.holds_token_ids)) if has]
        if owned:
            raise ConfigError(f"decoder_trimming=True: layer {plan.index} comes after the trim point (layer {layer}) "
                              f"and owns {' and '.join(owned)}, whose state every row must write; leave "
                              "decoder_trimming off for this model")
    return layer


def first_kept_positions(num_prompt_tokens: int, wants_prompt_logprobs: bool, num_kept: int) -> int:
    """The first position of a request that runs the layers after the trim point: its prompt's last
    `num_kept` positions onwards (generated tokens, recomputed after a preemption too, always run them);
    0 for requests asking for prompt logprobs, which are never trimmed."""
    return 0 if wants_prompt_logprobs else max(0, num_prompt_tokens - num_kept)


@dataclass
class TrimmedStep:
    """The kept rows of one step: `rows` (flat indices of the full step), the requests that keep any
    (`seqs`) and the `ForwardContext` of the step made of only those rows."""

    rows: torch.Tensor
    seqs: torch.Tensor
    ctx: ForwardContext
    num_tokens: int
    """Rows of the full step (to map its logits rows)."""

    @classmethod
    def build(cls, ctx: ForwardContext) -> TrimmedStep:
        """Cut `ctx` (whose `keep_from` is set) to the kept rows. A request keeps its positions from
        `max(start, keep_from)` to the end of its step; one keeping none leaves the step."""
        meta = ctx.metadata
        offsets = meta.query_start_loc.tolist()
        rows, seqs, lens, firsts, window_firsts = [], [], [], [], []
        for i, (start, num, keep) in enumerate(zip(meta.start_positions_host, meta.query_lens, ctx.keep_from)):
            first = max(start, keep)
            if first >= start + num:
                continue
            rows += range(offsets[i] + first - start, offsets[i] + num)
            seqs.append(i)
            lens.append(start + num - first)
            firsts.append(first)
            window_start = meta.window_start_positions_host[i] if meta.window_start_positions_host else 0
            window_firsts.append(max(window_start, keep))  # no window key below keep_from was written there
        device = meta.positions.device
        row_t, seq_t = (torch.tensor(v, dtype=torch.long).to(device, non_blocking=True) for v in (rows, seqs))
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
        )
        return cls(row_t, seq_t, trimmed, len(meta.positions))

    @property
    def is_empty(self) -> bool:
        """No request keeps a row: the layers after the trim point have nothing to run."""
        return len(self.seqs) == 0

    def take(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """A per-row tensor's kept rows."""
        return None if tensor is None else tensor[self.rows]

    def logits_rows(self, logits_indices: torch.Tensor) -> torch.Tensor:
        """Full-step logits rows as rows of the kept step; every one of them must have been kept."""
        kept = torch.full((self.num_tokens,), -1, dtype=torch.long, device=self.rows.device)
        kept[self.rows] = torch.arange(len(self.rows), device=self.rows.device)
        mapped = kept[logits_indices]
        if bool((mapped < 0).any()):
            raise RuntimeError("decoder-side trimming dropped a row the step computes logits for")
        return mapped
