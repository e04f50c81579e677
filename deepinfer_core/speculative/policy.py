"""How many drafts each request sends to the target this step.

`fixed`: every proposed draft, up to k. `confidence`: DSpark's hardware-aware prefix scheduler
(research-algorithms.md §1.3, Algorithm 1) with a linear step cost. Draft j of request r survives
verification with probability `a[r][j] = c[r][1] * ... * c[r][j]` (the drafter's per-token
confidences); verifying it adds `a[r][j]` expected tokens and one token of work. A step of B tokens
costs `1 + cost_per_token * B` (its fixed part, weights streamed once, plus a small per-token part),
and the policy maximises the expected tokens per unit time `tau / (1 + cost_per_token * B)`: it walks
the candidates by survival, best first, extends a request by one draft while that raises the rate and
fits the token budget, and stops at the first candidate that does not (the early break keeps the
choice from depending on later drafts' values, which DSpark needs for losslessness; our seeded rule
is lossless whatever is verified).

A step that verifies any draft also costs `sync_cost`: its accepted counts must reach the host before
the next step is planned, so it cannot overlap the next step's host work the way a plain decode step
does (`engine/overlap.py`). The walk above ignores it; the chosen drafts are kept only if their rate
with it still beats the rate of verifying nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


def fixed_draft_lengths(num_proposed: Sequence[int], budget: int) -> list[int]:
    """Every proposed draft, as long as the step's token budget (beyond each request's own token) lasts."""
    lengths = []
    for n in num_proposed:
        take = max(0, min(n, budget))
        lengths.append(take)
        budget -= take
    return lengths


def confidence_draft_lengths(confidences: Sequence[Sequence[float]], budget: int,
                             cost_per_token: float, sync_cost: float = 0.0) -> list[int]:
    """Per request, how many of its drafts to verify (a prefix), by expected tokens per unit time.

    :param confidences: per request, each draft's probability of surviving given the ones before it
        survived (in [0, 1]); its length is the number of drafts proposed.
    :param budget: most draft tokens the step can add beyond each request's own token.
    :param cost_per_token: time one more verified token adds, relative to a step's fixed cost.
    :param sync_cost: time a step that verifies any draft adds once (its host round trip), same unit.
    :returns: per request, the number of drafts to verify (<= its proposals).
    """
    num_requests = len(confidences)
    candidates = []
    for r, row in enumerate(confidences):
        survival = 1.0
        for j, c in enumerate(row, start=1):
            survival *= min(max(float(c), 0.0), 1.0)
            if survival <= 0.0:
                break
            candidates.append((-survival, j, r))
    candidates.sort()  # best survival first; ties: the shorter prefix first, so prefixes stay valid
    lengths = [0] * num_requests
    tokens, expected = num_requests, float(num_requests)
    best_rate = expected / (1 + cost_per_token * tokens)
    for neg_survival, j, r in candidates:
        if budget <= 0 or lengths[r] != j - 1:
            break  # out of budget, or a request's prefix would skip a draft (cannot happen when sorted)
        rate = (expected - neg_survival) / (1 + cost_per_token * (tokens + 1))
        if rate <= best_rate:
            break
        lengths[r], tokens, expected, best_rate = j, tokens + 1, expected - neg_survival, rate
        budget -= 1
    if tokens > num_requests and expected / (1 + cost_per_token * tokens + sync_cost) <= num_requests / (
            1 + cost_per_token * num_requests):
        return [0] * num_requests  # the drafts do not pay for the round trip they cost
    return lengths
