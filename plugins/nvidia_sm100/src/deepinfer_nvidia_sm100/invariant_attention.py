"""Batch-invariant V4 attention and CSA indexer on NVIDIA GPUs (`AttentionSpec.deterministic`).

What a query token's output depends on is fixed by `invariant_attention_kernels`: its keys in splits of
`SPLIT_KEYS` (a fixed split size, not a fixed number of splits) folded in ascending order onto the sink,
one tile configuration (the decode tile) for prefill, chunked prefill and decode. The step only chooses
how the splits are spread over programs (`uses_split_programs`), which changes no bit.

The indexer's scores are per-(token, entry) dot products whose blocks sit at absolute entry numbers; the
top k is taken over unique int64 keys (the score's order-preserving bits, then the lower entry number on
a tie), so the chosen entries and their order are a function of the token's scores alone, whatever the
score row's width (the step's bound) or the top-k algorithm the device picks.
"""

from __future__ import annotations

import torch
import triton

from deepinfer_core.backends.attention import AttentionMetadata, AttentionSpec
from deepinfer_nvidia_sm100.attention import (
    TritonAttention,
    max_visible_entries,
)
from deepinfer_nvidia_sm100.invariant_attention_kernels import (
    invariant_attention_kernel,
    ordered_combine_kernel,
)

SPLIT_KEYS = 128
"""Virtual keys (window positions, then compressed entries) per split, for every step shape."""
MAX_PARTIAL_BYTES = 256 << 20
"""Split states one step may store; beyond it every program folds its token's splits itself."""


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as `scores` (fp32, descending = larger), ties broken towards the lower column:
    the float's bits made order-preserving in the high word, the complement of the column in the low."""
    bits = scores.contiguous().view(torch.int32).to(torch.int64)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    columns = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return (bits << 32) | (0xFFFFFFFF - columns)


def invariant_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, k]` int64 columns of each row's `k` largest scores, larger first, the lower column first on a
    tie; -1 for a `-inf` score and past the row's width."""
    num_rows, width = scores.shape
    out = torch.full((num_rows, k), -1, dtype=torch.int64, device=scores.device)
    if width == 0:
        return out
    picked = ordered_keys(scores).topk(min(k, width), dim=-1).indices
    chosen = scores.gather(1, picked)
    out[:, : picked.shape[1]] = torch.where(chosen == float("-inf"), -1, picked)
    return out


class InvariantTritonAttention(TritonAttention):
    """`AttentionBackend` for deterministic specs on CUDA devices of compute capability >= 9.0."""

    supports_cuda_graphs = True
    """Launch sizes come from shapes and `max_seq_len`, as in `TritonAttention`."""

    def __init__(self, spec: AttentionSpec, split_keys: int = SPLIT_KEYS) -> None:
        super().__init__(spec)
        self.tile = self.tiles["decode"]
        """`(heads per program, keys per step, num_warps, num_stages)` of every step."""
        if split_keys % self.tile[1]:
            raise ValueError(f"split_keys {split_keys} must be a multiple of the key block {self.tile[1]}")
        self.split_keys = split_keys
        """Virtual keys per split (`SPLIT_KEYS`; tests take smaller ones)."""

    def uses_split_programs(self, num_tokens: int, num_splits: int) -> bool:
        """One program a split (then `ordered_combine_kernel`) while the tokens' head blocks alone leave SMs
        idle and the split states fit `MAX_PARTIAL_BYTES`; else each program folds its own splits."""
        programs = num_tokens * triton.cdiv(self.spec.num_heads, self.tile[0])
        partial_bytes = num_tokens * num_splits * self.spec.num_heads * self._head_dim_pow2 * 4
        return num_splits > 1 and programs < self._num_sms and partial_bytes <= MAX_PARTIAL_BYTES

    def forward(self, q, kv, window, compressed, sinks, metadata: AttentionMetadata, topk_indices=None,
                num_entries=None, split_programs: bool | None = None) -> torch.Tensor:
        """Attend each query over its window and visible compressed entries (see `AttentionBackend`);
        `split_programs` forces the launch shape (tests: both give the same bits)."""
        spec = self.spec
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, spec.num_heads, spec.head_dim, dtype=q.dtype, device=q.device)
        if num_tokens == 0:
            return out
        q, kv, window, compressed, num_comp, index = self._inputs(q, kv, window, compressed, metadata, topk_indices)
        has_comp = compressed is not None
        num_splits = triton.cdiv(spec.sliding_window + num_comp, self.split_keys)
        if split_programs is None:
            split_programs = self.uses_split_programs(num_tokens, num_splits)
        block_h, block_n, num_warps, num_stages = self.tile
        part_acc = part_ml = out
        if split_programs:
            part_acc = torch.empty(num_tokens, num_splits, spec.num_heads, self._head_dim_pow2,
                                   dtype=torch.float32, device=q.device)
            part_ml = torch.empty(num_tokens, num_splits, 2, spec.num_heads, dtype=torch.float32, device=q.device)
        comp = compressed if has_comp else kv
        topk = topk_indices if has_comp and spec.is_sparse else metadata.positions
        tables = metadata.block_tables
        head_blocks = triton.cdiv(spec.num_heads, block_h)
        shape = {"HEAD_DIM": self._head_dim_pow2, "BLOCK_H": block_h, "SPLIT_KEYS": self.split_keys,
                 "WINDOW": spec.sliding_window, "RATE": max(spec.compress_rate, 1), "IS_SPARSE": spec.is_sparse,
                 "HAS_COMP": has_comp}
        invariant_attention_kernel[(num_tokens, head_blocks, num_splits if split_programs else 1)](
            q, kv, window, comp, sinks, out, part_acc, part_ml,
            index.token_req, metadata.positions, metadata.start_positions, index.q_start, metadata.slots,
            index.win_start if index.win_start is not None else metadata.slots, tables, topk,
            spec.num_heads, spec.head_dim, self.scale, num_comp,
            q.stride(0), q.stride(1), kv.stride(0), window.stride(0), window.stride(1), comp.stride(0),
            tables.stride(0), topk.stride(0), out.stride(0), out.stride(1),
            BLOCK_N=block_n, EPB=max(spec.entries_per_block, 1), FOLD_IN_PROGRAM=not split_programs,
            IS_DECODE=index.is_decode, HAS_WIN_START=index.win_start is not None, IEEE=self._ieee,
            num_warps=num_warps, num_stages=num_stages, **shape,
        )
        if split_programs:
            ordered_combine_kernel[(num_tokens, head_blocks)](
                part_acc, part_ml, sinks, metadata.positions, out, spec.num_heads, spec.head_dim, num_comp,
                num_splits, out.stride(0), out.stride(1), num_warps=num_warps, **shape,
            )
        return out

    def indexer_topk(self, q, weights, index_keys, metadata: AttentionMetadata, num_entries) -> torch.Tensor:
        """The top `index_topk` visible entries per query, by `invariant_topk` (see the module docstring)."""
        spec = self.spec
        cap = max_visible_entries(metadata, spec.compress_rate)
        if q.shape[0] == 0 or cap == 0:
            return torch.full((q.shape[0], spec.index_topk), -1, dtype=torch.int64, device=q.device)
        return invariant_topk(self.index_scores(q, weights, index_keys, metadata, cap), spec.index_topk)
