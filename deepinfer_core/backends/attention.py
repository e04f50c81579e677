"""Attention contract: sliding-window + compressed (CSA/HCA) attention with sinks, and the CSA indexer.

Cache layout the backend reads (built by `deepinfer_core.kv.cache`):

- `window`: `[num_slots, sliding_window, head_dim]`, one ring per request state slot; the key of the
  token at absolute position `p` lives at `window[slot, p % sliding_window]`. Shared K=V (MQA, one head).
- `compressed`: `[num_blocks * entries_per_block + 1, head_dim]`, the paged compressed entries (the
  last row is scratch space for graph-safe writes; never read it). Entry `e` of a
  request lives at row `block_table[e // entries_per_block] * entries_per_block + e % entries_per_block`.
  Entry `e` summarises tokens `[e * rate, (e + 1) * rate)` and is visible to the query at position `t`
  iff `e < (t + 1) // rate`.
- `index_keys` (CSA only): same paging as `compressed`, `index_head_dim` wide.

Tokens of one step are flat (`[num_tokens, ...]`), grouped by request in `AttentionMetadata` order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from deepinfer_core.backends.graphs import GraphCapturable

BLOCK_SIZE = 128
"""Positions per paged cache block: a multiple of every compress rate (CSA 4, HCA 128), so a block holds
whole compressed entries of every layer. The scheduler, block manager, cache, runner and backends all
read this one value."""


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer kind needs; the factory hook builds one backend per distinct spec."""

    num_heads: int
    """Query heads (64 in V4-Flash). K=V is a single shared head."""
    head_dim: int
    """Width of q, the shared K=V and each compressed entry (512 in V4-Flash)."""
    sliding_window: int
    """Tokens each query sees in the uncompressed window, itself included (128)."""
    compress_rate: int
    """0 for sliding-only layers, 4 for CSA, 128 for HCA."""
    index_n_heads: int = 0
    """Indexer query heads (CSA only, else 0)."""
    index_head_dim: int = 0
    """Indexer key width (CSA only, else 0)."""
    index_topk: int = 0
    """Compressed entries each query keeps after indexer scoring (CSA only, else 0)."""
    dtype: torch.dtype = torch.float32
    """Activation and cache dtype."""
    deterministic: bool = False
    """Batch-invariant mode (`EngineConfig.deterministic`): a query's output must be bit-identical
    whatever else shares the step and however its request's tokens are split into steps (prefill,
    chunked prefill, decode). A backend without such a variant declines the spec."""

    @property
    def is_sparse(self) -> bool:
        """True for CSA layers, where an indexer picks the entries a query attends."""
        return self.index_topk > 0

    @property
    def entries_per_block(self) -> int:
        """Compressed entries per `BLOCK_SIZE`-token cache block (0 for sliding-only layers)."""
        return BLOCK_SIZE // self.compress_rate if self.compress_rate else 0


