"""Reference speculative verifier: greedy matching and rejection sampling, vectorised over the batch.

Rejection sampling (Leviathan et al., Chen et al.) emits tokens distributed exactly as the target's
`softmax(logits / temperature)`, whatever the draft distribution. Only temperature shapes the target
here; the `VerifyBackend` contract carries no top-k, top-p or min-p.
"""

from __future__ import annotations

import torch

from deepinfer_core.backends.verify import VerifyOutput, VerifySpec


class ReferenceVerifier:
    """Pure-PyTorch `VerifyBackend`."""

    def __init__(self, spec: VerifySpec, device: torch.device) -> None:
        self.spec = spec
        self.device = torch.device(device)

    def verify(
        self,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        temperature: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> VerifyOutput:
        """Accept the longest valid prefix of drafts per row and append one target token.

        See `VerifyBackend.verify`. Rows may mix greedy (temperature 0) and sampled requests.
        """
        self._check(draft_token_ids, draft_probs, target_logits, temperature)
        num_rows, num_drafts = draft_token_ids.shape
        is_greedy = temperature <= 0
        # Greedy rows: the target's choice at every position is its argmax.
        target_tokens = target_logits.argmax(dim=-1)
        accepted = draft_token_ids == target_tokens[:, :num_drafts]
        if bool((~is_greedy).any()):
            sampled_tokens, sampled_accepted = _rejection_sample(
                draft_token_ids, draft_probs, target_logits, temperature, generator
            )
            target_tokens = torch.where(is_greedy[:, None], target_tokens, sampled_tokens)
            accepted = torch.where(is_greedy[:, None], accepted, sampled_accepted)
        num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
        # Accepted positions hold the draft (equal to the target's token there for greedy rows); the
        # position right after holds the target's correction or bonus token; the rest is padding.
        positions = torch.arange(num_drafts + 1, device=draft_token_ids.device)
        padded_drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((num_rows, 1), -1)], dim=1)
        token_ids = torch.where(positions[None, :] < num_accepted[:, None], padded_drafts, target_tokens)
        token_ids = token_ids.masked_fill(positions[None, :] > num_accepted[:, None], -1)
        return VerifyOutput(token_ids=token_ids, num_accepted=num_accepted)

    def _check(
        self,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        temperature: torch.Tensor,
    ) -> None:
        num_rows, num_drafts = draft_token_ids.shape
        if num_drafts > self.spec.max_draft_tokens:
            raise ValueError(
                f"{num_drafts} draft tokens exceed max_draft_tokens={self.spec.max_draft_tokens}"
            )
        expected = [num_rows, num_drafts + 1, self.spec.vocab_size]
        if list(target_logits.shape) != expected:
            raise ValueError(f"target_logits must be {expected}, got {list(target_logits.shape)}")
        expected = [num_rows, num_drafts, self.spec.vocab_size]
        if draft_probs is not None and list(draft_probs.shape) != expected:
            raise ValueError(f"draft_probs must be {expected}, got {list(draft_probs.shape)}")
        if list(temperature.shape) != [num_rows]:
            raise ValueError(f"temperature must be [{num_rows}], got {list(temperature.shape)}")


def _rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: whether the draft is accepted, and the token to emit if it is the first rejection.

    :returns: `[B, k + 1]` tokens (recovered tokens at draft positions, bonus token last) and `[B, k]`
        acceptance. Greedy rows get meaningless values; the caller replaces them.
    """
    num_rows, num_drafts = draft_token_ids.shape
    safe_temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    target_probs = torch.softmax(target_logits.double() / safe_temperature.double()[:, None, None], dim=-1)
    if draft_probs is None:
        draft_probs = torch.zeros_like(target_probs[:, :num_drafts])
        draft_probs.scatter_(-1, draft_token_ids[..., None], 1.0)
    else:
        draft_probs = draft_probs.double()
    draft_index = draft_token_ids[..., None]
    p_draft = target_probs[:, :num_drafts].gather(-1, draft_index).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_index).squeeze(-1)
    uniforms = torch.rand(
        (num_rows, num_drafts), dtype=torch.float64, device=target_logits.device, generator=generator
    )
    # u < p/q  <=>  u * q < p; no division, and q = 0 (a draft its own sampler could not draw) accepts
    # only where p > 0.
    accepted = uniforms * q_draft < p_draft
    residual = (target_probs[:, :num_drafts] - draft_probs).clamp(min=0)
    residual_mass = residual.sum(dim=-1, keepdim=True)
    # p == q leaves no residual; rejection then has probability 0, so any valid distribution will do.
    residual = torch.where(residual_mass > 0, residual, target_probs[:, :num_drafts])
    choices = torch.cat([residual, target_probs[:, num_drafts:]], dim=1)
    tokens = torch.multinomial(choices.reshape(-1, choices.shape[-1]), 1, generator=generator)
    return tokens.view(num_rows, num_drafts + 1), accepted
