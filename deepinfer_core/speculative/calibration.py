"""Online calibration of a drafter's raw confidence scores into acceptance probabilities, per draft slot.

DSpark's confidence head returns a raw projection per draft (DeepSeek's reference applies no sigmoid),
trained to rank drafts by their chance of acceptance, but that chance depends on the workload (real
acceptance runs below published figures: research-engines.md), on the slot, and on how the target
samples. The confidence policy (`policy.confidence_draft_lengths`) needs probabilities: draft j's
chance of being accepted given drafts 1..j-1 were. `ConfidenceCalibration` learns that map from what
verification shows, per slot:

- raw scores fall into `NUM_BINS` fixed bins over `[-RAW_LIMIT, RAW_LIMIT]` (clipped beyond it);
- each bin keeps counts of verified drafts whose survival was tested and of those accepted: a draft
  before the first rejection was accepted, the first rejected one was not, later ones were not tested
  (their survival given the earlier ones is unknown);
- a bin's estimate is its counts plus `PRIOR_WEIGHT` pseudo-observations at `sigmoid(bin centre)` (so
  before any observation the calibration is the sigmoid of the raw score), made non-decreasing in the
  raw score over the slot's bins by pool-adjacent-violators (isotonic regression, count-weighted): a
  higher raw score never maps to a lower probability;
- counts are halved once a bin's reach `MAX_COUNT`, so memory is `slots x NUM_BINS` numbers, old
  evidence fades and the map follows a workload that changes.

Everything is float arithmetic in a fixed order: the same history gives the same map. The map only
decides which drafts are verified; a draft is accepted exactly when it equals the target's own draw
(`verify.py`), so calibration never changes a token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

NUM_BINS = 16
"""Bins of the raw score per slot."""
RAW_LIMIT = 8.0
"""Raw scores are clipped to `[-RAW_LIMIT, RAW_LIMIT]` (sigmoid 0.0003 .. 0.9997) before binning."""
PRIOR_WEIGHT = 2.0
"""Pseudo-observations at the sigmoid of its centre each bin starts with."""
MAX_COUNT = 512.0
"""A bin's tested count at which its counts are halved (bounded memory of the past, fading evidence)."""


def sigmoid(x: float) -> float:
    """The logistic function, safe for any float."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def bin_of(raw: float) -> int:
    """The bin of a raw score (NaN goes to the lowest bin: a draft of no known worth)."""
    if math.isnan(raw):
        return 0
    clipped = min(max(float(raw), -RAW_LIMIT), RAW_LIMIT)
    return min(int((clipped + RAW_LIMIT) / (2 * RAW_LIMIT) * NUM_BINS), NUM_BINS - 1)


def bin_centre(index: int) -> float:
    width = 2 * RAW_LIMIT / NUM_BINS
    return -RAW_LIMIT + (index + 0.5) * width


class SlotCalibration:
    """One slot's binned counts and their isotonic map."""

    def __init__(self) -> None:
        self.accepted = [0.0] * NUM_BINS
        self.tested = [0.0] * NUM_BINS
        self._map: list[float] | None = None

    def observe(self, raw: float, is_accepted: bool) -> None:
        """Count one tested draft."""
        b = bin_of(raw)
        self.accepted[b] += 1.0 if is_accepted else 0.0
        self.tested[b] += 1.0
        if self.tested[b] >= MAX_COUNT:
            self.accepted[b] *= 0.5
            self.tested[b] *= 0.5
        self._map = None

    def probability(self, raw: float) -> float:
        """The calibrated chance a draft of this raw score is accepted (given the earlier slots were)."""
        if self._map is None:
            self._map = self._isotonic()
        return self._map[bin_of(raw)]

    def _isotonic(self) -> list[float]:
        """Per bin, its smoothed rate, pooled with neighbours until non-decreasing (weights: counts)."""
        blocks: list[list[float]] = []  # [rate, weight, number of bins]
        for b in range(NUM_BINS):
            weight = self.tested[b] + PRIOR_WEIGHT
            rate = (self.accepted[b] + PRIOR_WEIGHT * sigmoid(bin_centre(b))) / weight
            blocks.append([rate, weight, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                rate2, weight2, n2 = blocks.pop()
                rate1, weight1, n1 = blocks.pop()
                total = weight1 + weight2
                blocks.append([(rate1 * weight1 + rate2 * weight2) / total, total, n1 + n2])
        out: list[float] = []
        for rate, _, n in blocks:
            out += [rate] * int(n)
        return out


class ConfidenceCalibration:
    """Per slot (a draft's index in its proposal), raw confidence -> acceptance probability; one per engine."""

    def __init__(self, num_slots: int) -> None:
        self.slots = [SlotCalibration() for _ in range(num_slots)]

    def probabilities(self, raw: Sequence[float]) -> list[float]:
        """Calibrated probabilities of a proposal's drafts (slot j: the j-th draft)."""
        return [self.slots[min(j, len(self.slots) - 1)].probability(r) for j, r in enumerate(raw)]

    def observe(self, raw: Sequence[float], num_accepted: int) -> None:
        """Count one verification: `raw` the verified drafts' raw scores, of which the first `num_accepted`
        were accepted; the first rejected one counts as a failure, the ones after it are not tested."""
        for j, r in enumerate(raw[: num_accepted + 1]):
            self.slots[min(j, len(self.slots) - 1)].observe(r, j < num_accepted)
