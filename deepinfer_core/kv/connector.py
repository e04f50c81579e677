"""The KV connector's scheduler half: what moves between the device's block pool and the tiers below it.

The block pool (`sched.block_pool.BlockPool`) only allocates, counts references, hashes and evicts. This
half decides the rest and writes it on the plan as `CacheOp`s (`take_cache_ops`), for the worker half
(`kv.connector_worker.KvConnectorWorker`) to apply before the step's forward:

- saves: a block the pool registers is pinned in the pool and queued to be saved to the host tier and
  the store (`on_cached`); once saved it is unpinned (`_release_saved`), so eviction loses nothing;
- loads: a prefix match that runs past the device's blocks takes the next ones from the host tier or
  from what the store's loader staged for the request (`take_missing`, `place`, with `is_prefix_ready`
  before admission);
- prefill/decode disaggregation: a prefill instance's request saves its state when it is released
  (`on_free`, `_exports_state`); a decode instance's request resumes from the state it read (`_resume`);
- the hit decision (`admit`): a hit resumes a prefill instance's state, or rebuilds the sliding windows
  by SWA replay. The replay mode is the engine's (`EngineConfig.swa_replay`, validated there from the
  model family's default); `ReplayPolicy.range_for` is the one place that turns a hit into a replay
  range, which the scheduler puts on the plan (`ScheduledRequest.replay`);
- hit accounting (`record_hit`, `hit_tokens`) by the tier each block came from.

It drives the pool through its public methods only (`LowerTiers` is the protocol the pool calls back),
and sees a request as the scheduler's `Sequence` (kv sits below sched: duck-typed, never imported).
"""

from __future__ import annotations

from collections.abc import Sequence as TokenIds
from dataclasses import dataclass
from typing import Any, Protocol

from deepinfer_core.config import SwaReplay
from deepinfer_core.kv.tiers import HIT_TIERS, BlockRef, PrefixTiers
from deepinfer_core.plan import CacheOp, ReplayRange


@dataclass(frozen=True)
class ReplayPolicy:
    """How a prefix hit rebuilds the sliding windows: the engine's `swa_replay` and the model's shape."""

    mode: SwaReplay
    sliding_window: int
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("exact", "bounded"):  # a third mode would silently take the exact span
            raise ValueError(f'swa_replay must be "exact" or "bounded", got {self.mode!r}')
        if self.sliding_window < 0 or self.num_layers < 1:
            raise ValueError(f"a replay needs sliding_window >= 0 and num_layers >= 1, got "
                             f"{self.sliding_window} and {self.num_layers}")

    def range_for(self, hit_tokens: int) -> ReplayRange:
        """The replay of a hit of `hit_tokens` (a whole number of blocks) from `start`: "bounded" takes
        `max(0, H - sliding_window)` (SWA Bounded Replay, approximate); "exact" takes
        `max(0, H - num_layers * sliding_window)`. Exact because a layer's window keys at H depend on the
        layer below through one window each, so after `num_layers` windows of recompute every layer's
        ring and compressor tail at H hold what a cold run holds, while the entries of closed windows
        come from the cache (layer `l` needs only the last `num_layers - l` of those windows:
        `models/deepseek_v4/row_trim.replay_keep_from`)."""
        span = self.sliding_window if self.mode == "bounded" else self.num_layers * self.sliding_window
        return ReplayRange(self.mode == "exact", max(0, hit_tokens - span), hit_tokens)


class PoolView(Protocol):
    """What the connector uses of the block pool (`sched.block_pool.BlockPool`)."""

    block_size: int
    enable_prefix_caching: bool
    reclaim: Any

    def match_prefix(self, seq, lower=None): ...
    def block_refs(self, token_ids: TokenIds[int], images=()) -> list[BlockRef]: ...
    def is_cached(self, key: bytes) -> bool: ...
    def has_free(self, num_blocks: int) -> bool: ...
    def take_block(self) -> int: ...
    def pin(self, block_id: int) -> None: ...
    def unpin(self, block_ids: tuple[int, ...]) -> None: ...


