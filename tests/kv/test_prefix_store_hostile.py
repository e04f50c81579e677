"""Hostile store files: each is refused, counted and removed, never raised; forged blocks fail the HMAC."""

from __future__ import annotations

import json
import os
import struct
import time
import zlib

import pytest

from deepinfer_core.kv.prefix_store import MAGIC, PrefixStore, encode_block
from deepinfer_core.kv.store_backends import PosixBackend
from deepinfer_core.sched.block_pool import block_key

FINGERPRINT = b"f" * 32
LAYOUT = "0.compressed[32,8]float32"
PAYLOAD_BYTES = 1000
TOKENS = [5, 6, 7]
KEY = block_key(FINGERPRINT, TOKENS)


def make_store(root) -> PrefixStore:
    return PrefixStore(PosixBackend(root), FINGERPRINT, LAYOUT, max_payload_bytes=PAYLOAD_BYTES)


def with_header(header: bytes, payload: bytes = b"") -> bytes:
    """A block file around `header` whose header CRC-32 is valid (what a crafted file would carry)."""
    return struct.pack("<8sII", MAGIC, len(header), zlib.crc32(header)) + header + payload


def valid_header(store: PrefixStore) -> dict:
    data = encode_block(KEY, FINGERPRINT, TOKENS, FINGERPRINT, LAYOUT, b"\1" * PAYLOAD_BYTES, "chat",
                        auth_key=store.auth_key)
    return json.loads(data[16 : 16 + struct.unpack_from("<I", data, 8)[0]])


def huge_payload_bytes(store: PrefixStore) -> bytes:
    text = json.dumps(valid_header(store)).replace(f'"payload_bytes": {PAYLOAD_BYTES}', '"payload_bytes": 1e400')
    assert "1e400" in text
    return with_header(text.encode(), b"\1" * PAYLOAD_BYTES)


def deep_header(store: PrefixStore) -> bytes:
    return with_header(b"[" * 100_000 + b"]" * 100_000)


def forged_with_recomputed_checksums(store: PrefixStore) -> bytes:
    """The valid block's payload replaced and both CRC-32s recomputed: only the HMAC can tell."""
    header = valid_header(store)
    forged = b"\2" * PAYLOAD_BYTES
    header["payload_crc32"] = zlib.crc32(forged)
    return with_header(json.dumps(header).encode(), forged)


def forged_with_another_key(store: PrefixStore) -> bytes:
    return encode_block(KEY, FINGERPRINT, TOKENS, FINGERPRINT, LAYOUT, b"\2" * PAYLOAD_BYTES, "chat",
                        auth_key=b"a stranger's key".ljust(32))


HOSTILE = {
    "payload_bytes 1e400": (huge_payload_bytes, "format"),
    "100k-deep header": (deep_header, "format"),
    "forged, CRCs recomputed": (forged_with_recomputed_checksums, "unauthenticated"),
    "forged, another key": (forged_with_another_key, "unauthenticated"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_crafted_file_is_refused_counted_and_removed(tmp_path, case):
    store = make_store(tmp_path)
    craft, reason = HOSTILE[case]
    path = tmp_path / store.name_of(KEY, "chat")
    path.parent.mkdir(parents=True)
    path.write_bytes(craft(store))
    assert store.get(KEY, FINGERPRINT, TOKENS) is None
    assert store.stats.num_corrupt[reason] == 1 and sum(store.stats.num_corrupt.values()) == 1
    assert not path.exists()  # quarantined: the next engine does not meet it again
    assert store.put(KEY, FINGERPRINT, TOKENS, b"\1" * PAYLOAD_BYTES, "chat")  # recomputed, written whole
    assert bytes(store.get(KEY, FINGERPRINT, TOKENS)) == b"\1" * PAYLOAD_BYTES


def test_a_64_gib_sparse_file_costs_a_bounded_read_and_is_removed(tmp_path):
    store = make_store(tmp_path)
    path = tmp_path / store.name_of(KEY, "chat")
    path.parent.mkdir(parents=True)
    with path.open("wb") as f:
        f.write(with_header(json.dumps(valid_header(store)).encode()))
        f.truncate(64 << 30)
    start = time.monotonic()
    assert store.get(KEY, FINGERPRINT, TOKENS) is None
    assert time.monotonic() - start < 5  # read up to the largest valid file's size + 1, not 64 GiB
    assert store.stats.num_corrupt["oversized"] == 1 and not path.exists()


def test_the_collector_removes_files_larger_than_any_block(tmp_path):
    store = make_store(tmp_path)
    assert store.put(KEY, FINGERPRINT, TOKENS, b"\1" * PAYLOAD_BYTES, "chat")
    big = tmp_path / "chat" / "ab" / ("ab" * 32 + ".blk")
    big.parent.mkdir(parents=True, exist_ok=True)
    with big.open("wb") as f:
        f.truncate(64 << 30)
    store.collect_garbage()
    assert not big.exists() and store.stats.num_corrupt["oversized"] == 1
    assert store.contains(KEY)


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_block_name_that_is_not_a_plain_file_is_refused_without_blocking(tmp_path, kind):
    store = make_store(tmp_path)
    path = tmp_path / store.name_of(KEY, "chat")
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer forever
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "elsewhere").write_bytes(b"\0" * 100)
        path.symlink_to(tmp_path / "elsewhere")
    assert store.get(KEY, FINGERPRINT, TOKENS) is None  # returns at once: nothing waits on a FIFO
    assert store.stats.num_misses == 1 and store.stats.num_hits == 0
    if kind == "symlink":  # a link is read without being followed: refused and removed
        assert store.stats.num_corrupt["truncated"] == 1 and not path.is_symlink()
