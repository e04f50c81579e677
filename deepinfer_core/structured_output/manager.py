"""Structured output: grammars compiled with xgrammar off the step loop, one matcher per sequence.

`StructuredOutputManager.submit` parses a request's `StructuredOutputsParams` at once (an invalid
schema, pattern or grammar is a `GrammarError`, a `ValueError`, with xgrammar's message) and compiles
it against the vocabulary on a small thread pool, cached by the constraint's key under a byte cap. The
engine then drives it each step:

- `pop_failed` before scheduling: sequences whose compile failed or ran past `compile_timeout_s`;
  the others start matching once compiled, and `is_ready` (the scheduler's admission predicate)
  keeps a sequence waiting until then;
- `plan_rows` after scheduling names the rows, `fill_rows` fills them: one packed row (`[rows, ceil(vocab / 32)]` int32) per sampled
  constrained request, named by its `ScheduledRequest.grammar_row`; the runner applies it to the
  logits on the device (`apply_bitmask`) before sampling. Under speculative decoding a request with d
  drafts has d + 1 rows from its `grammar_row` on, one per logits row it verifies: row j is its mask
  after the drafts before it, filled by advancing the matcher through the drafts and rolling it back
  afterwards (xgrammar's matchers roll back without limit). A draft the grammar rejects cannot be
  accepted (the masked draw of its row is another token), so the rows after it are left free.
  The rows travel as data, apart from the plan: the engine fills them after the executor's
  `execute_model` returned (in-process, while the forward runs) and hands them to `sample`. Under
  overlapped decode a request's input may still be on the device (`PENDING_TOKEN`): the engine then
  first accepts the tokens of the step in flight (vLLM's async scheduling does the same; such a request
  has no drafts: verify steps are never overlapped), with any executor;
- `accept` with each appended token: the matcher advances; True once the grammar is complete. It is
  idempotent by position, so the engine's settling of a step skips tokens accepted before a pending row was filled.

In thinking mode (the prompt's last `<think>` comes after its last `</think>`) the reasoning is free:
the matcher starts with the first token after the model's `</think>` (a `</think>` draft included: the
rows after it are masked from the grammar's start).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from deepinfer_core.plan import PENDING_TOKEN

if TYPE_CHECKING:
    import torch

    from deepinfer_core.plan import StepPlan
    from deepinfer_core.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 30.0
"""Longest a grammar may take to compile (from its submission) before its request is refused."""
CACHE_LIMIT_BYTES = 256 * 2**20
"""Compiled grammars kept for reuse, least recently used evicted first."""
NUM_COMPILE_THREADS = 2
"""Grammars compiled at once (each compile also spreads its mask precomputation over threads)."""
BATCH_FILL_ROWS = 8
"""From this many constrained rows on, bitmasks are filled by xgrammar's batch matcher (one C++ call)."""
FILL_THREADS = 1
"""Threads of that batch fill. A row's mask takes microseconds, and xgrammar's threads cost more than they
save: 32 rows in JSON states took 0.09 ms on one thread against 0.31 ms on two and 1.06 ms on eight on the
H200's 16-CPU host (bench/structured_overhead.py --fill-sweep), 0.06-0.10 ms against 0.14-0.94 ms on two
on a 2-CPU one."""
THINK_START, THINK_END = "<think>", "</think>"

_LOG_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?\S+:\d+:\s*")


class GrammarError(ValueError):
    """A constraint that cannot be compiled (invalid, or too slow), or a token its matcher rejects."""


def _compile_threads() -> int:
    """Threads for a grammar compile: the CPUs this process may run on, at most 8."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, usable))


def _xgrammar() -> Any:
    import xgrammar  # imported on first use: it pulls in transformers

    return xgrammar


def _message(err: BaseException) -> str:
    """xgrammar's message without its log prefix (`[12:00:00] /project/cpp/x.cc:42: `)."""
    return _LOG_PREFIX.sub("", str(err)).strip()


def parse_grammar(spec: StructuredOutputsParams) -> Any:
    """The xgrammar `Grammar` of `spec` (no vocabulary needed: fast); `GrammarError` if invalid."""
    xgr, kind = _xgrammar(), spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(spec.json), any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":  # any object (OpenAI's json_object)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace,
                                                strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as err:
        raise GrammarError(f"invalid structured outputs {kind}: {_message(err)}") from None


