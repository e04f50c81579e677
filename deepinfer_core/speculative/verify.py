"""The model side of a verification step: which logits rows it needs, and which drafts it accepts.

A request with d drafts computes its last token and the d drafts in one forward and takes d + 1 logits
rows: row j predicts the token after position `start + j`. The sampler draws every row as it would
without speculation (row j is the request's generated token number `start + 1 + j - prompt`, under the
request's seed), and draft j + 1 is accepted iff it equals row j's draw. The request emits rows
0 .. a for a accepted drafts: the accepted drafts (equal to the draws) and the draw after them. Each
emitted token is therefore exactly the token the request draws without speculation, so greedy and
seeded sampling are unchanged token for token, and every request samples from the target's own
distribution whatever the drafts were (research-algorithms.md §6).

`acceptance="rejection"` instead verifies requests that sample without a seed and without logit
filters through the `VerifyBackend` (accept with min(1, p/q), resample the residual), which accepts
at least as often for a drafter whose draft distribution q is known.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from deepinfer_core.backends import SamplerOutput
from deepinfer_core.backends.sampling_ops import sampler_output
from deepinfer_core.backends.sampling_tensors import host_tensor
from deepinfer_core.backends.verify import VerifyBackend
from deepinfer_core.plan import StepPlan
from deepinfer_core.sampling_params import SamplingParams


def logits_row_requests(plan: StepPlan, sampled: list[int]) -> list[int]:
    """Per logits row of a step, the index of its request in `plan.requests` (d + 1 rows a request
    with d drafts, one a sampled request without)."""
    rows = []
    for i in sampled:
        rows += [i] * (plan.requests[i].num_draft_tokens + 1)
    return rows


def row_token_offsets(plan: StepPlan, row_requests: list[int]) -> list[int]:
    """Per logits row, its offset from the request's last row (-d .. 0): row j of a request with d drafts
    draws the token `end - d + j`, the last row the token after every draft."""
    offsets, previous, j = [], None, 0
    for i in row_requests:
        j = j + 1 if i == previous else 0
        previous = i
        offsets.append(j - plan.requests[i].num_draft_tokens)
    return offsets


def is_rejection_eligible(params: SamplingParams, num_generated: int) -> bool:
    """Whether rejection sampling draws this request exactly: sampled without a seed, with nothing but
    temperature shaping its distribution (the `VerifyBackend` contract knows only temperature)."""
    return (params.seed is None and not params.is_greedy and not (0 < params.top_k) and params.top_p >= 1
            and params.min_p <= 0 and not params.logit_bias and not params.allowed_token_ids
            and not params.bad_words_token_ids and num_generated >= params.min_tokens)


@dataclass
class Verified:
    """What a verification step emits: output rows (with repeats, one per emitted token) and counts."""

    sampled: list[int]
    """Per emitted token, its request's index in `plan.requests`, in order."""
    output: SamplerOutput
    num_accepted: list[int]
    """Per sampled request (in `sampled` order without repeats), drafts accepted."""


