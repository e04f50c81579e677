"""The runner's image rows: the encoder cache's LRU bound by bytes, and each step's mask and rows for the
spans it covers (a chunk cutting through a span takes only the rows it covers)."""

from __future__ import annotations

import torch

from deepinfer_core.plan import ImageInput, ScheduledRequest
from deepinfer_core.worker.images import EncoderCache, ImageRows
from deepinfer_core.worker.input_batch import RequestState


def rows(n: int, value: float) -> torch.Tensor:
    return torch.full((n, 4), value)  # 16 bytes a row


def test_the_cache_drops_the_least_recently_used_within_its_bytes():
    cache = EncoderCache(max_bytes=3 * 32)
    for key in (b"a", b"b", b"c"):
        cache.put(key, rows(2, 1.0))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", rows(2, 2.0))  # evicts b, the least recently used
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"d") is not None
    cache.put(b"huge", rows(10, 3.0))  # larger than the whole cache: not kept, nothing evicted
    assert cache.get(b"huge") is None and len(cache) == 3 and cache.num_bytes == 96
    assert EncoderCache(0).get(b"x") is None


class FakeEncoder:
    """encode_image gives a span's rows numbered by position, so a slice shows which rows were taken."""

    def __init__(self):
        self.calls = 0

    def encode_image(self, pixels):
        self.calls += 1
        return torch.arange(int(pixels.numel()), dtype=torch.float32)[:, None].repeat(1, 4)


def state(images) -> RequestState:
    return RequestState(0, [], 20, None, 0, images=tuple(images))


def test_a_chunk_takes_the_rows_of_the_span_it_covers_and_encodes_once():
    encoder = FakeEncoder()
    image_rows = ImageRows(encoder, torch.device("cpu"), cache_bytes=1 << 20)
    image = ImageInput(offset=3, length=5, content_hash=b"h" * 32, pixel_values=torch.zeros(5))
    first = image_rows.prepare([ScheduledRequest("r", 0, tuple(range(6)), False)], [state([image])])
    assert first["image_mask"].tolist() == [False, False, False, True, True, True]
    assert first["image_embeds"][:, 0].tolist() == [0, 1, 2]  # span rows 0-2 (positions 3-5)
    other = ImageInput(offset=0, length=2, content_hash=b"o" * 32, pixel_values=torch.zeros(2))
    second = image_rows.prepare([ScheduledRequest("q", 0, (7, 7, 7), True), ScheduledRequest("r", 6, (1, 2, 3), True)],
                                [state([other]), state([image])])
    assert second["image_mask"].tolist() == [True, True, False, True, True, False]
    assert second["image_embeds"][:, 0].tolist() == [0, 1, 3, 4]  # other's rows, then the span's last two
    assert encoder.calls == 2  # the cut span's second chunk read the cache
    stats = image_rows.take_stats()
    assert (stats.num_encoded, stats.num_cache_hits) == (2, 1) and image_rows.take_stats() is None
    assert image_rows.prepare([ScheduledRequest("r", 8, (4,), True)], [state([image])]) is None  # past the span
