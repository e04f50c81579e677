"""The engine: requests in, incremental `RequestOutput`s out, one `step()` at a time.

`add_request` validates and queues; `step` asks the scheduler for a `StepPlan`, runs it through the
executor (the model side: in this process, or worker ranks), appends the sampled tokens of the
`StepResult`, applies stop rules and reports every request that progressed.

Overlapped decode (`async_scheduling`): a step whose plan is all decodes is left in flight. Its
sequences get a `PENDING_TOKEN`, so the next step can be scheduled and launched at once, the runner
reading those tokens on the device; only then does the host wait for the step in flight's tokens (copied back
without blocking the stream), write them in and apply stop rules. The device never waits for the host
between decode steps. A sequence that stops ran one step more than it needed; that token is dropped.
Any step that is not all decodes (a prefill, an admission, a sequence waiting) first settles the step
in flight, so prefill and preemption see only real tokens. Under speculative decoding a verify step is
never left in flight (the next plan's positions and drafts follow from its accepted counts), and a step
in flight is overlapped only while the next would verify no draft (`Speculator.allows_overlap`).
A verification step is instead read late: `step()` reads the step launched by the call before (its
tokens, accepted drafts and rollback), schedules and launches the next one (`ModelRunner.launch`), and
only then builds and returns the outputs of the step it read, so the device computes while the host
reports (the in-process executor, with `async_scheduling`). Everything that decides the next plan still
comes before it; only the outputs come a call later.

A structured-output request decodes every step too when the model runs in this process: its row of the
next plan's grammar bitmask is filled by the runner once that step's forward is launched, through
`_accept_grammar_tokens` (`StructuredOutputManager.fill_bitmask`). With worker ranks (plans that must
pickle) or speculative decoding it sits out the step launched while its last token is on the device.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from deepinfer_core import plugins
from deepinfer_core.backends import SamplerOutput
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.engine.detokenizer import IncrementalText
from deepinfer_core.engine.input import check_sampling_params
from deepinfer_core.engine.output import build_logprobs_entry, check_stop
from deepinfer_core.engine.overlap import InFlightStep, can_leave_in_flight, can_overlap, launch_copy
from deepinfer_core.executor.executor import can_defer_bitmask, can_launch, make_executor, parallel_stats
from deepinfer_core.kv.blocks import layout_bytes
from deepinfer_core.kv.connector import KvConnector
from deepinfer_core.kv.nixl_transfer import first_token_of, first_token_output
from deepinfer_core.kv.tiers import make_prefix_tiers
from deepinfer_core.models import registry
from deepinfer_core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SpecDecodeMetrics
from deepinfer_core.plan import NONFINITE_TOKEN, PENDING_TOKEN, StepPlan, StepResult
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sched.block_pool import BlockPool
from deepinfer_core.sched.scheduler import Scheduler, SchedulerConfig
from deepinfer_core.sched.sequence import Sequence, SequenceStatus
from deepinfer_core.speculative.proposer import Speculator
from deepinfer_core.structured_output.manager import GrammarError, StructuredOutputManager
from deepinfer_core.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def _show_info_logs() -> None:
    """Print the engine's INFO lines (cache size, graphs) unless the application configured logging."""
    package = logging.getLogger("deepinfer_core")
    if not package.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s deepinfer: %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)

_FINISH_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass
class _Completion:
    seq: Sequence
    request: _Request = field(repr=False, compare=False)
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    text_end: int | None = None
    """Where the text is cut when a stop string matched."""
    partial_text: IncrementalText | None = None
    """Text of an unfinished completion, decoded incrementally."""


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    seq_ids: list[str] = field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)