class KvConnector:
    """The scheduler half of the KV connector (see the module docstring).

    :param pool: the device's block pool.
    :param tiers: the host tier, store and NIXL transfer behind it (None: the device only).
    """

    def __init__(self, pool: PoolView, tiers: PrefixTiers | None = None) -> None:
        if tiers is not None and not pool.enable_prefix_caching:
            raise ValueError("a host cache or prefix store needs enable_prefix_caching=True")
        self.pool = pool
        self.tiers = tiers
        self.block_size = pool.block_size
        self.hit_tokens = dict.fromkeys(HIT_TIERS, 0)
        """Prefix-hit tokens of admitted requests, by the tier each block came from."""
        self._match_tiers: dict[str, dict[str, int]] = {}
        self._state_loads: dict[str, tuple[tuple[int, ...], object]] = {}
        """Requests whose prefill instance sent their state: (partial last block, bytes), loaded at admission."""
        if tiers is not None:
            tiers.on_saved = self._release_saved
            pool.reclaim = lambda: tiers.poll_saves(wait=True)

    # -- the pool's lower tiers (`block_pool.LowerTiers`) ---------------------------------------

    def take_missing(self, request_id: str, ref: BlockRef) -> tuple[str, Any] | None:
        """A block the device lacks, from the host tier or the request's staged store reads."""
        return self.tiers.take(request_id, ref)

    def place(self, block_id: int, ref: BlockRef, found: tuple[str, Any]) -> None:
        """Queue the bytes `take_missing` found for loading into device block `block_id`."""
        tier, data = found
        self.tiers.queue_load(block_id, ref.key, data, tier)

    # -- admission ------------------------------------------------------------------------------

    def admit(self, seq, replay: ReplayPolicy) -> None:
        """Match a fresh `seq`'s prefix (device, then the tiers) and decide what the hit means: resume
        the state a prefill instance sent, or a window replay. On a replayed hit of H tokens:
        `num_cached_tokens = no_write_before = H`, `seq.replay` = `replay.range_for(H)` and
        `num_computed_tokens = replay_start` = its start; the runner never rewrites the cached
        compressed entries (`no_write_before`). No-op without prefix caching."""
        match = self.pool.match_prefix(seq, self if self.tiers is not None else None)
        state = None
        if self.tiers is not None:
            self.tiers.finish_match(seq.request_id)
            self.tiers.note_hits(match.refs, getattr(seq.sampling_params, "traffic_class", None))
            state = self.tiers.take_staged_state(seq.request_id)
        hit_tokens = match.num_blocks * self.block_size
        if state is not None and self._resume(seq, state, hit_tokens, match.tiers):
            return
        if not hit_tokens:
            return
        self._match_tiers[seq.request_id] = match.tiers
        seq.num_cached_tokens = seq.no_write_before = hit_tokens
        seq.replay = replay.range_for(hit_tokens)
        seq.replay_start = seq.num_computed_tokens = seq.replay.start

    def _resume(self, seq, state: tuple[int, object], hit_tokens: int, tiers: dict[str, int]) -> bool:
        """Admit `seq` with its whole prompt computed, from the state its prefill instance sent (slot
        rings and partial last block, loaded at admission by `record_hit`): no replay, it decodes the
        first token the prefill instance sampled. False (nothing changed) when the state does not fit:
        another prompt, blocks missing, or no free block for the partial one."""
        num_prompt, data = state
        if not (num_prompt == seq.num_prompt_tokens == seq.num_tokens - 1
                and hit_tokens == num_prompt // self.block_size * self.block_size):
            return False
        tail: tuple[int, ...] = ()
        if num_prompt % self.block_size:
            if not self.pool.has_free(1):
                return False
            tail = (self.pool.take_block(),)
            seq.block_table.append(tail[0])
        self._state_loads[seq.request_id] = (tail, data)
        tiers["remote"] += num_prompt - hit_tokens
        self._match_tiers[seq.request_id] = tiers
        seq.num_cached_tokens = seq.num_computed_tokens = num_prompt
        seq.no_write_before, seq.replay_start = hit_tokens, 0
        return True

    def record_hit(self, seq) -> None:
        """Count an admitted request's prefix hit by tier (its latest `admit`), and load the state its
        prefill instance sent into its slot (it has one now)."""
        for tier, tokens in self._match_tiers.pop(seq.request_id, {}).items():
            self.hit_tokens[tier] += tokens
        resumed = self._state_loads.pop(seq.request_id, None)
        if resumed is not None:
            self.tiers.queue_state_load(seq.request_id, seq.slot, *resumed)

    def is_prefix_ready(self, seq) -> bool:
        """False while the request's prefix blocks are being read from the store (it is "loading");
        True at once without a store. See `PrefixTiers.is_ready`."""
        if self.tiers is None or seq.sampling_params.prompt_logprobs is not None:
            return True
        params = getattr(seq.sampling_params, "kv_transfer_params", None)
        source = params if params is not None and params.source else None  # a handle to read, not an export
        is_ready = self.tiers.is_ready(seq.request_id, lambda: self.block_refs(seq.token_ids, seq.images),
                                       self.pool.is_cached,
                                       source)
        seq.is_loading = not is_ready
        return is_ready

    def block_refs(self, token_ids: TokenIds[int], images=()) -> list[BlockRef]:
        """The key chain of the full blocks a prefix match of `token_ids` (with the prompt's `images`,
        whose content every block they overlap is keyed by) can hit: the pool's hashing, which every
        tier (host, store, PD transfers) is looked up with."""
        return self.pool.block_refs(token_ids, images)

    # -- saving and release ---------------------------------------------------------------------

    def on_cached(self, seq, registered: list[tuple[int, BlockRef]]) -> None:
        """The pool registered these blocks of `seq`: pin each and queue its save to the tiers."""
        if self.tiers is None:
            return
        traffic_class = getattr(seq.sampling_params, "traffic_class", None)
        for block_id, ref in registered:
            self.pool.pin(block_id)
            self.tiers.queue_save(block_id, ref, traffic_class)

    def on_free(self, seq) -> None:
        """Before the pool releases `seq`'s blocks: queue its state's export (a prefill instance's
        request) and forget what was pending for it."""
        if self.tiers is not None and self._exports_state(seq):
            full = seq.num_prompt_tokens // self.block_size
            self.tiers.queue_state_save(seq.request_id, seq.slot, tuple(seq.block_table[full : full + 1])
                                        if seq.num_prompt_tokens % self.block_size else ())
        self._match_tiers.pop(seq.request_id, None)
        self._state_loads.pop(seq.request_id, None)
        if self.tiers is not None:
            self.tiers.forget(seq.request_id)

    def _exports_state(self, seq) -> bool:
        """A prefill instance's request (`kv_transfer_params.export`) released right after its prompt ran
        and its first token was sampled: its state goes to the decode instance."""
        params = getattr(seq.sampling_params, "kv_transfer_params", None)
        return (params is not None and params.export and seq.slot is not None
                and seq.num_computed_tokens == seq.num_prompt_tokens and seq.num_output_tokens == 1)

    def _release_saved(self, block_ids: tuple[int, ...]) -> None:
        """The tiers finished saving these blocks: the pool may evict them again."""
        self.pool.unpin(block_ids)

    def take_cache_ops(self) -> tuple[CacheOp, ...]:
        """Transfers to and from the tiers queued since the last call, for the next plan."""
        return self.tiers.take_cache_ops() if self.tiers is not None else ()
