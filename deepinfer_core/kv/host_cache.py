"""The host tier of the prefix cache: whole blocks in (pinned) host memory, least recently used out.

One preallocated `[num_slots, block_bytes]` uint8 pool, pinned when CUDA is present so copies to the
device can run asynchronously; a slot per block, found by content key. Each entry also keeps its
parent key and token ids, so a hit is accepted only for exactly the block asked for (as the device
cache checks its own hits). Used by the engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass
class HostCacheStats:
    num_hits: int = 0
    num_inserted: int = 0
    num_evicted: int = 0
    bytes_in: int = 0
    """Bytes copied into the pool (saved from the device or loaded from the store)."""
    bytes_out: int = 0
    """Bytes handed out for loads into the device."""


class HostCache:
    """LRU of whole blocks in host memory.

    :param capacity_bytes: pool size; `capacity_bytes // block_bytes` blocks (0: the tier is off).
    :param block_bytes: bytes of one block (`kv_blocks.layout_bytes`).
    :param pin: pin the pool (page-locked) for asynchronous device copies; None: when CUDA is available.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, pin: bool | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host_cache_gib must be >= 0, got {capacity_bytes / GIB:g} GiB")
        self.block_bytes = max(block_bytes, 1)
        self.num_slots = capacity_bytes // self.block_bytes
        pin = torch.cuda.is_available() if pin is None else pin
        self.is_pinned = bool(pin and self.num_slots)
        self._pool = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=self.is_pinned)
        self._entries: OrderedDict[bytes, tuple[int, bytes, tuple[int, ...]]] = OrderedDict()  # oldest first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.stats = HostCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def num_bytes(self) -> int:
        """Bytes of the blocks held now."""
        return len(self._entries) * self.block_bytes

    def put(self, key: bytes, parent: bytes, tokens: TokenIds[int], data: torch.Tensor) -> None:
        """Hold a copy of `data` (`[block_bytes]` uint8) as block `key`, evicting the least recently used."""
        if not self.num_slots:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if not self._free:
            _, (slot, _, _) = self._entries.popitem(last=False)
            self._free.append(slot)
            self.stats.num_evicted += 1
        slot = self._free.pop()
        self._pool[slot].copy_(data.reshape(-1))
        self._entries[key] = (slot, parent, tuple(tokens))
        self.stats.num_inserted += 1
        self.stats.bytes_in += self.block_bytes

    def get(self, key: bytes, parent: bytes, tokens: TokenIds[int]) -> torch.Tensor | None:
        """A copy of block `key` if it is held for exactly this parent and these tokens (now most recent)."""
        entry = self._entries.get(key)
        if entry is None or entry[1] != parent or entry[2] != tuple(tokens):
            return None
        self._entries.move_to_end(key)
        self.stats.num_hits += 1
        self.stats.bytes_out += self.block_bytes
        return self._pool[entry[0]].clone()
