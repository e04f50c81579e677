"""The host tier: a fixed pool of blocks, least recently used out, hits only for the exact block."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.kv.host_cache import HostCache


def row(value: int) -> torch.Tensor:
    return torch.full((16,), value, dtype=torch.uint8)


def test_least_recently_used_blocks_leave_first():
    cache = HostCache(capacity_bytes=32, block_bytes=16, pin=False)
    cache.put(b"a", b"root", (1,), row(1))
    cache.put(b"b", b"a", (2,), row(2))
    assert torch.equal(cache.get(b"a", b"root", (1,)), row(1))  # a is now the most recent
    cache.put(b"c", b"b", (3,), row(3))
    assert b"b" not in cache and b"a" in cache and b"c" in cache
    assert cache.stats.num_evicted == 1 and cache.num_bytes == 32


def test_a_hit_needs_the_same_parent_and_tokens_and_returns_a_copy():
    cache = HostCache(capacity_bytes=64, block_bytes=16, pin=False)
    cache.put(b"k", b"p", (7, 8), row(9))
    assert cache.get(b"k", b"other", (7, 8)) is None and cache.get(b"k", b"p", (7, 9)) is None
    copy = cache.get(b"k", b"p", (7, 8))
    copy.zero_()
    assert torch.equal(cache.get(b"k", b"p", (7, 8)), row(9))


def test_pinned_only_with_cuda_and_a_zero_size_tier_holds_nothing():
    assert HostCache(64, 16).is_pinned == torch.cuda.is_available()
    empty = HostCache(0, 16)
    empty.put(b"k", b"p", (1,), row(1))
    assert len(empty) == 0
    with pytest.raises(ValueError, match="host_cache_gib must be >= 0"):
        HostCache(-1, 16)
