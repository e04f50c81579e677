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
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.layer_plan import BLOCK_SIZE

_ROOT_REGISTRATION = 0
"""Parent registration id of a request's first block."""
SWA_REPLAY_MODES: tuple[str, ...] = get_args(SwaReplay)


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


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to cover positions `[0, num_tokens)`."""
    return -(-num_tokens // block_size)


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
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, enable_prefix_caching: bool = False,
                 cache_fingerprint: bytes = b"") -> None:
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
        return self._num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover positions `< num_computed_tokens + num_new_tokens`.

        Takes never-cached blocks first, then evicts the least recently released cached block.
        :raises NoFreeBlocksError: when `can_allocate` is False.
        """
        missing = self._num_missing_blocks(seq, num_new_tokens)
        if missing > self.num_free_blocks:
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
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is not None:
                self._evictable[block_id] = None
            else:
                self._free_uncached.append(block_id)
        seq.block_table = []
        self._chains.pop(seq.request_id, None)

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
        run holds, while the entries of closed windows come from the cache. Either way the runner must
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
        hits: list[_Block] = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            tokens = self._block_tokens(seq, index)
            block_hash = block_key(parent_hash, tokens)
            parent = chain.registrations[-1] if chain.registrations else _ROOT_REGISTRATION
            block = self._lookup(block_hash, parent, tokens)
            if block is None:
                break
            hits.append(block)
            chain.hashes.append(block_hash)
            chain.registrations.append(block.registration)
            parent_hash = block_hash
        self._chains[seq.request_id] = chain
        if not hits:
            return
        for block in hits:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
            block.ref_count += 1
        seq.block_table = [block.block_id for block in hits]
        hit_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.no_write_before = hit_tokens
        span = sliding_window if replay == "bounded" else num_layers * sliding_window
        seq.replay_start = seq.num_computed_tokens = max(0, hit_tokens - span)

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
        if block.ref_count > 0:
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