@dataclass
class AttentionMetadata:
    """Flat step metadata, shared by every layer of one forward pass. Built once per step by the runner.

    All tensors live on the model's device. `num_seqs` requests contribute `query_lens[i]` consecutive
    tokens each, starting at absolute position `start_positions[i]`.
    """

    query_start_loc: torch.Tensor
    """`[num_seqs + 1]` int64: token offsets of each request in the flat batch."""
    start_positions: torch.Tensor
    """`[num_seqs]` int64: absolute position of each request's first token in this step."""
    positions: torch.Tensor
    """`[num_tokens]` int64: absolute position of every token."""
    slots: torch.Tensor
    """`[num_seqs]` int64: per-request state slot (window ring, compressor tails)."""
    block_tables: torch.Tensor
    """`[num_seqs, max_blocks]` int64: cache block ids per request, -1 padded."""
    query_lens: list[int]
    """Host copy of the per-request query lengths."""
    start_positions_host: list[int]
    """Host copy of `start_positions`."""
    window_start_positions_host: list[int] | None = None
    """Per request, the first absolute position whose window key is valid (SWA replay); None: 0."""
    window_starts: torch.Tensor | None = None
    """`[num_seqs]` int64 device copy of `window_start_positions_host`; None when all are 0."""
    needs_static_shapes: bool = False
    """True while a CUDA graph is captured or replayed: no op may depend on device values through the
    host (no `.item()`, `.tolist()`, `nonzero`, boolean indexing), and host lists are stale."""
    max_seq_len: int = 0
    """Upper bound on `start_position + query_len` over the batch (static under CUDA graphs, so a
    backend may size buffers from it without reading device tensors)."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        """True when every request contributes exactly one token."""
        return all(n == 1 for n in self.query_lens)


@runtime_checkable
class AttentionBackend(GraphCapturable, Protocol):
    """Computes one layer's attention output from queries, new keys and the layer's caches.

    Built once per distinct `AttentionSpec` by `make_attention`; called once per layer per step.
    """

    spec: AttentionSpec

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        window: torch.Tensor,
        compressed: torch.Tensor | None,
        sinks: torch.Tensor,
        metadata: AttentionMetadata,
        topk_indices: torch.Tensor | None = None,
        num_entries: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend each query over its sliding window and its visible compressed entries.

        :param q: `[num_tokens, num_heads, head_dim]`, RoPE applied.
        :param kv: `[num_tokens, head_dim]`, this step's shared K=V, RoPE applied, not yet in `window`.
        :param window: the layer's window ring `[num_slots, sliding_window, head_dim]`, holding keys of
            positions before each request's `start_position` (read only; the runner writes it after).
        :param compressed: the layer's paged entries `[rows, head_dim]`, already holding the entries this
            step closed, or None for sliding-only layers.
        :param sinks: `[num_heads]` fp32 per-head sink logits.
        :param metadata: the step's `AttentionMetadata`.
        :param topk_indices: CSA only: `[num_tokens, index_topk]` per-request entry numbers chosen by the
            indexer, -1 for none. Dense (HCA) layers pass None and attend every visible entry.
        :param num_entries: `[num_seqs]` int64 compressed entries each request has after this step.
        :returns: `[num_tokens, num_heads, head_dim]` attention output (before the inverse RoPE).
        """
        ...

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        index_keys: torch.Tensor,
        metadata: AttentionMetadata,
        num_entries: torch.Tensor,
    ) -> torch.Tensor:
        """CSA lightning indexer: score visible entries and keep the top `index_topk` per query.

        score(t, e) = sum_h weights[t, h] * relu(q[t, h] . index_keys[e]) / sqrt(index_head_dim).

        :param q: `[num_tokens, index_n_heads, index_head_dim]` indexer queries, RoPE applied.
        :param weights: `[num_tokens, index_n_heads]` fp32 head weights (already scaled).
        :param index_keys: the layer's paged indexer keys `[rows, index_head_dim]`.
        :param metadata: the step's `AttentionMetadata`.
        :param num_entries: `[num_seqs]` entries each request has after this step.
        :returns: `[num_tokens, index_topk]` int64 entry numbers; -1 where fewer entries are visible.
            On equal scores the lower entry number wins (ReLU makes exact ties common).
        """
        ...


@runtime_checkable
class IndexScorer(Protocol):
    """An `AttentionBackend` that also hands out the lightning indexer's raw scores, so a model that
    selects its own way (DeepSeek-V4.1's two-level indexer: candidate blocks, then picks inside them)
    scores on the backend's kernels. A backend without it leaves the scoring to the model's reference."""

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor,
                     metadata: AttentionMetadata, cap: int) -> torch.Tensor:
        """`[num_tokens, cap]` fp32 scores of each token's entries `0..cap-1`, as `indexer_topk` scores
        them (`sum_h weights[t, h] * relu(q[t, h] . index_keys[e]) / sqrt(index_head_dim)`), -inf at
        entries the token cannot see (`e >= (position + 1) // compress_rate`). `cap` comes from host
        bounds only (`AttentionMetadata.max_seq_len`), so the call is graph-safe."""
        ...