class Engine:
    """Synchronous engine; not thread-safe (see `deepinfer_core.engine.async_engine` for serving)."""

    def __init__(self, engine_config: EngineConfig, weights: dict[str, torch.Tensor] | None = None,
                 executor=None) -> None:
        """`executor`: the model side to run on (a data-parallel rank's share); None builds one."""
        _show_info_logs()
        model_config = registry.load_model_config(engine_config.model)
        self.config = engine_config.resolve(model_config)
        self.model_config: ModelConfig = model_config
        device = torch.device(self.config.device) if self.config.device else plugins.select_device()
        self.executor = executor if executor is not None else make_executor(model_config, self.config, device, weights)
        info = self.executor.info
        self.tokenizer = load_tokenizer(self.config.model, model_config)
        self.eos_token_ids = model_config.eos_token_ids
        self.structured_output = StructuredOutputManager(self.tokenizer, model_config.vocab_size,
                                                         self.eos_token_ids, pin_memory=device.type == "cuda")
        self.prefix_tiers = make_prefix_tiers(self.config, info.cache_fingerprint, info.block_layout,
                                              layout_bytes(info.block_layout))
        self.block_manager = BlockPool(info.num_blocks, info.block_size, self.config.enable_prefix_caching,
                                       info.cache_fingerprint)
        self.kv_connector = KvConnector(self.block_manager, self.prefix_tiers)
        spec = self.config.speculative_config
        self.speculator = Speculator.from_config(spec) if spec is not None else None
        """Speculative decoding's drafts and statistics (None without `speculative_config`)."""
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=self.config.max_model_len,
                block_size=info.block_size,
                sliding_window=model_config.sliding_window,
                enable_prefix_caching=self.config.enable_prefix_caching,
                swa_replay=self.config.swa_replay,
                num_layers=model_config.num_hidden_layers,
            ),
            self.block_manager,
            info.num_slots,
            # a constrained request waits for its grammar, one whose prefix is read from the store for it
            is_admissible=self._is_admissible,
            choose_drafts=self.speculator.choose_drafts if self.speculator is not None else None,
            connector=self.kv_connector,
        )
        self._requests: dict[str, _Request] = {}
        self._seq_owner: dict[str, _Completion] = {}
        overlap = self.config.async_scheduling
        self._overlap = info.device.type == "cuda" if overlap is None else overlap
        self._defers_grammar_masks = self._overlap and self.speculator is None and can_defer_bitmask(self.executor)
        """Constrained requests' masks may be filled after their step launches (see the module docstring)."""
        self._in_flight: InFlightStep | None = None
        self._launches_verify = self._overlap and self.speculator is not None and can_launch(self.executor)
        """Verification steps are launched before the previous step's outputs are built (module docstring)."""
        self._launched: tuple[StepPlan, list[Sequence], Callable[[], StepResult]] | None = None
        """A verification step the last `step()` launched and has not read: (plan, its sequences, completion)."""
        self._touched: dict[str, _Request] = {}
        self._seed_source = random.Random(self.config.seed)
        self._token_texts: dict[int, str] = {}
        """Single-token decodes (special tokens kept), for logprobs."""
        self._plain_token_texts: dict[int, str] = {}
        """Single-token decodes (special tokens skipped), shared by every incremental detokenizer."""

    def _is_admissible(self, seq: Sequence) -> bool:
        return self.structured_output.is_ready(seq) and self.kv_connector.is_prefix_ready(seq)

    # -- requests -----------------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise `ValueError` for an empty prompt, ids outside the vocabulary or one too long."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        if set(map(type, prompt_token_ids)) == {int}:  # the usual case, checked in C: ~10x faster at 8K ids
            bad = [] if 0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab else [
                t for t in prompt_token_ids if not 0 <= t < vocab]
        else:
            bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {self.config.max_model_len} "
                "(prompt + at least one new token); shorten the prompt or raise max_model_len"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Queue a request; raises `ValueError` on bad input before anything is queued."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        params = sampling_params
        check_sampling_params(params, self.model_config.vocab_size, self.tokenizer, self.eos_token_ids,
                              token_history=True)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the checkpoint's tokenizer (none found); use stop_token_ids")
        store = self.prefix_tiers.store if self.prefix_tiers is not None else None
        if store is not None and params.traffic_class is not None and params.traffic_class not in store.ttl_s:
            raise ValueError(f"traffic_class {params.traffic_class!r} is not configured; classes: {sorted(store.ttl_s)}")
        first = first_token_of(params, self.model_config.vocab_size)
        grammar = self.structured_output.submit(params.structured_outputs) if params.structured_outputs else None
        base_seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        request = _Request(request_id, prompt, list(prompt_token_ids), params, [], RequestMetrics(arrival_time=time.time()))
        if self.speculator is not None:
            request.metrics.spec_decode = SpecDecodeMetrics()
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt_token_ids)
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = (base_seed + index) % 2**64
            seq = Sequence(seq_id, prompt_token_ids, params, prompt=prompt, seed=seed,
                           defers_grammar_mask=self._defers_grammar_masks)
            request.completions.append(_Completion(seq, request, [] if params.logprobs is not None else None))
            request.seq_ids.append(seq_id)
        for completion in request.completions:  # all or nothing
            self.scheduler.add(completion.seq)
        for seq_id, completion in zip(request.seq_ids, request.completions):
            self._seq_owner[seq_id] = completion
            if self.speculator is not None:
                self.speculator.track(seq_id, request.metrics.spec_decode)
            if grammar is not None:
                self.structured_output.track(seq_id, grammar, prompt_token_ids)
        self._requests[request_id] = request
        if first is not None:  # sampled by a prefill instance (kv_transfer): the answer goes on from it
            self._append_tokens([request.completions[0].seq], first_token_output(first), touched := {})
            if request.finished:  # else it is reported with the next token, once the prompt's cache is in
                self._touched.update(touched)

    def abort(self, request_id: str) -> None:
        """Stop a request and free everything it holds; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for seq_id in request.seq_ids:
            self.scheduler.abort(seq_id)
            self._seq_owner.pop(seq_id, None)
            if self.speculator is not None:
                self.speculator.forget(seq_id)
            self.structured_output.remove(seq_id)

    @property
    def runner(self):
        """The model runner, when it lives in this process (the "uni" executor); benches and tests read it."""
        runner = getattr(self.executor, "runner", None)
        if runner is None:
            raise AttributeError("the model runs in worker processes: this engine has no in-process runner")
        return runner

    def shutdown(self) -> None:
        """Stop the executor's workers (in-process: the model's own threads); the engine is unusable afterwards."""
        self.flush_cache_ops()
        if self.prefix_tiers is not None:
            self.prefix_tiers.close()
        self.executor.shutdown()
        self.structured_output.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that progressed or finished.

        With overlapped decode a decode step's tokens are reported by the step after it. Once nothing is
        left to run, blocks still queued for the prefix tiers are saved (so they outlive the process)."""
        outputs = self._step()
        if (self.prefix_tiers is not None and self._in_flight is None and self._launched is None
                and not self.scheduler.has_unfinished()):
            self.flush_cache_ops()
        return outputs

    def flush_cache_ops(self) -> None:
        """Run the queued prefix-tier transfers in a plan of their own (no tokens): afterwards every
        computed block is in the host tier and queued for the store. A verify step still launched is read
        first (its outputs come with the next `step()`)."""
        if self._launched is not None:
            self._read_launched(self._touched)
        if self.prefix_tiers is None:
            return
        if self.prefix_tiers.has_cache_ops:
            ops = self.kv_connector.take_cache_ops()
            result = self.executor.execute(StepPlan((), cache_ops=ops))
            self.prefix_tiers.accept_saved(ops, result.saved)
        self.prefix_tiers.poll_saves(wait=True)

    def _step(self) -> list[RequestOutput]:
        touched, self._touched = self._touched, {}  # requests added with their first token count as progressed
        if self._launched is not None:  # the verification step the last call launched: read it first
            self._read_launched(touched)
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and not self._can_overlap():
            self._settle(in_flight, touched)
            in_flight = None
        owner = self._seq_owner
        if self.structured_output.has_pending:
            self._end_failed_grammars(touched)
        plan = self.scheduler.schedule()
        for seq in self.scheduler.pop_finished():
            request = owner[seq.request_id].request
            touched[request.request_id] = request
        if plan is None:
            self.flush_cache_ops()  # loads and saves queued by an admission that did not fit
            if in_flight is not None:  # everything running was preempted: nothing to launch
                self._settle(in_flight, touched)
            elif not touched and self.structured_output.has_pending:
                self.structured_output.wait_pending(0.05)  # only grammars compiling: no busy loop
            elif not touched and self.prefix_tiers is not None:
                self.prefix_tiers.wait_loading(0.05)  # only prefixes loading from the store: no busy loop
            return [self._finish_output(request) for request in touched.values()]
        plan = self.structured_output.fill_bitmask(
            plan, functools.partial(self._accept_grammar_tokens, in_flight) if in_flight is not None else None)
        seqs = [owner[r.request_id].seq for r in plan.requests]
        self._note_scheduled(seqs)
        if self._launches_verify and in_flight is None and not plan.cache_ops and any(
                r.num_draft_tokens for r in plan.requests):
            self._launched = plan, seqs, self.executor.launch(plan)
            # the device runs the step while the host reports the step read above
            return [self._finish_output(request) for request in touched.values()]
        result = self.executor.execute(plan)
        if plan.cache_ops:
            self.prefix_tiers.accept_saved(plan.cache_ops, result.saved)
        launched = launch_copy(seqs, result.output) if self._can_leave_in_flight(plan, result) else None
        if in_flight is not None:  # read only now: the device already runs this step
            self._settle(in_flight, touched)
        if launched is not None:
            outputs = [self._finish_output(request) for request in touched.values()]
            self.scheduler.postprocess(plan)
            for seq in seqs:
                if not seq.is_finished:
                    seq.append_token(PENDING_TOKEN)
            if self.speculator is not None:
                self.speculator.record(plan, None, is_overlapped=True)
            self._in_flight = launched
            return outputs
        self._apply_result(plan, seqs, result, touched)
        return [self._finish_output(request) for request in touched.values()]

    def _read_launched(self, touched: dict[str, _Request]) -> None:
        (plan, seqs, complete), self._launched = self._launched, None
        self._apply_result(plan, seqs, complete(), touched)

    def _apply_result(self, plan: StepPlan, seqs: list[Sequence], result: StepResult,
                      touched: dict[str, _Request]) -> None:
        """Record that `plan` ran and take in what it produced: prompt logprobs, sampled tokens (stop rules
        applied), the MTP drafter's next drafts and the accepted drafts."""
        self.scheduler.postprocess(plan)
        for i, (first, logits) in result.prompt_logits.items():
            if not seqs[i].is_finished:  # aborted while its step was launched (read late): it has no owner now
                self._record_prompt_logprobs(seqs[i], first, logits)
        if result.output is not None:
            is_identity = len(result.sampled) == len(seqs) and result.num_accepted is None
            sampled = seqs if is_identity else [seqs[i] for i in result.sampled]
            self._append_tokens(sampled, result.output, touched)
        if result.drafts is not None:  # the model side's drafter (MTP) proposed what follows each request
            for i, (drafts, confidences) in zip(dict.fromkeys(result.sampled), result.drafts, strict=True):
                seqs[i].draft_token_ids, seqs[i].draft_confidences = drafts, confidences
        if self.speculator is not None:
            if result.num_accepted is not None:  # drafts accepted: computed now that they are tokens
                self.scheduler.accept_drafts(plan, result.num_accepted)
            self.speculator.record(plan, result.num_accepted)

    def _can_leave_in_flight(self, plan: StepPlan, result) -> bool:
        """Whether the executed step may stay unread while the next launches (`overlap.can_leave_in_flight`);
        under speculation only a step whose successor would verify no draft, and never one that brought
        the MTP drafter's next drafts (they are read with the step)."""
        if not self._overlap or not can_leave_in_flight(plan, result):
            return False
        return self.speculator is None or (result.drafts is None and self.speculator.allows_overlap(self.scheduler.running))

    def _can_overlap(self) -> bool:
        """Whether the next step may launch while the one in flight is unread (`overlap.can_overlap`);
        under speculation only while it would verify no draft: a verify step's plan needs the accepted
        counts of the step before it (`Speculator.allows_overlap`)."""
        if not can_overlap(self.scheduler, self.config.max_model_len):
            return False
        return self.speculator is None or self.speculator.allows_overlap(self.scheduler.running)

    def _end_failed_grammars(self, touched: dict[str, _Request]) -> None:
        """End, with finish_reason "error", the sequences whose grammar failed to compile or timed out."""
        for seq_id, why in self.structured_output.pop_failed():
            completion = self._seq_owner[seq_id]
            logger.error("request %s: %s; it ends with finish_reason 'error'", seq_id, why)
            self.scheduler.finish(completion.seq, SequenceStatus.FINISHED_ERROR)
            touched[completion.request.request_id] = completion.request

    def _note_scheduled(self, seqs: list[Sequence]) -> None:
        now, owner = time.time(), self._seq_owner
        for seq in seqs:
            request = owner[seq.request_id].request
            if not request.metrics.first_scheduled_time:
                request.metrics.first_scheduled_time = now
            request.num_cached_tokens = max(request.num_cached_tokens, seq.num_cached_tokens)

    def _settle(self, in_flight: InFlightStep, touched: dict[str, _Request]) -> None:
        """Wait for the step in flight's tokens and append them (see `_append_tokens`)."""
        if in_flight.ready is not None:
            in_flight.ready.synchronize()
        self._append_tokens(in_flight.seqs, in_flight.output, touched, pending=True)

    def _accept_grammar_tokens(self, in_flight: InFlightStep) -> None:
        """Wait for the step in flight's tokens and advance its constrained sequences' matchers by them:
        the runner calls this through the next plan's deferred bitmask, once that step's forward is
        launched. `_settle` appends the tokens later, and finds them accepted (`accept` by position)."""
        if in_flight.ready is not None:
            in_flight.ready.synchronize()
        seq_ids, tokens, positions = [], [], []
        for seq, token in zip(in_flight.seqs, in_flight.output.token_ids.tolist()):
            if not (seq.is_finished or token == NONFINITE_TOKEN):
                seq_ids.append(seq.request_id)
                tokens.append(token)
                positions.append(seq.num_output_tokens - 1)
        # a rejected token leaves its row free; `_settle`'s `accept` raises it and ends the request
        self.structured_output.accept_many(seq_ids, tokens, positions)

    def _append_tokens(self, seqs: list[Sequence], output, touched: dict[str, _Request], pending: bool = False) -> None:
        """Add each row's token to its sequence and apply the stop rules; `pending`: the tokens replace
        the sequences' `PENDING_TOKEN`s, and sequences that finished meanwhile are skipped."""
        owner, eos_token_ids, max_model_len = self._seq_owner, self.eos_token_ids, self.config.max_model_len
        host_output = None  # the logprob tensors come to the host only when some row reports them
        tokens = output.token_ids.tolist()  # one device read: it waits for the step to finish
        now = time.time()  # the tokens exist from here (stamped before the read, a prefill's TTFT read short)
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.is_finished:
                continue  # stopped (by the step settled before this one) or aborted: the token is dropped
            if token == NONFINITE_TOKEN:  # a pending placeholder stays: outputs never show it
                logger.error("request %s: the model's logits are not finite; it ends with finish_reason "
                             "'error'", seq.request_id)
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
                touched[owner[seq.request_id].request.request_id] = owner[seq.request_id].request
                continue
            is_grammar_complete = False
            if seq.sampling_params.structured_outputs is not None:
                try:  # before the token is added: a rejected one is never shown
                    position = seq.num_output_tokens - 1 if pending else seq.num_output_tokens
                    is_grammar_complete = self.structured_output.accept(seq.request_id, token, position)
                except GrammarError as err:
                    logger.error("request %s: %s; it ends with finish_reason 'error'", seq.request_id, err)
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
                    touched[owner[seq.request_id].request.request_id] = owner[seq.request_id].request
                    continue
            if pending:
                seq.resolve_pending(token)
            else:
                seq.append_token(token)
            completion = owner[seq.request_id]
            request, params = completion.request, completion.request.params
            if completion.logprobs is not None:
                if host_output is None:
                    host_output = _host_lists(output)
                entry = build_logprobs_entry(host_output, row, params.logprobs, self._decode_token)
                completion.logprobs.append(entry)
                completion.cumulative_logprob += entry[token].logprob
            metrics = request.metrics
            if not metrics.first_token_time:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generation_tokens += 1
            reason = check_stop(params, token, seq.num_output_tokens, eos_token_ids, seq.num_tokens >= max_model_len)
            if (params.stop and reason != "stop" and seq.num_output_tokens >= params.min_tokens
                    and self._match_stop_string(completion)):
                reason = "stop"
            elif reason == "stop" and token in params.stop_token_ids:
                completion.stop_reason = token
            if is_grammar_complete and reason is None:
                reason = "stop"
            if reason is not None:
                self.scheduler.finish(seq, _FINISH_STATUS[reason])
            touched[request.request_id] = request

    def _match_stop_string(self, completion: _Completion) -> bool:
        """Whether the text now contains a stop string (only matches ending in the new text are searched)."""
        stops = completion.seq.sampling_params.stop
        seen = len(completion.partial_text.text) if completion.partial_text is not None else 0
        text = self._text(completion, completion.seq.output_token_ids)  # incremental: the seq is not finished
        start = max(0, seen - max(map(len, stops)) + 1)
        hits = [(i, stop) for stop in stops if (i := text.find(stop, start)) >= 0]
        if not hits:
            return False
        completion.text_end, completion.stop_reason = min(hits)
        return True

    def _record_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """Fill prompt positions `first ..` (a recomputed chunk overwrites them with equal values)."""
        request = self._seq_owner[seq.request_id].request
        if request.seq_ids[0] != seq.request_id:
            return  # the n completions share one prompt
        logits = logits.float()
        # deterministic mode: on the host, whose log-softmax reduces each row in an order fixed by the
        # vocabulary size (`SamplingSpec.deterministic`), so a position's logprobs ignore its step's shape
        logprobs = logits.cpu().log_softmax(-1) if self.config.deterministic else logits.log_softmax(-1).cpu()
        targets = torch.tensor(seq.token_ids[first : first + logprobs.shape[0]])
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        k = request.params.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k else None
        for j, token in enumerate(targets.tolist()):
            entry = {token: Logprob(float(chosen[j]), int(ranks[j]), self._decode_token(token))}
            if top is not None:
                for rank, (t, v) in enumerate(zip(top.indices[j].tolist(), top.values[j].tolist()), start=1):
                    entry.setdefault(t, Logprob(v, rank, self._decode_token(t)))
            request.prompt_logprobs[first + j] = entry

    def _finish_output(self, request: _Request) -> RequestOutput:
        finished = request.finished
        if finished:
            request.metrics.finished_time = time.time()
            self._requests.pop(request.request_id, None)
            for seq_id in request.seq_ids:
                self._seq_owner.pop(seq_id, None)
                self.structured_output.remove(seq_id)
                if self.speculator is not None:
                    self.speculator.forget(seq_id)
        return self.make_output(request, finished)

    def make_output(self, request: _Request, finished: bool | None = None) -> RequestOutput:
        """Everything `request` produced so far; `finished` (computed when None) is `request.finished`."""
        outputs = []
        for index, completion in enumerate(request.completions):  # positional: built per request and step
            seq, logprobs = completion.seq, completion.logprobs
            ids = seq.output_token_ids
            outputs.append(CompletionOutput(
                index, self._text(completion, ids), ids,
                completion.cumulative_logprob if logprobs is not None else None,
                list(logprobs) if logprobs is not None else None,
                _FINISH_REASON.get(seq.status), completion.stop_reason,  # None: unfinished
            ))
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs,
            request.finished if finished is None else finished, request.num_cached_tokens,
            request.metrics, list(request.prompt_logprobs) if request.prompt_logprobs else None,
        )

    # -- text ---------------------------------------------------------------------------------------

    def decode(self, token_ids: list[int]) -> str:
        """Text of generated ids (special tokens skipped); empty without a tokenizer."""
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _text(self, completion: _Completion, ids: list[int]) -> str:
        """Exact full decode once finished; while generating, an incremental decode (O(1) a step)."""
        if completion.seq.is_finished or self.tokenizer is None:
            return self.decode(ids)[: completion.text_end]
        if completion.partial_text is None:
            completion.partial_text = IncrementalText(self.tokenizer, self._plain_token_texts)
        return completion.partial_text.update(ids)

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def stats(self) -> dict:
        """Counters for monitoring: queue sizes, prefix-cache hits, preemptions, free blocks."""
        s = self.scheduler.stats
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.executor.info.num_blocks,
            "prefix_cache_hit_tokens": s.num_hit_tokens,
            "prefix_cache_queried_tokens": s.num_queried_tokens,
            "prefix_cache_hit_rate": s.hit_rate,
            "prefix_cache_replay_tokens": s.num_replay_tokens,
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_decode_tokens": s.num_decode_tokens,
            "num_preemptions": s.num_preemptions,
            "num_loading": sum(seq.is_loading for seq in self.scheduler.waiting),
            **{f"prefix_cache_hit_tokens_{tier}": n for tier, n in self.kv_connector.hit_tokens.items()},
            **(self.prefix_tiers.stats() if self.prefix_tiers is not None else {}),
            **(_spec_stats(self.speculator) if self.speculator is not None else {}),
            **parallel_stats(self.executor),
        }


def _spec_stats(speculator: Speculator) -> dict:
    """The engine's speculative decoding counters, for `stats()` and `/metrics`."""
    totals = speculator.totals
    return {
        "spec_drafted_tokens": totals.num_drafted_tokens,
        "spec_verified_tokens": totals.num_verified_tokens,
        "spec_accepted_tokens": totals.num_accepted_tokens,
        "spec_verify_steps": totals.num_verify_steps,
        "spec_mean_acceptance_length": totals.mean_acceptance_length,
        "spec_acceptance_histogram": list(totals.acceptance_histogram),
        "spec_overlapped_steps": speculator.num_overlapped_steps,
        "spec_probe_steps": speculator.num_probe_steps,
    }


def _host_lists(output: SamplerOutput) -> SamplerOutput:
    """`output` with every field as host lists, which `build_logprobs_entry` reads fast row by row."""
    values = {f.name: getattr(output, f.name) for f in fields(output)}
    return replace(output, **{name: value.tolist() for name, value in values.items() if value is not None})
