"""The prefix store: cache blocks as checksummed files, shared by every engine that points at it.

One file per block, named by its content key (`sched.block_pool.block_key`) under a directory per traffic
class: `<class>/<first two hex digits>/<key hex>.blk`. A file is

    magic "DIKVBLK1" | header length (u32) | header CRC-32 (u32) | header (JSON) | payload

and the header holds the key, the parent block's key, the block's token ids, the model's cache
fingerprint, the block layout (`kv_blocks.describe_layout`: every segment's shape and dtype), the
payload's length and CRC-32, and the traffic class. Every read checks all of it against what the reader
expects: a truncated, torn, bit-flipped, mislabelled or foreign (another model's fingerprint or
layout) file is never served; it is counted by reason, deleted, and the block is recomputed.

Retention: each traffic class has a TTL (agent 3 days, chat 7 days by default). A file's age is the
time since it was written or last used (`touch`, on every hit); a block used by a class with a longer
TTL moves to that class's directory. `collect_garbage` deletes expired files, then, above the capacity
limit, the files that would expire first, and temporary files a dead writer left behind. Several
processes may collect at once: deletes are idempotent.
"""

from __future__ import annotations

import json
import struct
import threading
import time
import zlib
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass, field

from deepinfer_core.config.traffic import (  # noqa: F401 (re-exported: the store's users read them here)
    DAY_S,
    DEFAULT_TRAFFIC_CLASS,
    DEFAULT_TRAFFIC_TTL_S,
    check_traffic_classes,
)
from deepinfer_core.kv.store_backends import TEMP_SUFFIX, StoreBackend

MAGIC = b"DIKVBLK1"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, header length, header CRC-32
_MAX_HEADER_BYTES = 1 << 20
TEMP_MAX_AGE_S = 600.0
"""A temporary file older than this was left by a writer that died; the collector removes it."""
CORRUPTION_REASONS = ("truncated", "format", "checksum", "fingerprint", "layout", "identity")


class CorruptBlockError(ValueError):
    """A store file that must not be served; `reason` is one of `CORRUPTION_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def encode_block(key: bytes, parent: bytes, tokens: TokenIds[int], fingerprint: bytes, layout: str,
                 payload: bytes | memoryview, traffic_class: str) -> bytes:
    """One store file's bytes (see the module docstring)."""
    header = json.dumps({
        "version": FORMAT_VERSION, "key": key.hex(), "parent": parent.hex(), "tokens": list(tokens),
        "fingerprint": fingerprint.hex(), "layout": layout, "payload_bytes": len(payload),
        "payload_crc32": zlib.crc32(payload), "traffic_class": traffic_class,
    }, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header + bytes(payload)


def decode_block(data: bytes, key: bytes, parent: bytes, tokens: TokenIds[int], fingerprint: bytes,
                 layout: str) -> memoryview:
    """The payload of a store file, after checking everything against what the reader expects.

    :raises CorruptBlockError: naming the first check that failed.
    """
    if len(data) < _PREFIX.size:
        raise CorruptBlockError("truncated", f"{len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, header_len, header_crc = _PREFIX.unpack_from(data)
    if magic != MAGIC or header_len > _MAX_HEADER_BYTES:
        raise CorruptBlockError("format", f"not a block file (magic {magic!r}, header length {header_len})")
    body = memoryview(data)[_PREFIX.size :]
    if len(body) < header_len:
        raise CorruptBlockError("truncated", f"the header needs {header_len} bytes, {len(body)} are left")
    raw_header = body[:header_len]
    if zlib.crc32(raw_header) != header_crc:
        raise CorruptBlockError("checksum", "the header's CRC-32 does not match")
    try:
        header = json.loads(bytes(raw_header))
        expected_bytes, expected_crc = int(header["payload_bytes"]), int(header["payload_crc32"])
        stored = (header["version"], header["key"], header["parent"], header["tokens"])
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptBlockError("format", f"unreadable header: {err}") from None
    if header.get("fingerprint") != fingerprint.hex():
        raise CorruptBlockError("fingerprint", "written by another model or cache layout (fingerprint differs)")
    if header.get("layout") != layout:
        raise CorruptBlockError("layout", f"block layout {header.get('layout')!r} differs from {layout!r}")
    if stored != (FORMAT_VERSION, key.hex(), parent.hex(), list(tokens)):
        raise CorruptBlockError("identity", "the header's key, parent or tokens differ from the block asked for")
    payload = body[header_len:]
    if len(payload) != expected_bytes:
        raise CorruptBlockError("truncated", f"payload of {len(payload)} bytes, the header says {expected_bytes}")
    if zlib.crc32(payload) != expected_crc:
        raise CorruptBlockError("checksum", "the payload's CRC-32 does not match")
    return payload


@dataclass
class StoreStats:
    """Counters since the store was opened (this process's view); `size_bytes`/`num_blocks` as of
    the last garbage collection plus what this process wrote since."""

    num_hits: int = 0
    num_misses: int = 0
    num_corrupt: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CORRUPTION_REASONS, 0))
    bytes_read: int = 0
    bytes_written: int = 0
    num_written: int = 0
    num_evicted_ttl: int = 0
    num_evicted_capacity: int = 0
    size_bytes: int = 0
    num_blocks: int = 0
    num_gc_runs: int = 0


