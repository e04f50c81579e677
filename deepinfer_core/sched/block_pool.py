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

The null block. Block `NULL_BLOCK` (0) is reserved: never handed out, never cached, so a block table
may be padded with it (decode graphs' slot tables, `sparse_flash_mla` on Ascend, which reads every
entry). The pool hands out ids `1 .. num_blocks`; the cache allocates `num_blocks + 2` rows (the null
block, the pool, the scratch block of padded decode rows). `num_blocks` and the free counts count only
blocks the pool can hand out.

Tiers below the device are not this pool's business: the KV connector (`kv.connector.KvConnector`)
pins blocks while they are saved (`pin`/`unpin`), and `match_prefix` asks it (`LowerTiers`) for a
block the device lacks, registering the fresh device block it is loaded into.

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
from collections.abc import Callable
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Protocol

from deepinfer_core.kv.blocks import blocks_for
from deepinfer_core.kv.cache import NULL_BLOCK
from deepinfer_core.kv.tiers import HIT_TIERS, BlockRef
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.plan import ImageInput
from deepinfer_core.sched.sequence import Sequence

_ROOT_REGISTRATION = 0
"""Parent registration id of a request's first block."""


class NoFreeBlocksError(RuntimeError):
    """`allocate` was called without a successful `can_allocate` (a scheduler bug, not user input)."""


def block_key(parent_key: bytes, token_ids: TokenIds[int], image_salt: bytes = b"") -> bytes:
    """Chained content key of one full block: SHA-256 over the parent's key, the block's token ids
    (int64, little-endian) and `image_salt` (`image_salt`: what the images overlapping the block add).
    The first block's parent is the cache fingerprint. Stable across processes and machines; a
    collision is harmless (hits are verified token by token)."""
    tokens = array("q", token_ids)
    if sys.byteorder == "big":  # pragma: no cover - keys are little-endian everywhere
        tokens.byteswap()
    return hashlib.sha256(parent_key + tokens.tobytes() + image_salt).digest()


def image_salt(images: TokenIds[ImageInput], start: int, end: int) -> bytes:
    """What the images overlapping positions `[start, end)` add to that block's key: each one's content
    hash and span. An image's positions all carry the same placeholder id, so without this two prompts
    with different images would share blocks; every block an image touches is keyed by it, and the
    chain carries it to every block after."""
    parts = [image.content_hash + array("q", (image.offset, image.length)).tobytes()
             for image in images if image.offset < end and image.end > start]
    return b"".join(parts)


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


@dataclass
class PrefixMatch:
    """What `BlockPool.match_prefix` found: the hit blocks' refs, in order, and their tokens by tier."""

    refs: list[BlockRef] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HIT_TIERS, 0))

    @property
    def num_blocks(self) -> int:
        return len(self.refs)


class LowerTiers(Protocol):
    """Where a block the device lacks may come from (the KV connector's scheduler half)."""

    def take_missing(self, request_id: str, ref: BlockRef) -> tuple[str, Any] | None:
        """(tier, bytes) of the block `ref` for this request, taken from the tier; None if none has it."""

    def place(self, block_id: int, ref: BlockRef, found: tuple[str, Any]) -> None:
        """Queue `found`'s bytes to be loaded into the fresh device block `block_id`."""


