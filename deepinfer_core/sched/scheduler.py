"""Decides, each step, which tokens of which requests the model computes.

Policy, in order, under a token budget and a sequence cap:
1. decodes: every running sequence with one uncomputed token gets that token;
2. prefill chunks: running sequences with more to compute get what budget is left, cut at any token;
3. admission: waiting sequences, first come first served, get a state slot, a prefix-cache match
   and a first chunk. Skipped in a step that preempted or ran short of blocks, so new work never
   overtakes older work starved of memory.

Memory pressure: when a running sequence's next tokens do not fit, the newest running sequence not
yet scheduled this step is preempted (blocks and slot freed, back to the waiting queue ahead of every
later arrival, recomputed later from its prompt + generated tokens). A decode that is itself the
newest preempts itself; a prefill chunk instead shrinks to the free blocks or waits a step.
A sequence whose tokens need more blocks than the whole pool finishes with FINISHED_LENGTH
(`pop_finished` hands it to the engine). `add` rejects a prompt that alone cannot fit.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

from deepinfer_core.backends.attention import BLOCK_SIZE
from deepinfer_core.config import SwaReplay
from deepinfer_core.kv.blocks import kept_blocks
from deepinfer_core.kv.connector import KvConnector, ReplayPolicy
from deepinfer_core.plan import NewRequest, ScheduledRequest, StepPlan
from deepinfer_core.sched.block_pool import BlockPool
from deepinfer_core.sched.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    """Limits and cache policy of the scheduler."""

    max_num_seqs: int
    """Most sequences running (and scheduled in one step)."""
    max_num_batched_tokens: int
    """Token budget of one step; must be >= max_num_seqs so every running sequence can decode."""
    max_model_len: int
    """Longest prompt accepted, in tokens (the engine stops generation at this length)."""
    block_size: int = BLOCK_SIZE
    """Positions per cache block; must equal the block pool's."""
    sliding_window: int = 128
    """Window of the sliding-window attention; bounded replay recomputes this many tokens."""
    enable_prefix_caching: bool = False
    """Reuse cached full blocks; must equal the block pool's setting."""
    swa_replay: SwaReplay = "bounded"
    """How a prefix hit rebuilds the window: "bounded" (the last `sliding_window` tokens) or "exact"
    (the last `num_layers * sliding_window`; see `ReplayPolicy.range_for`). Resolved and validated once,
    by `EngineConfig` (the model family's `swa_replay_default` unless set)."""
    num_layers: int = 1
    """Decoder layers of the model (how far back "exact" replay reaches)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")


@dataclass
class SchedulerStats:
    """Running totals since the scheduler was built."""

    num_preemptions: int = 0
    num_queried_tokens: int = 0
    """Tokens looked up in the prefix cache at admission (prompt + generated after a preemption)."""
    num_hit_tokens: int = 0
    """Of those, tokens served by cached blocks."""
    num_prefill_tokens: int = 0
    """Tokens computed in prefill chunks, replays and recomputes included."""
    num_decode_tokens: int = 0
    num_replay_tokens: int = 0
    """Tokens below prefix-cache hits recomputed to rebuild the windows (SWA replay)."""

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens / queried tokens (0 when nothing was queried)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


@dataclass
class _Step:
    budget: int
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    is_memory_short: bool = False
    """Something was preempted, or a chunk shrank or waited, for lack of blocks."""
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Speculative drafts verified this step, per request id (its last token's step computes them too)."""

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.scheduled.add(seq.request_id)
        self.budget -= num_new_tokens


