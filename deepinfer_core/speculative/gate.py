"""Per request, what its drafts have been worth so far, and when to try drafting again.

A drafter that can pause (`is_pausable`) is gated. The n-gram drafter reads the request's last sampled
token, so a step that may draft must wait for the step before it: it cannot launch while that step is in
flight (overlapped decode, `engine/overlap.py`). DSpark drafts on the device after every step whose plan
asks for it (`StepPlan.propose_drafts`), and its drafts come back with the step's result, so that step
too is read before the next is planned, and the drafter's block costs time. Under the confidence policy
both are paid only while drafting is expected to pay for them (`Speculator.allows_overlap`,
`Speculator.wants_drafts`). `DraftEstimate` keeps, per request, decayed and Laplace-smoothed counts of
two things:

- `confidence`: the chance a verified draft survives given the ones before it did;
- `proposal_rate`: the chance the drafter proposes anything when asked (prompt lookup often finds no
  match). Before the token is known, the first draft's survival is `proposal_rate x confidence`.

A new request's estimates start from the drafter's recent record over every request
(`DraftEstimate.seeded`, `PRIOR_WEIGHT` verified drafts' worth), not from an even chance: a drafter that
has been failing is not verified for a new request's first steps just to learn what the others showed.

A request whose estimates say no stays on the overlapped path. So that acceptance can come back (an
agent starts quoting a tool output), the request is probed: once `probe_interval` steps passed without
its drafts being verified, the next step waits for its token and verifies the first draft the
drafter proposes. A probe with nothing accepted doubles the interval (up to `MAX_PROBE_INTERVAL`); an accepted
draft resets it. A step that probes one request waits anyway, so every request at least half way to its
own probe joins it (`may_join_probe`): a batch whose requests started decoding on different steps (a
prefill split over several steps) then probes on one step, not on one step per start.

None of this changes a token: a draft is accepted exactly when it equals the target's own draw
(`verify.py`), so it only decides which steps wait and which drafts are verified.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.9
"""Weight of a request's older steps in its estimates, per step that updates them."""
PRIOR_WEIGHT = 4.0
"""Verified drafts (and drafter calls) of evidence a new request's estimates start with, at the rates of
every request's recent steps (`DraftEstimate.seeded`); its own steps outweigh them after a few steps."""
PROBE_INTERVAL = 16
"""Steps without verified drafts after which a request is probed (and the interval after a success)."""
MAX_PROBE_INTERVAL = 64
"""Longest interval between probes of a request whose probes keep failing."""


@dataclass
class DraftEstimate:
    """One request's online acceptance estimates and probe schedule."""

    accepted: float = 0.0
    """Decayed count of accepted drafts."""
    tested: float = 0.0
    """Decayed count of drafts whose survival was tested (accepted ones and each step's first rejection)."""
    proposed: float = 0.0
    """Decayed count of steps in which the drafter, asked, proposed at least one draft."""
    asked: float = 0.0
    """Decayed count of steps in which the drafter was asked."""
    num_idle_steps: int = 0
    """Steps since the request's drafts were last verified (or it was last probed)."""
    probe_interval: int = PROBE_INTERVAL

    @classmethod
    def seeded(cls, population: DraftEstimate) -> DraftEstimate:
        """A new request's estimates: the counts of `population` (the record of every request's steps),
        scaled down to at most `PRIOR_WEIGHT` observations each (no record: an even chance)."""
        tested, asked = min(population.tested, PRIOR_WEIGHT), min(population.asked, PRIOR_WEIGHT)
        return cls(accepted=population.accepted * tested / population.tested if tested else 0.0, tested=tested,
                   proposed=population.proposed * asked / population.asked if asked else 0.0, asked=asked)

    @property
    def confidence(self) -> float:
        """Laplace-smoothed chance a verified draft survives given the ones before it did."""
        return (self.accepted + 1.0) / (self.tested + 2.0)

    @property
    def proposal_rate(self) -> float:
        """Laplace-smoothed chance the drafter proposes anything when asked."""
        return (self.proposed + 1.0) / (self.asked + 2.0)

    @property
    def is_probe_due(self) -> bool:
        """Whether the request has gone `probe_interval` steps without its drafts verified."""
        return self.num_idle_steps >= self.probe_interval

    @property
    def may_join_probe(self) -> bool:
        """Whether the request is at least half way to its next probe: it probes in a step that probes
        another request anyway (that step waits for its tokens whatever this request does)."""
        return 2 * self.num_idle_steps >= self.probe_interval

    def expected_confidences(self, num_drafts: int) -> list[float]:
        """Per-draft survival (given the earlier drafts survived) as seen before the drafter is asked."""
        if num_drafts <= 0:
            return []
        c = self.confidence
        return [c * self.proposal_rate] + [c] * (num_drafts - 1)

    def record_expected(self, probability: float) -> None:
        """Count a first draft the policy declined to verify as `probability` of an accepted one (a
        calibrated drafter's estimate of it): while a drafter with confidences keeps proposing drafts not
        worth verifying, the request's estimate falls with them and the gate pauses the drafter."""
        self.accepted = self.accepted * DECAY + min(max(float(probability), 0.0), 1.0)
        self.tested = self.tested * DECAY + 1.0

    def record(self, num_proposed: int | None, num_verified: int, num_accepted: int | None,
               is_probe: bool = False) -> None:
        """Count one step of the request.

        :param num_proposed: drafts the drafter proposed (None: it was not asked, its token was pending).
        :param num_verified: drafts sent to the target.
        :param num_accepted: drafts the target accepted (None when none was verified).
        :param is_probe: the step verified its drafts as a probe (`is_probe_due` held when it was planned).
        """
        if num_proposed is not None:
            self.asked = self.asked * DECAY + 1.0
            self.proposed = self.proposed * DECAY + (1.0 if num_proposed else 0.0)
        if num_verified and num_accepted is not None:
            self.accepted = self.accepted * DECAY + num_accepted
            self.tested = self.tested * DECAY + num_accepted + (1 if num_accepted < num_verified else 0)
        if num_accepted:
            self.probe_interval = PROBE_INTERVAL
        elif is_probe:
            self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        self.num_idle_steps = 0 if num_verified or is_probe else self.num_idle_steps + 1