class BlockPool:
    """Owns the cache block pool: who holds which block, the prefix cache, and eviction.

    :param num_blocks: blocks the pool hands out (ids `1 .. num_blocks`; 0 is the null block).
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
        self._blocks = [_Block(i) for i in range(num_blocks + 1)]  # [NULL_BLOCK] is never handed out
        self._free_uncached: deque[int] = deque(range(NULL_BLOCK + 1, num_blocks + 1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._hash_to_block: dict[bytes, int] = {}
        self._chains: dict[str, _Chain] = {}
        self._registrations = count(_ROOT_REGISTRATION + 1)
        self._pinned: dict[int, int] = {}
        """Blocks kept from eviction (saves in flight), with how many pins."""
        self.reclaim: Callable[[], None] | None = None
        """Called when an allocation is short while blocks are pinned: may unpin some (the connector
        waits for its saves in flight)."""

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

    def is_cached(self, key: bytes) -> bool:
        """Whether a block with content key `key` is registered on the device."""
        return key in self._hash_to_block

    # -- allocation ----------------------------------------------------------------------------

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """True if `seq.block_table` can be grown to cover positions `< num_computed_tokens + num_new_tokens`."""
        return self.has_free(self._num_missing_blocks(seq, num_new_tokens))

    def has_free(self, num_blocks: int) -> bool:
        """Whether `num_blocks` are free; when short while blocks are pinned, `reclaim` first (a pinned
        block becomes evictable only once unpinned)."""
        if num_blocks > self.num_free_blocks and self._pinned and self.reclaim is not None:
            self.reclaim()
        return num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover positions `< num_computed_tokens + num_new_tokens`.

        Takes never-cached blocks first, then evicts the least recently released cached block.
        :raises NoFreeBlocksError: when `can_allocate` is False.
        """
        missing = self._num_missing_blocks(seq, num_new_tokens)
        if not self.has_free(missing):
            raise NoFreeBlocksError(
                f"{seq.request_id!r} needs {missing} more blocks but {self.num_free_blocks} are free; "
                "call can_allocate first"
            )
        for _ in range(missing):
            seq.block_table.append(self.take_block())

    def take_block(self) -> int:
        """One free block, referenced once (call `has_free(1)` first): a never-cached one first, else
        the least recently released cached one, evicted."""
        block = self._take_free_block()
        block.ref_count = 1
        return block.block_id

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
                if block_id not in self._pinned:  # else evictable once unpinned
                    self._evictable[block_id] = None
            else:
                self._free_uncached.append(block_id)
        seq.block_table = []
        self._chains.pop(seq.request_id, None)

    def pin(self, block_id: int) -> None:
        """Keep `block_id` from eviction until as many `unpin`s (its save to the tiers is in flight)."""
        self._pinned[block_id] = self._pinned.get(block_id, 0) + 1

    def unpin(self, block_ids: tuple[int, ...]) -> None:
        """Undo one `pin` of each block: unreferenced cached ones with no pin left become evictable."""
        for block_id in block_ids:
            left = self._pinned.get(block_id, 0) - 1
            if left > 0:
                self._pinned[block_id] = left
                continue
            self._pinned.pop(block_id, None)
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

    def _block_key(self, parent_key: bytes, tokens: tuple[int, ...], images, index: int) -> bytes:
        salt = image_salt(images, index * self.block_size, (index + 1) * self.block_size) if images else b""
        return block_key(parent_key, tokens, salt) if salt else block_key(parent_key, tokens)

    def match_prefix(self, seq: Sequence, lower: LowerTiers | None = None) -> PrefixMatch:
        """Reference the longest run of cached full blocks that equals `seq`'s leading tokens.

        For a fresh sequence (no blocks, nothing computed). The hit is a whole number of blocks and
        leaves at least one token to compute. A block the device lacks may come from `lower` (into a
        fresh device block registered now; its bytes follow by a "load" cache op). Appends the hit
        blocks to `seq.block_table` and returns them; what the hit means for the request (window
        replay, a resumed prefill) is the connector's decision. Empty without prefix caching.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(
                f"{seq.request_id!r} already holds cache state; match_prefix is for fresh sequences"
            )
        match = PrefixMatch()
        if not self.enable_prefix_caching:
            return match
        chain = _Chain()
        parent_hash = self.cache_fingerprint
        for index in range((seq.num_tokens - 1) // self.block_size):
            tokens = self._block_tokens(seq, index)
            ref = BlockRef(self._block_key(parent_hash, tokens, seq.images, index), parent_hash, tokens)
            parent = chain.registrations[-1] if chain.registrations else _ROOT_REGISTRATION
            block, tier = self._lookup(ref.key, parent, tokens), "device"
            if block is None and lower is not None:
                block, tier = self._load(seq, ref, parent, lower)
            if block is None:
                break
            if block.ref_count == 0:  # held from here on: a load below cannot evict it
                self._evictable.pop(block.block_id, None)  # (a block just loaded was never evictable)
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            match.tiers[tier] += self.block_size
            match.refs.append(ref)
            chain.hashes.append(ref.key)
            chain.registrations.append(block.registration)
            parent_hash = ref.key
        self._chains[seq.request_id] = chain
        return match

    def _load(self, seq: Sequence, ref: BlockRef, parent: int, lower: LowerTiers) -> tuple[_Block | None, str]:
        """A block the device lacks, from `lower`, into a fresh device block registered now."""
        if not self.num_free_blocks or not self._release_hash(ref.key):
            return None, ""
        found = lower.take_missing(seq.request_id, ref)
        if found is None:
            return None, ""
        block = self._register(self._take_free_block(), ref.key, parent, ref.tokens)
        lower.place(block.block_id, ref, found)
        return block, found[0]

    def block_refs(self, token_ids: TokenIds[int], images: TokenIds[ImageInput] = ()) -> list[BlockRef]:
        """The key chain of the full blocks a prefix match of `token_ids` (with its `images`) can hit (not
        the last token's)."""
        refs, parent = [], self.cache_fingerprint
        for index in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            key = self._block_key(parent, tokens, images, index)
            refs.append(BlockRef(key, parent, tokens))
            parent = key
        return refs

    def cache_full_blocks(self, seq: Sequence) -> list[tuple[int, BlockRef]]:
        """Register every block of `seq` whose positions are all computed (`(i+1)*block_size <= num_computed_tokens`).

        A block equal to one already registered is not registered twice (the request keeps its own
        copy, released normally). A different block holding the same hash is replaced when nothing
        references it; otherwise caching stops for the rest of this request. Returns the blocks newly
        registered (what the tiers below should save). No-op without prefix caching.
        """
        registered: list[tuple[int, BlockRef]] = []
        if not self.enable_prefix_caching:
            return registered
        chain = self._chains.get(seq.request_id)
        if chain is None:
            chain = self._chains[seq.request_id] = _Chain()
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        while not chain.is_broken and len(chain.hashes) < num_full:
            index = len(chain.hashes)
            tokens = self._block_tokens(seq, index)
            parent_hash = chain.hashes[-1] if chain.hashes else self.cache_fingerprint
            parent = chain.registrations[-1] if chain.registrations else _ROOT_REGISTRATION
            block_hash = self._block_key(parent_hash, tokens, seq.images, index)
            existing = self._lookup(block_hash, parent, tokens)
            if existing is None and not self._release_hash(block_hash):
                chain.is_broken = True
                break
            if existing is None:
                existing = self._register(self._blocks[seq.block_table[index]], block_hash, parent, tokens)
                registered.append((existing.block_id, BlockRef(block_hash, parent_hash, tokens)))
            chain.hashes.append(block_hash)
            chain.registrations.append(existing.registration)
        return registered

    def _release_hash(self, block_hash: bytes) -> bool:
        """Make `block_hash` free to register; False if a different block in use owns it.

        The owner differs from the block being registered by a hash collision, or because it is a
        stale child whose parent was evicted and re-registered. Unreferenced, it is simply dropped.
        """
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return True
        block = self._blocks[block_id]
        if block.ref_count > 0 or block_id in self._pinned:
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
