"""The engine's side of speculative decoding: per step, which drafts each decoding sequence verifies
(`Speculator.choose_drafts`, the scheduler's callback), and what came of them (`Speculator.record`:
online acceptance estimates, `gate.py`, and `SpecDecodeMetrics`).

A drafter is any object with `propose(seq, max_drafts) -> (drafts, confidences)`: `confidences` are
its per-draft probabilities of surviving (None: it has none, and the request's own acceptance history
estimates them), or raw scores the `Speculator` calibrates online per slot against observed acceptance
(`has_raw_confidences`: DSpark's confidence head, `calibration.py`). The n-gram drafter lives here; the
MTP and DSpark drafters' proposals come back from the runner with each step's result and are read from
the sequence (`Sequence.draft_token_ids`).

Never a loss: under the confidence policy a drafter that can pause (`is_pausable`: the n-gram drafter,
which drafts on the host only when asked, and DSpark, which the runner runs only after steps whose plan
asks for drafts, `StepPlan.propose_drafts`) is gated: while the requests' estimates say no draft pays,
it is not run and steps are left in flight as without speculation (`allows_overlap`, `wants_drafts`),
and requests are probed now and then (`gate.py`). A request's estimates learn from verified drafts and,
for calibrated drafters, from the calibrated chance of drafts the policy declined to verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from deepinfer_core.config.speculative import SpeculativeConfig
from deepinfer_core.outputs import SpecDecodeMetrics
from deepinfer_core.plan import PENDING_TOKEN, StepPlan
from deepinfer_core.sched.sequence import Sequence
from deepinfer_core.speculative.calibration import ConfidenceCalibration
from deepinfer_core.speculative.gate import DraftEstimate
from deepinfer_core.speculative.ngram import propose_ngram
from deepinfer_core.speculative.policy import confidence_draft_lengths, fixed_draft_lengths


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
    """It proposes no confidences: the request's estimates stand for them (`Speculator.is_gated`)."""
    is_pausable = True
    """It drafts on the host only when asked: a request gated off costs nothing (`Speculator.is_gated`)."""

    def propose(self, seq: Sequence, max_drafts: int) -> tuple[list[int], list[float] | None]:
        return propose_ngram(seq.token_ids, max_drafts, self.min_n, self.max_n), None


@dataclass
class StoredDrafter:
    """Drafts the model side proposed with the last step's result (MTP, DSpark), kept on the sequence."""

    has_confidences: bool = True
    """It proposes confidences of its own (MTP: its probability of each draft; DSpark: its confidence head's)."""
    has_raw_confidences: bool = False
    """Its confidences are raw scores, not probabilities (DSpark's head returns its projection with no
    sigmoid, as DeepSeek's reference does): the `Speculator` calibrates them (`calibration.py`)."""
    is_pausable: bool = False
    """The runner proposes only after steps whose plan asks for drafts (`StepPlan.propose_drafts`), so
    under the confidence policy a request whose drafts do not pay costs no drafter pass and no wait
    (DSpark); False: it drafts after every step (MTP)."""

    always_proposes = True
    """Asked, it proposes: a sequence without stored drafts was not asked (the runner paused it)."""

    def propose(self, seq: Sequence, max_drafts: int) -> tuple[list[int], list[float] | None]:
        drafts, confidences = seq.draft_token_ids, seq.draft_confidences
        return list(drafts[:max_drafts]), list(confidences[:max_drafts]) if confidences else None

    def discard(self, seq: Sequence) -> None:
        """Forget `seq`'s stored drafts once a step was planned from them: a pausable drafter may skip the
        next step, and drafts that follow an older token must not be read again."""
        if self.is_pausable:
            seq.draft_token_ids, seq.draft_confidences = [], None


