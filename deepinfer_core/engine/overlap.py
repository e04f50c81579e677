"""Overlapped decode (`EngineConfig.async_scheduling`): what a decode step left in flight holds, and when
the next step may launch before it is read. `Engine.step` drives it; docs/structures.md describes it.

The sampled tokens themselves stay with the runner that sampled them: the next plan names them with
`PENDING_TOKEN` and the runner substitutes its device copy. The host side only waits for the copy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from deepinfer_core.backends import SamplerOutput
from deepinfer_core.engine.output import ends_by_length
from deepinfer_core.plan import StepPlan, StepResult
from deepinfer_core.sched.scheduler import Scheduler
from deepinfer_core.sched.sequence import Sequence


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
    the host (`Sequence.needs_host_token`: penalties, a grammar whose mask is filled before launch) sit
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
