"""The MTP drafter on the model side: after each step, run the checkpoint's MTP layer over the
positions the step made final and propose the next drafts (`deepinfer_core.models.deepseek_v4.mtp`).

Row j of the MTP (its own sliding-window cache at position j) reads the target's residual streams at
j - 1 and token j. A step that computed positions `start .. start + c - 1` for good (a prefill chunk,
or the last token plus its c - 1 accepted drafts) fills rows `start + 1 .. start + c - 1`, and, when
the step sampled, row `start + c` with the emitted token there; that row's prediction is draft 1.
Drafts 2..k come from rows past it, the layer fed its own output streams and the previous draft; those
rows are speculative and rolled back at once (`DraftRollback`), so the MTP cache, like the target's,
only ever holds rows of final tokens. When every request of the step verified d drafts and the layer's
passes are captured as graphs, the first pass feeds each request d + 1 rows whatever it accepted (one
graph shape); the rows past its final positions are restored like the deeper drafts'. Drafts are drawn with the request's own sampling (greedy: argmax;
sampled: the seeded draw the target will make there), so a draft is accepted exactly when the MTP
agrees with the target's draw; each draft's confidence is the MTP's probability of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deepinfer_core.backends.sampling_tensors import (
    holds_at_later_positions,
    host_tensor,
    prepare_sampling_tensors,
    to_device,
)
from deepinfer_core.config import ModelConfig
from deepinfer_core.kv.cache import KVCache
from deepinfer_core.models.interface import ForwardContext
from deepinfer_core.plan import StepPlan, StepResult
from deepinfer_core.speculative.mtp_graphs import MTPGraphs
from deepinfer_core.speculative.rollback import DraftRollback, DraftRows
from deepinfer_core.speculative.verify import is_rejection_eligible


@dataclass(frozen=True)
class DraftTarget:
    """What the MTP drafter reads of the target's side: its step-context builder and sampler, and the
    facts its cache, static buffers and sampling tensors are sized by."""

    config: ModelConfig
    """The target's config: EOS ids and vocabulary (sampling tensors), streams' shape (graph buffers)."""
    make_context: Callable[..., ForwardContext]
    """The runner's `InputBatch.make_context`: the MTP rows' `ForwardContext`."""
    sampler: object
    """The target's `Sampler`: each draft is drawn as the target draws there."""
    num_slots: int
    """Request slots; the MTP cache's scratch slot (padding rows) is `num_slots`."""
    dtype: torch.dtype
    device: torch.device

    def draft_tensors(self, states, drafted):
        """The sampling tensors of the drafts at `drafted` (state index, position of the drafted token)."""
        return prepare_sampling_tensors(
            [states[i].sampling_params for i, _ in drafted], [states[i].seed for i, _ in drafted],
            [p - states[i].num_prompt_tokens for i, p in drafted], self.config.eos_token_ids, self.device,
            self.config.vocab_size)

    def next_draft_tensors(self, tensors, states, drafted):
        """The next draft's sampling tensors: the same rows one position on, so only `steps` moves (on the
        device), unless a row's banned ids follow its position (`min_tokens`, bad words): then rebuilt."""
        if holds_at_later_positions(tensors, [states[i].sampling_params for i, _ in drafted]):
            return replace(tensors, steps=tensors.steps + 1)
        return self.draft_tensors(states, drafted)