class PrefixStore:
    """Block files on a `StoreBackend` for one model (see the module docstring). Thread-safe.

    :param backend: where the files live.
    :param fingerprint: the model's cache fingerprint (files of another are never served).
    :param layout: `kv_blocks.describe_layout` of the model's blocks.
    :param ttl_s: per traffic class, seconds a block lives after its last use.
    :param capacity_bytes: most bytes the directory may hold (None: unlimited); enforced by `collect_garbage`.
    """

    def __init__(self, backend: StoreBackend, fingerprint: bytes, layout: str,
                 ttl_s: dict[str, float] | None = None, capacity_bytes: int | None = None) -> None:
        self.backend, self.fingerprint, self.layout = backend, fingerprint, layout
        self.ttl_s = dict(DEFAULT_TRAFFIC_TTL_S if ttl_s is None else ttl_s)
        check_traffic_classes(self.ttl_s, next(iter(self.ttl_s), DEFAULT_TRAFFIC_CLASS))
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"prefix store capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()

    @staticmethod
    def name_of(key: bytes, traffic_class: str) -> str:
        digest = key.hex()
        return f"{traffic_class}/{digest[:2]}/{digest}.blk"

    def find(self, key: bytes) -> str | None:
        """The traffic class whose directory holds `key`'s file, or None."""
        return next((cls for cls in self.ttl_s if self.backend.contains(self.name_of(key, cls))), None)

    def contains(self, key: bytes) -> bool:
        return self.find(key) is not None

    def put(self, key: bytes, parent: bytes, tokens: TokenIds[int], payload: bytes | memoryview,
            traffic_class: str) -> bool:
        """Write a block unless it is stored already (then it is touched for `traffic_class`); True if written."""
        if self.touch(key, traffic_class):
            return False
        data = encode_block(key, parent, tokens, self.fingerprint, self.layout, payload, traffic_class)
        self.backend.put(self.name_of(key, traffic_class), data)
        with self._lock:
            self.stats.bytes_written += len(data)
            self.stats.num_written += 1
            self.stats.size_bytes += len(data)
            self.stats.num_blocks += 1
        return True

    def get(self, key: bytes, parent: bytes, tokens: TokenIds[int]) -> memoryview | None:
        """The block's payload if a valid file holds it; a corrupt one is counted and deleted (None)."""
        cls = self.find(key)
        data = None if cls is None else self.backend.get(self.name_of(key, cls))
        if data is None:
            with self._lock:
                self.stats.num_misses += 1
            return None
        try:
            payload = decode_block(data, key, parent, tokens, self.fingerprint, self.layout)
        except CorruptBlockError as err:
            self.backend.delete(self.name_of(key, cls))
            with self._lock:
                self.stats.num_corrupt[err.reason] += 1
                self.stats.num_misses += 1
            return None
        with self._lock:
            self.stats.num_hits += 1
            self.stats.bytes_read += len(data)
        return payload

    def touch(self, key: bytes, traffic_class: str) -> bool:
        """Refresh a stored block's age; move it to `traffic_class` when that class keeps blocks longer.
        False if the block is not stored."""
        cls = self.find(key)
        if cls is None:
            return False
        if self.ttl_s.get(traffic_class, 0) > self.ttl_s[cls]:
            data = self.backend.get(self.name_of(key, cls))
            if data is not None:
                self.backend.put(self.name_of(key, traffic_class), data)
                self.backend.delete(self.name_of(key, cls))
                return True
        return self.backend.touch(self.name_of(key, cls))

    def collect_garbage(self, now: float | None = None) -> None:
        """Delete expired blocks, then the soonest-expiring ones above capacity, and stale temporary files."""
        now = time.time() if now is None else now
        longest = max(self.ttl_s.values())
        kept, evicted_ttl = [], 0
        for name, size, mtime in self.backend.scan():
            if name.endswith(TEMP_SUFFIX):
                if now - mtime > TEMP_MAX_AGE_S:
                    self.backend.delete(name)
                continue
            if not name.endswith(".blk"):
                continue
            expiry = mtime + self.ttl_s.get(name.split("/", 1)[0], longest)
            if expiry <= now:
                self.backend.delete(name)
                evicted_ttl += 1
            else:
                kept.append((expiry, size, name))
        total = sum(size for _, size, _ in kept)
        evicted_capacity = 0
        if self.capacity_bytes is not None and total > self.capacity_bytes:
            for _, size, name in sorted(kept):
                if total <= self.capacity_bytes:
                    break
                self.backend.delete(name)
                total -= size
                evicted_capacity += 1
        with self._lock:
            stats = self.stats
            stats.num_evicted_ttl += evicted_ttl
            stats.num_evicted_capacity += evicted_capacity
            stats.size_bytes, stats.num_blocks = total, len(kept) - evicted_capacity
            stats.num_gc_runs += 1
