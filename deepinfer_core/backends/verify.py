"""Speculative verification contract: accept a prefix of draft tokens against the target model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class VerifySpec:
    """What the verifier must support."""

    vocab_size: int
    """Logit width."""
    max_draft_tokens: int
    """Largest number of draft tokens per request and step."""


@dataclass
class VerifyOutput:
    """Result of verifying one step's drafts."""

    token_ids: torch.Tensor
    """`[B, max_draft_tokens + 1]` int64 accepted drafts followed by one target token, -1 padded."""
    num_accepted: torch.Tensor
    """`[B]` int64 drafts accepted (the row holds `num_accepted + 1` valid tokens)."""


@runtime_checkable
class VerifyBackend(Protocol):
    """Checks draft tokens against target probabilities (greedy match or rejection sampling)."""

    spec: VerifySpec

    def verify(
        self,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        temperature: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> VerifyOutput:
        """Accept the longest valid prefix of drafts per row and append one target token.

        Greedy rows (temperature 0) accept a draft iff it equals the target argmax. Other rows use
        rejection sampling: accept draft `d` with probability `min(1, p(d) / q(d))`, on rejection draw
        from `norm(max(p - q, 0))`; after the last accepted draft, draw the bonus token from `p`.

        :param draft_token_ids: `[B, k]` int64 drafts.
        :param draft_probs: `[B, k, vocab]` draft distributions, or None for greedy drafts (q is one-hot).
        :param target_logits: `[B, k + 1, vocab]` fp32 target logits at each draft position and after.
        :param temperature: `[B]` fp32; 0 means greedy.
        :param generator: random source for sampled rows.
        :returns: a `VerifyOutput`.
        """
        ...
