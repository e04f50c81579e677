"""The prefix store: cache blocks as checksummed files, shared by every engine that points at it.

One file per block, named by its content key (`sched.block_pool.block_key`) under a directory per traffic
class: `<class>/<first two hex digits>/<key hex>.blk`. A file is

    magic "DIKVBLK1" | header length (u32) | header CRC-32 (u32) | header (JSON) | payload

and the header holds the key, the parent block's key, the block's token ids, the model's cache
fingerprint (which covers the weights' bytes), the block layout (`kv_blocks.describe_layout`: every
segment's shape and dtype), the payload's length and CRC-32, the traffic class, and an HMAC-SHA256 of
all of it and the payload under the deployment's store key (`store_key`). Every read is bounded (at most
one byte past the largest file a block of this size makes) and checks all of it against what the reader
expects, the HMAC last: a truncated, torn, bit-flipped, mislabelled, oversized, crafted (a header of
`1e400`, nested 100k deep) or foreign (another model's fingerprint or layout) file, or one forged by a
writer without the key, is never served and never raised; it is counted by reason (the
`prefix_store_corrupt_<reason>` stats), deleted, and the block is recomputed.

What the store trusts: the holders of the store key, i.e. the engines of one deployment. Anyone else
who can write the directory can delete blocks (a recompute) but cannot make an engine serve theirs.

Retention: each traffic class has a TTL (agent 3 days, chat 7 days by default). A file's age is the
time since it was written or last used (`touch`, on every hit); a block used by a class with a longer
TTL moves to that class's directory. `collect_garbage` deletes expired files, then, above the capacity
limit, the files that would expire first, and temporary files a dead writer left behind. Several
processes may collect at once: deletes are idempotent.
"""

from __future__ import annotations

import hmac
import json
import logging
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
from deepinfer_core.kv.store_key import store_key

logger = logging.getLogger(__name__)

MAGIC = b"DIKVBLK1"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sII")  # magic, header length, header CRC-32
_MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 28
"""The payload bound of a store that was not told its block size: no read allocates more than this."""
TEMP_MAX_AGE_S = 600.0
"""A temporary file older than this was left by a writer that died; the collector removes it."""
CORRUPTION_REASONS = ("truncated", "format", "checksum", "fingerprint", "layout", "identity", "oversized",
                      "unauthenticated")
_HEADER_FIELDS = {"version": int, "key": str, "parent": str, "tokens": list, "fingerprint": str, "layout": str,
                  "payload_bytes": int, "payload_crc32": int, "traffic_class": str, "mac": str}


class CorruptBlockError(ValueError):
    """A store file that must not be served; `reason` is one of `CORRUPTION_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _mac(auth_key: bytes, header: dict, payload: bytes | memoryview) -> str:
    """HMAC-SHA256 over the header's fields (canonical JSON, the MAC itself left out) and the payload."""
    mac = hmac.new(auth_key, json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True,
                                        separators=(",", ":")).encode(), "sha256")
    mac.update(payload)
    return mac.hexdigest()


def max_file_bytes(max_payload_bytes: int) -> int:
    """The largest store file a reader accepts for payloads of at most `max_payload_bytes`."""
    return _PREFIX.size + _MAX_HEADER_BYTES + max_payload_bytes


def encode_block(key: bytes, parent: bytes, tokens: TokenIds[int], fingerprint: bytes, layout: str,
                 payload: bytes | memoryview, traffic_class: str, *, auth_key: bytes) -> bytes:
    """One store file's bytes (see the module docstring), authenticated with `auth_key`."""
    header = {
        "version": FORMAT_VERSION, "key": key.hex(), "parent": parent.hex(), "tokens": list(tokens),
        "fingerprint": fingerprint.hex(), "layout": layout, "payload_bytes": len(payload),
        "payload_crc32": zlib.crc32(payload), "traffic_class": traffic_class,
    }
    header["mac"] = _mac(auth_key, header, payload)
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, len(raw), zlib.crc32(raw)) + raw + bytes(payload)


def _parse_header(raw: memoryview, max_payload_bytes: int) -> dict:
    """The header's fields, each of the type the format gives it and within bounds.

    :raises CorruptBlockError: ("format") for anything else: not JSON, nested too deep, a field missing or of
        another type, a number out of range (`1e400`, a negative length).
    """
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError, MemoryError) as err:
        raise CorruptBlockError("format", f"the header is not readable JSON ({type(err).__name__})") from None
    if not isinstance(header, dict):
        raise CorruptBlockError("format", "the header is not a JSON object")
    for name, kind in _HEADER_FIELDS.items():
        value = header.get(name)
        if type(value) is not kind:  # bool is not int here, nor a float an int
            raise CorruptBlockError("format", f"header field {name!r} is missing or not a {kind.__name__}")
    if not all(type(t) is int for t in header["tokens"]):
        raise CorruptBlockError("format", "header field 'tokens' holds something other than integers")
    if not 0 <= header["payload_bytes"] <= max_payload_bytes:
        raise CorruptBlockError("oversized", f"the header's payload of {header['payload_bytes']} bytes is outside "
                                f"[0, {max_payload_bytes}]")
    return header