class Speculator:
    """Chooses each step's drafts and keeps their statistics; one per engine."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        """Replaceable (tests and benches plug in oracle or adversarial drafters)."""
        self.totals = SpecDecodeMetrics()
        self.num_overlapped_steps = 0
        """Steps left in flight (overlapped decode) while speculating: no request drafted in them."""
        self.num_probe_steps = 0
        """Steps that verified a request's drafts as a probe (`gate.DraftEstimate.is_probe_due`)."""
        self.population = DraftEstimate()
        """Every request's steps in one estimate: where a new request's estimates start (`gate.py`)."""
        self.calibration = ConfidenceCalibration(config.num_speculative_tokens)
        """Raw confidence -> acceptance probability per slot, for drafters with raw confidences (DSpark)."""
        self._metrics: dict[str, SpecDecodeMetrics] = {}
        self._estimates: dict[str, DraftEstimate] = {}
        self._asked: dict[str, _Asked] = {}
        """Per sequence scheduled this step: what its drafter proposed and whether it probes."""

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> Speculator:
        if config.method == "ngram":
            return cls(config, NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max))
        if config.method == "dspark":
            return cls(config, StoredDrafter(has_raw_confidences=True, is_pausable=True))
        return cls(config, StoredDrafter())

    def track(self, seq_id: str, metrics: SpecDecodeMetrics) -> None:
        """Count `seq_id`'s drafts into `metrics` (its request's, shared by its completions)."""
        self._metrics[seq_id] = metrics
        self._estimates[seq_id] = DraftEstimate.seeded(self.population)

    def forget(self, seq_id: str) -> None:
        for table in (self._metrics, self._estimates, self._asked):
            table.pop(seq_id, None)

    @property
    def is_gated(self) -> bool:
        """Whether requests draft only while their estimates say it pays, probed now and then (`gate.py`):
        the confidence policy over a drafter that can pause (`is_pausable`; a drafter that does not say is
        pausable when it has no confidences of its own, as a host-side drafter asked per step)."""
        if self.config.draft_length_policy != "confidence":
            return False
        return bool(getattr(self.drafter, "is_pausable", not getattr(self.drafter, "has_confidences", True)))

    @property
    def calibrates(self) -> bool:
        """The drafter's confidences are raw scores calibrated here (`calibration.py`)."""
        return bool(getattr(self.drafter, "has_raw_confidences", False))

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

    def _estimate(self, seq: Sequence) -> DraftEstimate:
        return self._estimates.get(seq.request_id) or DraftEstimate()

    def choose_drafts(self, seqs: list[Sequence], budget: int) -> list[tuple[int, ...]]:
        """The scheduler's callback: per decoding sequence, the drafts it verifies this step."""
        proposals, confidences, probes = [], [], []
        is_gated = self.is_gated
        limits = [self.max_drafts(seq) for seq in seqs]
        estimates = [self._estimate(seq) for seq in seqs]
        # a step that probes waits for its tokens: requests half way to their own probe join it
        probing = is_gated and any(limit and e.is_probe_due for limit, e in zip(limits, estimates, strict=True))
        discard = getattr(self.drafter, "discard", None)
        for seq, limit, estimate in zip(seqs, limits, estimates, strict=True):
            drafts, raw = self.drafter.propose(seq, limit) if limit else ([], None)
            if discard is not None:
                discard(seq)
            drafts = list(drafts[:limit])
            raw = list(raw[: len(drafts)]) if raw is not None else None
            calibrated = self.calibration.probabilities(raw) if raw is not None and self.calibrates else None
            confidence = calibrated or raw or [estimate.confidence] * len(drafts)
            is_probe = bool(limit) and probing and estimate.may_join_probe
            proposals.append(drafts)
            confidences.append(list(confidence[: len(drafts)]))
            probes.append(is_probe)
            asked = bool(limit) and (bool(drafts) or not getattr(self.drafter, "always_proposes", False))
            self._asked[seq.request_id] = _Asked(len(drafts) if asked else None, is_probe, raw, calibrated)
        lengths = self._draft_lengths(proposals, confidences, probes, budget)
        return [tuple(p[:n]) for p, n in zip(proposals, lengths, strict=True)]

    def _draft_lengths(self, proposals: list[list[int]], confidences: list[list[float]], probes: list[bool],
                       budget: int) -> list[int]:
        """The policy's choice. A probing request verifies its first draft (enough to tell whether
        acceptance came back; an accepted one lets the estimates choose more drafts from the next step,
        while a batch of failing probes costs one token a request, not k); the others are chosen by
        confidence, without the round trip's cost when a probe pays for it anyway."""
        config = self.config
        if config.draft_length_policy != "confidence":
            return fixed_draft_lengths([len(p) for p in proposals], budget)
        forced = fixed_draft_lengths([min(len(p), 1) if probe else 0 for p, probe in zip(proposals, probes, strict=True)],
                                     budget)
        chosen = confidence_draft_lengths(
            [[] if probe else c for c, probe in zip(confidences, probes, strict=True)], budget - sum(forced),
            config.verify_cost_per_token, 0.0 if any(probes) else config.sync_cost)
        return [f or c for f, c in zip(forced, chosen, strict=True)]

    def allows_overlap(self, seqs: list[Sequence]) -> bool:
        """Whether the next step of `seqs` may launch before the host reads this step's tokens
        (overlapped decode): only when it would verify no draft whatever the drafter proposed. That is
        known without the tokens only when the requests are gated (`is_gated`): their estimates
        (`DraftEstimate.expected_confidences`) say no draft pays for the wait, and no probe is due."""
        return self.is_gated and self._declines_every_draft(seqs, 0)

    def wants_drafts(self, seqs: list[Sequence]) -> bool:
        """Whether a pausable model-side drafter should propose after the step now launched
        (`StepPlan.propose_drafts`): always unless gated; gated, when some request's next step may
        verify drafts: its estimates say they pay, or its probe falls due by then (one step ahead of
        `allows_overlap`, since the drafts of the step after next come with this one's result)."""
        return not self.is_gated or not self._declines_every_draft(seqs, 1)

    def _declines_every_draft(self, seqs: list[Sequence], lookahead: int) -> bool:
        """Whether, by the requests' estimates, no draft of theirs pays and no probe is due within
        `lookahead` steps."""
        confidences = []
        for seq in seqs:
            limit = self._draft_limit(seq) if seq.takes_drafts else 0
            estimate = self._estimate(seq)
            if limit and estimate.num_idle_steps + lookahead >= estimate.probe_interval:
                return False
            confidences.append(estimate.expected_confidences(limit))
        budget = sum(map(len, confidences))  # the policy's choice only shrinks with a smaller budget
        config = self.config
        return not any(confidence_draft_lengths(confidences, budget, config.verify_cost_per_token, config.sync_cost))

    def record(self, plan: StepPlan, num_accepted: list[int] | None, is_overlapped: bool = False) -> None:
        """After a step: update each decoding request's estimates and metrics. `is_overlapped`: the step
        was left in flight (its tokens are read with the next)."""
        accepted_of = {}
        if num_accepted is not None:
            sampled = [r for r in plan.requests if r.is_sampled]
            accepted_of = {r.request_id: a for r, a in zip(sampled, num_accepted, strict=True)}
        has_probe = False
        for request in plan.requests:
            asked = self._asked.pop(request.request_id, None)
            if asked is None:
                continue
            proposed, is_probe, raw, calibrated = asked.proposed, asked.is_probe, asked.raw, asked.calibrated
            d = request.num_draft_tokens
            accepted = accepted_of.get(request.request_id) if d else None
            estimate = self._estimates.get(request.request_id)
            if estimate is not None:
                estimate.record(proposed, d, accepted, is_probe)
                if not d and calibrated:  # declined by the calibrated policy: its chance is the evidence
                    estimate.record_expected(calibrated[0])
                self.population.record(proposed, d, accepted)
            if accepted is not None and raw is not None and self.calibrates:
                self.calibration.observe(raw[:d], accepted)
            has_probe |= is_probe
            for metrics in (self._metrics.get(request.request_id), self.totals):
                if metrics is not None:
                    metrics.record(proposed or 0, d, accepted, raw, calibrated)
        self.num_overlapped_steps += is_overlapped
        self.num_probe_steps += has_probe


@dataclass(frozen=True)
class _Asked:
    """What a sequence's drafter gave for this step."""

    proposed: int | None
    """Drafts proposed (None: not asked: its token was pending, or a pausable drafter skipped it)."""
    is_probe: bool
    raw: list[float] | None
    """The drafter's own confidences of the proposals, as it gave them (DSpark: raw scores)."""
    calibrated: list[float] | None
    """Their calibrated acceptance probabilities (raw-score drafters only)."""
