"""The prefix cache below the device: pinned host memory, then the store, and the moves between them.

Blocks move by content key. A block is saved as soon as it is computed and registered on the device
(a "save" `CacheOp` in the next plan copies it out, in stream order before anything can overwrite it,
to pinned host memory on a copy stream); the step result brings the pending copy back, and once it
finished (`poll_saves`, every plan) the host tier keeps a copy (LRU) and a writer thread writes it to
the store, so another process, or this one after a restart, finds it there. Until then the block
manager keeps the block from eviction (`on_saved`), so a device eviction loses nothing: the block lives
on in host memory and in the store.

Prefill/decode disaggregation (`kv_transfer`): a prefill request's state (slot rings, partial last
block) is copied out the same way when it finishes ("save_state", `pop_state`); on a decode instance
the state read with the blocks is staged (`take_staged_state`) and written into the request's slot at
admission ("load_state").

A request's prefix is looked up device -> host -> store. Before admission (`is_ready`), the blocks
past what the device and the host hold are read from the store by a loader thread while the request
waits ("loading") and other requests run; once read they are staged for it. At admission the block
manager takes each missing block from the staging area or the host tier (`take`) into a free device
block and queues a "load" `CacheOp` that the runner applies before the step's forward.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from deepinfer_core.kv.blocks import PendingCopy
from deepinfer_core.kv.host_cache import GIB, HostCache
from deepinfer_core.kv.prefix_store import PrefixStore
from deepinfer_core.plan import LOAD, LOAD_STATE, SAVE, SAVE_STATE, SAVING_KINDS, CacheOp
from deepinfer_core.sampling_params import KvTransferParams

logger = logging.getLogger(__name__)

GC_INTERVAL_S = 300.0
"""How often the writer thread collects the store's garbage (and once at start)."""
TOUCH_INTERVAL_S = 600.0
"""A block hit again within this long is not touched in the store again."""
_MAX_TOUCHED = 1 << 16
MAX_UNCLAIMED_STATES = 32
"""Exported request states kept for `pop_state` (a prefill route that never asked for its own: the oldest go)."""
_READY = "ready"
HIT_TIERS = ("device", "host", "store", "remote")
"""Where a prefix hit's blocks came from: this device, the host tier, the store, a prefill instance."""
MAX_LOAD_ROUNDS = 2
"""Store reads a request may add, before admission, for blocks evicted while its first read ran."""


