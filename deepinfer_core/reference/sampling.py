"""Reference sampler: batch-invariant seeded draws in PyTorch, after the shared steps of
`deepinfer_core.backends.sampling_ops` (logit adjustments, temperature, top-k, top-p, min-p).

Seeded draws are Gumbel-max in vocabulary-id space with counter-based noise: the uniform for token `v`
of a row drawing its token number `step` under `seed` is a pure function of `(seed, step, v)`, so a
row's token never depends on which other rows share its batch or where the row sits. The function
(SplitMix64 finaliser `mix64`, all arithmetic modulo 2**64):

    key   = mix64(mix64(seed) xor step)
    bits  = mix64(key + GAMMA * (v + 1))
    u     = ((bits >> 11) + 0.5) / 2**53            # in (0, 1), never 0 or 1
    token = argmax_v(filtered_logits[v] / temperature - log(-log(u)))

An accelerated sampler that reproduces this bit for bit draws the same tokens as the reference.
"""

from __future__ import annotations

import torch

from deepinfer_core.backends.sampling import SamplerOutput, SamplingSpec, SamplingTensors
from deepinfer_core.backends.sampling_ops import (
    adjust_logits,
    check_sampler_inputs,
    filter_sampled,
    sampler_output,
    sampling_flags,
)
from deepinfer_core.reference.invariant import log_softmax_rows

# SplitMix64's unsigned constants, as the int64 values with the same bits.
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64
_MAX_NOISE_ELEMENTS = 1 << 22
"""Rows are drawn in chunks of at most this many (row, token) pairs to bound memory."""


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 bit patterns (multiplication wraps modulo 2**64)."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def seeded_uniforms(seeds: torch.Tensor, steps: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), one per (row, token id).

    :param seeds: `[B]` int64 (bit patterns of unsigned 64-bit seeds).
    :param steps: `[B]` int64 index of the token being drawn.
    :param num_tokens: vocabulary width.
    :returns: `[B, num_tokens]` float64.
    """
    key = mix64(mix64(seeds) ^ steps)
    counters = torch.arange(1, num_tokens + 1, dtype=torch.int64, device=seeds.device) * _GAMMA
    bits = mix64(key[:, None] + counters[None, :])
    return (_shift_right(bits, 11).double() + 0.5) * 2.0**-53


class ReferenceSampler:
    """Pure-PyTorch `SamplingBackend`; vectorised over the batch."""

    def __init__(self, spec: SamplingSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = torch.device(device)

    def sample(self, logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
        """Sample one token per row; see `SamplingBackend.sample`."""
        check_sampler_inputs(self.spec, logits, params)
        logits = logits.float()
        adjusted = adjust_logits(logits, params)
        token_ids = adjusted.argmax(dim=-1)
        is_sampled = params.temperature > 0
        flags = sampling_flags(params, is_sampled, logits.shape[-1])
        if flags[0]:
            scaled = filter_sampled(adjusted, params, is_sampled, flags)
            rows = is_sampled.nonzero().squeeze(1)
            token_ids[rows] = _gumbel_argmax(scaled[rows], params.seeds[rows], params.steps[rows])
        return sampler_output(logits, token_ids, params, log_softmax_rows if self.spec.deterministic else None,
                              stable_ties=self.spec.deterministic)


def _gumbel_argmax(scaled: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    num_rows, vocab_size = scaled.shape
    rows_per_chunk = max(1, _MAX_NOISE_ELEMENTS // vocab_size)
    chosen = []
    for start in range(0, num_rows, rows_per_chunk):
        stop = start + rows_per_chunk
        uniforms = seeded_uniforms(seeds[start:stop], steps[start:stop], vocab_size)
        gumbel = -torch.log(-torch.log(uniforms))
        chosen.append((scaled[start:stop].double() + gumbel).argmax(dim=-1))
    return torch.cat(chosen)
