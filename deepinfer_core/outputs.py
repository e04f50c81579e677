"""What a request returns, with vLLM's class and attribute names.

`RequestOutput.outputs[i]` is the i-th completion (`SamplingParams.n` of them): its `text`, `token_ids`,
per-step `logprobs` and `finish_reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a completion ended: a stop token or EOS, `max_tokens` or a full context, an abort, or an error
(the model's logits for its next token were not finite: no token is made up)."""


@dataclass
class Logprob:
    """One token's log-probability at one position."""

    logprob: float
    """Natural-log probability under the model's raw (temperature 1, unfiltered) distribution."""
    rank: int | None = None
    """1 for the most likely token, 2 for the next, and so on."""
    decoded_token: str | None = None
    """The token as text, when a tokenizer was available."""


@dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    """Which of the request's `n` completions this is."""
    text: str
    """Decoded text of `token_ids` (empty when the engine does not detokenize)."""
    token_ids: list[int]
    """Generated token ids."""
    cumulative_logprob: float | None
    """Sum of the generated tokens' logprobs, or None when logprobs were not requested."""
    logprobs: list[dict[int, Logprob]] | None
    """Per generated token: the sampled token and the top `logprobs` tokens; None when not requested."""
    finish_reason: FinishReason | None = None
    """None while generating."""
    stop_reason: int | str | None = None
    """The stop token id that ended the completion; None for EOS, length or abort."""

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={_summarise_logprobs(self.logprobs)}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (`time.time()`, seconds) of a request's life; None until reached."""

    arrival_time: float
    """When the request was added."""
    first_scheduled_time: float | None = None
    """When it was first put in a batch."""
    first_token_time: float | None = None
    """When its first token was sampled."""
    last_token_time: float | None = None
    """When its latest token was sampled."""
    finished_time: float | None = None
    """When it finished."""
    num_generation_tokens: int = 0
    """Tokens generated so far, over all completions."""
    spec_decode: SpecDecodeMetrics | None = None
    """Speculative decoding counters, over all completions (None without speculation)."""

    @property
    def time_in_queue(self) -> float | None:
        """Seconds between arrival and first scheduling."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds between arrival and the first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class SpecDecodeMetrics:
    """Speculative decoding of one request (or, summed, of the engine)."""

    num_drafted_tokens: int = 0
    """Drafts the drafter proposed."""
    num_verified_tokens: int = 0
    """Drafts sent to the target (the draft-length policy may verify fewer than were proposed)."""
    num_accepted_tokens: int = 0
    """Verified drafts the target accepted."""
    num_verify_steps: int = 0
    """Steps that verified at least one draft."""
    acceptance_histogram: list[int] = field(default_factory=list)
    """`acceptance_histogram[a]`: verify steps that accepted exactly `a` drafts."""
    num_verified_per_slot: list[int] = field(default_factory=list)
    """`[j]`: drafts verified at slot j (the j-th draft of a step, from 0)."""
    num_accepted_per_slot: list[int] = field(default_factory=list)
    """`[j]`: drafts accepted at slot j."""
    confidence_sum_per_slot: list[float] = field(default_factory=list)
    """`[j]`: the sum of the drafter's own confidence (DSpark: its head's raw output, before any sigmoid or
    calibration) over the drafts verified at slot j that came with one."""
    num_confidences_per_slot: list[int] = field(default_factory=list)
    """`[j]`: drafts verified at slot j that came with a confidence (none for the n-gram drafter)."""
    calibrated_sum_per_slot: list[float] = field(default_factory=list)
    """`[j]`: the sum of the calibrated acceptance probability (`speculative/calibration.py`) over the drafts
    verified at slot j whose raw confidence was calibrated (DSpark)."""
    num_calibrated_per_slot: list[int] = field(default_factory=list)
    """`[j]`: drafts verified at slot j with a calibrated probability."""

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token; DSpark's tau);
        0 before the first verify step."""
        return (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified drafts (0 before any was verified)."""
        return self.num_accepted_tokens / self.num_verified_tokens if self.num_verified_tokens else 0.0

    @property
    def acceptance_rate_per_slot(self) -> list[float]:
        """`[j]`: accepted / verified drafts at slot j (a draft after a rejected one counts as not accepted)."""
        return [a / v if v else 0.0 for a, v in zip(self.num_accepted_per_slot, self.num_verified_per_slot)]

    @property
    def mean_confidence_per_slot(self) -> list[float]:
        """`[j]`: the mean of the drafter's own confidence (DSpark: raw) over the drafts verified at slot j."""
        return [c / n if n else 0.0 for c, n in zip(self.confidence_sum_per_slot, self.num_confidences_per_slot)]

    @property
    def mean_calibrated_confidence_per_slot(self) -> list[float]:
        """`[j]`: the mean calibrated acceptance probability over the drafts verified at slot j (DSpark)."""
        return [c / n if n else 0.0 for c, n in zip(self.calibrated_sum_per_slot, self.num_calibrated_per_slot)]

    _STATS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("spec_drafted_tokens", "num_drafted_tokens"), ("spec_verified_tokens", "num_verified_tokens"),
        ("spec_accepted_tokens", "num_accepted_tokens"), ("spec_verify_steps", "num_verify_steps"),
        ("spec_acceptance_histogram", "acceptance_histogram"),
        ("spec_verified_per_slot", "num_verified_per_slot"), ("spec_accepted_per_slot", "num_accepted_per_slot"),
        ("spec_confidence_sum_per_slot", "confidence_sum_per_slot"),
        ("spec_confidences_per_slot", "num_confidences_per_slot"),
        ("spec_calibrated_sum_per_slot", "calibrated_sum_per_slot"),
        ("spec_calibrated_per_slot", "num_calibrated_per_slot"))
    RATIO_STATS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("spec_mean_acceptance_length", "mean_acceptance_length"),
        ("spec_acceptance_rate_per_slot", "acceptance_rate_per_slot"),
        ("spec_mean_confidence_per_slot", "mean_confidence_per_slot"),
        ("spec_mean_calibrated_confidence_per_slot", "mean_calibrated_confidence_per_slot"))
    """`stats()` keys computed from the counters (recomputed, not summed, when engines' counters are)."""

    def to_stats(self) -> dict:
        """The counters and the figures computed from them under their `stats()` / `/metrics` names."""
        out = {key: list(v) if isinstance(v := getattr(self, name), list) else v for key, name in self._STATS}
        return out | {key: getattr(self, name) for key, name in self.RATIO_STATS}

    @classmethod
    def from_stats(cls, stats: dict) -> SpecDecodeMetrics:
        """The counters of `stats` (`to_stats`'s keys, e.g. summed over data-parallel ranks)."""
        return cls(**{name: stats[key] for key, name in cls._STATS if key in stats})

    def record(self, num_proposed: int, num_verified: int, num_accepted: int | None,
               confidences: list[float] | None = None, calibrated: list[float] | None = None) -> None:
        """Count one step: drafts proposed, verified, and accepted (None when none was verified), and the
        verified drafts' confidences as the drafter gave them and as calibrated (None: none)."""
        self.num_drafted_tokens += num_proposed
        self.num_verified_tokens += num_verified
        if num_accepted is None:
            return
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
        _add(self.acceptance_histogram, num_accepted, 1)
        for j in range(num_verified):
            _add(self.num_verified_per_slot, j, 1)
            _add(self.num_accepted_per_slot, j, int(j < num_accepted))
        for values, sums, counts in ((confidences, self.confidence_sum_per_slot, self.num_confidences_per_slot),
                                     (calibrated, self.calibrated_sum_per_slot, self.num_calibrated_per_slot)):
            for j, value in enumerate((values or [])[:num_verified]):
                _add(sums, j, float(value))
                _add(counts, j, 1)