class Scheduler:
    """Waiting and running queues, state slots, and the per-step batch decision.

    :param config: limits and cache policy.
    :param block_pool: the block pool (its block size and prefix-caching flag must match `config`).
    :param num_slots: per-request state slots (sliding window + compressor tails) in the cache.
    :param connector: the KV connector's scheduler half over `block_pool` (tiers, PD, hit accounting);
        None: one for the device alone.
    :param is_admissible: whether a waiting sequence may be admitted now (False: it is skipped this
        step and later ones are considered; a structured-output request waits for its grammar).
    :param choose_drafts: speculative decoding: given the step's decoding sequences and the token budget
        left beyond their own tokens, the drafts each verifies this step (`engine.spec.proposer`).
    """

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, num_slots: int,
                 is_admissible: Callable[[Sequence], bool] | None = None,
                 choose_drafts: Callable[[list[Sequence], int], list[tuple[int, ...]]] | None = None,
                 connector: KvConnector | None = None) -> None:
        if block_pool.block_size != config.block_size:
            raise ValueError(
                f"block pool block_size {block_pool.block_size} != scheduler block_size {config.block_size}"
            )
        if block_pool.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError("enable_prefix_caching differs between the scheduler and the block pool")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if connector is not None and connector.pool is not block_pool:
            raise ValueError("the KV connector must be built over the scheduler's block pool")
        self.config = config
        self.block_pool = block_pool
        self.connector = connector if connector is not None else KvConnector(block_pool)
        self._replay = ReplayPolicy(config.swa_replay, config.sliding_window, config.num_layers)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order, oldest first
        self.stats = SchedulerStats()
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._seqs: dict[str, Sequence] = {}
        self._arrival: dict[str, int] = {}
        self._arrivals = count()
        self._finished_here: list[Sequence] = []
        self._planned: set[str] = set()  # requests the runner holds state for
        self._freed: list[str] = []  # of those, released since the last plan
        self._is_admissible = is_admissible
        self._choose_drafts = choose_drafts

    # -- queues --------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue.

        :raises ValueError: duplicate request id, a sequence that is not fresh, a prompt longer than
            `max_model_len`, or a prompt needing more blocks than the whole pool.
        """
        if seq.request_id in self._seqs:
            raise ValueError(
                f"request id {seq.request_id!r} is already scheduled; request ids must be unique"
            )
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"{seq!r} is not a fresh sequence; create a new Sequence for each request")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r} has {seq.num_tokens} tokens but max_model_len is "
                f"{self.config.max_model_len}; shorten the prompt or raise max_model_len"
            )
        if self._exceeds_pool(seq):
            raise ValueError(
                f"request {seq.request_id!r} needs {self.block_pool.blocks_for(seq.num_tokens)} cache blocks "
                f"but the cache has {self.block_pool.num_blocks}; shorten the prompt or give the cache "
                "more memory"
            )
        self._seqs[seq.request_id] = seq
        self._arrival[seq.request_id] = next(self._arrivals)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` with a FINISHED_* `status`: free its blocks and slot and drop it from the queues."""
        if not status.is_finished:
            raise ValueError(f"finish needs a FINISHED_* status, got {status}")
        if self._seqs.get(seq.request_id) is not seq:
            raise ValueError(f"{seq!r} is not scheduled here (finished already, or never added)")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release_resources(seq)
        seq.status = status  # counts such as num_cached_tokens stay for the final output
        del self._seqs[seq.request_id], self._arrival[seq.request_id]

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting or running request as FINISHED_ABORTED; None if it is unknown."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def pop_finished(self) -> list[Sequence]:
        """Sequences the scheduler finished itself (FINISHED_LENGTH: too long for the whole cache)
        since the last call. The engine must emit their final outputs; call after every `schedule`."""
        finished, self._finished_here = self._finished_here, []
        return finished

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Pick this step's work (see the module docstring) as a plan; None when nothing can run."""
        step = _Step(budget=self.config.max_num_batched_tokens)
        drafts = self._drafts_of_decodes(step)
        self._schedule_decodes(step)
        self._schedule_prefill_chunks(step)
        if not step.is_memory_short:
            self._admit_waiting(step)
        if drafts:
            self._add_drafts(step, drafts)
        return self._plan(step) if step.seqs else None

    def _plan(self, step: _Step) -> StepPlan:
        """The immutable plan of `step`; new requests carry their whole state, the others what changed."""
        new_requests, requests = [], []
        for seq, n in zip(step.seqs, step.num_new_tokens):
            start, table = seq.num_computed_tokens, seq.block_table
            if seq.request_id not in self._planned:
                self._planned.add(seq.request_id)
                history = tuple(seq.token_ids) if seq.needs_token_history else ()
                new_requests.append(NewRequest(seq.request_id, seq.slot, tuple(table), seq.num_prompt_tokens,
                                               seq.sampling_params, seq.seed, history, seq.images))
                new_blocks = ()
            else:
                new_blocks = tuple(table[seq.num_planned_blocks :])
            seq.num_planned_blocks = len(table)
            drafts = step.drafts.get(seq.request_id, ())
            requests.append(ScheduledRequest(
                seq.request_id, start, tuple(seq.token_ids[start : start + n - len(drafts)]) + drafts,
                start + n - len(drafts) == seq.num_tokens, new_blocks, seq.replay_start, seq.no_write_before,
                num_draft_tokens=len(drafts), replay=seq.replay if seq.replay and start < seq.replay.hit else None,
            ))
        freed, self._freed = tuple(self._freed), []
        return StepPlan(tuple(requests), tuple(new_requests), freed, cache_ops=self.connector.take_cache_ops())

    def postprocess(self, plan: StepPlan) -> None:
        """Record that the plan ran: advance each sequence and cache its newly full blocks."""
        is_caching = self.config.enable_prefix_caching  # cache_full_blocks is a no-op otherwise
        for request in plan.requests:
            seq = self._seqs.get(request.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule and postprocess
            seq.num_computed_tokens += request.num_tokens - request.num_draft_tokens
            if is_caching:
                self.connector.on_cached(seq, self.block_pool.cache_full_blocks(seq))

    def accept_drafts(self, plan: StepPlan, num_accepted: list[int]) -> None:
        """After `postprocess` and after the emitted tokens were appended: count each request's accepted
        drafts as computed (they are now its tokens), cache the blocks they filled, and give back the
        blocks only its rejected drafts needed. `num_accepted`: per sampled request of `plan`."""
        sampled = [r for r in plan.requests if r.is_sampled]
        for request, accepted in zip(sampled, num_accepted, strict=True):
            seq = self._seqs.get(request.request_id)
            if not request.num_draft_tokens or seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished inside its accepted run (its blocks are freed) or aborted
            seq.num_computed_tokens += accepted
            self.connector.on_cached(seq, self.block_pool.cache_full_blocks(seq))
            keep = kept_blocks(len(seq.block_table), len(request.new_block_ids), seq.num_computed_tokens,
                               self.config.block_size)
            self.block_pool.release_tail(seq, keep)
            seq.num_planned_blocks = min(seq.num_planned_blocks, keep)

    def _has_room(self, step: _Step) -> bool:
        return step.budget > 0 and len(step.seqs) < self.config.max_num_seqs

    def _schedule_decodes(self, step: _Step) -> None:
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefill or seq.waits_for_host:
                continue  # preempted by an older sequence this step, prefilling, or its token is in flight
            if seq.num_uncomputed_tokens < 1:
                raise RuntimeError(
                    f"{seq!r} has no uncomputed token: append the sampled token (or finish the sequence) "
                    "before the next schedule()"
                )
            if not self._has_room(step):
                return
            if self._make_room(seq, 1, step):
                step.add(seq, 1)
                self.stats.num_decode_tokens += 1
            elif seq.status is SequenceStatus.RUNNING:
                self._preempt(seq)
                step.is_memory_short = True

    def _drafts_of_decodes(self, step: _Step) -> dict[str, tuple[int, ...]]:
        """The drafts the speculative policy picks for this step's decodes (none without speculation)."""
        if self._choose_drafts is None:
            return {}
        decoding = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING and not seq.is_prefill
                    and not seq.waits_for_host][: self.config.max_num_seqs]
        if not decoding:
            return {}
        chosen = self._choose_drafts(decoding, max(0, step.budget - len(decoding)))
        return {seq.request_id: tuple(d) for seq, d in zip(decoding, chosen, strict=True) if d}

    def _add_drafts(self, step: _Step, drafts: dict[str, tuple[int, ...]]) -> None:
        """Last in a step, once every decode, chunk and admission has its tokens and blocks: give each
        scheduled decode the drafts that fit the budget left, the context, and blocks still free without
        evicting a cached block (so drafts never cost another request memory or budget)."""
        for index, seq in enumerate(step.seqs):
            proposed = drafts.get(seq.request_id)
            is_decode = step.num_new_tokens[index] == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
            if not proposed or not is_decode or seq.status is not SequenceStatus.RUNNING:
                continue
            proposed = proposed[: max(0, min(step.budget, self.config.max_model_len - seq.num_tokens))]
            while proposed:
                missing = self.block_pool.blocks_for(seq.num_computed_tokens + 1 + len(proposed)) - len(seq.block_table)
                if missing <= self.block_pool.num_free_uncached_blocks:
                    break
                proposed = proposed[:-1]
            if not proposed:
                continue
            self.block_pool.allocate(seq, 1 + len(proposed))
            step.drafts[seq.request_id] = proposed
            step.num_new_tokens[index] += len(proposed)
            step.budget -= len(proposed)

    def _schedule_prefill_chunks(self, step: _Step) -> None:
        if len(step.seqs) == len(self.running):
            return  # every running sequence is decoding this step
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.request_id in step.scheduled or seq.waits_for_host:
                continue
            if not self._has_room(step):
                return
            num_new_tokens = min(seq.num_uncomputed_tokens, step.budget)
            if not self._make_room(seq, num_new_tokens, step):
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                step.is_memory_short = True
                free_positions = (
                    len(seq.block_table) + self.block_pool.num_free_blocks
                ) * self.config.block_size
                num_new_tokens = min(num_new_tokens, free_positions - seq.num_computed_tokens)
                if num_new_tokens < 1:
                    continue  # waits for older or already scheduled sequences to release blocks
                self.block_pool.allocate(seq, num_new_tokens)
            step.add(seq, num_new_tokens)
            self.stats.num_prefill_tokens += num_new_tokens

    def _admit_waiting(self, step: _Step) -> None:
        while self.waiting and self._free_slots and self._has_room(step):
            if len(self.running) >= self.config.max_num_seqs:
                return
            seq = self.waiting[0] if self._is_admissible is None else next(
                (s for s in self.waiting if self._is_admissible(s)), None)
            if seq is None:
                return
            if self._exceeds_pool(seq):
                self._finish_here(seq)
                continue
            if self.config.enable_prefix_caching and seq.sampling_params.prompt_logprobs is None:
                # prompt logprobs need every prompt position computed, so such requests take no hit
                self.connector.admit(seq, self._replay)
            num_new_tokens = min(seq.num_uncomputed_tokens, step.budget)
            if not self.block_pool.can_allocate(seq, num_new_tokens):
                self._release(seq)  # undo the prefix match; retried next step
                return
            self.waiting.remove(seq)
            self.block_pool.allocate(seq, num_new_tokens)
            seq.slot = self._free_slots.pop()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: self._arrival[s.request_id])
            if self.config.enable_prefix_caching:
                self.stats.num_queried_tokens += seq.num_tokens
                self.stats.num_hit_tokens += seq.num_cached_tokens
                self.stats.num_replay_tokens += seq.num_cached_tokens - seq.num_computed_tokens
                self.connector.record_hit(seq)
            step.add(seq, num_new_tokens)
            if seq.num_output_tokens and seq.num_uncomputed_tokens == 1:  # resumed from a prefill instance's state
                self.stats.num_decode_tokens += 1
            else:
                self.stats.num_prefill_tokens += num_new_tokens

    # -- memory pressure -----------------------------------------------------------------------

    def _exceeds_pool(self, seq: Sequence) -> bool:
        return self.block_pool.blocks_for(seq.num_tokens) > self.block_pool.num_blocks

    def _make_room(self, seq: Sequence, num_new_tokens: int, step: _Step) -> bool:
        """Allocate blocks for `seq`'s next tokens, preempting newer unscheduled sequences as needed.

        False, with nothing allocated, when `seq` is the newest unscheduled sequence and still does not
        fit, or when it can never fit (then it is finished with FINISHED_LENGTH).
        """
        if seq.num_tokens <= len(seq.block_table) * self.config.block_size:
            return True  # its blocks hold every token already (a decode inside its last block, usually)
        if self._exceeds_pool(seq):
            self._finish_here(seq)
            return False
        while not self.block_pool.can_allocate(seq, num_new_tokens):
            victim = next(s for s in reversed(self.running) if s.request_id not in step.scheduled)
            if victim is seq:
                return False
            self._preempt(victim)
            step.is_memory_short = True
        self.block_pool.allocate(seq, num_new_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to waiting for recompute, ahead of every later arrival."""
        self.running.remove(seq)
        self._release(seq)
        arrival = self._arrival[seq.request_id]
        index = next((i for i, s in enumerate(self.waiting) if self._arrival[s.request_id] > arrival), None)
        self.waiting.insert(len(self.waiting) if index is None else index, seq)
        self.stats.num_preemptions += 1

    def _release_resources(self, seq: Sequence) -> None:
        if seq.request_id in self._planned:
            self._planned.remove(seq.request_id)
            self._freed.append(seq.request_id)
        self.connector.on_free(seq)
        self.block_pool.free(seq)
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            seq.slot = None

    def _release(self, seq: Sequence) -> None:
        """Give back blocks and slot and forget the cache state (tokens are kept)."""
        self._release_resources(seq)
        seq.reset_cache_state()

    def _finish_here(self, seq: Sequence) -> None:
        self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self._finished_here.append(seq)
