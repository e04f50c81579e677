"""What is in flight: the steps launched and not yet read, and when the next step may launch before
them (`EngineConfig.async_scheduling`). `InFlightSteps` runs every plan; docs/structures.md describes it.

Overlapped decode: a step whose plan is all decodes is left in flight. Its sequences get a
`PENDING_TOKEN`, so the next step can be scheduled and launched at once, the runner reading those tokens
on the device; only then does the host wait for the step in flight's tokens (copied back without
blocking the stream), write them in and apply stop rules. The device never waits for the host between
decode steps. A sequence that stops ran one step more than it needed; that token is dropped. Any step
that is not all decodes (a prefill, an admission, a sequence waiting) first settles the step in flight,
so prefill and preemption see only real tokens. Under speculative decoding a verify step is never left
in flight (the next plan's positions and drafts follow from its accepted counts), and a step in flight
is overlapped only while the next would verify no draft (`Speculator.allows_overlap`).

Two phases: every step is the executor's `execute_model(plan)` (states, cache ops, the forward queued;
the logits stay on the model side) then `sample(grammar_rows)`, the constrained rows' masks as data
filled by the host in between (`StructuredOutputManager.plan_rows` / `fill_rows`); in-process the
matchers' work overlaps the forward on the device. So a structured-output request decodes every step
under overlapped decode, with any executor (in-process, worker processes, torchrun, a DP rank's core)
and under speculation: when its input is the step in flight's token, the host first waits for that
step's tokens and advances the matchers by them (`accept_grammar_tokens`). Only requests whose sampling
reads their own ids (penalties) or whose state is exported still sit out the step launched while their
last token is on the device (`Sequence.needs_host_token`).

Late read: a verification step is sampled with `sample(..., late=True)` and read by the next
`Engine.step`, which reads it first, then schedules and launches the next one, and only then builds
and returns the outputs of the step it read, so the device computes while the host reports (the
in-process executor, `Executor.is_in_process`, with `async_scheduling`). Everything that decides the
next plan still comes before it.

The sampled tokens themselves stay with the runner that sampled them: the next plan names them with
`PENDING_TOKEN` and the runner substitutes its device copy. The host side only waits for the copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from deepinfer_core.backends import SamplerOutput
from deepinfer_core.engine.output import OutputProcessor, ends_by_length
from deepinfer_core.engine.requests import Request
from deepinfer_core.plan import NONFINITE_TOKEN, PENDING_TOKEN, EncoderStats, StepPlan, StepResult
from deepinfer_core.sched.scheduler import Scheduler
from deepinfer_core.sched.sequence import Sequence

if TYPE_CHECKING:
    from deepinfer_core.kv.tiers import PrefixTiers
    from deepinfer_core.speculative.proposer import Speculator
    from deepinfer_core.structured_output.manager import StructuredOutputManager


@dataclass
class InFlightStep:
    """A launched decode step whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]
    output: SamplerOutput
    """Host copies of the sampler's output, valid once `ready` has fired."""
    ready: torch.cuda.Event | None
    """Recorded after the copies (None when the output already lives on the host)."""