def accept_drafts(plan: StepPlan, row_requests: list[int], output: SamplerOutput,
                  rejection: dict[int, tuple[torch.Tensor, int]] | None = None,
                  needs_logprobs: bool = True) -> Verified:
    """Apply the seeded-draw rule to a step's sampler output (`rejection`: per request index, tokens
    `[d + 1]` and accepted count from the verifier, which replace the rule for that request). Reads the
    sampled ids once; the emitted `token_ids` come back on the host, the other fields stay on the device.
    Without `needs_logprobs` (no request reads them) the emitted logprobs are NaN and the ranks 0, on the
    host, as the sampler gives them then: nothing is gathered on the device."""
    tokens = output.token_ids.tolist()
    emit, num_accepted, row = [], [], 0
    requests = plan.requests
    while row < len(row_requests):
        i = row_requests[row]
        d = requests[i].num_draft_tokens
        drafts = requests[i].token_ids[len(requests[i].token_ids) - d :]
        if rejection is not None and i in rejection:
            a = int(rejection[i][1])
        else:
            a = 0
            while a < d and drafts[a] == tokens[row + a]:
                a += 1
        emit += range(row, row + a + 1)
        num_accepted.append(a)
        row += d + 1
    token_ids = host_tensor([tokens[r] for r in emit]).to(output.token_ids.dtype)
    sampled = [row_requests[r] for r in emit]
    if not needs_logprobs:
        unread = SamplerOutput(token_ids, torch.full((len(emit),), float("nan")), torch.zeros_like(token_ids))
        return Verified(sampled, unread, num_accepted)
    index = host_tensor(emit).to(output.token_ids.device, non_blocking=True)
    picked = {f.name: getattr(output, f.name) for f in fields(output) if getattr(output, f.name) is not None}
    selected = {name: value.index_select(0, index) for name, value in picked.items() if name != "token_ids"}
    # the emitted ids are already on the host: the engine reads them without a second device round trip
    selected["token_ids"] = token_ids
    return Verified(sampled, replace(output, **selected), num_accepted)


def rejection_verify(verifier: VerifyBackend, plan: StepPlan, row_requests: list[int], eligible: set[int],
                     logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None,
                     draft_probs: dict[int, torch.Tensor] | None = None) -> dict[int, tuple[torch.Tensor, int]]:
    """Run the verifier over the eligible requests with drafts, grouped by draft count; per request
    index, its `[d + 1]` tokens (accepted drafts, then the correction or bonus) and accepted count.

    `draft_probs`: per request index, the distributions `[>= d, vocab]` its drafts were drawn from (the
    MTP drafter's); requests without are verified as one-hot drafts (q = 1 at the draft)."""
    first_row: dict[int, int] = {}
    for row, i in enumerate(row_requests):
        first_row.setdefault(i, row)
    groups: dict[int, list[int]] = {}
    for i in sorted(eligible):
        d = plan.requests[i].num_draft_tokens
        if d:
            groups.setdefault(d, []).append(i)
    results = {}
    for d, members in groups.items():
        rows = torch.tensor([first_row[i] + j for i in members for j in range(d + 1)], device=logits.device)
        drafts = torch.tensor([plan.requests[i].token_ids[-d:] for i in members], device=logits.device)
        temps = temperature[rows.view(len(members), d + 1)[:, 0]]
        probs = _draft_distributions(members, drafts, d, logits.shape[-1], draft_probs or {})
        out = verifier.verify(drafts, probs, logits[rows].view(len(members), d + 1, -1), temps, generator)
        accepted = out.num_accepted.tolist()  # one read a group, not one a request
        for m, i in enumerate(members):
            results[i] = (out.token_ids[m], accepted[m])
    return results


def _draft_distributions(members: list[int], drafts: torch.Tensor, d: int, vocab: int,
                         draft_probs: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """`[M, d, vocab]` q of a group's drafts: the drafter's where it gave them, one-hot elsewhere (None
    when no member has any, which the verifier reads as one-hot)."""
    if not any(i in draft_probs for i in members):
        return None
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    return torch.stack([draft_probs[i][:d].float() if i in draft_probs else one_hot[m]
                        for m, i in enumerate(members)])


def merge_rejection(output: SamplerOutput, logits: torch.Tensor, tensors, row_requests: list[int],
                    results: dict[int, tuple[torch.Tensor, int]]) -> SamplerOutput:
    """The sampler output with each verified request's rows replaced by the verifier's tokens (rows past
    its emitted tokens keep the sampler's, never emitted), logprobs recomputed for them."""
    token_ids = output.token_ids.clone()
    first_row: dict[int, int] = {}
    for row, i in enumerate(row_requests):
        first_row.setdefault(i, row)
    for i, (tokens, a) in results.items():
        token_ids[first_row[i] : first_row[i] + a + 1] = tokens[: a + 1]
    return sampler_output(logits, token_ids, tensors)
