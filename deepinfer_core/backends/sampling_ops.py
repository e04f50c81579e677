"""Sampling steps every sampler shares, in PyTorch: input checks, logit adjustments, filters, output.

The reference sampler (`deepinfer_core.reference.sampling`) is these functions plus a seeded draw; an
accelerated sampler reuses them on its device and replaces only what it makes faster (the NVIDIA
plugin fuses the draw into one kernel). Every function works row by row: a row's result never depends
on the other rows of its batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_core.backends.sampling import (
    SamplerOutput,
    SamplingSpec,
    SamplingTensors,
    SparseTokenValues,
    TokenPenalties,
)


def check_sampler_inputs(spec: SamplingSpec, logits: torch.Tensor, params: SamplingTensors) -> None:
    """`ValueError` unless `logits` is `[batch, vocab_size]` and `params` asks for at most `max_logprobs`."""
    if logits.dim() != 2 or logits.shape[1] != spec.vocab_size:
        raise ValueError(f"logits must be [batch, {spec.vocab_size}], got {list(logits.shape)}")
    if params.num_logprobs > spec.max_logprobs:
        raise ValueError(f"num_logprobs={params.num_logprobs} exceeds this sampler's max_logprobs={spec.max_logprobs}")


def adjust_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The logits every row chooses from (greedy or drawn), before temperature and filters.

    In vLLM's order: ids outside a row's allowed set and banned ids masked to -inf, logit bias added,
    then the repetition, frequency and presence penalties. `logits` (fp32) is left untouched.
    """
    adjusted = mask_disallowed(logits, params.allowed_token_ids)
    adjusted = mask_banned(adjusted, params.banned_token_ids)
    if params.logit_bias is not None:
        adjusted = add_logit_bias(adjusted, params.logit_bias)
    if params.penalties is not None:
        adjusted = apply_penalties(adjusted, params.penalties)
    return adjusted


def mask_banned(logits: torch.Tensor, banned_token_ids: list[list[int]] | None) -> torch.Tensor:
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


def mask_disallowed(logits: torch.Tensor, allowed: SparseTokenValues | None) -> torch.Tensor:
    """Copy of `logits` where each row listed in `allowed` keeps only its allowed ids (others -inf)."""
    if allowed is None:
        return logits
    is_restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    is_restricted[allowed.rows] = True
    keep = (~is_restricted)[:, None].expand_as(logits).clone()
    keep[allowed.rows, allowed.token_ids] = True
    return logits.masked_fill(~keep, float("-inf"))


def add_logit_bias(logits: torch.Tensor, bias: SparseTokenValues) -> torch.Tensor:
    """Copy of `logits` with `bias.values` added at `(rows, token_ids)`."""
    return logits.index_put((bias.rows, bias.token_ids), bias.values.to(logits.dtype), accumulate=True)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[B, vocab_size]` int64: how often each id occurs in each row of `token_ids` (padding = vocab_size)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, penalties: TokenPenalties) -> torch.Tensor:
    """vLLM's penalties: repetition (prompt and output ids), then frequency and presence (output ids)."""
    vocab_size = logits.shape[-1]
    output_counts = token_counts(penalties.output_token_ids, vocab_size)
    seen = output_counts > 0
    if penalties.prompt_token_ids is not None:
        seen = seen | (token_counts(penalties.prompt_token_ids, vocab_size) > 0)
    repetition = torch.where(seen, penalties.repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - penalties.frequency[:, None] * output_counts
    return logits - penalties.presence[:, None] * (output_counts > 0)


def apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
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


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop values whose probability is below `min_p` times the row's most likely one."""
    threshold = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def sampling_flags(params: SamplingTensors, is_sampled: torch.Tensor, vocab_size: int) -> list[bool]:
    """Which optional passes a batch needs: `[any row drawn, any drawn row with top-k or top-p, any drawn
    row with min-p]`; from the host when the runner sent them (`host_flags`), else one read-back (which
    waits for the forward)."""
    if params.host_flags is not None:
        return params.host_flags
    return torch.stack([
        is_sampled.any(),
        (is_sampled & (((params.top_k > 0) & (params.top_k < vocab_size)) | (params.top_p < 1))).any(),
        (is_sampled & (params.min_p > 0)).any(),
    ]).tolist()


def filter_sampled(adjusted: torch.Tensor, params: SamplingTensors, is_sampled: torch.Tensor,
                   flags: list[bool]) -> torch.Tensor:
    """What the drawn rows draw from: `adjusted` divided by each row's temperature, then the top-k / top-p
    filter, then min-p (the passes `flags` (`sampling_flags`) asks for). Rows not drawn are divided by 1 and
    left unfiltered. Row by row, so a drawn row's values do not depend on the other rows."""
    scaled = adjusted / torch.where(is_sampled, params.temperature, 1.0)[:, None]
    if flags[1]:
        scaled = apply_top_k_top_p(scaled, torch.where(is_sampled, params.top_k, 0),
                                   torch.where(is_sampled, params.top_p, 1.0))
    if flags[2]:
        scaled = apply_min_p(scaled, torch.where(is_sampled, params.min_p, 0.0))
    return scaled


def sampler_output(logits: torch.Tensor, token_ids: torch.Tensor, params: SamplingTensors,
                   log_softmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   stable_ties: bool = False) -> SamplerOutput:
    """The chosen `token_ids` with their logprobs and ranks under the raw log-softmax of `logits`, and the
    top `num_logprobs`; NaN logprobs and zero ranks when no row asked for logprobs. `log_softmax` replaces
    torch's (`[B, V]` -> `[B, V]` fp32; a sampler's own kernel, e.g. a batch-invariant one for
    `SamplingSpec.deterministic`). `stable_ties` (deterministic mode): equal top logprobs are listed by
    ascending token id (a stable sort), where `topk`'s order among ties is unspecified on CUDA; bf16 logits
    tie often."""
    if not params.needs_logprobs and params.num_logprobs == 0:
        nan = torch.full(token_ids.shape, float("nan"), device=logits.device)
        return SamplerOutput(token_ids=token_ids, logprobs=nan, ranks=torch.zeros_like(token_ids))
    raw_logprobs = log_softmax(logits) if log_softmax is not None else torch.log_softmax(logits, dim=-1)
    chosen = raw_logprobs.gather(1, token_ids[:, None])
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    output = SamplerOutput(token_ids=token_ids, logprobs=chosen.squeeze(1), ranks=ranks)
    if params.num_logprobs > 0:
        num_top = min(params.num_logprobs, logits.shape[-1])
        if stable_ties:
            values, ids = raw_logprobs.sort(dim=-1, descending=True, stable=True)
            output.top_logprobs, output.top_token_ids = values[:, :num_top], ids[:, :num_top]
        else:
            output.top_logprobs, output.top_token_ids = raw_logprobs.topk(num_top, dim=-1)
    return output