def decode_block(data: bytes, key: bytes, parent: bytes, tokens: TokenIds[int], fingerprint: bytes,
                 layout: str, *, auth_key: bytes, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> memoryview:
    """The payload of a store file, after checking everything against what the reader expects, the
    block's HMAC under `auth_key` last (a forged file with recomputed checksums fails there).

    :raises CorruptBlockError: naming the first check that failed.
    """
    if len(data) < _PREFIX.size:
        raise CorruptBlockError("truncated", f"{len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    if len(data) > max_file_bytes(max_payload_bytes):
        raise CorruptBlockError("oversized", f"over {max_file_bytes(max_payload_bytes)} bytes")
    magic, header_len, header_crc = _PREFIX.unpack_from(data)
    if magic != MAGIC or header_len > _MAX_HEADER_BYTES:
        raise CorruptBlockError("format", f"not a block file (magic {magic!r}, header length {header_len})")
    body = memoryview(data)[_PREFIX.size :]
    if len(body) < header_len:
        raise CorruptBlockError("truncated", f"the header needs {header_len} bytes, {len(body)} are left")
    raw_header = body[:header_len]
    if zlib.crc32(raw_header) != header_crc:
        raise CorruptBlockError("checksum", "the header's CRC-32 does not match")
    header = _parse_header(raw_header, max_payload_bytes)
    if header["fingerprint"] != fingerprint.hex():
        raise CorruptBlockError("fingerprint", "written by another model or cache layout (fingerprint differs)")
    if header["layout"] != layout:
        raise CorruptBlockError("layout", f"block layout {header['layout']!r} differs from {layout!r}")
    stored = (header["version"], header["key"], header["parent"], header["tokens"])
    if stored != (FORMAT_VERSION, key.hex(), parent.hex(), list(tokens)):
        raise CorruptBlockError("identity", "the header's version, key, parent or tokens differ from the block asked for")
    payload = body[header_len:]
    if len(payload) != header["payload_bytes"]:
        raise CorruptBlockError("truncated", f"payload of {len(payload)} bytes, the header says {header['payload_bytes']}")
    if zlib.crc32(payload) != header["payload_crc32"]:
        raise CorruptBlockError("checksum", "the payload's CRC-32 does not match")
    if not hmac.compare_digest(_mac(auth_key, header, payload), header["mac"]):
        raise CorruptBlockError("unauthenticated", "the block's HMAC does not match this deployment's store key")
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
    :param auth_key: the deployment's store key, authenticating every block (None: `store_key.store_key`
        finds it: `DEEPINFER_PREFIX_STORE_KEY`, else the key file kept in a POSIX store's directory).
    :param max_payload_bytes: a block's bytes (the model's block size); no read allocates more than a
        file of this payload can hold, and a larger file is refused unread.
    """

    def __init__(self, backend: StoreBackend, fingerprint: bytes, layout: str,
                 ttl_s: dict[str, float] | None = None, capacity_bytes: int | None = None,
                 auth_key: bytes | None = None, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self.backend, self.fingerprint, self.layout = backend, fingerprint, layout
        self.ttl_s = dict(DEFAULT_TRAFFIC_TTL_S if ttl_s is None else ttl_s)
        check_traffic_classes(self.ttl_s, next(iter(self.ttl_s), DEFAULT_TRAFFIC_CLASS))
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"prefix store capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.auth_key = auth_key if auth_key is not None else store_key(backend)
        self.max_payload_bytes = max_payload_bytes
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
        data = encode_block(key, parent, tokens, self.fingerprint, self.layout, payload, traffic_class,
                            auth_key=self.auth_key)
        self.backend.put(self.name_of(key, traffic_class), data)
        with self._lock:
            self.stats.bytes_written += len(data)
            self.stats.num_written += 1
            self.stats.size_bytes += len(data)
            self.stats.num_blocks += 1
        return True

    def get(self, key: bytes, parent: bytes, tokens: TokenIds[int]) -> memoryview | None:
        """The block's payload if a valid file holds it, else None. A bad file (damaged, foreign, forged,
        oversized, crafted to break the parser) is quarantined: counted by reason and deleted, never
        raised; the block is then recomputed."""
        cls = self.find(key)
        data = None if cls is None else self._read(self.name_of(key, cls))
        if data is None:
            with self._lock:
                self.stats.num_misses += 1
            return None
        try:
            payload = decode_block(data, key, parent, tokens, self.fingerprint, self.layout, auth_key=self.auth_key,
                                   max_payload_bytes=self.max_payload_bytes)
        except CorruptBlockError as err:
            self._quarantine(self.name_of(key, cls), err.reason, str(err))
            return None
        except Exception as err:  # a file must never take the engine down, whatever it holds  # noqa: BLE001
            self._quarantine(self.name_of(key, cls), "format", f"{type(err).__name__}: {err}")
            return None
        with self._lock:
            self.stats.num_hits += 1
            self.stats.bytes_read += len(data)
        return payload

    def _read(self, name: str) -> bytes | None:
        """The file's bytes, read only up to one byte past the largest valid file (so an oversized one,
        a sparse 64 GiB file say, costs a bounded read and is refused as such)."""
        return self.backend.get(name, max_file_bytes(self.max_payload_bytes) + 1)

    def _quarantine(self, name: str, reason: str, message: str) -> None:
        logger.warning("prefix store file %s refused (%s: %s); deleted, the block is recomputed", name, reason,
                       message)
        try:
            self.backend.delete(name)
        except OSError as err:
            logger.warning("the refused prefix store file %s could not be deleted: %s", name, err)
        with self._lock:
            self.stats.num_corrupt[reason] += 1
            self.stats.num_misses += 1

    def touch(self, key: bytes, traffic_class: str) -> bool:
        """Refresh a stored block's age; move it to `traffic_class` when that class keeps blocks longer.
        False if the block is not stored."""
        cls = self.find(key)
        if cls is None:
            return False
        if self.ttl_s.get(traffic_class, 0) > self.ttl_s[cls]:
            data = self._read(self.name_of(key, cls))  # copied as it is: the reader checks it
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
            # larger than any block (of this model, or of another sharing the store): never read it
            if size > max_file_bytes(max(self.max_payload_bytes, DEFAULT_MAX_PAYLOAD_BYTES)):
                self.backend.delete(name)
                with self._lock:
                    self.stats.num_corrupt["oversized"] += 1
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
