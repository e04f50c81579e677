"""Cache blocks: allocation, reference counts, and the prefix cache.

A block holds the compressed state (CSA entries, indexer keys, HCA entries) of `block_size`
consecutive positions of one request. The sliding window and compressor tails live in per-request
slots, not blocks, so only full blocks are shared through the prefix cache.

Prefix cache. A full block is identified by a chained content key from the first token:
`k_i = block_key(k_{i-1}, tokens of block i)`, `k_{-1}` = the cache fingerprint (model, weights
identity, dtype and cache layout). Keys are SHA-256 digests, equal in every process and on every
machine, so a store outside this process can be looked up with them. The key only finds a
candidate; a hit is accepted only when the candidate's stored tokens equal the query's and its
stored parent is exactly the block matched just before it, so a hash collision can never serve a
wrong block. Every registration gets a fresh id, and a child remembers its parent's id, so a parent
evicted and re-registered with other content never revives stale children.

Tiers below the device (`prefix_tiers.PrefixTiers`, optional): a block this manager registers is
queued to be saved to the host tier and the store; a match that runs past the device's blocks takes
the next ones from the host tier or from what the store's loader staged for the request, into fresh
device blocks registered at once (their bytes arrive by a "load" cache op before the step's forward).

Free-pool invariant: `num_free_blocks` counts never-cached free blocks plus cached blocks no request
references (those stay reusable by a prefix hit until evicted, least recently released first).
Allocating and then freeing a request leaves `num_free_blocks` and every reference count as they were;
only which cached blocks exist may change.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass, field
from itertools import count
from typing import get_args

from deepinfer_core.config import SwaReplay
from deepinfer_core.kv.blocks import blocks_for
from deepinfer_core.kv.tiers import BlockRef, PrefixTiers
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.plan import CacheOp
from deepinfer_core.sched.sequence import Sequence

_ROOT_REGISTRATION = 0
"""Parent registration id of a request's first block."""
SWA_REPLAY_MODES: tuple[str, ...] = get_args(SwaReplay)
HIT_TIERS = ("device", "host", "store", "remote")
"""Where a prefix hit's blocks came from: this device, the host tier, the store, a prefill instance."""


class NoFreeBlocksError(RuntimeError):
    """`allocate` was called without a successful `can_allocate` (a scheduler bug, not user input)."""


def block_key(parent_key: bytes, token_ids: TokenIds[int]) -> bytes:
    """Chained content key of one full block: SHA-256 over the parent's key and the block's token ids
    (int64, little-endian). The first block's parent is the cache fingerprint. Stable across processes
    and machines; a collision is harmless (hits are verified token by token)."""
    tokens = array("q", token_ids)
    if sys.byteorder == "big":  # pragma: no cover - keys are little-endian everywhere
        tokens.byteswap()
    return hashlib.sha256(parent_key + tokens.tobytes()).digest()


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    """Set while registered in the prefix cache."""
    token_ids: tuple[int, ...] | None = None
    registration: int = 0
    parent_registration: int = _ROOT_REGISTRATION


@dataclass
class _Chain:
    """How far a request's leading full blocks are hashed and matched to registered blocks."""

    hashes: list[bytes] = field(default_factory=list)
    registrations: list[int] = field(default_factory=list)
    is_broken: bool = False
    """A hash collision stopped the chain: later blocks of this request are not cached."""


