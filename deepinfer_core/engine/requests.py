"""The request registry: every request the engine holds, the completion that owns each sequence, and the
per-request seeds. The other parts of the engine look requests up here by request or sequence id."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer_core.outputs import RequestMetrics, SpecDecodeMetrics
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sched.sequence import Sequence

if TYPE_CHECKING:
    from deepinfer_core.engine.output import IncrementalText
    from deepinfer_core.speculative.proposer import Speculator
    from deepinfer_core.structured_output.manager import StructuredOutputManager


@dataclass
class Completion:
    """One of a request's `n` completions: its sequence and what output processing keeps for it."""

    seq: Sequence
    request: Request = field(repr=False, compare=False)
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    text_end: int | None = None
    """Where the text is cut when a stop string matched."""
    partial_text: IncrementalText | None = None
    """Text of an unfinished completion, decoded incrementally."""


@dataclass
class Request:
    """A queued request: its prompt, parameters, completions and metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[Completion]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    seq_ids: list[str] = field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)


class RequestRegistry:
    """The engine's requests by id, the completion owning each sequence id, and the seeds of requests
    that give none (drawn from `seed`). Removing a request also forgets its sequences' grammar matchers
    and speculative-decoding state.

    :param seed: seeds the per-request seeds (`EngineConfig.seed`).
    :param structured_output: holds the constrained sequences' matchers.
    :param speculator: holds each sequence's draft statistics (None without speculative decoding).
    """

    def __init__(self, seed: int | None, structured_output: StructuredOutputManager,
                 speculator: Speculator | None) -> None:
        self.requests: dict[str, Request] = {}
        self.seq_owner: dict[str, Completion] = {}
        self.touched: dict[str, Request] = {}
        """Requests that progressed outside a step (added with their first token); the next step reports them."""
        self._seed_source = random.Random(seed)
        self._structured_output, self._speculator = structured_output, speculator

    def create(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               defers_grammar_mask: bool, images: tuple = ()) -> Request:
        """A new request with its `params.n` sequences (seeded), not yet registered; `images`: the
        prompt's `ImageInput`s, laid into `prompt_token_ids` (`multimodal.lay_images`)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        request = Request(request_id, prompt, list(prompt_token_ids), params, [], RequestMetrics(arrival_time=time.time()))
        if self._speculator is not None:
            request.metrics.spec_decode = SpecDecodeMetrics()
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt_token_ids)
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = (base_seed + index) % 2**64
            seq = Sequence(seq_id, prompt_token_ids, params, prompt=prompt, seed=seed,
                           defers_grammar_mask=defers_grammar_mask, images=images)
            request.completions.append(Completion(seq, request, [] if params.logprobs is not None else None))
            request.seq_ids.append(seq_id)
        return request

    def register(self, request: Request, grammar=None) -> None:
        """Register `request` (its sequences already queued); `grammar`: its compiling grammar, if any."""
        for seq_id, completion in zip(request.seq_ids, request.completions):
            self.seq_owner[seq_id] = completion
            if self._speculator is not None:
                self._speculator.track(seq_id, request.metrics.spec_decode)
            if grammar is not None:
                self._structured_output.track(seq_id, grammar, request.prompt_token_ids)
        self.requests[request.request_id] = request

    def request_of(self, seq_id: str) -> Request:
        """The request that sequence `seq_id` belongs to."""
        return self.seq_owner[seq_id].request

    def remove(self, request_id: str) -> Request | None:
        """Forget a request and its sequences' state; None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq_id in request.seq_ids:
            self.seq_owner.pop(seq_id, None)
            if self._speculator is not None:
                self._speculator.forget(seq_id)
            self._structured_output.remove(seq_id)
        return request

    def note_scheduled(self, seqs: list[Sequence]) -> None:
        """Stamp the first scheduling time and the cached prompt tokens of the requests of `seqs`."""
        now, owner = time.time(), self.seq_owner
        for seq in seqs:
            request = owner[seq.request_id].request
            if not request.metrics.first_scheduled_time:
                request.metrics.first_scheduled_time = now
            request.num_cached_tokens = max(request.num_cached_tokens, seq.num_cached_tokens)
