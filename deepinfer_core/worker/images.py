"""The runner's image rows: each step's `image_mask` and `image_embeds`, from the vision encoder's
output per image, kept in an LRU cache keyed by the image's content hash.

A step computes a slice of each request's positions; an image's span may be covered whole, in part (a
prefill chunk that cuts through it) or again (a recompute after preemption, a replay after a prefix
hit). Each image is encoded once while its rows fit the cache (`EngineConfig.encoder_cache_mib`), and a
step takes the rows of the span it covers, in the order of the step's flat rows.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from deepinfer_core.plan import EncoderStats, ImageInput


class EncoderCache:
    """Vision encoder outputs by image content hash, least recently used dropped first, at most
    `max_bytes` in all (0: nothing kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: bytes) -> torch.Tensor | None:
        rows = self._rows.get(key)
        if rows is not None:
            self._rows.move_to_end(key)
        return rows

    def put(self, key: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes or key in self._rows:
            return
        while self.num_bytes + size > self.max_bytes:
            _, dropped = self._rows.popitem(last=False)
            self.num_bytes -= dropped.numel() * dropped.element_size()
        self._rows[key] = rows
        self.num_bytes += size


class ImageRows:
    """Builds a step's image inputs for the model (`image_mask`, `image_embeds`), encoding with
    `model.encode_image` what the cache lacks, and counts the encoder's work for the step's result."""

    def __init__(self, model, device: torch.device, cache_bytes: int) -> None:
        self.model, self.device = model, device
        self.cache = EncoderCache(cache_bytes)
        self.stats = EncoderStats()
        """The encoder's work since the last `take_stats`."""

    def take_stats(self) -> EncoderStats | None:
        """The work since the last call (None if none), then zero."""
        stats, self.stats = self.stats, EncoderStats()
        return stats if stats.num_images else None

    def prepare(self, requests, states) -> dict[str, torch.Tensor] | None:
        """`{"image_mask": [rows] bool, "image_embeds": [image rows, dim]}` for the step's flat rows
        (each request's `token_ids` in plan order), or None when no row is an image's."""
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        offset = 0
        for request, state in zip(requests, states):
            for image in state.images:
                lo, hi = max(image.offset, request.start), min(image.end, request.end)
                if lo < hi:
                    pieces.append(self._encoded(image)[lo - image.offset : hi - image.offset])
                    rows.extend(range(offset + lo - request.start, offset + hi - request.start))
            offset += request.num_tokens
        if not pieces:
            return None
        mask = torch.zeros(offset, dtype=torch.bool)
        mask[rows] = True
        return {"image_mask": mask.to(self.device, non_blocking=True), "image_embeds": torch.cat(pieces)}

    def _encoded(self, image: ImageInput) -> torch.Tensor:
        rows = self.cache.get(image.content_hash)
        if rows is not None:
            self.stats.num_cache_hits += 1
            return rows
        is_cuda = self.device.type == "cuda"
        if is_cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            rows = self.model.encode_image(image.pixel_values.to(self.device))
        if is_cuda:
            torch.cuda.synchronize(self.device)
        self.stats.seconds += time.perf_counter() - start
        self.stats.num_encoded += 1
        if rows.shape[0] != image.length:
            # internal: the span length comes from the same processor geometry the encoder reads
            raise RuntimeError(f"the vision encoder gave {rows.shape[0]} rows for a span of {image.length}")
        self.cache.put(image.content_hash, rows)
        return rows