class BlockManager:
    """Owns the cache block pool: who holds which block, and (optionally) the prefix cache.

    :param num_blocks: blocks in the pool.
    :param block_size: positions per block (128 for DeepSeek-V4: a multiple of every compress rate).
    :param enable_prefix_caching: register full blocks and serve them to later requests.
    :param cache_fingerprint: root of every key chain: what the cached content depends on besides the
        tokens (the model, its weights, the dtype and the cache layout).
    :param tiers: the host tier and store behind this cache (None: the device only).
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, enable_prefix_caching: bool = False,
                 cache_fingerprint: bytes = b"", tiers: PrefixTiers | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the cache more memory")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_fingerprint = cache_fingerprint
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._hash_to_block: dict[bytes, int] = {}
        self._chains: dict[str, _Chain] = {}
        self._registrations = count(_ROOT_REGISTRATION + 1)
        if tiers is not None and not enable_prefix_caching:
            raise ValueError("a host cache or prefix store needs enable_prefix_caching=True")
        self.tiers = tiers
        self._saving: dict[int, int] = {}
        """Blocks whose save to the tiers has not finished, with how many saves: never evictable meanwhile."""
        self._state_loads: dict[str, tuple[tuple[int, ...], object]] = {}
        """Requests whose prefill instance sent their state: (partial last block, bytes), loaded at admission."""
        if tiers is not None:
            tiers.on_saved = self._release_saved
        self.hit_tokens = dict.fromkeys(HIT_TIERS, 0)
        """Prefix-hit tokens of admitted requests, by the tier each block came from."""
        self._match_tiers: dict[str, dict[str, int]] = {}

    # -- inspection ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached free ones plus evictable cached ones."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_free_uncached_blocks(self) -> int:
        """Free blocks that hold no prefix-cache entry (taking one evicts nothing)."""
        return len(self._free_uncached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        """How many requests hold `block_id`."""
        return self._blocks[block_id].ref_count

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to cover positions `[0, num_tokens)`."""
        return blocks_for(num_tokens, self.block_size)

    # -- allocation ----------------------------------------------------------------------------

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """True if `seq.block_table` can be grown to cover positions `< num_computed_tokens + num_new_tokens`."""
        return self._has_free(self._num_missing_blocks(seq, num_new_tokens))

    def _has_free(self, num_blocks: int) -> bool:
        """Whether `num_blocks` are free; when short while saves are in flight, wait for them first (a
        block is evictable only once its save finished, see `_release_saved`)."""
        if num_blocks > self.num_free_blocks and self._saving and self.tiers is not None:
            self.tiers.poll_saves(wait=True)
        return num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover positions `< num_computed_tokens + num_new_tokens`.

        Takes never-cached blocks first, then evicts the least recently released cached block.
        :raises NoFreeBlocksError: when `can_allocate` is False.
        """
        missing = self._num_missing_blocks(seq, num_new_tokens)
        if not self._has_free(missing):
            raise NoFreeBlocksError(
                f"{seq.request_id!r} needs {missing} more blocks but {self.num_free_blocks} are free; "
                "call can_allocate first"
            )
        for _ in range(missing):
            block = self._take_free_block()
            block.ref_count = 1
            seq.block_table.append(block.block_id)

    def _take_free_block(self) -> _Block:
        if self._free_uncached:
            return self._blocks[self._free_uncached.popleft()]
        block_id, _ = self._evictable.popitem(last=False)
        block = self._blocks[block_id]
        self._unregister(block)
        return block

    def _unregister(self, block: _Block) -> None:
        if block.hash is not None and self._hash_to_block.get(block.hash) == block.block_id:
            del self._hash_to_block[block.hash]
        block.hash, block.token_ids = None, None
        block.registration, block.parent_registration = 0, _ROOT_REGISTRATION

    def free(self, seq: Sequence) -> None:
        """Release every block `seq` holds and clear its block table.

        Blocks are released last-first, so when cached blocks must be evicted a request's tail goes
        before its head (a chain is only reachable from its first block).
        """
        if self.tiers is not None and self._exports_state(seq):
            full = seq.num_prompt_tokens // self.block_size
            self.tiers.queue_state_save(seq.request_id, seq.slot, tuple(seq.block_table[full : full + 1])
                                        if seq.num_prompt_tokens % self.block_size else ())
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is not None:
                if block_id not in self._saving:  # else evictable once saved (`_release_saved`)
                    self._evictable[block_id] = None
            else:
                self._free_uncached.append(block_id)
        seq.block_table = []
        self._chains.pop(seq.request_id, None)
        self._match_tiers.pop(seq.request_id, None)
        self._state_loads.pop(seq.request_id, None)
        if self.tiers is not None:
            self.tiers.forget(seq.request_id)

    def _exports_state(self, seq: Sequence) -> bool:
        """A prefill instance's request (`kv_transfer_params={"export": True}`) released right after
        its prompt ran and its first token was sampled: its state goes to the decode instance."""
        params = getattr(seq.sampling_params, "kv_transfer_params", None)
        return (bool(params) and params.get("export") is True and seq.slot is not None
                and seq.num_computed_tokens == seq.num_prompt_tokens and seq.num_output_tokens == 1)

    def _release_saved(self, block_ids: tuple[int, ...]) -> None:
        """The tiers finished saving these blocks: unreferenced ones become evictable."""
        for block_id in block_ids:
            left = self._saving.get(block_id, 0) - 1
            if left > 0:
                self._saving[block_id] = left
                continue
            self._saving.pop(block_id, None)
            block = self._blocks[block_id]
            if block.ref_count == 0 and block.hash is not None:
                self._evictable[block_id] = None

    def release_tail(self, seq: Sequence, num_kept: int) -> None:
        """Give back `seq`'s blocks past its first `num_kept`, taken this step from the never-cached free
        blocks (speculative drafts that were rejected): they return to the front of that queue in the
        order they left it, so the pool is as if they had never been taken."""
        for block_id in reversed(seq.block_table[num_kept:]):
            block = self._blocks[block_id]
            if block.ref_count != 1 or block.hash is not None:
                raise RuntimeError(f"block {block_id} of {seq.request_id!r} is shared or cached; only blocks "
                                   "taken for drafts may be released")
            block.ref_count = 0
            self._free_uncached.appendleft(block_id)
        del seq.block_table[num_kept:]

    # -- prefix cache --------------------------------------------------------------------------

    def _lookup(self, block_hash: bytes, parent_registration: int, token_ids: tuple[int, ...]) -> _Block | None:
        """The registered block equal to this one (same tokens, same parent), or None."""
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self._blocks[block_id]
        if block.token_ids != token_ids or block.parent_registration != parent_registration:
            return None
        return block

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def match_prefix(self, seq: Sequence, sliding_window: int, replay: str, num_layers: int = 1) -> None:
        """Reuse the longest run of cached full blocks that equals `seq`'s leading tokens.

        For a fresh sequence (no blocks, nothing computed). The hit length H is a whole number of
        blocks and leaves at least one token to compute (H <= num_tokens - 1). On a hit:
        `block_table` = the hit blocks (referenced), `num_cached_tokens = no_write_before = H`, and the
        window is rebuilt by replay from `S`, window attention seeing only positions >= S
        (`replay_start`): "bounded" takes `S = max(0, H - sliding_window)` (SWA Bounded Replay,
        approximate); "exact" takes `S = max(0, H - num_layers * sliding_window)`. Exact because a
        layer's window keys at H depend on the layer below through one window each, so after
        `num_layers` windows of recompute every layer's ring and compressor tail at H hold what a cold
        run holds, while the entries of closed windows come from the cache (layer `l` needs only the last
        `num_layers - l` of those windows: `models/row_trim.replay_keep_from`). Either way the runner must
        not rewrite the cached compressed entries (`no_write_before`). No-op without prefix caching.
        """
        if replay not in SWA_REPLAY_MODES:
            raise ValueError(f"swa_replay must be one of {SWA_REPLAY_MODES}, got {replay!r}")
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(
                f"{seq.request_id!r} already holds cache state; match_prefix is for fresh sequences"
            )
        if not self.enable_prefix_caching:
            return
        chain = _Chain()
        parent_hash = self.cache_fingerprint
        tiers: dict[str, int] = dict.fromkeys(HIT_TIERS, 0)
        hit_refs: list[BlockRef] = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            tokens = self._block_tokens(seq, index)
            block_hash = block_key(parent_hash, tokens)
            parent = chain.registrations[-1] if chain.registrations else _ROOT_REGISTRATION
            block, tier = self._lookup(block_hash, parent, tokens), "device"
            if block is None:
                block, tier = self._load_from_tiers(seq, BlockRef(block_hash, parent_hash, tokens), parent)
            if block is None:
                break
            if block.ref_count == 0:  # held from here on: a load below cannot evict it
                self._evictable.pop(block.block_id, None)  # (a block just loaded was never evictable)
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            tiers[tier] += self.block_size
            hit_refs.append(BlockRef(block_hash, parent_hash, tokens))
            chain.hashes.append(block_hash)
            chain.registrations.append(block.registration)
            parent_hash = block_hash
        self._chains[seq.request_id] = chain
        state = None
        if self.tiers is not None:
            self.tiers.finish_match(seq.request_id)
            self.tiers.note_hits(hit_refs, getattr(seq.sampling_params, "traffic_class", None))
            state = self.tiers.take_staged_state(seq.request_id)
        hit_tokens = len(hit_refs) * self.block_size
        if state is not None and self._resume(seq, state, hit_tokens, tiers):
            return
        if not hit_refs:
            return
        self._match_tiers[seq.request_id] = tiers
        seq.num_cached_tokens = seq.no_write_before = hit_tokens
        span = sliding_window if replay == "bounded" else num_layers * sliding_window
        seq.replay_start = seq.num_computed_tokens = max(0, hit_tokens - span)

    def _resume(self, seq: Sequence, state: tuple[int, object], hit_tokens: int, tiers: dict[str, int]) -> bool:
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
            if not self._has_free(1):
                return False
            block = self._take_free_block()
            block.ref_count = 1
            seq.block_table.append(block.block_id)
            tail = (block.block_id,)
        self._state_loads[seq.request_id] = (tail, data)
        tiers["remote"] += num_prompt - hit_tokens
        self._match_tiers[seq.request_id] = tiers
        seq.num_cached_tokens = seq.num_computed_tokens = num_prompt
        seq.no_write_before, seq.replay_start = hit_tokens, 0
        return True

    def _load_from_tiers(self, seq: Sequence, ref: BlockRef, parent: int) -> tuple[_Block | None, str]:
        """A block the device lacks, from the host tier or the request's staged store reads, into a
        fresh device block registered now (its bytes follow by a "load" cache op); (None, "") if none."""
        if self.tiers is None or not self.num_free_blocks or not self._release_hash(ref.key):
            return None, ""
        found = self.tiers.take(seq.request_id, ref)
        if found is None:
            return None, ""
        tier, data = found
        block = self._register(self._take_free_block(), ref.key, parent, ref.tokens)
        self.tiers.queue_load(block.block_id, ref.key, data, tier)
        return block, tier

    def record_hit(self, seq: Sequence) -> None:
        """Count an admitted request's prefix hit by tier (its latest `match_prefix`), and load the state
        its prefill instance sent into its slot (it has one now)."""
        for tier, tokens in self._match_tiers.pop(seq.request_id, {}).items():
            self.hit_tokens[tier] += tokens
        resumed = self._state_loads.pop(seq.request_id, None)
        if resumed is not None:
            self.tiers.queue_state_load(seq.request_id, seq.slot, *resumed)

    def is_prefix_ready(self, seq: Sequence) -> bool:
        """False while the request's prefix blocks are being read from the store (it is "loading");
        True at once without a store. See `PrefixTiers.is_ready`."""
        if self.tiers is None or seq.sampling_params.prompt_logprobs is not None:
            return True
        is_ready = self.tiers.is_ready(seq.request_id, lambda: self._block_refs(seq), self._hash_to_block.__contains__,
                                       getattr(seq.sampling_params, "kv_transfer_params", None))
        seq.is_loading = not is_ready
        return is_ready

    def _block_refs(self, seq: Sequence) -> list[BlockRef]:
        return self.block_refs(seq.token_ids)

    def block_refs(self, token_ids: TokenIds[int]) -> list[BlockRef]:
        """The key chain of the full blocks a prefix match of `token_ids` can hit (not the last token's)."""
        refs, parent = [], self.cache_fingerprint
        for index in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            key = block_key(parent, tokens)
            refs.append(BlockRef(key, parent, tokens))
            parent = key
        return refs

    def take_cache_ops(self) -> tuple[CacheOp, ...]:
        """Transfers to and from the tiers queued since the last call, for the next plan."""
        return self.tiers.take_cache_ops() if self.tiers is not None else ()

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` whose positions are all computed (`(i+1)*block_size <= num_computed_tokens`).

        A block equal to one already registered is not registered twice (the request keeps its own
        copy, released normally). A different block holding the same hash is replaced when nothing
        references it; otherwise caching stops for the rest of this request. No-op without prefix
        caching.
        """
        if not self.enable_prefix_caching:
            return
        chain = self._chains.get(seq.request_id)
        if chain is None:
            chain = self._chains[seq.request_id] = _Chain()
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        while not chain.is_broken and len(chain.hashes) < num_full:
            index = len(chain.hashes)
            tokens = self._block_tokens(seq, index)
            parent_hash = chain.hashes[-1] if chain.hashes else self.cache_fingerprint
            parent = chain.registrations[-1] if chain.registrations else _ROOT_REGISTRATION
            block_hash = block_key(parent_hash, tokens)
            existing = self._lookup(block_hash, parent, tokens)
            if existing is None and not self._release_hash(block_hash):
                chain.is_broken = True
                break
            if existing is None:
                existing = self._register(self._blocks[seq.block_table[index]], block_hash, parent, tokens)
                if self.tiers is not None:
                    self._saving[existing.block_id] = self._saving.get(existing.block_id, 0) + 1
                    self.tiers.queue_save(existing.block_id, BlockRef(block_hash, parent_hash, tokens),
                                          getattr(seq.sampling_params, "traffic_class", None))
            chain.hashes.append(block_hash)
            chain.registrations.append(existing.registration)

    def _release_hash(self, block_hash: bytes) -> bool:
        """Make `block_hash` free to register; False if a different block in use owns it.

        The owner differs from the block being registered by a hash collision, or because it is a
        stale child whose parent was evicted and re-registered. Unreferenced, it is simply dropped.
        """
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return True
        block = self._blocks[block_id]
        if block.ref_count > 0 or block_id in self._saving:
            return False
        del self._evictable[block_id]
        self._unregister(block)
        self._free_uncached.append(block_id)
        return True

    def _register(self, block: _Block, block_hash: bytes, parent: int, tokens: tuple[int, ...]) -> _Block:
        block.hash, block.token_ids = block_hash, tokens
        block.registration, block.parent_registration = next(self._registrations), parent
        self._hash_to_block[block_hash] = block.block_id
        return block
