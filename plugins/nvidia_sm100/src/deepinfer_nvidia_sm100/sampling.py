"""Sampler on NVIDIA GPUs: the reference's semantics, with the seeded draw fused into one Triton kernel.

The reference (`deepinfer_core.reference.sampling`) draws by Gumbel-max with counter-based SplitMix64
noise; `gumbel_argmax_kernel` computes the same noise bit for bit and the argmax of
`filtered / temperature + gumbel` in float64 in one pass over each row, instead of materialising
`[B, vocab]` float64 noise. Allowed and banned ids, logit bias, penalties and the top-k / top-p /
min-p filters run as the shared PyTorch steps of `deepinfer_core.backends.sampling_ops` on the device (only
when some row asks for them). For a deterministic spec (`SamplingSpec.deterministic`) the logprobs come
from `log_softmax_kernel`: one program a row, `BLOCK_V`-wide chunks of the vocabulary in ascending order,
one fixed reduction across the lanes, so a row's logprobs never depend on its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.backends.sampling import SamplerOutput, SamplingSpec, SamplingTensors
from deepinfer_core.backends.sampling_ops import (
    adjust_logits,
    check_sampler_inputs,
    filter_sampled,
    sampler_output,
    sampling_flags,
)

BLOCK_V = 2048
"""Vocabulary ids a program reads at once (the draw and the log-softmax); 64 chunks at V4's 129,280 ids."""
LOG_SOFTMAX_WARPS = 8
"""Warps of every log-softmax program: with `BLOCK_V`, it fixes the tree that reduces the lanes."""


@triton.jit
def _mix64(x):
    """SplitMix64's finaliser on uint64 (multiplication wraps modulo 2**64)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def gumbel_argmax_kernel(
    scaled_ptr,
    seeds_ptr,
    steps_ptr,
    out_ptr,
    vocab_size,
    stride_row,
    BLOCK: tl.constexpr,
):
    """out[row] = argmax_v(scaled[row, v] + gumbel(seed, step, v)), first index on ties."""
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
    step = tl.load(steps_ptr + row).to(tl.uint64, bitcast=True)
    key = _mix64(_mix64(seed) ^ step)
    best_value = tl.full([], float("-inf"), dtype=tl.float64)
    best_index = tl.full([], 0, dtype=tl.int64)
    for v0 in range(0, vocab_size, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        in_range = v < vocab_size
        logits = tl.load(scaled_ptr + row * stride_row + v, mask=in_range, other=float("-inf")).to(tl.float64)
        counters = (v + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
        bits = _mix64(key + counters)
        uniform = ((bits >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16
        value = logits - tl.log(-tl.log(uniform))
        value = tl.where(in_range, value, float("-inf"))
        block_best = tl.max(value, axis=0)
        block_index = tl.min(tl.where(value == block_best, v, vocab_size), axis=0).to(tl.int64)
        is_better = block_best > best_value
        best_index = tl.where(is_better, block_index, best_index)
        best_value = tl.where(is_better, block_best, best_value)
    tl.store(out_ptr + row, best_index)


def gumbel_argmax(scaled: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Seeded Gumbel-max draw per row of `scaled` ([B, V] fp32, filtered and divided by temperature)."""
    scaled = scaled.contiguous()
    out = torch.empty(scaled.shape[0], dtype=torch.int64, device=scaled.device)
    if scaled.shape[0] == 0:
        return out
    gumbel_argmax_kernel[(scaled.shape[0],)](
        scaled,
        seeds.contiguous(),
        steps.contiguous(),
        out,
        scaled.shape[1],
        scaled.stride(0),
        BLOCK=BLOCK_V,
    )
    return out


@triton.jit
def log_softmax_kernel(logits_ptr, out_ptr, vocab_size, stride_in, stride_out, BLOCK: tl.constexpr):
    """out[row] = (logits[row] - m) - log(sum_v exp(logits[row, v] - m)), `m` the row's max, fp32.

    Lane `i` keeps a running max and sum over ids `i, i + BLOCK, ...` (chunks in ascending order, the
    sum rescaled when the max grows); the lanes are then reduced once, by a tree fixed by `BLOCK` and
    the warp count. Nothing depends on other rows or on the grid, so a row's bits are its own."""
    row = tl.program_id(0).to(tl.int64)
    lane_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for v0 in range(0, vocab_size, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_in + v, mask=v < vocab_size, other=float("-inf"))
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a lane that saw only -inf stays at 0
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    log_sum = tl.log(tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0))
    for v0 in range(0, vocab_size, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_in + v, mask=v < vocab_size, other=0.0)
        tl.store(out_ptr + row * stride_out + v, (x - shift) - log_sum, mask=v < vocab_size)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax of `logits` `[B, V]` fp32 by `log_softmax_kernel` (batch-invariant)."""
    logits = logits.float().contiguous()
    out = torch.empty_like(logits)
    if logits.shape[0] == 0:
        return out
    log_softmax_kernel[(logits.shape[0],)](logits, out, logits.shape[1], logits.stride(0), out.stride(0),
                                           BLOCK=BLOCK_V, num_warps=LOG_SOFTMAX_WARPS)
    return out


class CudaSampler:
    """`SamplingBackend` for CUDA devices; draws the same tokens as the reference sampler."""

    def __init__(self, spec: SamplingSpec) -> None:
        self.spec = spec

    def sample(self, logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
        """Sample one token per row; see `SamplingBackend.sample`."""
        check_sampler_inputs(self.spec, logits, params)
        logits = logits.float()
        masked = adjust_logits(logits, params)
        token_ids = masked.argmax(dim=-1)
        is_sampled = params.temperature > 0
        flags = sampling_flags(params, is_sampled, logits.shape[-1])
        if flags[0]:
            scaled = filter_sampled(masked, params, is_sampled, flags)
            drawn = gumbel_argmax(scaled, params.seeds, params.steps)
            token_ids = torch.where(is_sampled, drawn, token_ids)
        return sampler_output(logits, token_ids, params, log_softmax if self.spec.deterministic else None,
                              stable_ties=self.spec.deterministic)