def apply_bitmask(logits: torch.Tensor, plan: StepPlan, sampled: list[int], bitmask: torch.Tensor) -> None:
    """Mask, in place, the disallowed tokens of the constrained rows of `logits` by `bitmask` (the step's
    rows, `StructuredOutputManager.fill_rows`): row k samples `plan.requests[sampled[k]]`, repeated for a
    request's drafts, and its j-th row takes bitmask row `grammar_row + j`; the other rows are not touched."""
    from deepinfer_core.speculative.verify import row_token_offsets

    rows, source = [], []
    for row, (index, offset) in enumerate(zip(sampled, row_token_offsets(plan, sampled))):
        request = plan.requests[index]
        if request.grammar_row is not None:  # offset -d .. 0 over the request's d + 1 rows
            rows.append(row)
            source.append(request.grammar_row + request.num_draft_tokens + offset)
    if not rows:
        return
    if rows != source:  # xgrammar reads bitmask row i for logits row i
        full = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
        full[rows] = bitmask[source]
        bitmask = full
    indices: Any = rows
    if logits.is_cuda:
        import torch

        # a pageable source makes a copy wait for the stream, i.e. for this step's forward: the host
        # would stall here instead of preparing the next step (H200, bs 64: 13.1 ms steps against 6.2).
        # xgrammar copies a list of indices from pageable memory, so they go as a tensor too.
        if not bitmask.is_pinned():
            bitmask = bitmask.pin_memory()
        bitmask = bitmask.to(logits.device, non_blocking=True)
        indices = torch.tensor(rows, dtype=torch.int32, pin_memory=True).to(logits.device, non_blocking=True)
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=indices)


@dataclass(frozen=True)
class GrammarRows:
    """The constrained rows of one plan (`StructuredOutputManager.plan_rows`), filled by `fill_rows`."""

    seq_ids: list[str]
    drafts: list[tuple[int, ...]]
    """Per sequence, the drafts its step verifies (its rows after the first)."""
    first_rows: list[int]
    num_rows: int
    is_pending: bool
    """Some sequence's input is still on the device: accept the step in flight's tokens before filling."""


@dataclass
class _SeqGrammar:
    compiled: Future
    submitted_at: float
    is_reasoning: bool
    """Still thinking: no mask until the model's `</think>`."""
    matcher: Any = None
    num_accepted: int = 0
    """Output tokens `accept` has consumed (thinking ones included)."""
    is_complete: bool = False
    """The matcher has terminated (accepted an end-of-sequence token)."""
    error: str | None = None
    """Why the matcher rejected a token (the sequence ends with it)."""


@dataclass
class _DraftWalk:
    """One sequence's way through its drafts while its rows are filled (`next_token_bitmask`)."""

    row: int
    """Its first bitmask row."""
    state: _SeqGrammar
    drafts: tuple[int, ...]
    is_reasoning: bool
    is_stopped: bool = False
    """The matcher rejected a draft or terminated: the later rows stay free."""
    num_consumed: int = 0
    """Drafts the matcher accepted (rolled back once every row is filled)."""

    def advance(self, token: int, think_end: int | None) -> None:
        if self.is_stopped:
            return
        if self.is_reasoning:
            self.is_reasoning = token != think_end
            return
        matcher = self.state.matcher
        if not matcher.accept_token(token):
            self.is_stopped = True
            return
        self.num_consumed += 1
        self.is_stopped = matcher.is_terminated()


