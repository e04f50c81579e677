"""V4 attention on NVIDIA GPUs: one Triton kernel for decode and prefill, plus the CSA indexer scores.

See `attention_kernels.py` for how a program walks a query's window and compressed entries. Per-token
metadata (request, first new position, ring slot) is derived here with device ops only, and the sizes
that shape a launch (`num_comp`, the split count, the indexer's score width) come from tensor shapes and
`AttentionMetadata.max_seq_len`, never from device values. A decode step (one token per request) reads
no host list but `len(query_lens)`, so it can be captured in a CUDA graph and replayed with new inputs:
under graphs `max_seq_len` is the static `max_model_len` bound, and each program stops at its own
token's visible keys. A step where every request brings the same 2 .. 8 query tokens (a verification
step) and the queries share their keys (window, HCA) runs `multi_query_kernels` instead: one program a
request reads those keys once for all its queries (it reads `query_lens`, the step's static shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from deepinfer_core.backends.attention import AttentionMetadata, AttentionSpec
from deepinfer_nvidia_sm100 import multi_query_kernels
from deepinfer_nvidia_sm100.attention_kernels import attention_kernel, combine_kernel, indexer_scores_kernel

BLOCK_H = 16
"""Query heads per program."""
MAX_SPLITS = 32


@dataclass
class TokenIndex:
    """Per-token and per-request device tensors the kernels index with."""

    is_decode: bool
    """One token per request: token `t` belongs to request `t` (the kernels skip `token_req`)."""
    token_req: torch.Tensor
    """`[T]` int32 request of each token (`query_start_loc` itself, unread, in decode steps)."""
    q_start: torch.Tensor
    """`[num_seqs]` int64 first flat token of each request."""
    win_start: torch.Tensor | None
    """`[num_seqs]` int64 first position whose window key is valid; None when every one is 0."""


def prepare_token_index(metadata: AttentionMetadata, num_tokens: int) -> TokenIndex:
    """Map flat tokens to their requests; take the SWA-replay window starts (None when all are 0).

    Decode steps use device tensors only (`window_starts`); the host list serves callers that build
    metadata without the device copy, outside CUDA graphs.
    """
    device = metadata.query_start_loc.device
    is_decode = num_tokens == metadata.num_seqs and metadata.is_decode_only
    if is_decode:
        token_req = metadata.query_start_loc
    else:
        tokens = torch.arange(num_tokens, device=device)
        token_req = torch.searchsorted(metadata.query_start_loc[1:], tokens, right=True).to(torch.int32)
    win_start = metadata.window_starts
    if win_start is None and metadata.window_start_positions_host is not None:
        win_start = torch.tensor(metadata.window_start_positions_host, dtype=torch.int64, device=device)
    return TokenIndex(is_decode, token_req, metadata.query_start_loc[:-1], win_start)


def max_visible_entries(metadata: AttentionMetadata, rate: int) -> int:
    """An upper bound on the compressed entries any query of the step can see.

    From `max_seq_len` (static under CUDA graphs); metadata built without it (0) falls back to the
    host lists, which are current whenever no graph is replayed.
    """
    if metadata.max_seq_len > 0:
        return metadata.max_seq_len // rate
    ends = [s + n for s, n in zip(metadata.start_positions_host, metadata.query_lens)]
    return max(ends, default=0) // rate


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonAttention:
    """`AttentionBackend` for CUDA devices of compute capability >= 9.0."""

    supports_cuda_graphs = True
    """Decode steps read no device value on the host and size every launch statically."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.scale = spec.head_dim**-0.5
        self._ieee = spec.dtype == torch.float32
        self._head_dim_pow2 = max(16, triton.next_power_of_2(spec.head_dim))
        self._block_n = 32 if self._head_dim_pow2 >= 256 else 64
        self.tiles = {"decode": (BLOCK_H, self._block_n, 4, 2), "prefill": (BLOCK_H, self._block_n, 4, 2)}
        """`(heads per program, keys per step, num_warps, num_stages)` of decode and of prefill steps."""
        if spec.num_heads >= 64 and self._head_dim_pow2 >= 256:
            # every head in one program reads each key row once a token; H200, 16 x 512-token prompts,
            # V4-Flash sizes: CSA 6.10 -> 2.82 ms, HCA 2.80 -> 1.47 ms against 16 heads a program
            self.tiles["prefill"] = (64, 32, 8, 2)
        self._num_sms = (
            torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
        )

    def _num_splits(self, num_tokens: int, num_keys: int, block_h: int, block_n: int) -> int:
        programs = num_tokens * triton.cdiv(self.spec.num_heads, block_h)
        target = 2 * self._num_sms
        key_blocks = triton.cdiv(num_keys, block_n)
        return max(1, min(MAX_SPLITS, key_blocks, target // max(programs, 1)))

    def _inputs(self, q, kv, window, compressed, metadata: AttentionMetadata, topk_indices):
        """A launch's inputs, contiguous in their last dim: `(q, kv, window, compressed, num_comp, index)`,
        `compressed` None when the layer attends its window only, `num_comp` the most compressed entries a
        token visits (its picks with CSA), `index` the step's `prepare_token_index`."""
        spec = self.spec
        has_comp = spec.compress_rate > 0 and compressed is not None
        if has_comp and spec.is_sparse and topk_indices is None:
            raise ValueError("CSA attention needs topk_indices from indexer_topk")
        num_comp = 0
        if has_comp:
            num_comp = topk_indices.shape[1] if spec.is_sparse else max_visible_entries(metadata, spec.compress_rate)
        q, kv, window = _last_dim_contiguous(q), _last_dim_contiguous(kv), _last_dim_contiguous(window)
        compressed = _last_dim_contiguous(compressed) if has_comp else None
        return q, kv, window, compressed, num_comp, prepare_token_index(metadata, q.shape[0])

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
        """Attend each query over its window and visible compressed entries (see `AttentionBackend`)."""
        spec = self.spec
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, spec.num_heads, spec.head_dim, dtype=q.dtype, device=q.device)
        if num_tokens == 0:
            return out
        q, kv, window, compressed, num_comp, index = self._inputs(q, kv, window, compressed, metadata, topk_indices)
        has_comp = compressed is not None
        width = multi_query_kernels.uniform_width(metadata, num_tokens)
        if width and not (has_comp and spec.is_sparse):  # k + 1 queries a request sharing their keys
            return multi_query_kernels.launch(self, q, kv, window, compressed, sinks, metadata, num_comp, width,
                                              index.win_start)
        block_h, block_n, num_warps, num_stages = self.tiles["decode" if index.is_decode else "prefill"]
        num_splits = self._num_splits(num_tokens, spec.sliding_window + num_comp, block_h, block_n)
        is_split = num_splits > 1
        part_acc = part_ml = out
        if is_split:
            part_acc = torch.empty(
                num_tokens,
                num_splits,
                spec.num_heads,
                self._head_dim_pow2,
                dtype=torch.float32,
                device=q.device,
            )
            part_ml = torch.empty(
                num_tokens, num_splits, 2, spec.num_heads, dtype=torch.float32, device=q.device
            )
        comp = compressed if has_comp else kv
        topk = topk_indices if has_comp and spec.is_sparse else metadata.positions
        block_tables = metadata.block_tables
        grid = (num_tokens, triton.cdiv(spec.num_heads, block_h), num_splits)
        attention_kernel[grid](
            q,
            kv,
            window,
            comp,
            sinks,
            out,
            part_acc,
            part_ml,
            index.token_req,
            metadata.positions,
            metadata.start_positions,
            index.q_start,
            metadata.slots,
            index.win_start if index.win_start is not None else metadata.slots,
            block_tables,
            topk,
            spec.num_heads,
            spec.head_dim,
            self.scale,
            num_comp,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            window.stride(0),
            window.stride(1),
            comp.stride(0),
            block_tables.stride(0),
            topk.stride(0),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=self._head_dim_pow2,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            WINDOW=spec.sliding_window,
            RATE=max(spec.compress_rate, 1),
            EPB=max(spec.entries_per_block, 1),
            IS_SPARSE=spec.is_sparse,
            HAS_COMP=has_comp,
            IS_SPLIT=is_split,
            IS_DECODE=index.is_decode,
            HAS_WIN_START=index.win_start is not None,
            IEEE=self._ieee,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if is_split:
            combine_kernel[(num_tokens, spec.num_heads)](
                part_acc,
                part_ml,
                sinks,
                out,
                spec.num_heads,
                spec.head_dim,
                num_splits,
                out.stride(0),
                out.stride(1),
                HEAD_DIM=self._head_dim_pow2,
                NUM_SPLITS_POW2=triton.next_power_of_2(num_splits),
            )
        return out

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        index_keys: torch.Tensor,
        metadata: AttentionMetadata,
        num_entries: torch.Tensor,
    ) -> torch.Tensor:
        """Score visible entries with the lightning indexer and keep the top `index_topk` per query.

        Scores are `[T, cap]` with `cap` the static bound of `max_visible_entries`; entries a token cannot
        see score -inf (their blocks skip the loads) and come out as -1.
        """
        spec = self.spec
        num_tokens = q.shape[0]
        cap = max_visible_entries(metadata, spec.compress_rate)
        if num_tokens == 0 or cap == 0:
            return torch.full((num_tokens, spec.index_topk), -1, dtype=torch.int64, device=q.device)
        scores = self.index_scores(q, weights, index_keys, metadata, cap)
        values, picked = scores.topk(min(spec.index_topk, cap), dim=-1)
        picked = torch.where(values == float("-inf"), -1, picked)
        if picked.shape[1] == spec.index_topk:
            return picked
        topk = torch.full((num_tokens, spec.index_topk), -1, dtype=torch.int64, device=q.device)
        topk[:, : picked.shape[1]] = picked
        return topk

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor,
                     metadata: AttentionMetadata, cap: int) -> torch.Tensor:
        """`[T, cap]` fp32 lightning-indexer scores of entries `0..cap-1`, -inf where not visible."""
        spec = self.spec
        num_tokens = q.shape[0]
        q, index_keys = _last_dim_contiguous(q), _last_dim_contiguous(index_keys)
        index = prepare_token_index(metadata, num_tokens)
        scores = torch.empty(num_tokens, cap, dtype=torch.float32, device=q.device)
        block_n = 64
        indexer_scores_kernel[(num_tokens, triton.cdiv(cap, block_n))](
            q,
            weights,
            index_keys,
            metadata.block_tables,
            index.token_req,
            metadata.positions,
            scores,
            cap,
            spec.index_n_heads,
            spec.index_head_dim,
            spec.index_head_dim**-0.5,
            q.stride(0),
            q.stride(1),
            weights.stride(0),
            index_keys.stride(0),
            metadata.block_tables.stride(0),
            scores.stride(0),
            N_HEADS=max(16, triton.next_power_of_2(spec.index_n_heads)),
            HEAD_DIM=max(16, triton.next_power_of_2(spec.index_head_dim)),
            RATE=spec.compress_rate,
            EPB=spec.entries_per_block,
            BLOCK_N=block_n,
            IS_DECODE=index.is_decode,
            IEEE=self._ieee,
        )
        return scores
