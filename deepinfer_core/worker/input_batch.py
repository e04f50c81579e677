"""The persistent batch (vLLM's `InputBatch`): what the runner keeps per request between steps, and the
flat step tensors built from a `StepPlan` and those states.

`InputBatch.update_states` applies a plan's bookkeeping (freed, new, appended blocks); `prepare_inputs`
turns the plan into flat device tensors and the step's `ForwardContext` (`make_context`, shared with the
decode graphs, the MTP drafter and context parallelism), including which rows an exact replay or the
decoder-side trimming lets the model drop. The tokens the last step sampled stay on the device in a
`CarriedTokens`, so an input that is `PENDING_TOKEN` (overlapped decode) is filled there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

import torch

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.backends.parallel import ParallelGroups
from deepinfer_core.backends.sampling_tensors import host_tensor, to_device
from deepinfer_core.config import ModelConfig
from deepinfer_core.models.interface import CausalLM, ForwardContext
from deepinfer_core.plan import PENDING_TOKEN, ImageInput, StepPlan
from deepinfer_core.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the runner keeps of one request between steps (vLLM's persistent batch, one row)."""

    slot: int
    block_table: list[int]
    """Grows by the plan's `new_block_ids`; a new admission brings a new list."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    token_ids: list[int] | None = None
    """Prompt and generated ids, kept only for requests whose sampling reads them (penalties)."""
    images: tuple[ImageInput, ...] = ()
    """The prompt's images (`NewRequest.images`): their spans take the vision encoder's rows."""


@dataclass
class CarriedTokens:
    """The tokens the last step sampled, on the device: `tokens[rows[request_id]]`."""

    tokens: torch.Tensor
    request_ids: list[str]

    @functools.cached_property
    def rows(self) -> dict[str, int]:
        return {request_id: row for row, request_id in enumerate(self.request_ids)}

    def fill(self, input_ids: torch.Tensor, pending: list[tuple[int, str]]) -> None:
        """Write the carried token of each `(flat row, request id)` into `input_ids` on the device."""
        if not pending:
            return
        dst, src = [], []
        for flat_row, request_id in pending:
            row = self.rows.get(request_id)
            if row is None:
                raise RuntimeError(f"request {request_id!r} has a pending token that the last step did not sample")
            dst.append(flat_row)
            src.append(row)
        if dst == src and len(src) == self.tokens.numel():  # the same batch again, in the same order
            input_ids[: len(dst)].copy_(self.tokens)
            return
        index = host_tensor(dst + src).to(input_ids.device, non_blocking=True).view(2, -1)
        input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]).to(input_ids.dtype))


class InputBatch:
    """The runner's per-request states and the step inputs built from them."""

    def __init__(self, model: CausalLM, config: ModelConfig, plans, parallel: ParallelGroups,
                 device: torch.device, num_trim_kept: int | None = None) -> None:
        """`model`: its `rope_tables` build each step's rotary tables; `config`: the whole model's
        (its sliding window); `plans`: the layer plans (the compression rates); `num_trim_kept`: the
        prompt rows decoder-side trimming keeps past the trim point (None: trimming off)."""
        self.model, self.parallel, self.device = model, parallel, device
        self.sliding_window = config.sliding_window
        self.compress_rates = {p.compress_rate for p in plans if p.has_compressor}
        """The compression rates of the model's compressing layers (CSA and HCA)."""
        self.num_trim_kept = num_trim_kept
        self.requests: dict[str, RequestState] = {}

    def update_states(self, plan: StepPlan) -> list[RequestState]:
        """Apply the plan's bookkeeping (freed, new, appended blocks); the states in `plan.requests` order."""
        for request_id in plan.freed_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(new.slot, list(new.block_ids), new.num_prompt_tokens,
                                                         new.sampling_params, new.seed,
                                                         list(new.token_ids) if new.token_ids else None,
                                                         new.images)
        states = []
        for request in plan.requests:
            state = self.requests.get(request.request_id)
            if state is None:
                raise RuntimeError(f"plan schedules {request.request_id!r}, which the runner holds no state for")
            if request.new_block_ids:
                state.block_table.extend(request.new_block_ids)
            if state.token_ids is not None and request.end > len(state.token_ids):
                state.token_ids.extend(request.token_ids[len(state.token_ids) - request.start :])
            states.append(state)
        return states

    def make_context(self, input_ids: torch.Tensor, positions: torch.Tensor, totals: torch.Tensor,
                     no_write_before: torch.Tensor, keep_from: list[int] | None = None,
                     replay_hits: list[int] | None = None, **metadata) -> ForwardContext:
        """The step's `ForwardContext` (eager steps and decode graphs alike): `metadata` are the
        `AttentionMetadata` fields; `totals` `[num_seqs]` tokens each request has after the step;
        `keep_from` the decoder-side trimming's first kept positions (None: nothing trimmed);
        `replay_hits` the exact replay's hits (`ForwardContext.replay_hits`)."""
        return ForwardContext(
            keep_from=keep_from, replay_hits=replay_hits,
            metadata=AttentionMetadata(positions=positions, **metadata),
            input_ids=input_ids,
            rope=self.model.rope_tables(positions),
            num_entries={rate: totals // rate for rate in self.compress_rates},
            no_write_before=no_write_before,
            parallel=self.parallel,
        )

    def prepare_inputs(self, plan: StepPlan, states: list[RequestState]):
        """Flat step tensors. Logits rows: first one per sampled request (in `sampled` order), then, per
        request asking for prompt logprobs, a span `(first target position, row, count)`. `pending`:
        `(flat row, request id)` of inputs that are `PENDING_TOKEN` (written as 0 here)."""
        ids, positions, totals, sampled, ends, pending = [], [], [], [], [], []
        prompt_spans, prompt_rows = {}, []
        requests = plan.requests
        offset = 0
        for i, (request, state) in enumerate(zip(requests, states)):
            start, n, end = request.start, request.num_tokens, request.end
            ids += request.token_ids
            if request.token_ids[-1] == PENDING_TOKEN:
                ids[-1] = 0
                pending.append((offset + n - 1, request.request_id))
            positions += range(start, end)
            totals.append(end)
            if request.is_sampled:  # a row for the last token and one for each draft before it
                sampled.append(i)
                ends += range(offset + n - 1 - request.num_draft_tokens, offset + n)
            if state.sampling_params.prompt_logprobs is not None:
                count = min(end, state.num_prompt_tokens - 1) - start  # positions predicting prompt tokens
                if count > 0:
                    prompt_spans[i] = (start + 1, len(prompt_rows), count)
                    prompt_rows += range(offset, offset + count)
            offset += n
        width = max(len(s.block_table) for s in states) or 1
        starts = [r.start for r in requests]
        window_starts = [r.window_start for r in requests]
        has_window_starts = any(window_starts)
        (start_loc, start_positions, position_t, slots, total_t, input_ids, no_write_before, logits_rows,
         window_t, tables) = to_device([
            [0, *accumulate(r.num_tokens for r in requests)], starts, positions, [s.slot for s in states], totals,
            ids, [r.no_write_before for r in requests], ends + prompt_rows,
            window_starts if has_window_starts else [], _flat_block_tables(states, width, fill=-1),
        ], self.device)
        ctx = self.make_context(
            input_ids, position_t, total_t, no_write_before, keep_from=self._first_kept_positions(requests, states),
            replay_hits=self._replay_hits(requests),
            query_start_loc=start_loc, start_positions=start_positions, slots=slots,
            block_tables=tables.view(len(states), width), query_lens=[r.num_tokens for r in requests],
            start_positions_host=starts, max_seq_len=max(totals),
            window_start_positions_host=window_starts if has_window_starts else None,
            window_starts=window_t if has_window_starts else None,
        )
        prompt_spans = {i: (first, len(ends) + row, count) for i, (first, row, count) in prompt_spans.items()}
        return ctx, logits_rows, sampled, prompt_spans, pending

    def _replay_hits(self, requests) -> list[int] | None:
        """Per request, the hit its exact replay (`ScheduledRequest.replay`) runs below (0: none), when
        some request of the step computes rows below its hit's last window: the rows a model running the
        replay layer by layer (`row_trim.replay_keep_from`) can drop. None otherwise, and under context
        parallelism, whose ranks exchange every row's window keys."""
        window = self.sliding_window
        hits = [r.replay.hit if r.replay is not None and r.replay.exact else 0 for r in requests]
        if self.parallel.cp.size > 1 or not any(r.start < hit - window for r, hit in zip(requests, hits)):
            return None
        return hits

    def _first_kept_positions(self, requests, states: list[RequestState]) -> list[int] | None:
        """Per request, the first position that runs the layers after the trim point (`v41_trim`); None
        when trimming is off or changes nothing in this step: no request drops a row or has a window that
        reaches below its first kept position (decode steps never do)."""
        if self.num_trim_kept is None:
            return None
        from deepinfer_core.models.deepseek_v41.trim import first_kept_positions

        keep = [first_kept_positions(s.num_prompt_tokens, s.sampling_params.prompt_logprobs is not None,
                                     self.num_trim_kept) for s in states]
        window = self.sliding_window
        return keep if any(k > 0 and k > r.start - window + 1 for k, r in zip(keep, requests)) else None


def _flat_block_tables(states: list[RequestState], width: int, fill: int) -> list[int]:
    """Row-major `[len(states), width]` block tables, each row padded with `fill`."""
    flat = []
    for state in states:
        flat += state.block_table
        flat += [fill] * (width - len(state.block_table))
    return flat
