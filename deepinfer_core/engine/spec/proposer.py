"""The engine's side of speculative decoding: per step, which drafts each decoding sequence verifies
(`Speculator.choose_drafts`, the scheduler's callback), and what came of them (`Speculator.record`:
online acceptance estimates and `SpecDecodeMetrics`).

A drafter is any object with `propose(seq, max_drafts) -> (drafts, confidences)`: `confidences` are
its per-draft probabilities of surviving (None: it has none, and the request's own acceptance history
estimates them). The n-gram drafter lives here; the MTP drafter's proposals come back from the runner
with each step's result and are read from the sequence (`Sequence.draft_token_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from deepinfer_core.engine.plan import PENDING_TOKEN, StepPlan
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.spec.config import SpeculativeConfig
from deepinfer_core.engine.spec.ngram import propose_ngram
from deepinfer_core.engine.spec.policy import confidence_draft_lengths, fixed_draft_lengths
from deepinfer_core.outputs import SpecDecodeMetrics

_HISTORY_DECAY = 0.9
"""Weight of a request's older verify steps in its acceptance estimate, per step."""


class Drafter(Protocol):
    """Proposes drafts for one sequence."""

    def propose(self, seq: Sequence, max_drafts: int) -> tuple[list[int], list[float] | None]:
        """Up to `max_drafts` tokens to follow `seq.token_ids`, and per draft its probability of
        surviving given the earlier ones survived (None: no estimate of its own)."""


@dataclass
class NgramDrafter:
    """Prompt lookup over the sequence's prompt and output (`ngram.propose_ngram`)."""

    min_n: int
    max_n: int
    has_confidences = False
    """It proposes no confidences: the request's history stands for them (`Speculator.allows_overlap`)."""

    def propose(self, seq: Sequence, max_drafts: int) -> tuple[list[int], list[float] | None]:
        return propose_ngram(seq.token_ids, max_drafts, self.min_n, self.max_n), None


class StoredDrafter:
    """Drafts the model side proposed with the last step's result (MTP), kept on the sequence."""

    def propose(self, seq: Sequence, max_drafts: int) -> tuple[list[int], list[float] | None]:
        drafts, confidences = seq.draft_token_ids, seq.draft_confidences
        return list(drafts[:max_drafts]), list(confidences[:max_drafts]) if confidences else None


@dataclass
class _History:
    accepted: float = 0.0
    tested: float = 0.0

    @property
    def confidence(self) -> float:
        """Laplace-smoothed chance a draft survives given the ones before it did."""
        return (self.accepted + 1.0) / (self.tested + 2.0)


class Speculator:
    """Chooses each step's drafts and keeps their statistics; one per engine."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        """Replaceable (tests and benches plug in oracle or adversarial drafters)."""
        self.totals = SpecDecodeMetrics()
        self._metrics: dict[str, SpecDecodeMetrics] = {}
        self._history: dict[str, _History] = {}
        self._proposed: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> Speculator:
        if config.method == "ngram":
            return cls(config, NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max))
        return cls(config, StoredDrafter())

    def track(self, seq_id: str, metrics: SpecDecodeMetrics) -> None:
        """Count `seq_id`'s drafts into `metrics` (its request's, shared by its completions)."""
        self._metrics[seq_id] = metrics
        self._history[seq_id] = _History()

    def forget(self, seq_id: str) -> None:
        for table in (self._metrics, self._history, self._proposed):
            table.pop(seq_id, None)

    def max_drafts(self, seq: Sequence) -> int:
        """Drafts worth verifying for `seq`: none while its sampling reads its history (penalties) or
        its state is exported (`Sequence.takes_drafts`), else at most k and one fewer than the tokens it
        may still emit. A grammar's request takes drafts: each draft's row gets its own mask."""
        if not seq.takes_drafts or seq.token_ids[-1] == PENDING_TOKEN:  # drafts follow known tokens only
            return 0
        return self._draft_limit(seq)

    def _draft_limit(self, seq: Sequence) -> int:
        limit = self.config.num_speculative_tokens
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - seq.num_output_tokens - 1)
        return max(0, limit)

    def choose_drafts(self, seqs: list[Sequence], budget: int) -> list[tuple[int, ...]]:
        """The scheduler's callback: per decoding sequence, the drafts it verifies this step."""
        proposals, confidences = [], []
        for seq in seqs:
            limit = self.max_drafts(seq)
            drafts, confidence = self.drafter.propose(seq, limit) if limit else ([], None)
            drafts = list(drafts[:limit])
            if confidence is None:
                history = self._history.get(seq.request_id) or _History()
                confidence = [history.confidence] * len(drafts)
            proposals.append(drafts)
            confidences.append(list(confidence[: len(drafts)]))
            self._proposed[seq.request_id] = len(drafts)
        if self.config.draft_length_policy == "confidence":
            lengths = confidence_draft_lengths(confidences, budget, self.config.verify_cost_per_token,
                                               self.config.sync_cost)
        else:
            lengths = fixed_draft_lengths([len(p) for p in proposals], budget)
        return [tuple(p[:n]) for p, n in zip(proposals, lengths, strict=True)]

    def allows_overlap(self, seqs: list[Sequence]) -> bool:
        """Whether the next step of `seqs` may launch before the host reads this step's tokens
        (overlapped decode): only when it would verify no draft whatever the drafter proposed. That is
        known without the tokens for the confidence policy over a drafter without confidences of its own
        (`has_confidences = False`): the requests' acceptance histories decide, and here they say no."""
        if self.config.draft_length_policy != "confidence" or getattr(self.drafter, "has_confidences", True):
            return False
        confidences = []
        for seq in seqs:
            history = self._history.get(seq.request_id) or _History()
            confidences.append([history.confidence] * self._draft_limit(seq))
        budget = sum(map(len, confidences))  # the policy's choice only shrinks with a smaller budget
        config = self.config
        return not any(confidence_draft_lengths(confidences, budget, config.verify_cost_per_token, config.sync_cost))

    def record(self, plan: StepPlan, num_accepted: list[int] | None) -> None:
        """After a step: update each decoding request's acceptance estimate and metrics."""
        accepted_of = {}
        if num_accepted is not None:
            sampled = [r for r in plan.requests if r.is_sampled]
            accepted_of = {r.request_id: a for r, a in zip(sampled, num_accepted, strict=True)}
        for request in plan.requests:
            proposed = self._proposed.pop(request.request_id, None)
            if proposed is None:
                continue
            d = request.num_draft_tokens
            accepted = accepted_of.get(request.request_id) if d else None
            if accepted is not None:
                history = self._history.get(request.request_id)
                if history is not None:
                    history.accepted = history.accepted * _HISTORY_DECAY + accepted
                    history.tested = history.tested * _HISTORY_DECAY + accepted + (1 if accepted < d else 0)
            for metrics in (self._metrics.get(request.request_id), self.totals):
                if metrics is not None:
                    metrics.record(proposed, d, accepted)
