"""BlockPool: allocation, reference counts, the prefix cache, collision safety, LRU eviction, the null
block. Prefix matches go through the KV connector (`match`), which also decides the replay fields."""

import pytest

from deepinfer_core.kv.blocks import blocks_for
from deepinfer_core.kv.cache import NULL_BLOCK
from deepinfer_core.kv.connector import KvConnector, ReplayPolicy
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sched import block_pool as bm_module
from deepinfer_core.sched.block_pool import BlockPool, NoFreeBlocksError
from deepinfer_core.sched.sequence import Sequence

BS = 4


def make_seq(tokens, request_id="r") -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams())


def match(manager: BlockPool, seq: Sequence, sliding_window: int = 0, replay: str = "bounded",
          num_layers: int = 1) -> None:
    """Admission's prefix match: the pool's blocks, and the connector's replay decision."""
    KvConnector(manager).admit(seq, ReplayPolicy(replay, sliding_window, num_layers))


def compute_all(manager: BlockPool, seq: Sequence) -> None:
    """Allocate and 'compute' every token of seq, then register its full blocks."""
    manager.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)


def snapshot(manager: BlockPool) -> tuple[int, list[int]]:
    return manager.num_free_blocks, [manager.ref_count(i) for i in range(1, manager.num_blocks + 1)]


# -- allocation ---------------------------------------------------------------------------------


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0}, {"num_blocks": 4, "block_size": 0}])
def test_rejects_empty_pool(kwargs):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockPool(**kwargs)


def test_allocate_covers_computed_plus_new_tokens():
    manager = BlockPool(num_blocks=8, block_size=BS)
    seq = make_seq(range(10))
    manager.allocate(seq, 5)  # positions 0..4 -> 2 blocks
    assert seq.block_table == [1, 2]  # block 0 is the null block, never handed out
    seq.num_computed_tokens = 5
    assert manager.can_allocate(seq, 3)
    manager.allocate(seq, 3)  # positions < 8: still 2 blocks
    assert seq.block_table == [1, 2]
    manager.allocate(seq, 5)  # positions < 10: 3 blocks
    assert seq.block_table == [1, 2, 3]
    assert manager.num_free_blocks == 5
    assert [manager.ref_count(i) for i in range(4)] == [0, 1, 1, 1]


def test_can_allocate_counts_free_blocks_exactly():
    manager = BlockPool(num_blocks=3, block_size=BS)
    seq = make_seq(range(20))
    assert manager.can_allocate(seq, 12)
    assert not manager.can_allocate(seq, 13)
    with pytest.raises(NoFreeBlocksError, match="can_allocate"):
        manager.allocate(seq, 13)
    assert seq.block_table == [] and manager.num_free_blocks == 3


def test_free_restores_pool_and_clears_table():
    manager = BlockPool(num_blocks=6, block_size=BS)
    a, b = make_seq(range(9), "a"), make_seq(range(5), "b")
    manager.allocate(a, 9)
    manager.allocate(b, 5)
    assert manager.num_free_blocks == 1
    manager.free(a)
    assert a.block_table == [] and manager.num_free_blocks == 4
    assert manager.ref_count(b.block_table[0]) == 1
    manager.free(b)
    assert snapshot(manager) == (6, [0] * 6)


# -- prefix cache: registration and hits ---------------------------------------------------------


def test_cache_full_blocks_registers_only_computed_full_blocks():
    manager = BlockPool(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(11))
    manager.allocate(seq, 11)
    seq.num_computed_tokens = 7  # block 0 full, block 1 half computed
    manager.cache_full_blocks(seq)
    assert manager.num_cached_blocks == 1
    seq.num_computed_tokens = 11
    manager.cache_full_blocks(seq)
    assert manager.num_cached_blocks == 2  # the partial third block is never cached
    manager.cache_full_blocks(seq)  # idempotent
    assert manager.num_cached_blocks == 2


def test_no_caching_when_disabled():
    manager = BlockPool(num_blocks=8, block_size=BS)
    a = make_seq(range(9), "a")
    compute_all(manager, a)
    assert manager.num_cached_blocks == 0
    b = make_seq(range(9), "b")
    match(manager, b, 4, "bounded")
    assert (b.block_table, b.num_computed_tokens, b.num_cached_tokens) == ([], 0, 0)