@dataclass(frozen=True)
class BlockRef:
    """What identifies one full block of a request: its chained key, its parent's key and its tokens."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


class PrefixTiers:
    """Host tier + store behind the device cache (see the module docstring).

    :param host: the host tier (None: off).
    :param store: the store (None: off).
    :param default_class: traffic class of requests that name none.
    :param gc_interval_s: seconds between the store's garbage collections.
    :param importer: a `kv_transfer.KvImporter` (decode instances): requests carrying a prefill
        instance's handle (`SamplingParams.kv_transfer_params`) read their blocks from it.
    :param exporter: a `kv_transfer.KvExporter` (prefill instances).
    """

    def __init__(self, host: HostCache | None, store: PrefixStore | None, default_class: str = "chat",
                 gc_interval_s: float = GC_INTERVAL_S, importer=None, exporter=None) -> None:
        self.host, self.store, self.default_class = host, store, default_class
        self.importer, self.exporter = importer, exporter
        """Prefill/decode disaggregation (`kv_transfer`): blocks read from a prefill instance, or exported."""
        self._ops: list[tuple[str, tuple[int, ...], bytes, object]] = []
        self._pending_saves: deque[tuple[CacheOp, PendingCopy]] = deque()
        self.on_saved: Callable[[tuple[int, ...]], None] | None = None
        """Called with the block ids of each finished save (the block manager then lets them be evicted)."""
        self._exported_states: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._staged_states: dict[str, tuple[int, torch.Tensor]] = {}
        self.num_loaded_states = 0
        self._save_meta: dict[bytes, tuple[BlockRef, str]] = {}
        self._loads: dict[str, object] = {}  # request id -> _READY or (future, start time)
        self._staged: dict[str, dict[bytes, tuple[BlockRef, torch.Tensor]]] = {}
        self._touched: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # key -> (ttl, time)
        self._staged_tier: dict[str, str] = {}  # request id -> "store" or "remote" (a prefill instance)
        self.num_loaded = {"host": 0, "store": 0, "remote": 0}
        self.load_seconds_total = self.load_seconds_max = 0.0
        self.num_store_loads = 0
        self.num_store_rereads = 0
        self._gc_interval_s, self._last_gc = gc_interval_s, time.monotonic()
        self._writer = self._loader = None
        if store is not None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-store-write")
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-store-load")
            self._writer.submit(self._collect_garbage)
            atexit.register(_close_at_exit, weakref.ref(self))
        if importer is not None and self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-kv-import")

    # -- cache ops --------------------------------------------------------------------------------

    def queue_save(self, block_id: int, ref: BlockRef, traffic_class: str | None) -> None:
        """A block just computed and registered on the device: copy it out in the next plan (the block
        manager keeps it from eviction until `on_saved` names it)."""
        self._save_meta[ref.key] = (ref, traffic_class or self.default_class)
        self._ops.append((SAVE, (block_id,), ref.key, None))

    def take(self, request_id: str, ref: BlockRef) -> tuple[str, torch.Tensor] | None:
        """A block missing on the device, from the request's staged store reads or the host tier:
        `(tier, bytes)`, or None."""
        staged = self._staged.get(request_id)
        entry = staged.get(ref.key) if staged else None
        if entry is not None and entry[0] == ref:
            # kept staged: `finish_match` moves it to the host tier, where putting it now could evict the
            # request's next blocks before they are taken
            return self._staged_tier.get(request_id, "store"), entry[1]
        data = self.host.get(ref.key, ref.parent, ref.tokens) if self.host is not None else None
        return None if data is None else ("host", data)

    def queue_load(self, block_id: int, key: bytes, data: torch.Tensor, tier: str) -> None:
        """Write `data` into device block `block_id` before the next plan's forward."""
        self._ops.append((LOAD, (block_id,), key, data))
        self.num_loaded[tier] += 1

    @property
    def has_cache_ops(self) -> bool:
        return bool(self._ops)

    def take_cache_ops(self) -> tuple[CacheOp, ...]:
        """The queued transfers as plan `CacheOp`s, in queue order (consecutive block ops of a kind merged).
        Also finishes the saves whose copies are done (called once a plan)."""
        self.poll_saves()
        ops, groups = self._ops, []
        self._ops = []
        for kind, block_ids, key, data in ops:
            if kind in (SAVE_STATE, LOAD_STATE):
                slot, payload = (data, None) if kind == SAVE_STATE else data
                groups.append((kind, list(block_ids), [key], payload, slot))
                continue
            if not groups or groups[-1][0] != kind:
                groups.append((kind, [], [], [], None))
            groups[-1][1].extend(block_ids)
            groups[-1][2].append(key)
            groups[-1][3].append(data)
        return tuple(CacheOp(kind, tuple(ids), tuple(keys), torch.stack(datas) if kind == LOAD else
                             datas if kind == LOAD_STATE else None, slot)
                     for kind, ids, keys, datas, slot in groups)

    def accept_saved(self, ops: tuple[CacheOp, ...], saved: tuple[PendingCopy, ...]) -> None:
        """The copies a plan's saving ops started: each is finished (`poll_saves`) once its bytes are on
        the host; only then do its blocks go to the host tier and the store, and become evictable."""
        saves = [op for op in ops if op.kind in SAVING_KINDS]
        if len(saves) != len(saved):
            raise RuntimeError(f"the step ran {len(saves)} save ops but returned {len(saved)} results")
        self._pending_saves.extend(zip(saves, saved))
        self.poll_saves()
        self._maybe_collect_garbage()

    @property
    def num_pending_saves(self) -> int:
        """Saving ops whose device-to-host copy has not finished."""
        return len(self._pending_saves)

    def poll_saves(self, wait: bool = False) -> None:
        """Finish the saves whose copies are done (`wait`: all of them, blocking until they are)."""
        while self._pending_saves and (wait or self._pending_saves[0][1].is_done()):
            op, copy = self._pending_saves.popleft()
            data = copy.wait()
            if op.kind == SAVE_STATE:
                self._exported_states[op.keys[0].decode()] = data
                while len(self._exported_states) > MAX_UNCLAIMED_STATES:
                    self._exported_states.popitem(last=False)
                continue
            for key, row in zip(op.keys, data):
                meta = self._save_meta.pop(key, None)
                if meta is None:
                    continue
                ref, cls = meta
                if self.host is not None:
                    self.host.put(key, ref.parent, ref.tokens, row)
                if self._writer is not None:
                    self._writer.submit(self._write, ref, row, cls)
            if self.on_saved is not None:
                self.on_saved(op.block_ids)

    # -- request state (prefill/decode disaggregation) --------------------------------------------

    def queue_state_save(self, request_id: str, slot: int, tail_block_ids: tuple[int, ...]) -> None:
        """A prefill request finished: copy out its state (slot rings, partial last block) in the next
        plan, before anything can reuse them; `pop_state` hands it out once copied."""
        self._ops.append((SAVE_STATE, tail_block_ids, request_id.encode(), slot))

    def pop_state(self, request_id: str) -> torch.Tensor | None:
        """The state bytes `queue_state_save` copied out for `request_id` (once), or None."""
        return self._exported_states.pop(request_id, None)

    def take_staged_state(self, request_id: str) -> tuple[int, torch.Tensor] | None:
        """The state read from a prefill instance for this request (once): (its prompt length, bytes)."""
        return self._staged_states.pop(request_id, None)

    def queue_state_load(self, request_id: str, slot: int, tail_block_ids: tuple[int, ...], data: torch.Tensor) -> None:
        """Write a request's state (`take_staged_state`) into `slot` and its partial last block before
        the next forward."""
        self._ops.append((LOAD_STATE, tail_block_ids, request_id.encode(), (slot, data)))
        self.num_loaded_states += 1

    # -- loading from the store -------------------------------------------------------------------

    def is_ready(self, request_id: str, refs: Callable[[], list[BlockRef]], device_has: Callable[[bytes], bool],
                 kv_source: KvTransferParams | None = None) -> bool:
        """Whether the request may be admitted: False while its blocks are being read.

        The first call looks its blocks up (`refs()`, in order): if one is neither on the device nor
        in the host tier, the loader reads it and the ones after it from the store, or, for a request
        with a prefill instance's handle (`kv_source`), every block of the handle from that instance
        (and the request's state, read even when every block is here).
        """
        if self.store is None and (kv_source is None or self.importer is None):
            return True
        state = self._loads.get(request_id)
        if state is None:
            chain = refs()
            first = next((i for i, ref in enumerate(chain)
                          if not device_has(ref.key) and not (self.host is not None and ref.key in self.host)), None)
            # a prefill instance's handle: read it unless every block is here and it carries no state
            if kv_source is not None and self.importer is not None and (
                    first is not None or kv_source.first_token is not None):
                self._staged_tier[request_id] = "remote"
                self._loads[request_id] = (self._loader.submit(self.importer.fetch, kv_source, chain),
                                           time.monotonic(), 0)
                return False
            if first is None or self.store is None or not self.store.contains(chain[first].key):  # nothing to read
                self._loads[request_id] = _READY
                return True
            self._loads[request_id] = (self._loader.submit(self._fetch, chain[first:]), time.monotonic(), 0)
            return False
        if state is _READY:
            return True
        future, started, rounds = state
        if not future.done():
            return False
        staged = self._staged.setdefault(request_id, {})
        staged.update(self._fetched(request_id, future))
        if self._staged_tier.get(request_id) != "remote" and rounds < MAX_LOAD_ROUNDS:
            # while the read ran, other requests' work may have evicted blocks the first lookup found on
            # the device or in the host tier: read those again, or the prefix would stop at the hole
            def here(ref: BlockRef) -> bool:
                return ref.key in staged or device_has(ref.key) or (self.host is not None and ref.key in self.host)

            chain = refs()
            hole = next((i for i, ref in enumerate(chain) if not here(ref)), None)
            if hole is not None and self.store.contains(chain[hole].key):
                missing = [ref for ref in chain[hole:] if not here(ref)]
                self._loads[request_id] = (self._loader.submit(self._fetch, missing), started, rounds + 1)
                self.num_store_rereads += 1
                return False
        self._loads[request_id] = _READY
        elapsed = time.monotonic() - started  # how long the request waited "loading"
        self.load_seconds_total += elapsed
        self.load_seconds_max = max(self.load_seconds_max, elapsed)
        self.num_store_loads += 1
        return True

    def wait_loading(self, timeout_s: float) -> None:
        """Block up to `timeout_s` until some store read finishes (the engine has nothing else to run)."""
        pending = [state[0] for state in self._loads.values() if isinstance(state, tuple) and not state[0].done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _fetched(self, request_id: str, future: Future) -> dict[bytes, tuple[BlockRef, torch.Tensor]]:
        try:
            blocks, state = future.result()
        except Exception as err:  # a read from the store or a prefill instance is never fatal  # noqa: BLE001
            logger.warning("reading prefix blocks failed (%s: %s); the prefix is recomputed", type(err).__name__, err)
            return {}
        if state is not None:
            self._staged_states[request_id] = state
        return {ref.key: (ref, data) for ref, data in blocks}

    def _fetch(self, chain: list[BlockRef]) -> tuple[list[tuple[BlockRef, torch.Tensor]], None]:
        """Loader thread: the chain's blocks from the store, up to the first one missing or corrupt
        (and no request state: the store holds blocks only)."""
        blocks = []
        for ref in chain:
            payload = self.store.get(ref.key, ref.parent, ref.tokens)
            if payload is None:
                break
            blocks.append((ref, torch.frombuffer(bytearray(payload), dtype=torch.uint8)))
        return blocks, None

    def finish_match(self, request_id: str) -> None:
        """After a prefix match: the staged blocks (taken or not) go to the host tier."""
        staged = self._staged.pop(request_id, None)
        self._staged_tier.pop(request_id, None)
        if staged and self.host is not None:
            for ref, data in staged.values():
                self.host.put(ref.key, ref.parent, ref.tokens, data)

    def forget(self, request_id: str) -> None:
        """The request released its cache state (finished, aborted, preempted): drop its load state."""
        state = self._loads.pop(request_id, None)
        if isinstance(state, tuple):
            state[0].cancel()
        self._staged_states.pop(request_id, None)
        self.finish_match(request_id)

    def note_hits(self, refs: list[BlockRef], traffic_class: str | None) -> None:
        """Blocks a request hit (any tier): refresh their age in the store, for its traffic class."""
        if self._writer is None or not refs:
            return
        cls = traffic_class or self.default_class
        ttl, now = self.store.ttl_s.get(cls, 0.0), time.monotonic()
        keys = []
        for ref in refs:
            last = self._touched.get(ref.key)
            if last is not None and last[0] >= ttl and now - last[1] < TOUCH_INTERVAL_S:
                continue
            self._touched[ref.key] = (ttl, now)
            self._touched.move_to_end(ref.key)
            keys.append(ref.key)
        while len(self._touched) > _MAX_TOUCHED:
            self._touched.popitem(last=False)
        if keys:
            self._writer.submit(self._touch, keys, cls)

    # -- writer thread ----------------------------------------------------------------------------

    def _write(self, ref: BlockRef, row: torch.Tensor, cls: str) -> None:
        try:
            self.store.put(ref.key, ref.parent, ref.tokens, memoryview(row.numpy()), cls)
        except OSError as err:
            logger.warning("writing a prefix block to the store failed: %s", err)

    def _touch(self, keys: list[bytes], cls: str) -> None:
        for key in keys:
            try:
                self.store.touch(key, cls)
            except OSError as err:
                logger.warning("refreshing a prefix block in the store failed: %s", err)

    def _collect_garbage(self) -> None:
        try:
            self.store.collect_garbage()
        except OSError as err:
            logger.warning("prefix store garbage collection failed: %s", err)

    def _maybe_collect_garbage(self) -> None:
        if self._writer is not None and time.monotonic() - self._last_gc > self._gc_interval_s:
            self._last_gc = time.monotonic()
            self._writer.submit(self._collect_garbage)

    def flush(self) -> None:
        """Wait until every queued store write has been done (tests, shutdown)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the started saves and the queued writes, and stop the threads (idempotent)."""
        self.poll_saves(wait=True)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._loader.shutdown(wait=False, cancel_futures=True)
            self._writer = None

    # -- observability ----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters of the host tier and the store (see `Engine.stats`)."""
        out: dict[str, float] = {f"prefix_loaded_blocks_{tier}": n for tier, n in self.num_loaded.items()}
        if self.host is not None:
            h = self.host.stats
            out.update(host_cache_blocks=len(self.host), host_cache_bytes=self.host.num_bytes,
                       host_cache_capacity_bytes=self.host.num_slots * self.host.block_bytes,
                       host_cache_evictions=h.num_evicted, host_cache_bytes_in=h.bytes_in,
                       host_cache_bytes_out=h.bytes_out)
        out["prefix_saves_pending"] = len(self._pending_saves)
        if self.importer is not None:
            out.update(kv_transfer_blocks_in=self.importer.num_fetched, kv_transfer_bytes_in=self.importer.bytes_read,
                       kv_transfer_failures=self.importer.num_failed, kv_transfer_states_in=self.num_loaded_states)
        if self.exporter is not None:
            out.update(kv_transfer_exports=self.exporter.num_exported, kv_transfer_exports_pending=self.exporter.num_pending)
        if self.store is not None:
            s = self.store.stats
            out.update(prefix_store_hits=s.num_hits, prefix_store_misses=s.num_misses,
                       prefix_store_bytes_read=s.bytes_read, prefix_store_bytes_written=s.bytes_written,
                       prefix_store_blocks_written=s.num_written, prefix_store_size_bytes=s.size_bytes,
                       prefix_store_blocks=s.num_blocks, prefix_store_evictions_ttl=s.num_evicted_ttl,
                       prefix_store_evictions_capacity=s.num_evicted_capacity, prefix_store_gc_runs=s.num_gc_runs,
                       prefix_store_corrupt_blocks=sum(s.num_corrupt.values()),
                       prefix_store_load_seconds_total=self.load_seconds_total,
                       prefix_store_load_seconds_max=self.load_seconds_max, prefix_store_loads=self.num_store_loads,
                       prefix_store_rereads=self.num_store_rereads,
                       **{f"prefix_store_corrupt_{reason}": n for reason, n in s.num_corrupt.items()})
        return out


def _close_at_exit(ref: weakref.ref) -> None:
    tiers = ref()
    if tiers is not None:
        tiers.close()


def make_prefix_tiers(config, fingerprint: bytes, layout, block_bytes: int) -> PrefixTiers | None:
    """The tiers an `EngineConfig` asks for (`host_cache_gib`, `prefix_store_path`, ...), or None."""
    from deepinfer_core.kv.blocks import describe_layout
    from deepinfer_core.kv.store_backends import open_backend

    host_gib, path, role = config.host_cache_gib or 0.0, config.prefix_store_path, config.kv_transfer_role
    if not host_gib and not path and role is None:
        return None
    if role == "prefill" and not host_gib:
        raise ValueError("a prefill instance exports blocks from its host tier: give host_cache_gib > 0")
    host = HostCache(int(host_gib * GIB), block_bytes) if host_gib else None
    store = None
    if path:
        capacity = None if config.prefix_store_gib is None else int(config.prefix_store_gib * GIB)
        store = PrefixStore(open_backend(path), fingerprint, describe_layout(layout), config.prefix_store_ttl_s,
                            capacity, max_payload_bytes=block_bytes)
    importer = exporter = None
    if role is not None:
        from deepinfer_core.kv.nixl_transfer import KvExporter, KvImporter

        importer, exporter = (KvImporter(), None) if role == "decode" else (None, KvExporter())
    return PrefixTiers(host, store, config.default_traffic_class, importer=importer, exporter=exporter)
