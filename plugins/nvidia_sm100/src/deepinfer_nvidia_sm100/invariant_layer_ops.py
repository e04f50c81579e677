"""Batch-invariant Triton layer ops (`LayerOpsSpec.deterministic`): the default kernels with launch shapes
that never depend on the call's row count.

What the default launchers choose by the number of rows, and what is fixed here:

- RMSNorm / RoPE (`layer_kernels.rms_norm`, `rotary`): rows a program (1 below 4,096 rows, up to 8 above)
  and with it the warps that reduce a row; here one row a program, always;
- mHC (`hyper_kernels`, and V4.1's single pass `single_pass`): tokens a program, one or two launches, the
  split of the hidden dim and the dot's form; here `invariant_launch_plan`, one plan (two launches,
  16-token programs and a fixed split in the first, partial sums added in split order by one-row programs
  in the second) for every row count;
- the compressor's window close (`layer_kernels.compress`): whether channels are split over programs;
  here fixed by the span alone;
- the window ring write is a copy;
- `map_rows` (every per-token projection, the shared experts, `lm_head`) runs `fn` on fixed row tiles
  (`deepinfer_core.reference.invariant.tile_rows`, `ROW_TILE` rows, zero-padded): each GEMM has one shape,
  so cuBLAS (or the FP8 kernel) picks one algorithm and tile, whatever the batch. Decode batches up to
  `ROW_TILE` rows run as one GEMM, as in default mode; a prefill of `T` tokens runs `T / ROW_TILE`.

Every launch is sized from shapes, so decode steps stay CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton

from deepinfer_core.backends import LayerOpsSpec
from deepinfer_core.reference.invariant import tile_rows
from deepinfer_nvidia_sm100 import hyper_kernels, layer_kernels, single_pass
from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

PLAN_TOKENS = 16
"""Tokens a program of the mHC plan (the tensor-core dot needs 16)."""
PLAN_CHUNKS_PER_SPLIT = 2
"""Hidden-dim chunks (of `hyper_kernels.TWO_PASS_TILE[0]` channels) a split of the mHC plan walks: a
V4-Flash decode step reads `fn` over 64 programs a token block (H200, bs 1: 4 chunks, 32 programs, left
the first launch latency-bound)."""
PLAN_TAIL_TOKENS = 1
"""Rows a program of the mHC plan's second launch: a decode step of one token is one program either way,
and one row's streams collapse in registers without a second pass over the hidden dim (H200, bs 1: the
4-row tail took 21 us a call, the default's whole one-launch call 13 us)."""
POOL_CHANNEL_SPLIT = 32
"""Channels a pooling program for spans longer than 16 rows (the HCA close), as a default decode step."""


def invariant_launch_plan(n: int, hidden: int, is_head: bool) -> hyper_kernels.LaunchPlan:
    """The one mHC launch plan of deterministic mode for `n` streams of `hidden` channels."""
    n_pow2 = triton.next_power_of_2(n)
    num_cols = max(16, triton.next_power_of_2(n_pow2 * (1 if is_head else 2 + n_pow2)))
    block_d = hyper_kernels.TWO_PASS_TILE[0]
    num_splits = triton.cdiv(triton.cdiv(hidden, block_d), PLAN_CHUNKS_PER_SPLIT)
    return hyper_kernels.LaunchPlan(PLAN_TOKENS, block_d, num_splits, PLAN_CHUNKS_PER_SPLIT, n_pow2, num_cols,
                                    two_pass=True, split_dot=hyper_kernels.TENSOR_CORE_DOT,
                                    tail_tokens=PLAN_TAIL_TOKENS)


def pool_channel_split(rate: int, overlap: bool) -> int:
    """Channels a pooling program of the compressor's close (0: one program a token), from the span alone."""
    span = 2 * rate if overlap else rate
    return POOL_CHANNEL_SPLIT if span > 16 else 0


class InvariantTritonLayerOps(TritonLayerOps):
    """`LayerOps` for deterministic specs on CUDA devices of compute capability >= 9.0."""

    supports_cuda_graphs = True
    """Tiles and plans come from shapes; nothing is read back."""

    def __init__(self, spec: LayerOpsSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        n, hidden = spec.hc_mult, spec.hidden_size
        self._block_plan = invariant_launch_plan(n, hidden, is_head=False)
        self._head_plan = invariant_launch_plan(n, hidden, is_head=True)

    def map_rows(self, fn, *rows):
        return tile_rows(fn, *rows)

    def hc_pre(self, streams, hc, norm_weight):
        return hyper_kernels.hc_pre(streams, hc, norm_weight, self.spec, plan=self._block_plan)

    def hc_post_pre(self, streams, block_out, post, comb, hc, norm_weight):
        return hyper_kernels.hc_post_pre(streams, block_out, post, comb, hc, norm_weight, self.spec,
                                         plan=self._block_plan)

    def hc_post_head(self, streams, block_out, post, comb, rows, head, norm_weight):
        return hyper_kernels.hc_post_head(streams, block_out, post, comb, rows, head, norm_weight, self.spec,
                                          plan=self._head_plan)

    def hc_mix(self, streams, hc, norm_weight, collapse_pre):
        return single_pass.hc_mix(streams, hc, norm_weight, collapse_pre, self.spec, plan=self._block_plan)

    def hc_post_mix(self, streams, block_out, post, comb, hc, norm_weight, collapse_pre):
        return single_pass.hc_post_mix(streams, block_out, post, comb, hc, norm_weight, collapse_pre, self.spec,
                                       plan=self._block_plan)

    def rms_norm(self, x, weight, cos=None, sin=None):
        return layer_kernels.rms_norm(x, weight, self.spec.rms_norm_eps, cos, sin, rows_per_program=1)

    def rotary(self, x, cos, sin):
        return layer_kernels.rotary(x, cos, sin, rows_per_program=1)

    def compress(self, kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before) -> None:
        layer_kernels.compress(kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before,
                               self.spec.rms_norm_eps, channel_split=pool_channel_split(weights.rate, weights.overlap))