class StructuredOutputManager:
    """Compiles constraints and keeps one matcher per constrained sequence (see the module docstring).

    :param tokenizer: the checkpoint's tokenizer (its `hf` is a `tokenizers.Tokenizer`), or None.
    :param vocab_size: the model's vocabulary (the logits' width; the mask covers it all).
    :param stop_token_ids: end-of-sequence ids: the only tokens allowed once a grammar is complete.
    :param pin_memory: fill the bitmasks in pinned host memory (the logits are on a CUDA device: its copy
        then never waits for the step's forward, and nothing is copied twice).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S, cache_limit_bytes: int = CACHE_LIMIT_BYTES,
                 num_threads: int = NUM_COMPILE_THREADS, pin_memory: bool = False) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.pin_memory = pin_memory
        self.compile_timeout_s, self.cache_limit_bytes = compile_timeout_s, cache_limit_bytes
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_bytes: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._seqs: dict[str, _SeqGrammar] = {}
        self._pending: set[str] = set()
        """Sequences whose grammar is not compiled yet (or not yet checked since it was)."""
        self._batch_matcher: Any = None
        self._think: tuple[int | None, int | None] | None = None

    # -- compiling (any thread) ---------------------------------------------------------------

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compile of `spec` (a cached one, or a new one on the pool); `GrammarError` if invalid."""
        if self.tokenizer is None or not hasattr(self.tokenizer, "hf"):
            raise GrammarError("structured outputs need the checkpoint's tokenizer.json (none was loaded)")
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = parse_grammar(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="deepinfer-grammar")
                future = self._cache[key] = self._pool.submit(self._compile, key, spec.kind, grammar)
            return future

    def wait(self, spec: StructuredOutputsParams) -> Any:
        """Block until `spec` is compiled (at most `compile_timeout_s`); `GrammarError` if it fails."""
        try:
            return self.submit(spec).result(timeout=self.compile_timeout_s)
        except FutureTimeoutError:
            raise GrammarError(self._timeout_message(spec.kind)) from None

    def wait_all(self, specs: list[StructuredOutputsParams | None]) -> None:
        """Compile every constraint in `specs` (None entries skipped) in parallel and wait for all;
        the first failure raises `GrammarError`."""
        specs = [spec for spec in specs if spec is not None]
        for spec in specs:
            self.submit(spec)
        for spec in specs:
            self.wait(spec)

    def _timeout_message(self, kind: str) -> str:
        return (f"compiling the structured outputs {kind} took longer than {self.compile_timeout_s:g} s; "
                "simplify it")

    def _compile(self, key: str, kind: str, grammar: Any) -> Any:
        try:
            compiled = self._get_compiler().compile_grammar(grammar)
        except Exception as err:  # noqa: BLE001 - any compile failure is this request's error
            with self._lock:
                self._cache.pop(key, None)  # not kept: a later request tries again
            raise GrammarError(f"cannot compile the structured outputs {kind}: {_message(err)}") from None
        with self._lock:
            self._cache_bytes[key] = compiled.memory_size_bytes
            self._evict()
        return compiled

    def _evict(self) -> None:
        while sum(self._cache_bytes.values()) > self.cache_limit_bytes and len(self._cache_bytes) > 1:
            key = next(k for k in self._cache if k in self._cache_bytes)
            del self._cache[key], self._cache_bytes[key]  # sequences using it keep their own reference

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                from transformers import PreTrainedTokenizerFast

                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.hf), vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=_compile_threads(),
                                                     cache_enabled=False)
            return self._compiler

    # -- sequences (the engine's thread) ------------------------------------------------------

    def track(self, seq_id: str, compiled: Future, prompt_token_ids: list[int]) -> None:
        """Constrain sequence `seq_id` by the grammar `compiled` will hold (from `submit`)."""
        self._seqs[seq_id] = _SeqGrammar(compiled, time.monotonic(), self._is_thinking(prompt_token_ids))
        self._pending.add(seq_id)

    def remove(self, seq_id: str) -> None:
        """Forget a finished or aborted sequence (unknown ids are ignored)."""
        self._seqs.pop(seq_id, None)
        self._pending.discard(seq_id)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    @property
    def has_pending(self) -> bool:
        """Some sequence waits for its grammar."""
        return bool(self._pending)

    def is_ready(self, seq: Any) -> bool:
        """Whether `seq` may be admitted: unconstrained, or its grammar compiled (see `pop_failed`)."""
        return seq.request_id not in self._pending

    def pop_failed(self) -> list[tuple[str, str]]:
        """`(seq_id, why)` of sequences whose compile failed or timed out (forgotten here); start the
        matchers of those whose compile finished."""
        failed = []
        now = time.monotonic()
        for seq_id in list(self._pending):
            state = self._seqs[seq_id]
            if state.compiled.done():
                error = state.compiled.exception()
                if error is None:
                    state.matcher = _xgrammar().GrammarMatcher(state.compiled.result())
                    self._pending.discard(seq_id)
                    continue
                failed.append((seq_id, str(error)))
            elif now - state.submitted_at > self.compile_timeout_s:
                failed.append((seq_id, self._timeout_message("grammar")))
            else:
                continue
            self.remove(seq_id)
        return failed

    def wait_pending(self, timeout_s: float) -> None:
        """Block until some pending grammar is compiled, or `timeout_s` (a step with nothing to run)."""
        futures = {self._seqs[seq_id].compiled for seq_id in self._pending}
        if futures:
            wait_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def plan_rows(self, plan: StepPlan) -> tuple[StepPlan, GrammarRows | None]:
        """`plan` with a bitmask row named (`grammar_row`) for each sampled constrained request, and those
        rows to fill (`fill_rows`) once the plan's forward is queued (None: no constrained request).

        A request with d drafts gets d + 1 rows (`apply_bitmask`), one per draft position. A request
        whose input is `PENDING_TOKEN` (it has no drafts) has its row filled only after the engine
        `accept`s the tokens of the step in flight (`GrammarRows.is_pending`): the engine does that after
        `execute_model`, so the matchers' host work overlaps the forward, in any executor.
        """
        if not self._seqs:
            return plan, None
        indices, seq_ids, drafts, first_rows, is_pending_any = [], [], [], [], False
        num_rows = 0  # logits rows before this request's: its grammar rows are its logits rows
        for index, request in enumerate(plan.requests):
            if not request.is_sampled:
                continue
            num_rows += request.num_draft_tokens + 1
            state = self._seqs.get(request.request_id)
            if state is None or state.matcher is None:
                continue
            is_pending = request.token_ids[-1] == PENDING_TOKEN
            d = request.num_draft_tokens
            request_drafts = tuple(request.token_ids[len(request.token_ids) - d :])
            # a pending token may be the `</think>`, and so may a draft
            if state.is_reasoning and not is_pending and self._think_ids()[1] not in request_drafts:
                continue
            if is_pending and d:
                raise RuntimeError("a request with drafts has a pending input (drafts follow known tokens)")
            indices.append(index)
            seq_ids.append(request.request_id)
            drafts.append(request_drafts)
            first_rows.append(num_rows - d - 1)
            is_pending_any |= is_pending
        if not indices:
            return plan, None
        requests = list(plan.requests)
        for index, row in zip(indices, first_rows):
            requests[index] = replace(requests[index], grammar_row=row)
        return replace(plan, requests=tuple(requests)), GrammarRows(seq_ids, drafts, first_rows, num_rows, is_pending_any)

    def fill_rows(self, rows: GrammarRows) -> torch.Tensor:
        """The packed masks of `rows` (`next_token_bitmask`), what the executor's `sample` applies."""
        return self.next_token_bitmask(rows.seq_ids, rows.drafts, rows=rows.first_rows, num_rows=rows.num_rows)

    def next_token_bitmask(self, seq_ids: list[str], drafts: list[tuple[int, ...]] | None = None, *,
                           rows: list[int] | None = None, num_rows: int | None = None) -> torch.Tensor:
        """Packed masks `[rows, ceil(vocab / 32)]` int32 of each sequence's next token: one row per
        sequence, or with `drafts` (per sequence, the drafts its step verifies) d + 1 consecutive rows
        for d drafts, row j the mask after drafts 0 .. j - 1. Every token is allowed for one still
        thinking, or whose grammar is over (complete, or its last token rejected): such a sequence ends,
        and what its step samples is dropped; and on the rows after a draft the grammar rejects or that
        ends it (the draft cannot be accepted, or the sequence stops at it).

        `rows`: each sequence's first row in a mask of `num_rows` rows (default: one after the other);
        the rows no sequence owns are left unset (`apply_bitmask` never reads them)."""
        import torch

        drafts = drafts if drafts is not None else [()] * len(seq_ids)
        if rows is None:
            rows = [0, *itertools.accumulate(len(d) + 1 for d in drafts)][:-1]
            num_rows = len(seq_ids) + sum(map(len, drafts))
        bitmask = torch.empty((num_rows, -(-self.vocab_size // 32)), dtype=torch.int32, pin_memory=self.pin_memory)
        walks, filled = [], set()
        for seq_id, seq_drafts, row in zip(seq_ids, drafts, rows, strict=True):
            state = self._seqs.get(seq_id)
            if state is not None and not (state.is_complete or state.error):
                walks.append(_DraftWalk(row, state, seq_drafts, state.is_reasoning))
        think_end = self._think_ids()[1] if any(drafts) else None
        for j in range(max(map(len, drafts), default=0) + 1):
            live = [w for w in walks if j <= len(w.drafts) and not (w.is_stopped or w.is_reasoning)]
            self._fill(bitmask, [w.row + j for w in live], [w.state.matcher for w in live])
            filled.update(w.row + j for w in live)
            for walk in walks:
                if j < len(walk.drafts):
                    walk.advance(walk.drafts[j], think_end)
        for walk in walks:
            if walk.num_consumed:
                walk.state.matcher.rollback(walk.num_consumed)
        free = [r + j for r, d in zip(rows, drafts) for j in range(len(d) + 1) if r + j not in filled]
        if free:  # all allowed
            bitmask[free] = -1
        return bitmask

    def _fill(self, bitmask: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Fill bitmask row `rows[i]` from `matchers[i]`, in one C++ call for many rows."""
        if len(rows) >= BATCH_FILL_ROWS:
            if self._batch_matcher is None:
                # xgrammar's "auto" is half of std::thread::hardware_concurrency: name the count
                self._batch_matcher = _xgrammar().BatchGrammarMatcher(max_threads=FILL_THREADS)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        else:
            for row, matcher in zip(rows, matchers):
                matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, seq_id: str, token_id: int, position: int) -> bool:
        """Advance `seq_id`'s matcher by its output token number `position` (0 for the first); True
        once the grammar is complete. A position already accepted (before a pending row was
        filled, see `plan_rows`) gives the same answer again without advancing the matcher.

        :raises GrammarError: the matcher rejects the token (again at every later call).
        """
        state = self._seqs[seq_id]
        self.accept_many([seq_id], [token_id], [position])
        if state.error is not None:
            raise GrammarError(state.error)
        return state.is_complete

    def accept_many(self, seq_ids: list[str], token_ids: list[int], positions: list[int]) -> None:
        """`accept` for the tokens of one step (the step in flight's, see `plan_rows`), raising nothing:
        sequences not tracked, or whose token at that position was accepted already, are skipped, and a
        rejected token becomes the sequence's error, which its next `accept` raises."""
        think_end = None
        for seq_id, token_id, position in zip(seq_ids, token_ids, positions, strict=True):
            state = self._seqs.get(seq_id)
            if state is None or state.error is not None or position < state.num_accepted:
                continue
            if position > state.num_accepted:
                raise RuntimeError(f"sequence {seq_id!r}: output token {position} accepted before token "
                                   f"{state.num_accepted}")
            state.num_accepted += 1
            if state.is_reasoning:
                think_end = think_end or self._think_ids()[1]
                state.is_reasoning = token_id != think_end
            elif state.matcher.accept_token(token_id):  # xgrammar's batch_accept_token is slower for 8-32
                state.is_complete = state.matcher.is_terminated()
            else:
                state.error = f"token {token_id} does not continue the grammar"

    def _think_ids(self) -> tuple[int | None, int | None]:
        if self._think is None:
            self._think = self.tokenizer.hf.token_to_id(THINK_START), self.tokenizer.hf.token_to_id(THINK_END)
        return self._think

    def _is_thinking(self, prompt_token_ids: list[int]) -> bool:
        start, end = self._think_ids()
        if start is None or end is None:
            return False
        for token in reversed(prompt_token_ids):
            if token == end:
                return False
            if token == start:
                return True
        return False

    def shutdown(self) -> None:
        """Stop the compile threads (a compile under way finishes in the background)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
