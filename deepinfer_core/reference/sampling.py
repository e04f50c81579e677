"""Reference sampler: temperature, top-k, top-p, min-p and batch-invariant seeded draws in PyTorch.

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
        masked = _mask_banned(logits, params.banned_token_ids)
        token_ids = masked.argmax(dim=-1)
        is_sampled = params.temperature > 0
        if bool(is_sampled.any()):
            rows = is_sampled.nonzero().squeeze(1)
            token_ids[rows] = _draw(
                masked[rows],
                params.temperature[rows],
                params.top_k[rows],
                params.top_p[rows],
                params.min_p[rows],
                params.seeds[rows],
                params.steps[rows],
            )
        return sampler_output(logits, token_ids, params)


def check_sampler_inputs(spec: SamplingSpec, logits: torch.Tensor, params: SamplingTensors) -> None:
    """`ValueError` unless `logits` is `[batch, vocab_size]` and `params` asks for at most `max_logprobs`."""
    if logits.dim() != 2 or logits.shape[1] != spec.vocab_size:
        raise ValueError(f"logits must be [batch, {spec.vocab_size}], got {list(logits.shape)}")
    if params.num_logprobs > spec.max_logprobs:
        raise ValueError(f"num_logprobs={params.num_logprobs} exceeds this sampler's max_logprobs={spec.max_logprobs}")


def sampler_output(logits: torch.Tensor, token_ids: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
    """The chosen `token_ids` with their logprobs and ranks under the raw log-softmax of `logits`, and the
    top `num_logprobs`; NaN logprobs and zero ranks when no row asked for logprobs."""
    if not params.needs_logprobs and params.num_logprobs == 0:
        nan = torch.full(token_ids.shape, float("nan"), device=logits.device)
        return SamplerOutput(token_ids=token_ids, logprobs=nan, ranks=torch.zeros_like(token_ids))
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    chosen = raw_logprobs.gather(1, token_ids[:, None])
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    output = SamplerOutput(token_ids=token_ids, logprobs=chosen.squeeze(1), ranks=ranks)
    if params.num_logprobs > 0:
        num_top = min(params.num_logprobs, logits.shape[-1])
        output.top_logprobs, output.top_token_ids = raw_logprobs.topk(num_top, dim=-1)
    return output


def _mask_banned(logits: torch.Tensor, banned_token_ids: list[list[int]] | None) -> torch.Tensor:
    """Copy of `logits` with each row's banned ids set to -inf (the input is left untouched)."""
    if not banned_token_ids or not any(banned_token_ids):
        return logits
    rows = [row for row, ids in enumerate(banned_token_ids) for _ in ids]
    cols = [token_id for ids in banned_token_ids for token_id in ids]
    masked = logits.clone()
    # one host-to-device copy, and the fill value made on the device: each blocking copy of a host
    # tensor would wait for the whole stream (the model's forward included)
    index = torch.tensor([rows, cols]).to(logits.device, non_blocking=True)
    masked.index_put_((index[0], index[1]), torch.full((), float("-inf"), device=logits.device))
    return masked


def _draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filters, then a seeded Gumbel-max draw, per row."""
    scaled = logits / temperature[:, None]
    vocab_size = scaled.shape[-1]
    if bool(((top_k > 0) & (top_k < vocab_size)).any() or (top_p < 1).any()):
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    if bool((min_p > 0).any()):
        threshold = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    return _gumbel_argmax(scaled, seeds, steps)


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` largest values, then the smallest prefix whose mass reaches `top_p`."""
    vocab_size = scaled.shape[-1]
    sorted_values, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=scaled.device)
    keep_count = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    sorted_values = sorted_values.masked_fill(positions[None, :] >= keep_count[:, None], float("-inf"))
    # fp64 so that rows with top_p = 1 and long tails never lose tokens to rounding of the running sum.
    probs = torch.softmax(sorted_values.double(), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    outside_nucleus = (mass_before >= top_p.double()[:, None]) & (top_p < 1)[:, None]
    outside_nucleus[:, 0] = False
    sorted_values = sorted_values.masked_fill(outside_nucleus, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, sorted_ids, sorted_values)


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
