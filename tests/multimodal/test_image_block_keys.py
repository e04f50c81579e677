"""Block keys cover image content: same placeholder tokens with another image never share a block, in
the device pool and in every tier keyed by the pool's refs (host, store, PD export)."""

from __future__ import annotations

from deepinfer_core.plan import ImageInput
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sched.block_pool import BlockPool
from deepinfer_core.sched.sequence import Sequence

BS = 4
IMAGE_ID = 9
TOKENS = [1, 2, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, 3, 4, 5, 6, 7, 8]
"""Block 0 holds the span's first two positions, block 1 its last three; blocks 2 follows it."""


def image(digest: bytes, offset: int = 2, length: int = 5) -> ImageInput:
    return ImageInput(offset, length, digest * 32)


def computed(pool: BlockPool, request_id: str, images) -> Sequence:
    seq = Sequence(request_id, TOKENS, SamplingParams(), images=images)
    pool.match_prefix(seq)
    pool.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    pool.cache_full_blocks(seq)
    return seq


def hit_blocks(pool: BlockPool, images) -> int:
    seq = Sequence("probe", TOKENS, SamplingParams(), images=images)
    return pool.match_prefix(seq).num_blocks


def test_another_image_misses_and_the_same_image_hits():
    pool = BlockPool(16, BS, enable_prefix_caching=True, cache_fingerprint=b"model")
    computed(pool, "a", (image(b"\x01"),))
    assert hit_blocks(pool, (image(b"\x01"),)) == 3  # every full block (the last token's is not)
    assert hit_blocks(pool, (image(b"\x02"),)) == 0  # the first block already overlaps the span
    assert hit_blocks(pool, ()) == 0  # placeholder ids alone (no image) are not the image's blocks
    assert hit_blocks(pool, (image(b"\x01", offset=2, length=4),)) == 0  # another span


def test_refs_are_the_pools_keys_for_every_tier():
    pool = BlockPool(16, BS, enable_prefix_caching=True, cache_fingerprint=b"model")
    images = (image(b"\x01"),)
    refs = pool.block_refs(TOKENS, images)
    seq = computed(pool, "a", images)
    assert [r.key for r in refs] == [r.key for r in pool.match_prefix(
        Sequence("b", TOKENS, SamplingParams(), images=images)).refs]
    other = pool.block_refs(TOKENS, (image(b"\x02"),))
    assert all(a.key != b.key for a, b in zip(refs, other))  # the chain carries the image past its span
    assert seq.images == images


def test_a_text_prompt_keeps_its_keys():
    pool = BlockPool(16, BS, enable_prefix_caching=True, cache_fingerprint=b"model")
    from deepinfer_core.sched.block_pool import block_key

    refs = pool.block_refs(TOKENS)
    assert refs[0].key == block_key(b"model", tuple(TOKENS[:BS]))
    # an image that does not reach block 0 leaves its key alone and changes block 1 on
    late = pool.block_refs(TOKENS, (ImageInput(5, 2, b"\x03" * 32),))
    assert late[0].key == refs[0].key and late[1].key != refs[1].key and late[2].key != refs[2].key
