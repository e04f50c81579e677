"""Sampling contract: per-request temperature, top-k, top-p, min-p, penalties, logit bias, allowed ids,
seeded draws and logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """What the sampler must support."""

    vocab_size: int
    """Logit width."""
    max_logprobs: int = 20
    """Largest `logprobs` a request may ask for."""
    deterministic: bool = False
    """Batch-invariant mode (`EngineConfig.deterministic`): a row's logprobs (and token) must be
    bit-identical whatever other rows share the call, e.g. a log-softmax of one program a row with a fixed
    reduction order. Every other step of `sampling_ops` already works row by row; the reference takes the
    log-softmax on fixed row tiles (`reference.invariant.log_softmax_rows`). A sampler without such a
    log-softmax declines the spec."""


@dataclass
class TokenPenalties:
    """vLLM's presence, frequency and repetition penalties of one step, with the token ids they read.

    Ids are padded with `vocab_size` (a column past the vocabulary, dropped after counting).
    """

    presence: torch.Tensor
    """`[B]` fp32; subtracted from the logit of each token generated at least once (0: off)."""
    frequency: torch.Tensor
    """`[B]` fp32; subtracted once per time the token was generated (0: off)."""
    repetition: torch.Tensor
    """`[B]` fp32; a token seen in the prompt or the output has a positive logit divided by it and a
    negative one multiplied by it (1: off)."""
    output_token_ids: torch.Tensor
    """`[B, L]` int64 ids generated so far, padded with `vocab_size`."""
    prompt_token_ids: torch.Tensor | None = None
    """`[B, P]` int64 prompt ids, padded with `vocab_size`; None when no row has a repetition penalty."""


@dataclass
class SparseTokenValues:
    """Per-row token entries as flat (row, token id, value) triples."""

    rows: torch.Tensor
    """`[N]` int64 batch rows."""
    token_ids: torch.Tensor
    """`[N]` int64 token ids."""
    values: torch.Tensor | None = None
    """`[N]` fp32 values (a logit bias), or None for a plain set of ids."""


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, built by the runner. Row `i` is one request."""

    temperature: torch.Tensor
    """`[B]` fp32; 0 means greedy."""
    top_k: torch.Tensor
    """`[B]` int64; 0 or -1 means no top-k filter."""
    top_p: torch.Tensor
    """`[B]` fp32 in (0, 1]."""
    min_p: torch.Tensor
    """`[B]` fp32 in [0, 1]."""
    seeds: torch.Tensor
    """`[B]` int64 per-request seed."""
    steps: torch.Tensor
    """`[B]` int64 index of the token being drawn (so a seeded draw does not depend on the batch)."""
    num_logprobs: int
    """Top logprobs to return per row (max over the batch); 0 for none."""
    banned_token_ids: list[list[int]] | None = None
    """Per row, token ids to mask out this step (for `min_tokens` and EOS handling)."""
    needs_logprobs: bool = True
    """False when no row asked for logprobs: the sampler may then skip the log-softmax and return
    NaN logprobs and zero ranks."""
    host_flags: tuple[bool, bool, bool] | None = None
    """Host copies of (some row draws: temperature > 0; some drawing row filters by top-k < vocab or
    top-p < 1; some drawing row filters by min-p > 0), so a sampler can choose its passes without
    reading the device; None: derive them from the tensors."""
    allowed_token_ids: SparseTokenValues | None = None
    """Rows restricted to a set of ids (`SamplingParams.allowed_token_ids`): every other id is masked
    in those rows; rows absent here are unrestricted. None: no row is restricted."""
    logit_bias: SparseTokenValues | None = None
    """Values added to logits (`SamplingParams.logit_bias`); None: no row has a bias."""
    penalties: TokenPenalties | None = None
    """Presence, frequency and repetition penalties; None: no row has one."""


@dataclass
class SamplerOutput:
    """What the sampler returns for a step."""

    token_ids: torch.Tensor
    """`[B]` int64 chosen tokens."""
    logprobs: torch.Tensor
    """`[B]` fp32 log-probability of the chosen token under the unfiltered distribution."""
    ranks: torch.Tensor
    """`[B]` int64 rank of the chosen token (1 = most likely)."""
    top_token_ids: torch.Tensor | None = None
    """`[B, num_logprobs]` int64 most likely tokens, or None."""
    top_logprobs: torch.Tensor | None = None
    """`[B, num_logprobs]` fp32 their log-probabilities, or None."""


@runtime_checkable
class SamplingBackend(Protocol):
    """Turns a step's last-position logits into tokens and logprobs."""

    spec: SamplingSpec

    def sample(self, logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
        """Sample one token per row.

        Order, as vLLM's: ids outside a row's allowed set and banned ids masked; logit bias added;
        repetition, then frequency and presence penalties; greedy rows take the argmax; other rows
        divide by temperature, then apply top-k, top-p and min-p, then draw with a generator seeded
        from `(seeds[i], steps[i])`. Logprobs and ranks are those of the raw (unadjusted, unfiltered,
        temperature 1) log-softmax. Every step is row by row, so a row's token never depends on its batch.

        :param logits: `[B, vocab_size]` fp32.
        :param params: the step's `SamplingTensors`.
        :returns: a `SamplerOutput`.
        """
        ...
