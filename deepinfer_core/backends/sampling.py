"""Sampling contract: per-request temperature, top-k, top-p, min-p, seeded draws and logprobs."""

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

        Order: banned ids masked; greedy rows take the argmax; other rows divide by temperature, then
        apply top-k, top-p and min-p, then draw with a generator seeded from `(seeds[i], steps[i])`.
        Logprobs and ranks are those of the raw (unfiltered, temperature 1) log-softmax.

        :param logits: `[B, vocab_size]` fp32.
        :param params: the step's `SamplingTensors`.
        :returns: a `SamplerOutput`.
        """
        ...
