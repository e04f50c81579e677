"""V4 attention on the Ascend 950: `cann_ops_transformer.sparse_flash_mla` with its metadata op.

One call per layer does the sliding window, the compressed entries (CSA with the indexer's top-k, HCA
dense) and the per-head sinks, with BF16/FP16 KV in the op's paged layout (`PA_BBND`, TND queries):

- `ori_kv` (the window): the engine keeps each request's window in a ring; the op reads a paged,
  bottom-right aligned sequence. `prepare_window_kv` gathers, per request, the ring keys its first
  query sees then this step's keys into plugin-owned blocks (block 0 unused: block ids must be
  positive), so request i's sequence is `m_i` old keys then its `n_i` new ones and the op's band mask
  (`ori_win_left = sliding_window - 1`) is exactly the window. It also honours SWA-replay
  `window_starts` (keys before them are simply not gathered).
- `cmp_kv` (the compressed entries): the engine's pool is already paged by `entries_per_block`; it is
  passed as a view, zero-copy, with the engine's block ids (int32; -1 padding becomes id 1, never
  read). `seqused_cmp_kv` = entries, `cmp_residual_kv` = length % rate: the op's cmp mask length
  `cmp_len * cmp_ratio + residual` is each request's length, so entry e is visible to position t iff
  `e < (t + 1) // rate`, as the contract says.

Block id 0. The op documents block-table values as positive integers. The engine reserves block 0 as
its null block (`deepinfer_core.kv.cache.NULL_BLOCK`) and never hands it out, so a 0 in an engine's
table is padding past a request's blocks, never read (reads stop at `seqused_cmp_kv`), and
`prepare_compressed` sends it, like -1, as id 1. Under static shapes (decode graphs) the tables come
from the runner's graph buffers, zero-padded, so compressed specs declare `supports_cuda_graphs` and
every captured step takes the op. An eager step from a caller that does use block 0 as a real block
(the backend conformance suite's random tables) is caught by a guard (one host read per step) and runs
its compressed layers through the PyTorch fallback (the reference's code on the NPU). `path_counts`
counts which path served.

Step geometry (tables, lengths, the 1024-int metadata) is built once per step per layer kind and reused
by every layer of the forward pass. Decode steps read no device value on the host (shapes come from
`query_lens` and `max_seq_len`), so the path is graph-safe. The CSA indexer runs in PyTorch on the NPU
(the reference's scoring and top-k): CANN's `quant_lightning_indexer` wants FP8 keys with per-token
scales, and the engine's indexer cache holds bf16 keys (a cache-format hook would be needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer_ascend950.constraints import check_sparse_flash_mla_call, check_sparse_flash_mla_spec
from deepinfer_core.backends.attention import AttentionMetadata, AttentionSpec
from deepinfer_core.kv.cache import NULL_BLOCK
from deepinfer_core.reference.attention import ReferenceAttention

WINDOW_BLOCK = 128
"""Block size of the gathered window (one block holds a decode request's whole window)."""
BAND_MASK, CAUSAL_MASK, NO_MASK = 4, 3, 0
"""`ori_mask_mode` / `cmp_mask_mode` values of sparse_flash_mla."""


@dataclass
class WindowLayout:
    """Where each request's window keys go in the gathered `ori_kv` (host ints and device tensors)."""

    first_block: list[int]
    """Per request, its first block in the gathered buffer (>= 1)."""
    num_blocks: int
    """Blocks of the gathered buffer, the unused block 0 included."""
    old_keys: torch.Tensor
    """`[B]` int64 ring keys each request's first query sees (`m_i`)."""
    block_table: torch.Tensor
    """`[B, max_blocks]` int32, positive."""
    seqused: torch.Tensor
    """`[B]` int32 `m_i + n_i`."""
    max_seqlen: int


def window_old_keys(metadata: AttentionMetadata, sliding_window: int) -> torch.Tensor:
    """`[B]` int64: keys before `start` each request's first query sees (`sliding_window - 1` at most,
    none before position 0 or before the request's `window_starts`)."""
    start = metadata.start_positions
    low = (start - (sliding_window - 1)).clamp(min=0)
    if metadata.window_starts is not None:
        low = torch.maximum(low, metadata.window_starts)
    elif metadata.window_start_positions_host is not None:
        low = torch.maximum(low, torch.tensor(metadata.window_start_positions_host, device=start.device))
    return (start - low).clamp(min=0)


def plan_window(metadata: AttentionMetadata, sliding_window: int, block: int = WINDOW_BLOCK) -> WindowLayout:
    """Blocks per request from host-known query lengths: `ceil((sliding_window - 1 + n_i) / block)`."""
    device = metadata.start_positions.device
    caps = [-(-(sliding_window - 1 + n) // block) for n in metadata.query_lens]
    first, offset = [], 1
    for cap in caps:
        first.append(offset)
        offset += cap
    width = max(caps)
    table = [[f + min(j, cap - 1) for j in range(width)] for f, cap in zip(first, caps)]
    old = window_old_keys(metadata, sliding_window)
    lens = metadata.query_start_loc.diff()
    return WindowLayout(first_block=first, num_blocks=offset, old_keys=old,
                        block_table=torch.tensor(table, dtype=torch.int32).to(device, non_blocking=True),
                        seqused=(old + lens).to(torch.int32), max_seqlen=sliding_window - 1 + max(metadata.query_lens))


def prepare_window_kv(kv: torch.Tensor, window: torch.Tensor, metadata: AttentionMetadata, layout: WindowLayout,
                      block: int = WINDOW_BLOCK) -> torch.Tensor:
    """The gathered `ori_kv` `[num_blocks, block, 1, D]`: request i's blocks hold its `m_i` ring keys in
    position order, then its new keys; rows past them are zeros (never read)."""
    ring, dim = window.shape[1], window.shape[2]
    device, num_seqs = kv.device, metadata.num_seqs
    buffer = torch.zeros(layout.num_blocks * block, dim, dtype=kv.dtype, device=device)
    first_row = torch.tensor(layout.first_block, device=device) * block
    old = layout.old_keys
    k = torch.arange(ring - 1, device=device)
    positions = (metadata.start_positions - old)[:, None] + k
    keys = window[metadata.slots[:, None], positions % ring].to(kv.dtype)
    keys = keys.masked_fill((k >= old[:, None])[..., None], 0)  # also clears NaN of rows never written
    buffer[(first_row[:, None] + k).flatten()] = keys.flatten(0, 1)
    lens = metadata.query_start_loc.diff()
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), lens, output_size=kv.shape[0])
    within = torch.arange(kv.shape[0], device=device) - metadata.query_start_loc[seq]
    buffer[first_row[seq] + old[seq] + within] = kv
    return buffer.view(layout.num_blocks, block, 1, dim)


def prepare_compressed(compressed: torch.Tensor, block_tables: torch.Tensor, entries_per_block: int,
                       keep_block_zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`cmp_kv` `[blocks, epb, 1, D]` (a view of the pool) and its int32 block table, the padding (-1, or
    the engine's null block 0; never read: beyond `seqused_cmp_kv`) replaced by block 1 so that every
    value is positive. `keep_block_zero`: send 0 as it is (the doctor's probe of whether the op takes it)."""
    usable = compressed.shape[0] // entries_per_block
    view = compressed[: usable * entries_per_block].view(usable, entries_per_block, 1, compressed.shape[1])
    return view, torch.where(block_tables < 0 if keep_block_zero else block_tables <= NULL_BLOCK, 1, block_tables).to(torch.int32)


@dataclass
class StepGeometry:
    """Everything one step's layers of one kind share: built on the first layer, reused by the rest."""

    metadata: AttentionMetadata
    window: WindowLayout
    op_args: dict
    """Length tensors and attributes passed identically to the metadata op and the main op."""
    split_args: dict
    """What only the metadata op takes (maximum lengths, top-k widths, which KV is present)."""
    op_metadata: torch.Tensor


class AscendAttention:
    """`AttentionBackend` on the Ascend 950 through `sparse_flash_mla` (see the module docstring)."""

    def __init__(self, spec: AttentionSpec, device: torch.device, cann_ops: ModuleType) -> None:
        check_sparse_flash_mla_spec(spec.num_heads, spec.head_dim, spec.sliding_window, spec.compress_rate,
                                    spec.dtype)
        self.spec, self.device, self.ops = spec, device, cann_ops
        self.fallback = ReferenceAttention(spec, device)
        self.supports_cuda_graphs = True
        """Decode reads no device value on the host; under static shapes the tables' zeros are the engine's
        null block (padding), sent as id 1 (see the module docstring)."""
        self.path_counts = {"sparse_flash_mla": 0, "fallback (block id 0)": 0}
        self._step: StepGeometry | None = None
        self._block_zero: tuple[AttentionMetadata, bool] | None = None
        self.sends_block_zero = False
        """Send block id 0 to the op as a real block (set only by the doctor's probe, `check.py`)."""

    def indexer_topk(self, q, weights, index_keys, metadata: AttentionMetadata, num_entries):
        """PyTorch scoring and top-k on the NPU (see the module docstring for why not the CANN op)."""
        return self.fallback.indexer_topk(q, weights, index_keys, metadata, num_entries)

    def needs_fallback(self, metadata: AttentionMetadata, has_cmp: bool) -> bool:
        """Whether this eager step's compressed attention cannot take the op: block id 0 used as a real
        block in a table (one host read, once per step). Under static shapes the tables are the engine's,
        whose zeros are padding (and no host read may run)."""
        if not has_cmp or metadata.needs_static_shapes:
            return False
        if self._block_zero is None or self._block_zero[0] is not metadata:
            self._block_zero = (metadata, bool((metadata.block_tables == 0).any()))
        return self._block_zero[1]

    def forward(self, q, kv, window, compressed, sinks, metadata: AttentionMetadata, topk_indices=None,
                num_entries=None):
        spec = self.spec
        has_cmp = spec.compress_rate > 0 and compressed is not None
        check_sparse_flash_mla_call(q, sinks, WINDOW_BLOCK, topk_indices if spec.is_sparse else None)
        if has_cmp and spec.is_sparse and topk_indices is None:
            raise ValueError("CSA attention needs topk_indices from indexer_topk")
        if self.needs_fallback(metadata, has_cmp):
            self.path_counts["fallback (block id 0)"] += 1
            return self.fallback.forward(q, kv, window, compressed, sinks, metadata, topk_indices, num_entries)
        self.path_counts["sparse_flash_mla"] += 1
        step = self._geometry(metadata, has_cmp, num_entries, topk_indices)
        tensors = {"ori_kv": prepare_window_kv(kv, window, metadata, step.window),
                   "ori_block_table": step.window.block_table}
        if has_cmp:
            tensors["cmp_kv"], tensors["cmp_block_table"] = prepare_compressed(
                compressed, metadata.block_tables, spec.entries_per_block, self.sends_block_zero)
            if spec.is_sparse:
                tensors["cmp_sparse_indices"] = topk_indices.to(torch.int32).unsqueeze(1)
        out, _ = self.ops.sparse_flash_mla(q, **tensors, **step.op_args, sinks=sinks, metadata=step.op_metadata,
                                           softmax_scale=spec.head_dim**-0.5, return_softmax_lse=False)
        return out

    def _geometry(self, metadata: AttentionMetadata, has_cmp: bool, num_entries, topk_indices) -> StepGeometry:
        if self._step is not None and self._step.metadata is metadata:
            return self._step
        spec = self.spec
        layout = plan_window(metadata, spec.sliding_window)
        args = {"cu_seqlens_q": metadata.query_start_loc.to(torch.int32), "seqused_ori_kv": layout.seqused,
                "ori_mask_mode": BAND_MASK, "ori_win_left": spec.sliding_window - 1, "ori_win_right": 0,
                "cmp_ratio": 1, "cmp_mask_mode": NO_MASK, "layout_q": "TND", "layout_kv": "PA_BBND"}
        split = {"batch_size": metadata.num_seqs, "max_seqlen_q": max(metadata.query_lens),
                 "max_seqlen_ori_kv": layout.max_seqlen, "ori_topk": 0, "cmp_topk": 0, "has_ori_kv": True,
                 "has_cmp_kv": has_cmp}
        if has_cmp:
            rate = spec.compress_rate
            lengths = metadata.start_positions + metadata.query_start_loc.diff()
            args.update(cmp_ratio=rate, cmp_mask_mode=CAUSAL_MASK, seqused_cmp_kv=num_entries.to(torch.int32),
                        cmp_residual_kv=(lengths % rate).to(torch.int32))
            split.update(max_seqlen_cmp_kv=max(_max_seq_len(metadata) // rate, 1),
                         cmp_topk=topk_indices.shape[1] if spec.is_sparse else 0)
        op_metadata = self.ops.sparse_flash_mla_metadata(spec.num_heads, 1, spec.head_dim, **split, **args)
        self._step = StepGeometry(metadata, layout, args, split, op_metadata)
        return self._step


def _max_seq_len(metadata: AttentionMetadata) -> int:
    if metadata.max_seq_len or metadata.needs_static_shapes:
        return metadata.max_seq_len
    return max(a + n for a, n in zip(metadata.start_positions_host, metadata.query_lens))