def test_hit_shares_blocks_and_sets_bounded_replay_fields():
    manager = BlockPool(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_seq(range(14), "a")
    compute_all(manager, a)  # 3 full blocks cached
    b = make_seq(list(range(13)) + [99, 100], "b")
    match(manager, b, BS, "bounded")
    assert b.block_table == a.block_table[:3]
    assert [manager.ref_count(i) for i in a.block_table] == [2, 2, 2, 1]
    assert (b.num_cached_tokens, b.no_write_before) == (12, 12)
    assert b.replay_start == b.num_computed_tokens == 8  # H - sliding_window


@pytest.mark.parametrize(("num_layers", "start"), [(1, 8), (2, 4), (3, 0), (40, 0)])
def test_exact_replay_recomputes_layers_times_window(num_layers, start):
    manager = BlockPool(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    compute_all(manager, make_seq(range(13), "a"))
    b = make_seq(range(13), "b")
    match(manager, b, BS, "exact", num_layers=num_layers)
    assert (b.num_cached_tokens, b.no_write_before, b.replay_start, b.num_computed_tokens) == (12, 12, start, start)
    assert len(b.block_table) == 3


def test_replay_start_clamps_at_zero_when_window_exceeds_hit():
    manager = BlockPool(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    compute_all(manager, make_seq(range(9), "a"))
    b = make_seq(range(9), "b")
    match(manager, b, 3 * BS, "bounded")
    assert (b.num_cached_tokens, b.replay_start, b.num_computed_tokens) == (8, 0, 0)


@pytest.mark.parametrize(("query_len", "hit"), [(12, 8), (13, 12), (4, 0), (5, 4)])
def test_hit_leaves_at_least_one_token_to_compute(query_len, hit):
    manager = BlockPool(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    compute_all(manager, make_seq(range(16), "a"))
    b = make_seq(range(query_len), "b")
    match(manager, b, 0, "bounded")
    assert b.num_cached_tokens == hit and b.num_computed_tokens == hit
    assert len(b.block_table) == hit // BS


def test_chained_hash_needs_the_whole_prefix():
    manager = BlockPool(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    compute_all(manager, make_seq([1, 1, 1, 1, 2, 2, 2, 2, 3], "a"))
    b = make_seq([9, 9, 9, 9, 2, 2, 2, 2, 3], "b")  # same second block, different first
    match(manager, b, 0, "bounded")
    assert b.block_table == [] and b.num_cached_tokens == 0


def test_match_prefix_validates_arguments():
    manager = BlockPool(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(6))
    manager.allocate(seq, 2)
    with pytest.raises(ValueError, match="fresh"):
        match(manager, seq, 4, "bounded")


def test_generated_tokens_are_cached_too():
    manager = BlockPool(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_seq(range(6), "a")
    for token in (50, 51, 52):
        a.append_token(token)
    compute_all(manager, a)  # 9 tokens: 2 full blocks, the second half generated
    b = make_seq(list(range(6)) + [50, 51, 7], "b")
    match(manager, b, 0, "bounded")
    assert b.num_cached_tokens == 8


def test_duplicate_block_is_not_registered_twice():
    manager = BlockPool(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a, b = make_seq(range(9), "a"), make_seq(range(9), "b")
    manager.allocate(a, 9)
    manager.allocate(b, 9)  # both computed the same prefix before either cached it
    for seq in (a, b):
        seq.num_computed_tokens = 9
        manager.cache_full_blocks(seq)
    assert manager.num_cached_blocks == 2
    a_blocks = list(a.block_table)
    manager.free(b)  # b's copies were never registered: they come back as plain free blocks
    manager.free(a)
    assert manager.num_free_blocks == 8
    c = make_seq(range(9), "c")
    match(manager, c, 0, "bounded")
    assert c.block_table == a_blocks[:2]


# -- collision safety ----------------------------------------------------------------------------


def test_forced_hash_collision_never_serves_a_wrong_block(monkeypatch):
    monkeypatch.setattr(bm_module, "block_key", lambda parent, tokens: 7)
    manager = BlockPool(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 3], "a")
    compute_all(manager, a)
    # block 1 collides with block 0 (same hash, held by a): caching stops after block 0
    assert manager.num_cached_blocks == 1
    b = make_seq([5, 5, 5, 5, 2, 2, 2, 2, 3], "b")
    match(manager, b, 0, "bounded")
    assert b.block_table == [] and b.num_cached_tokens == 0
    c = make_seq([1, 1, 1, 1, 9, 9, 9, 9, 3], "c")
    match(manager, c, 0, "bounded")
    assert c.block_table == a.block_table[:1] and c.num_cached_tokens == 4


def test_parent_is_verified_not_only_the_block_tokens(monkeypatch):
    # A hash that ignores the parent: block tokens alone would match a block of another chain.
    monkeypatch.setattr(bm_module, "block_key", lambda parent, tokens: hash(tuple(tokens)))
    manager = BlockPool(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    compute_all(manager, make_seq([1] * 4 + [2] * 4 + [0], "a"))  # chain X -> Y
    compute_all(manager, make_seq([3] * 4 + [4] * 4 + [0], "c"))  # chain Z -> W
    b = make_seq([3] * 4 + [2] * 4 + [0], "b")  # Z then Y's tokens, but Y's parent is X
    match(manager, b, 0, "bounded")
    assert b.num_cached_tokens == 4 and len(b.block_table) == 1


def test_collision_with_unreferenced_block_replaces_it(monkeypatch):
    monkeypatch.setattr(bm_module, "block_key", lambda parent, tokens: 7)
    manager = BlockPool(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = make_seq([1] * 4 + [0], "a")
    compute_all(manager, a)
    manager.free(a)
    b = make_seq([2] * 4 + [0], "b")
    compute_all(manager, b)  # a's cached block is unreferenced: b's block takes the hash
    assert manager.num_cached_blocks == 1 and manager.num_free_blocks == 6
    again_a = make_seq([1] * 4 + [0], "a2")
    match(manager, again_a, 0, "bounded")
    assert again_a.block_table == []
    again_b = make_seq([2] * 4 + [0], "b2")
    match(manager, again_b, 0, "bounded")
    assert again_b.block_table == b.block_table[:1]


# -- eviction and the free-pool invariant --------------------------------------------------------


def test_free_keeps_cached_blocks_reusable_and_counted_free():
    manager = BlockPool(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_seq(range(9), "a")
    compute_all(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 2
    b = make_seq(range(9), "b")
    match(manager, b, 0, "bounded")
    assert b.block_table == [1, 2] and manager.num_free_blocks == 2


def test_plain_free_blocks_are_used_before_cached_ones():
    manager = BlockPool(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_seq(range(9), "a")  # 2 cached blocks + 1 partial
    compute_all(manager, a)
    manager.free(a)
    b = make_seq([7] * 5, "b")
    manager.allocate(b, 5)  # 2 blocks: the never-used block 4 and a's uncached partial block 3
    assert sorted(b.block_table) == [3, 4]
    assert manager.num_cached_blocks == 2


def test_lru_eviction_order_oldest_release_first_tail_before_head():
    manager = BlockPool(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_seq([1] * 8 + [0], "a")
    manager.allocate(a, 8)
    a.num_computed_tokens = 8
    manager.cache_full_blocks(a)
    a_blocks = list(a.block_table)
    b = make_seq([2] * 8 + [0], "b")
    manager.allocate(b, 8)
    b.num_computed_tokens = 8
    manager.cache_full_blocks(b)
    b_blocks = list(b.block_table)
    manager.free(a)  # released first: evicted first, its tail before its head
    manager.free(b)
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 4
    c = make_seq([3] * 5, "c")
    manager.allocate(c, 1)
    assert c.block_table == [a_blocks[1]]
    manager.allocate(c, 5)
    assert c.block_table == [a_blocks[1], a_blocks[0]]
    assert manager.num_cached_blocks == 2
    probe_b = make_seq([2] * 8 + [0], "pb")
    match(manager, probe_b, 0, "bounded")
    assert probe_b.block_table == b_blocks
    probe_a = make_seq([1] * 8 + [0], "pa")
    match(manager, probe_a, 0, "bounded")
    assert probe_a.block_table == []


def test_hit_refreshes_lru_position():
    manager = BlockPool(num_blocks=2, block_size=BS, enable_prefix_caching=True)
    a, b = make_seq([1] * 4 + [0], "a"), make_seq([2] * 4 + [0], "b")
    for seq in (a, b):
        manager.allocate(seq, 4)
        seq.num_computed_tokens = 4
        manager.cache_full_blocks(seq)
    manager.free(a)
    manager.free(b)
    again = make_seq([1] * 4 + [0], "a2")
    match(manager, again, 0, "bounded")
    manager.free(again)  # a's block is now the most recently released
    c = make_seq([3] * 2, "c")
    manager.allocate(c, 2)
    assert c.block_table == [2]  # b's block, released after a's but not touched since
    probe_a = make_seq([1] * 4 + [0], "pa")
    match(manager, probe_a, 0, "bounded")
    assert probe_a.block_table == [1]
    probe_b = make_seq([2] * 4 + [0], "pb")
    match(manager, probe_b, 0, "bounded")
    assert probe_b.block_table == []


def test_allocate_then_free_restores_pool_with_shared_blocks():
    manager = BlockPool(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    base = make_seq(range(13), "base")
    compute_all(manager, base)
    before = snapshot(manager)
    seq = make_seq(list(range(12)) + [50, 51, 52, 53, 54, 55], "x")
    match(manager, seq, BS, "bounded")
    manager.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)
    assert manager.num_free_blocks < before[0]
    manager.free(seq)
    assert snapshot(manager) == before


# -- stable keys ------------------------------------------------------------------------------------


def test_block_keys_are_content_hashes_equal_in_another_process():
    import subprocess
    import sys

    tokens = list(range(100, 100 + BS))
    root = bm_module.block_key(b"fingerprint", tokens)
    child = bm_module.block_key(root, [7] * BS)
    code = ("from deepinfer_core.sched.block_pool import block_key as k; "
            f"r = k(b'fingerprint', {tokens!r}); print(r.hex(), k(r, [7] * {BS}).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [root.hex(), child.hex()]  # Python's hash() would differ between processes
    assert len(root) == 32 and root != bm_module.block_key(b"other model", tokens)
    assert child != bm_module.block_key(bm_module.block_key(b"fingerprint", tokens[::-1]), [7] * BS)


def test_the_cache_fingerprint_roots_every_chain():
    a = BlockPool(num_blocks=8, block_size=BS, enable_prefix_caching=True, cache_fingerprint=b"model-a")
    b = BlockPool(num_blocks=8, block_size=BS, enable_prefix_caching=True, cache_fingerprint=b"model-b")
    for manager in (a, b):
        seq = Sequence("s", list(range(1, 2 * BS + 2)), SamplingParams())
        manager.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        manager.cache_full_blocks(seq)
    assert set(a._hash_to_block).isdisjoint(b._hash_to_block)  # same tokens, other model: other keys
    assert a.num_cached_blocks == b.num_cached_blocks == 2


# -- the null block -----------------------------------------------------------------------------


def test_the_null_block_is_never_handed_out_and_not_counted():
    manager = BlockPool(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    assert manager.num_free_blocks == 3  # `num_blocks` counts only blocks the pool hands out
    seq = make_seq(range(12))
    compute_all(manager, seq)
    assert NULL_BLOCK not in seq.block_table and sorted(seq.block_table) == [1, 2, 3]
    assert not manager.can_allocate(make_seq(range(4), "x"), 4)  # full: the null block is not spare
    manager.free(seq)
    other = make_seq(range(100, 112), "o")  # evicts every cached block: still never the null block
    manager.allocate(other, 12)
    assert NULL_BLOCK not in other.block_table and manager.ref_count(NULL_BLOCK) == 0
    spec = make_seq(range(200, 204), "s")  # drafts' blocks given back go to the front of the free queue
    manager.free(other)
    manager.allocate(spec, 4)
    manager.release_tail(spec, 0)
    assert NULL_BLOCK not in [manager.take_block() for _ in range(3)]