class MTPDrafter:
    """Runs the MTP module over each step's final positions; one per runner."""

    reads_every_step = False
    """Called only after steps that sampled (the DSpark drafter, which writes its windows at every step's
    final positions, says True)."""

    def __init__(self, module, target: DraftTarget, num_drafts: int, keeps_probs: bool = False) -> None:
        """`target`: the target's side the drafter reads; `keeps_probs`: keep each rejection-eligible
        request's draft distributions for the next step's rejection sampling (`acceptance="rejection"`)."""
        self.module, self.target, self.num_drafts, self.device = module, target, num_drafts, target.device
        cache = KVCache([module.plan], 1, target.num_slots, target.dtype, target.device)
        self.cache = cache.layers
        self.rollback = DraftRollback(cache.layers, [module.plan], cache.stacks)
        self.first_row: dict[str, int] = {}
        """Per request, its first MTP row since admission: older ring rows belong to someone else."""
        self.keeps_probs = keeps_probs
        self.backends: list = []
        """The layer's attention, MoE and linear backends (`build_mtp_drafter` sets them)."""
        self.graphs = None
        """`MTPGraphs` of the layer's passes (None: every pass runs eagerly; see `capture_graphs`)."""
        self._probs: dict[str, tuple[list[int], torch.Tensor]] = {}
        """Per request id: the last drafts proposed and `[k, vocab]` the distributions they were drawn from."""

    def capture_graphs(self, api, sizes, max_seq_len: int) -> None:
        """Capture the layer's passes for the decode graphs' batch `sizes` and 1 .. k + 1 rows a request
        (`api` None: keep the padded static-input passes, run eagerly: the CPU tests' path). A module of
        several MTP layers (a layer per depth) keeps running eagerly."""
        if len(self.module) != 1:
            return
        graphs = MTPGraphs(self.module, self.cache[0], self.target, sizes, max_seq_len, range(1, self.num_drafts + 2),
                           api)
        if api is not None:
            graphs.capture()
        self.graphs = graphs

    def draft_probs(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        """Per index into `plan.requests`, the distributions its drafts were drawn from, for requests
        whose drafts are a prefix of what this drafter last proposed for them (others have none)."""
        found = {}
        for i, request in enumerate(plan.requests):
            kept = self._probs.get(request.request_id)
            d = request.num_draft_tokens
            if kept is not None and d and list(request.token_ids[-d:]) == kept[0][:d]:
                found[i] = kept[1]
        return found

    def propose(self, plan: StepPlan, states, input_ids: torch.Tensor, streams: torch.Tensor,
                result: StepResult) -> list[tuple[list[int], list[float]]] | None:
        """Per sampled request (in plan order), its drafts and their confidences."""
        for request_id in plan.freed_request_ids:
            self.first_row.pop(request_id, None)
        for new in plan.new_requests:
            self.first_row.pop(new.request_id, None)
        rows = self._rows(plan, result)
        if rows is None:
            return None
        self._plan, self._states = plan, states
        # a non-finite row's placeholder (< 0) ends its request; any valid id keeps the batch running
        emitted = result.output.token_ids.to(input_ids.device, input_ids.dtype, non_blocking=True)
        tokens = torch.cat([input_ids, emitted.clamp(min=0)])
        index = host_tensor(rows["h"] + rows["tok"]).to(self.device, non_blocking=True).view(2, -1)
        prev, ids = streams.index_select(0, index[0]), tokens.index_select(0, index[1])
        heads = host_tensor(rows["heads"]).to(self.device, non_blocking=True)
        sampled = rows["sampled"]  # (state index, position of the drafted token)
        # rows past each drafted position: the deeper drafts' and a full-width first pass's extra rows
        saved = self.rollback.capture([DraftRows(states[i].slot, p - 1, max(self.num_drafts - 1, extra), [])
                                       for (i, p), extra in zip(sampled, rows["extra"], strict=True)])
        width = self._graph_width(rows["requests"], len(sampled))
        if width:  # every request feeds the layer `width` rows: one replay
            logits, out_streams = self._replay(states, rows["requests"], width, ids, prev,
                                               [h - j * width for j, h in enumerate(rows["heads"])])
        else:
            ctx = self._context(rows["requests"], rows["positions"], ids)
            logits, out_streams = self.module(0, ctx, self.cache[0], prev, ids, heads)
        tensors = self.target.draft_tensors(states, sampled)
        temperature = host_tensor([states[i].sampling_params.temperature or 1.0 for i, _ in sampled],
                                  torch.float32).to(self.device, non_blocking=True)
        drafts, confidences, probs = [self.target.sampler.sample(logits, tensors).token_ids], [], []
        self._confidence(logits, temperature, drafts[-1], confidences, probs)
        if any(rows["extra"]):  # the rejected positions' rows go back before the deeper drafts read the ring
            DraftRollback.restore(saved)
        prev = out_streams.index_select(0, heads)
        for depth in range(1, self.num_drafts):
            requests = [(i, p + depth - 1, 1) for i, p in sampled]
            if self._graph_width(requests, len(sampled)):
                logits, prev = self._replay(states, requests, 1, drafts[-1], prev)
            else:
                ctx = self._context(requests, [p + depth - 1 for _, p in sampled], drafts[-1])
                every = torch.arange(len(sampled), device=self.device)
                logits, prev = self.module(depth, ctx, self.cache[0], prev, drafts[-1], every)
            # each draft as the request's own sampler draws it at that position (seeded noise included)
            tensors = self.target.next_draft_tensors(tensors, states, [(i, p + depth) for i, p in sampled])
            drafts.append(self.target.sampler.sample(logits, tensors).token_ids)
            self._confidence(logits, temperature, drafts[-1], confidences, probs)
        DraftRollback.restore(saved)  # every row: the drafter's cache keeps only computed tokens
        # one copy to the host for both (float64 holds every token id exactly)
        host = torch.cat((torch.stack(drafts, dim=1).double(), torch.stack(confidences, dim=1).double()), dim=1).tolist()
        k = self.num_drafts
        proposals = [([int(t) for t in row[:k]], row[k:]) for row in host]
        self._keep_probs(plan, states, sampled, proposals, probs)
        return proposals

    def _graph_width(self, requests, num_sampled: int) -> int:
        """The rows each request feeds when a captured pass fits (every request sampled, all feeding the
        same number of rows), else 0."""
        if self.graphs is None or len(requests) != num_sampled:
            return 0
        width = requests[0][2]
        if any(c != width for _, _, c in requests) or not self.graphs.can_run(num_sampled, width):
            return 0
        return width

    def _replay(self, states, requests, width: int, ids: torch.Tensor, prev: torch.Tensor, heads=None):
        plan_requests = self._plan.requests
        return self.graphs.run([states[i].slot for i, _, _ in requests], [p for _, p, _ in requests],
                               [self.first_row[plan_requests[i].request_id] for i, _, _ in requests], width, ids,
                               prev, heads)

    def _keep_probs(self, plan: StepPlan, states, sampled, proposals, probs: list[torch.Tensor]) -> None:
        self._probs = {}
        if not self.keeps_probs:
            return
        stacked = torch.stack(probs, dim=1)  # [requests, k, vocab]
        for row, ((i, p), (tokens, _)) in enumerate(zip(sampled, proposals, strict=True)):
            if is_rejection_eligible(states[i].sampling_params, p - states[i].num_prompt_tokens):
                self._probs[plan.requests[i].request_id] = (tokens, stacked[row])

    def _rows(self, plan: StepPlan, result: StepResult) -> dict | None:
        """Host lists of the MTP rows this step makes final (see the module docstring)."""
        last_emitted = {i: row for row, i in enumerate(result.sampled)}
        accepted = dict(zip(dict.fromkeys(result.sampled), result.num_accepted or [], strict=False))
        out = {"h": [], "tok": [], "positions": [], "requests": [], "heads": [], "sampled": [], "extra": []}
        offset, num_inputs = 0, plan.num_tokens
        full = self._full_width(plan, last_emitted)
        for i, request in enumerate(plan.requests):
            s, n, d = request.start, request.num_tokens, request.num_draft_tokens
            final = n - d + accepted.get(i, 0)  # positions computed for good
            count = final if request.is_sampled else n - 1
            if count > 0 and (request.is_sampled and i in last_emitted or not request.is_sampled):
                first = len(out["positions"])
                rows = full or count
                for j in range(s + 1, s + rows + 1):
                    out["h"].append(offset + j - 1 - s)
                    # the emitted token at its position; past it (extra rows) any valid id will do
                    is_emitted = j >= s + final and request.is_sampled
                    out["tok"].append(num_inputs + last_emitted[i] if is_emitted else offset + j - s)
                    out["positions"].append(j)
                out["requests"].append((i, s + 1, rows))
                self.first_row.setdefault(request.request_id, s + 1)
                if request.is_sampled:
                    out["heads"].append(first + count - 1)
                    out["sampled"].append((i, s + count + 1))
                    out["extra"].append(rows - count)
            offset += n
        return out if out["sampled"] else None

    def _full_width(self, plan: StepPlan, last_emitted: dict[int, int]) -> int:
        """Rows a request when the first pass runs at full width (0: each request feeds its final rows).

        When every request verified the same d drafts, each feeds the layer d + 1 rows (a captured graph's
        shape), whatever it accepted: a row past the request's final positions sees only final rows
        before it (causal attention over the ring as it was and the pass's own keys), so the final rows'
        outputs are those of a pass without it, and its ring writes are restored before any later pass
        reads the ring (`propose`)."""
        if self.graphs is None or not plan.requests:
            return 0
        d = plan.requests[0].num_draft_tokens
        if d == 0 or not all(r.is_sampled and i in last_emitted and r.num_draft_tokens == d == r.num_tokens - 1
                             for i, r in enumerate(plan.requests)):
            return 0
        return d + 1 if self.graphs.can_run(len(plan.requests), d + 1) else 0

    def _context(self, requests, positions, ids):
        """The MTP rows' `ForwardContext`: `requests` (state index, first position, rows) in row order."""
        states, plan_requests = self._states, self._plan.requests
        starts = [p for _, p, _ in requests]
        lens = [c for _, _, c in requests]
        ends = [p + c for _, p, c in requests]
        windows = [self.first_row[plan_requests[i].request_id] for i, _, _ in requests]
        loc = [0]
        for c in lens:
            loc.append(loc[-1] + c)
        slots = [states[i].slot for i, _, _ in requests]
        # one host-to-device copy for every per-row and per-request input
        positions_d, ends_d, zeros_d, loc_d, starts_d, slots_d, windows_d = to_device(
            [positions, ends, [0] * len(requests), loc, starts, slots, windows], self.device)
        return self.target.make_context(
            ids, positions_d, ends_d, zeros_d, query_start_loc=loc_d, start_positions=starts_d, slots=slots_d,
            block_tables=torch.zeros(len(requests), 1, dtype=torch.long, device=self.device), query_lens=lens,
            start_positions_host=starts, max_seq_len=max(ends),
            window_start_positions_host=windows, window_starts=windows_d,
        )

    def _confidence(self, logits, temperature, tokens, confidences: list, probs: list) -> None:
        """Append the drafted tokens' probabilities to `confidences` and (when kept) the distributions
        `softmax(logits / temperature)` they were drawn from to `probs`."""
        distributions = torch.softmax(logits.float() / temperature[:, None], dim=-1)
        confidences.append(distributions.gather(1, tokens[:, None]).squeeze(1))
        if self.keeps_probs:
            probs.append(distributions)
