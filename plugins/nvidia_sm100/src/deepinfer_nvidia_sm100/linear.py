"""FP8 projections on NVIDIA GPUs: activations quantised per token and 128 inputs, a block-scaled FP8 GEMM.

A call is two launches (three with split-K), none reading a value back, so decode captures in CUDA graphs:

1. `act_quant_kernel`: `x` to float8_e4m3fn with one float32 scale per token and 128 inputs (a power of
   two when the checkpoint's scales are "ue8m0", as DeepSeek's kernels do);
2. `fp8_gemm_kernel`: float8 x float8 `tl.dot` (wgmma on Hopper) with fp32 accumulation, each K step
   scaled by its rows' activation scales and its columns' weight-tile scales;
3. with split-K (few tokens: more programs than output tiles, so the weight streams from every SM),
   `split_k_sum_kernel` adds the K slices in a fixed order and casts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from deepinfer_core.backends.linear import LinearSpec
from deepinfer_nvidia_sm100.fp8_kernels import (
    ACT_GROUP,
    act_quant_kernel,
    fp8_gemm_kernel,
    split_k_sum_kernel,
)
from deepinfer_nvidia_sm100.platform import linear_problem

MAX_SPLIT_K = 16


@dataclass(frozen=True)
class GemmTiles:
    """Tile sizes of one FP8 GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def pick_tiles(num_tokens: int, spec: LinearSpec, num_sms: int) -> GemmTiles:
    """Prefill: 128x128 tiles (K steps of the weight tile's columns, at most 128). Decode (<= 64 tokens,
    memory-bound): 16-64 rows a tile, 64 columns, and K split until about two programs an SM stream
    the weight."""
    block_k = min(ACT_GROUP, spec.block[1])
    out_per_group = spec.out_features // spec.groups
    if num_tokens > 64:
        return GemmTiles(128, 128, block_k, num_warps=8, num_stages=3)
    block_m = max(16, triton.next_power_of_2(num_tokens))
    tiles = triton.cdiv(out_per_group, 64) * spec.groups * triton.cdiv(num_tokens, block_m)
    steps = triton.cdiv(spec.in_features, block_k)
    split_k = 1
    while split_k < MAX_SPLIT_K and tiles * split_k < 2 * num_sms and steps // (2 * split_k) >= 4:
        split_k *= 2
    return GemmTiles(block_m, 64, block_k, split_k=split_k, num_warps=4, num_stages=4)


class TritonFP8Linear:
    """`LinearBackend` for FP8 block-scaled projections on CUDA devices of compute capability >= 9.0."""

    supports_cuda_graphs = True
    """Buffers and launches are sized from shapes alone; nothing is read back."""

    def __init__(self, spec: LinearSpec, num_sms: int = 132) -> None:
        problem = linear_problem(spec)
        if problem is not None:
            raise ValueError(problem)
        self.spec, self.num_sms = spec, num_sms

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x[M, K]` as float8_e4m3fn values and `[M, ceil(K / 128)]` float32 scales."""
        num_rows, width = x.shape
        groups = triton.cdiv(width, ACT_GROUP)
        q = torch.empty(num_rows, width, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)
        if num_rows:
            act_quant_kernel[(num_rows, groups)](x, q, scales, width, x.stride(0), q.stride(0), scales.stride(0),
                                                 GROUP=ACT_GROUP, UE8M0=self.spec.scale_format == "ue8m0")
        return q, scales

    def forward(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                tiles: GemmTiles | None = None) -> torch.Tensor:
        """See `LinearBackend.forward`; `tiles` overrides the launch's tile sizes (benchmarks, tests)."""
        spec = self.spec
        if scale is None or weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            raise ValueError("TritonFP8Linear needs a float8_e4m3fn weight and float32 block scales")
        if weight.stride(-1) != 1 or scale.stride(-1) != 1:
            raise ValueError("FP8 weights and scales must be contiguous in their last dimension")
        num_tokens = x.shape[0]
        q, x_scales = self.quantize(x.reshape(num_tokens, -1).contiguous())
        tiles = tiles or pick_tiles(num_tokens, spec, self.num_sms)
        out = torch.empty(num_tokens, spec.out_features, dtype=x.dtype, device=x.device)
        if num_tokens == 0:
            return out
        target = out if tiles.split_k == 1 else torch.empty(
            tiles.split_k, num_tokens, spec.out_features, dtype=torch.float32, device=x.device)
        per_group = spec.out_features // spec.groups
        grid = (triton.cdiv(per_group, tiles.block_n), triton.cdiv(num_tokens, tiles.block_m),
                spec.groups * tiles.split_k)
        fp8_gemm_kernel[grid](
            q, x_scales, weight, scale, target, num_tokens, per_group, spec.in_features,
            q.stride(0), x_scales.stride(0), weight.stride(0), scale.stride(0),
            target.stride(0) if tiles.split_k > 1 else 0, target.stride(-2),
            G=spec.groups, SPLIT_K=tiles.split_k, GROUP=ACT_GROUP, BLOCK_ROWS=spec.block[0],
            BLOCK_COLS=spec.block[1], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        if tiles.split_k > 1:
            numel = out.numel()
            split_k_sum_kernel[(triton.cdiv(numel, 1024),)](target, out, numel, SPLIT_K=tiles.split_k, BLOCK=1024)
        return out
