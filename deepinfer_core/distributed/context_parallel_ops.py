"""The context-parallel wrappers around one rank's attention backends and layer ops.

On a split step (its metadata a `ContextParallelMetadata`) they exchange what the rank's pieces need
with the other ranks of the cp group (see `deepinfer_core.distributed.context_parallel`) and call the
wrapped backend on scratch rings; on every other step they are the wrapped backend itself.
"""

from __future__ import annotations

import torch

from deepinfer_core.backends.attention import AttentionMetadata
from deepinfer_core.backends.layer_ops import CompressorWeights
from deepinfer_core.distributed.context_parallel import ContextParallelMetadata, RingPlan, StepView


def _exchange(view: StepView, rows: torch.Tensor, rings: list[torch.Tensor]):
    """All-gather every piece's last `ring` rows of `rows` (`[tokens, width]`, this rank's tokens; the
    channels of `rings`, real rings `[slots, ring, width_k]`, side by side). Returns per ring the pieces'
    scratch rings (the rows just before each piece: gathered tails, or the request's ring for positions
    before the step), the gathered tails and the plan."""
    plan = view.ring_plan(rings[0].shape[1])
    width = rows.shape[-1]
    tails = rows.new_zeros(plan.max_pieces * plan.ring, width)
    tails[plan.tail_dst] = rows[plan.tail_src]
    gathered = view.all_gather(tails).view(-1, width)
    scratches, start = [], 0
    for ring in rings:
        channels = ring.shape[-1]
        scratch = ring.new_zeros(plan.num_pieces * plan.ring, channels)
        scratch[plan.scratch_from_gathered] = gathered[plan.gathered_src, start : start + channels].to(ring.dtype)
        scratch[plan.scratch_from_ring] = ring.view(-1, channels)[plan.ring_src]
        scratches.append(scratch.view(plan.num_pieces, plan.ring, channels))
        start += channels
    return scratches, gathered, plan


def _write_rings(rings: list[torch.Tensor], gathered: torch.Tensor, plan: RingPlan) -> None:
    """Each request's real rings get its step's last rows, identically on every rank."""
    start = 0
    for ring in rings:
        channels = ring.shape[-1]
        rows = gathered[plan.ring_from_gathered, start : start + channels]
        ring.view(-1, channels)[plan.ring_dst] = rows.to(ring.dtype)
        start += channels


class ContextParallelAttention:
    """An `AttentionBackend` that, on split steps, attends a rank's pieces with the keys before them."""

    def __init__(self, inner) -> None:
        self.inner, self.spec = inner, inner.spec
        self.supports_cuda_graphs = getattr(inner, "supports_cuda_graphs", False)

    def forward(self, q, kv, window, compressed, sinks, metadata: AttentionMetadata, topk_indices=None,
                num_entries=None):
        if not isinstance(metadata, ContextParallelMetadata):
            return self.inner.forward(q, kv, window, compressed, sinks, metadata, topk_indices, num_entries)
        (scratch,), gathered, plan = _exchange(metadata.view, kv, [window])
        out = self.inner.forward(q, kv, scratch, compressed, sinks, metadata, topk_indices, num_entries)
        _write_rings([window], gathered, plan)  # after the pieces read the request's ring through `scratch`
        return out

    def indexer_topk(self, q, weights, index_keys, metadata: AttentionMetadata, num_entries):
        return self.inner.indexer_topk(q, weights, index_keys, metadata, num_entries)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class ContextParallelLayerOps:
    """`LayerOps` whose compressor closes a rank's windows from exchanged tail rows and gathers the
    entries every rank closed; the window ring is written by `ContextParallelAttention` on split steps.
    A model that closes entries itself (V4.1) calls the same exchanges through `SplitStepExchange`."""

    def __init__(self, inner) -> None:
        self.inner, self.spec = inner, inner.spec
        self.supports_cuda_graphs = getattr(inner, "supports_cuda_graphs", False)

    def write_window(self, metadata: AttentionMetadata, window, kv) -> None:
        if not isinstance(metadata, ContextParallelMetadata):
            self.inner.write_window(metadata, window, kv)

    def compress(self, kv, gate, weights: CompressorWeights, metadata: AttentionMetadata, kv_tail, gate_tail,
                 entries, no_write_before) -> None:
        if not isinstance(metadata, ContextParallelMetadata):
            self.inner.compress(kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before)
            return
        view = metadata.view
        # the tail rings hold the gate with its position bias (`LayerOps.compress`); kv and gate travel as
        # one fp32 row, which holds the activation dtype's values exactly
        biased = gate.float() + weights.position_bias[metadata.positions % weights.rate]
        (scratch_kv, scratch_gate), gathered, plan = _exchange(view, torch.cat((kv.float(), biased), dim=-1),
                                                               [kv_tail, gate_tail])
        self.inner.compress(kv, gate, weights, metadata, scratch_kv, scratch_gate, entries, no_write_before)
        _write_rings([kv_tail, gate_tail], gathered, plan)
        self.share_entries(metadata, [entries], weights.rate)

    # -- `models.interface.SplitStepExchange` -------------------------------------------------------

    def split_tail_rings(self, metadata: AttentionMetadata, kv: torch.Tensor, gate: torch.Tensor,
                         kv_tail: torch.Tensor, gate_tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not isinstance(metadata, ContextParallelMetadata):
            return None
        # kv and gate travel as one fp32 row, which holds the activation dtype's values exactly
        rows = torch.cat((kv.float(), gate.float()), dim=-1)
        (scratch_kv, scratch_gate), gathered, plan = _exchange(metadata.view, rows, [kv_tail, gate_tail])
        _write_rings([kv_tail, gate_tail], gathered, plan)  # the scratch rings already hold what pieces read
        return scratch_kv, scratch_gate

    def share_entries(self, metadata: AttentionMetadata, pools: list[torch.Tensor], rate: int) -> None:
        if not isinstance(metadata, ContextParallelMetadata):
            return
        view = metadata.view
        for pool in pools:
            table, mine = view.entry_rows(rate, pool.shape[0] - 1)
            closed = view.all_gather(pool[mine])
            pool[table.flatten()] = closed.view(-1, pool.shape[-1])

    def share_rows(self, metadata: AttentionMetadata, pool: torch.Tensor, rows: torch.Tensor,
                   values: torch.Tensor) -> None:
        if not isinstance(metadata, ContextParallelMetadata):
            pool[rows] = values
            return
        view = metadata.view
        most = max(sum(piece.length for piece in pieces) for pieces in view.layout.pieces)
        padded_rows = rows.new_full((most,), -1)
        padded_rows[: len(rows)] = rows
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[: len(values)] = values
        every_row, every_value = view.all_gather(padded_rows).flatten(), view.all_gather(padded_values).flatten(0, 1)
        real = every_row >= 0  # a split step is never captured in a graph: the host may read this mask
        pool[every_row[real]] = every_value[real].to(pool.dtype)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