def launch_copy(seqs: list[Sequence], output: SamplerOutput) -> InFlightStep:
    """Start copying `output` to the host without blocking the stream (pinned buffers, an event)."""
    if output.token_ids.device.type != "cuda":
        return InFlightStep(list(seqs), output, None)
    copies = {}
    for name in (f.name for f in fields(output)):
        value = getattr(output, name)
        if value is not None:
            copies[name] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            copies[name].copy_(value, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return InFlightStep(list(seqs), replace(output, **copies), ready)


def can_leave_in_flight(plan: StepPlan, result: StepResult) -> bool:
    """Whether the executed plan computed one token of every request and sampled each (no prompt
    logprobs): such a step may be left in flight."""
    return (result.output is not None and len(result.sampled) == len(plan.requests) and not result.prompt_logits
            and plan.is_all_decodes)


def can_overlap(scheduler: Scheduler, max_model_len: int) -> bool:
    """Whether the next plan will be all decodes (nothing waiting, every running sequence decoding), so it
    may launch before the step in flight is settled. Sequences whose next step needs their last token on
    the host (`Sequence.needs_host_token`: penalties, an exported state; a grammar only without overlap) sit
    that step out (`waits_for_host`), so it launches only if some other sequence would decode in it, not
    by length alone (a step whose every token ends its sequence by length would compute nothing anybody
    reads)."""
    if scheduler.waiting or any(seq.is_prefill for seq in scheduler.running):
        return False
    return any(
        not seq.needs_host_token
        and not ends_by_length(seq.sampling_params, seq.num_output_tokens, seq.num_tokens >= max_model_len)
        for seq in scheduler.running
    )


class InFlightSteps:
    """Runs each plan on the executor and owns what is still in flight: the overlapped decode step whose
    tokens the host has not read (`in_flight`) and the verification step launched to be read late
    (`launched`). See the module docstring.

    :param overlap: overlapped decode and late reads are on (`EngineConfig.async_scheduling`).
    """

    def __init__(self, executor, scheduler: Scheduler, output: OutputProcessor,
                 structured_output: StructuredOutputManager, speculator: Speculator | None,
                 prefix_tiers: PrefixTiers | None, overlap: bool, max_model_len: int) -> None:
        self.executor, self.scheduler, self.output = executor, scheduler, output
        self.structured_output, self.speculator, self.prefix_tiers = structured_output, speculator, prefix_tiers
        self.overlap, self.max_model_len = overlap, max_model_len
        self.defers_grammar_masks = overlap
        """Constrained requests' rows may be filled after their step's `execute_model` (module docstring)."""
        self.launches_verify = overlap and speculator is not None and getattr(executor, "is_in_process", False)
        """Verification steps are launched before the previous step's outputs are built (module docstring)."""
        self.in_flight: InFlightStep | None = None
        self.launched: tuple[StepPlan, list[Sequence], Callable[[], StepResult]] | None = None
        """A verification step launched and not read: (plan, its sequences, completion)."""
        self.encoder = EncoderStats()
        """The vision encoder's work, summed over the steps read (`Engine.stats`)."""

    @property
    def is_empty(self) -> bool:
        """Nothing is in flight."""
        return self.in_flight is None and self.launched is None

    def read(self, touched: dict[str, Request]) -> None:
        """Before scheduling: read the launched verification step, and settle the step in flight unless the
        next step may launch before it (`can_overlap`)."""
        if self.launched is not None:
            self.read_launched(touched)
        if self.in_flight is not None and not self.can_overlap():
            self.settle_in_flight(touched)

    def settle_in_flight(self, touched: dict[str, Request]) -> None:
        """Settle the step in flight, if any."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            self.settle(in_flight, touched)

    def settle(self, in_flight: InFlightStep, touched: dict[str, Request]) -> None:
        """Wait for the step in flight's tokens and append them (`OutputProcessor.append_tokens`)."""
        if in_flight.ready is not None:
            in_flight.ready.synchronize()
        self.output.append_tokens(in_flight.seqs, in_flight.output, touched, pending=True)

    def read_launched(self, touched: dict[str, Request]) -> None:
        """Wait for the launched verification step and take its result in."""
        (plan, seqs, complete), self.launched = self.launched, None
        self.apply_result(plan, seqs, complete(), touched)

    def run(self, plan: StepPlan, seqs: list[Sequence], touched: dict[str, Request]) -> Callable[[], None] | None:
        """Run `plan` (launch it, or execute it and leave it in flight, or execute and read it).

        :returns: what is left to do once the outputs of `touched` are built (the step left in flight gets
            its pending tokens), or None.
        """
        in_flight, self.in_flight = self.in_flight, None
        plan, grammar = self.structured_output.plan_rows(plan)
        if self.speculator is not None and plan.requests:  # a pausable drafter skips steps no draft follows
            plan = replace(plan, propose_drafts=self.speculator.wants_drafts(self.scheduler.running))
        self.executor.execute_model(plan)  # in-process the forward is queued: the host fills rows meanwhile
        grammar_rows = None
        if grammar is not None:
            if grammar.is_pending:
                if in_flight is None:
                    raise RuntimeError("a constrained request's input is pending and no step is in flight")
                self.accept_grammar_tokens(in_flight)
            grammar_rows = self.structured_output.fill_rows(grammar)
        if self.launches_verify and in_flight is None and not plan.cache_ops and any(
                r.num_draft_tokens for r in plan.requests):
            self.launched = plan, seqs, self.executor.sample(grammar_rows, late=True)
            return None  # the device runs the step while the host reports the step read before
        result = self.executor.sample(grammar_rows)
        if plan.cache_ops:
            self.prefix_tiers.accept_saved(plan.cache_ops, result.saved)
        launched = launch_copy(seqs, result.output) if self.can_leave_in_flight(plan, result) else None
        if in_flight is not None:  # read only now: the device already runs this step
            self.settle(in_flight, touched)
        if launched is None:
            self.apply_result(plan, seqs, result, touched)
            return None
        self.in_flight = launched
        return functools.partial(self._leave_in_flight, plan, seqs)

    def _leave_in_flight(self, plan: StepPlan, seqs: list[Sequence]) -> None:
        """Record that `plan` ran; its sequences wait for their tokens with a `PENDING_TOKEN`."""
        self.scheduler.postprocess(plan)
        for seq in seqs:
            if not seq.is_finished:
                seq.append_token(PENDING_TOKEN)
        if self.speculator is not None:
            self.speculator.record(plan, None, is_overlapped=True)

    def apply_result(self, plan: StepPlan, seqs: list[Sequence], result: StepResult,
                     touched: dict[str, Request]) -> None:
        """Record that `plan` ran and take in what it produced: prompt logprobs, sampled tokens (stop rules
        applied), the MTP drafter's next drafts and the accepted drafts."""
        self.scheduler.postprocess(plan)
        if result.encoder is not None:
            self.encoder.add(result.encoder)
        for i, (first, logits) in result.prompt_logits.items():
            if not seqs[i].is_finished:  # aborted while its step was launched (read late): it has no owner now
                self.output.record_prompt_logprobs(seqs[i], first, logits)
        if result.output is not None:
            is_identity = len(result.sampled) == len(seqs) and result.num_accepted is None
            sampled = seqs if is_identity else [seqs[i] for i in result.sampled]
            self.output.append_tokens(sampled, result.output, touched)
        if result.drafts is not None:  # the model side's drafter (MTP) proposed what follows each request
            for i, (drafts, confidences) in zip(dict.fromkeys(result.sampled), result.drafts, strict=True):
                seqs[i].draft_token_ids, seqs[i].draft_confidences = drafts, confidences
        if self.speculator is not None:
            if result.num_accepted is not None:  # drafts accepted: computed now that they are tokens
                self.scheduler.accept_drafts(plan, result.num_accepted)
            self.speculator.record(plan, result.num_accepted)

    def accept_grammar_tokens(self, in_flight: InFlightStep) -> None:
        """Wait for the step in flight's tokens and advance its constrained sequences' matchers by them:
        called once the next step's `execute_model` returned, before its rows are filled. `settle`
        appends the tokens later, and finds them accepted (`accept` by position)."""
        if in_flight.ready is not None:
            in_flight.ready.synchronize()
        seq_ids, tokens, positions = [], [], []
        for seq, token in zip(in_flight.seqs, in_flight.output.token_ids.tolist()):
            if not (seq.is_finished or token == NONFINITE_TOKEN):
                seq_ids.append(seq.request_id)
                tokens.append(token)
                positions.append(seq.num_output_tokens - 1)
        # a rejected token leaves its row free; `settle`'s `accept` raises it and ends the request
        self.structured_output.accept_many(seq_ids, tokens, positions)

    def can_leave_in_flight(self, plan: StepPlan, result: StepResult) -> bool:
        """Whether the executed step may stay unread while the next launches (`can_leave_in_flight`); under
        speculation only a step whose successor would verify no draft, and never one that brought the
        MTP drafter's next drafts (they are read with the step)."""
        if not self.overlap or not can_leave_in_flight(plan, result):
            return False
        return self.speculator is None or (result.drafts is None and self.speculator.allows_overlap(self.scheduler.running))

    def can_overlap(self) -> bool:
        """Whether the next step may launch while the one in flight is unread (`can_overlap`); under
        speculation only while it would verify no draft: a verify step's plan needs the accepted counts
        of the step before it (`Speculator.allows_overlap`)."""
        if not can_overlap(self.scheduler, self.max_model_len):
            return False
        return self.speculator is None or self.speculator.allows_overlap(self.scheduler.running)
