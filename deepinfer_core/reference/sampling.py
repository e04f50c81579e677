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

A row that a grammar or a top-k / top-p / min-p filter has cut down to a few finite logits draws noise
for those tokens only (`_sparse_gumbel_argmax`): `-inf` plus any noise never wins, so the argmax is the
same, and the row costs its allowed tokens, not the vocabulary (129K ids, about 15 integer passes each).
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
_SPARSE_FRACTION = 8
"""A row with at most `1 / _SPARSE_FRACTION` of its vocabulary finite draws noise for those tokens only."""


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 bit patterns (multiplication wraps modulo 2**64)."""
    return _mix64_(x.clone())


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """`mix64` in place (half the memory traffic of the out-of-place form on `[B, V]` noise)."""
    for bits, factor in ((30, _MIX_1), (27, _MIX_2), (31, None)):
        shifted = x >> bits
        x ^= shifted.bitwise_and_((1 << (64 - bits)) - 1)
        if factor is not None:
            x *= factor
    return x


def seeded_uniforms(seeds: torch.Tensor, steps: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), one per (row, token id).

    :param seeds: `[B]` int64 (bit patterns of unsigned 64-bit seeds).
    :param steps: `[B]` int64 index of the token being drawn.
    :param num_tokens: vocabulary width.
    :returns: `[B, num_tokens]` float64.
    """
    counters = torch.arange(1, num_tokens + 1, dtype=torch.int64, device=seeds.device) * _GAMMA
    return _uniforms(_mix64_(_row_keys(seeds, steps)[:, None] + counters[None, :]))


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`key = mix64(mix64(seed) xor step)` of each row."""
    return mix64(mix64(seeds) ^ steps)


def _uniforms(bits: torch.Tensor) -> torch.Tensor:
    """`((bits >> 11) + 0.5) / 2**53` (float64; `bits` is overwritten)."""
    bits >>= 11
    return (bits.bitwise_and_((1 << 53) - 1).double() + 0.5) * 2.0**-53


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
    """Each row's `argmax_v(scaled[v] - log(-log(u_v)))`; rows with few finite logits drawn sparsely."""
    finite = (~torch.isneginf(scaled)).sum(dim=1)
    sparse = (finite > 0) & (finite * _SPARSE_FRACTION <= scaled.shape[1]) & ~scaled.isnan().any(dim=1)
    if not bool(sparse.any()):
        return _dense_gumbel_argmax(scaled, seeds, steps)
    chosen = torch.empty(scaled.shape[0], dtype=torch.int64, device=scaled.device)
    rows = sparse.nonzero().squeeze(1)
    chosen[rows] = _sparse_gumbel_argmax(scaled[rows], seeds[rows], steps[rows])
    rows = (~sparse).nonzero().squeeze(1)
    if rows.numel():
        chosen[rows] = _dense_gumbel_argmax(scaled[rows], seeds[rows], steps[rows])
    return chosen


def _sparse_gumbel_argmax(scaled: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`_dense_gumbel_argmax` over only the finite entries (every row has one; none is NaN): the same noise
    per (row, token), and ties go to the lowest token id, as `argmax`'s do."""
    row, token = (~torch.isneginf(scaled)).nonzero(as_tuple=True)
    uniforms = _uniforms(_mix64_(_row_keys(seeds, steps)[row] + (token + 1) * _GAMMA))
    values = scaled[row, token].double() - torch.log(-torch.log(uniforms))
    best = torch.full((scaled.shape[0],), float("-inf"), dtype=torch.float64, device=scaled.device)
    best = best.scatter_reduce(0, row, values, "amax")
    at_best = values == best[row]
    first = torch.full_like(seeds, scaled.shape[1], dtype=torch.int64)
    return first.scatter_reduce(0, row[at_best], token[at_best], "amin")


def _dense_gumbel_argmax(scaled: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's `argmax_v(scaled[v] - log(-log(u_v)))` over the whole vocabulary, in row chunks."""
    num_rows, vocab_size = scaled.shape
    rows_per_chunk = max(1, _MAX_NOISE_ELEMENTS // vocab_size)
    chosen = []
    for start in range(0, num_rows, rows_per_chunk):
        stop = start + rows_per_chunk
        uniforms = seeded_uniforms(seeds[start:stop], steps[start:stop], vocab_size)
        gumbel = uniforms.log_().neg_().log_().neg_()  # -log(-log(u)), in place
        chosen.append((scaled[start:stop].double() + gumbel).argmax(dim=-1))
    return torch.cat(chosen)