def _add(counts: list, index: int, value) -> None:
    """`counts[index] += value`, the list grown with zeros to reach `index`."""
    if len(counts) <= index:
        counts += [type(value)()] * (index + 1 - len(counts))
    counts[index] += value


@dataclass
class RequestOutput:
    """Everything a request has produced so far (or in total, once `finished`)."""

    request_id: str
    prompt: str | None
    """The prompt text, or None when the request was given as token ids."""
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    """One entry per completion (`SamplingParams.n`)."""
    finished: bool
    """True when every completion has finished."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache instead of being computed."""
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Per prompt token (None for the first, which has no context), when requested."""

    def __repr__(self) -> str:
        prompt_ids = _summarise_ids(self.prompt_token_ids)
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={prompt_ids}, outputs={self.outputs}, finished={self.finished}, "
            f"num_cached_tokens={self.num_cached_tokens}, metrics={self.metrics})"
        )


def _summarise_ids(token_ids: list[int], limit: int = 16) -> str:
    if len(token_ids) <= limit:
        return str(token_ids)
    return f"[{', '.join(map(str, token_ids[:limit]))}, ... ({len(token_ids)} tokens)]"


def _summarise_logprobs(logprobs: list[dict[int, Logprob]] | None) -> str:
    if logprobs is None:
        return "None"
    return f"<{len(logprobs)} steps>"
