"""The prefix store's files: format and checks on every read, retention by class, capacity, sharing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deepinfer_core.kv.prefix_store import (
    DAY_S,
    CorruptBlockError,
    PrefixStore,
    decode_block,
    encode_block,
)
from deepinfer_core.kv.store_backends import PosixBackend, StoreBackend, open_backend
from deepinfer_core.kv.store_key import KEY_ENV, KEY_FILE
from deepinfer_core.sched.block_pool import block_key

FINGERPRINT = b"f" * 32
LAYOUT = "0.compressed[32,8]float32"
KEY = b"k" * 32


def block(i: int, parent: bytes = FINGERPRINT) -> tuple[bytes, bytes, list[int], bytes]:
    tokens = [i, i + 1, i + 2]
    return block_key(parent, tokens), parent, tokens, bytes([i % 251]) * 1000


def make_store(root: Path, **options) -> PrefixStore:
    return PrefixStore(PosixBackend(root), FINGERPRINT, LAYOUT, **options)


def encode(*args, auth_key: bytes = KEY) -> bytes:
    return encode_block(*args, auth_key=auth_key)


def test_a_block_round_trips_and_every_check_fails_on_its_own_damage():
    key, parent, tokens, payload = block(1)
    data = encode(key, parent, tokens, FINGERPRINT, LAYOUT, payload, "chat")
    assert bytes(decode_block(data, key, parent, tokens, FINGERPRINT, LAYOUT, auth_key=KEY)) == payload
    flipped_payload = bytearray(data)
    flipped_payload[-10] ^= 0x40
    flipped_header = bytearray(data)
    flipped_header[20] ^= 0x01
    cases = {
        "truncated": (data[:-1], {}),
        "format": (b"NOTABLOCK" + data[9:], {}),
        "checksum": (bytes(flipped_payload), {}),
        "fingerprint": (encode(key, parent, tokens, b"g" * 32, LAYOUT, payload, "chat"), {}),
        "layout": (encode(key, parent, tokens, FINGERPRINT, "0.compressed[32,9]float32", payload, "chat"), {}),
        "identity": (data, {"tokens": [9, 9, 9]}),
    }
    for reason, (damaged, changes) in cases.items():
        expected = {"key": key, "parent": parent, "tokens": tokens, "fingerprint": FINGERPRINT, "layout": LAYOUT,
                    "auth_key": KEY, **changes}
        with pytest.raises(CorruptBlockError) as err:
            decode_block(damaged, **expected)
        assert err.value.reason == reason, reason
    with pytest.raises(CorruptBlockError) as err:
        decode_block(bytes(flipped_header), key, parent, tokens, FINGERPRINT, LAYOUT, auth_key=KEY)
    assert err.value.reason in ("checksum", "format")


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "delete"])
def test_a_damaged_file_is_never_served_and_is_counted_and_deleted(tmp_path, damage):
    store = make_store(tmp_path)
    key, parent, tokens, payload = block(2)
    assert store.put(key, parent, tokens, payload, "chat")
    path = tmp_path / store.name_of(key, "chat")
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        path.write_bytes(raw[:-5] + bytes([raw[-5] ^ 0xFF]) + raw[-4:])
    elif damage == "foreign":
        path.write_bytes(encode(key, parent, tokens, b"another model".ljust(32), LAYOUT, payload, "chat",
                                auth_key=store.auth_key))
    else:
        path.unlink()
    assert store.get(key, parent, tokens) is None
    assert not path.exists()
    expected = {"truncate": "truncated", "flip": "checksum", "foreign": "fingerprint"}.get(damage)
    assert sum(store.stats.num_corrupt.values()) == (expected is not None)
    if expected:
        assert store.stats.num_corrupt[expected] == 1
    assert store.stats.num_misses == 1 and store.stats.num_hits == 0


def test_writes_are_atomic_and_a_stored_block_is_touched_not_rewritten(tmp_path):
    store = make_store(tmp_path)
    key, parent, tokens, payload = block(3)
    assert store.put(key, parent, tokens, payload, "chat")
    assert not store.put(key, parent, tokens, payload, "chat")  # already there: touched
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != KEY_FILE]
    assert [p.name for p in files] == [f"{key.hex()}.blk"]  # no temporary file left behind
    assert bytes(store.get(key, parent, tokens)) == payload
    assert store.stats.num_written == 1 and store.stats.num_hits == 1


def age(store: PrefixStore, root: Path, key: bytes, cls: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(root / store.name_of(key, cls), (then, then))


def test_ttl_by_class_agent_three_days_chat_seven(tmp_path):
    store = make_store(tmp_path)
    agent, chat = block(4), block(5)
    store.put(*agent, "agent")
    store.put(*chat, "chat")
    for key, cls in ((agent[0], "agent"), (chat[0], "chat")):
        age(store, tmp_path, key, cls, 4 * DAY_S)
    store.collect_garbage()
    assert store.find(agent[0]) is None and store.find(chat[0]) == "chat"
    assert store.stats.num_evicted_ttl == 1 and store.stats.num_blocks == 1
    store.collect_garbage(now=time.time() + 3.5 * DAY_S)  # 7.5 days after its last use
    assert store.find(chat[0]) is None and store.stats.num_evicted_ttl == 2


def test_a_hit_refreshes_the_age_and_a_longer_class_keeps_the_block(tmp_path):
    store = make_store(tmp_path)
    key, parent, tokens, payload = block(6)
    store.put(key, parent, tokens, payload, "agent")
    age(store, tmp_path, key, "agent", 2.5 * DAY_S)
    assert store.touch(key, "chat")  # used by chat traffic: moves to the 7-day class
    assert store.find(key) == "chat"
    store.collect_garbage(now=time.time() + 5 * DAY_S)
    assert bytes(store.get(key, parent, tokens)) == payload


def test_capacity_evicts_the_blocks_expiring_first(tmp_path):
    sizes = []
    probe = make_store(tmp_path / "probe")
    probe.put(*block(10), "chat")
    sizes.append(probe.stats.bytes_written)
    store = make_store(tmp_path / "store", capacity_bytes=3 * sizes[0] + 8)  # class names differ in length
    blocks = {name: block(i) for i, name in enumerate(["agent_old", "agent_new", "chat_old", "chat_new", "chat_mid"], 10)}
    ages = {"agent_old": 2, "agent_new": 0, "chat_old": 5, "chat_new": 0, "chat_mid": 1}
    for name, b in blocks.items():
        cls = name.split("_")[0]
        store.put(*b, cls)
        age(store, tmp_path / "store", b[0], cls, ages[name] * DAY_S)
    # expiry = last use + TTL: agent_old in 1 day, chat_old in 2, agent_new in 3, chat_mid in 6, chat_new in 7
    store.collect_garbage()
    kept = {name for name, b in blocks.items() if store.find(b[0])}
    assert kept == {"agent_new", "chat_mid", "chat_new"}
    assert store.stats.num_evicted_capacity == 2 and store.stats.size_bytes <= 3 * sizes[0] + 8


def test_collector_removes_temp_files_of_dead_writers_only_when_old(tmp_path):
    store = make_store(tmp_path)
    old, new = tmp_path / "chat" / "aa" / "x.blk.1.ab.tmp", tmp_path / "chat" / "aa" / "y.blk.2.cd.tmp"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"partial")
    new.write_bytes(b"partial")
    then = time.time() - 3600
    os.utime(old, (then, then))
    store.collect_garbage()
    assert not old.exists() and new.exists()


_SHARER = textwrap.dedent("""
    import sys
    import time
    from pathlib import Path
    from deepinfer_core.sched.block_pool import block_key
    from deepinfer_core.kv.prefix_store import PrefixStore
    from deepinfer_core.kv.store_backends import PosixBackend

    root, me, other, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    store = PrefixStore(PosixBackend(root), b"f" * 32, "0.compressed[32,8]float32")

    def block(i):
        tokens = [i, i + 1, i + 2]
        return block_key(b"f" * 32, tokens), b"f" * 32, tokens, bytes([i % 251]) * 20000

    seen_other = 0
    for r in range(rounds):
        for i in (1000 * me + r, 5000 + r):  # own blocks, and blocks both processes write
            store.put(*block(i), "chat")
        for i in range(rounds):
            key, parent, tokens, payload = block(1000 * other + i)
            got = store.get(key, parent, tokens)
            if got is not None:
                assert bytes(got) == payload
                seen_other += 1
            shared = block(5000 + i)
            got = store.get(*shared[:3])
            assert got is None or bytes(got) == shared[3]
    (root / f"done-{me}").write_text(str(seen_other))
    while not (root / f"done-{other}").exists():
        time.sleep(0.01)
    for i in range(rounds):
        key, parent, tokens, payload = block(1000 * other + i)
        assert bytes(store.get(key, parent, tokens)) == payload  # every block the other wrote
    assert sum(store.stats.num_corrupt.values()) == 0, store.stats
    print("ok", seen_other)
""")


def test_two_processes_share_one_store_directory(tmp_path):
    root = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _SHARER, str(root), str(me), str(1 - me), "40"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in (0, 1)]
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out.startswith("ok")
    files = [p for p in root.rglob("*.blk")]
    assert len(files) == 2 * 40 + 40  # own blocks of each, and one copy of each shared block
    assert not list(root.rglob("*.tmp"))


def test_backends_are_opened_by_path_or_by_a_registered_scheme(tmp_path, monkeypatch):
    assert isinstance(open_backend(str(tmp_path / "a")), PosixBackend)
    assert isinstance(open_backend(f"file://{tmp_path / 'b'}"), PosixBackend)

    class Memory:
        def __init__(self, url):
            self.url, self.objects = url, {}

        def put(self, name, data):
            self.objects[name] = bytes(data)

        def get(self, name, max_bytes):
            data = self.objects.get(name)
            return None if data is None else data[:max_bytes]

        def contains(self, name):
            return name in self.objects

        def delete(self, name):
            self.objects.pop(name, None)

        def touch(self, name):
            return name in self.objects

        def scan(self):
            return iter([(n, len(d), time.time()) for n, d in self.objects.items()])

    backend = open_backend("mem://bucket", {"mem": Memory})
    assert isinstance(backend, StoreBackend) and backend.url == "mem://bucket"
    with pytest.raises(ValueError, match=KEY_ENV):  # no directory to keep a key in: it must be given
        PrefixStore(backend, FINGERPRINT, LAYOUT)
    monkeypatch.setenv(KEY_ENV, "a deployment's secret")
    store = PrefixStore(backend, FINGERPRINT, LAYOUT)
    key, parent, tokens, payload = block(7)
    store.put(key, parent, tokens, payload, "agent")
    assert bytes(store.get(key, parent, tokens)) == payload
    with pytest.raises(ValueError, match="no prefix store backend for '3fs'"):
        open_backend("3fs://cluster/kv", {"mem": Memory})


def test_blocks_evicted_while_a_store_read_runs_are_read_again(tmp_path):
    """A request's first lookup found blocks 0 and 1 in host memory and read 2 and 3 from the store; block 0
    left host memory meanwhile (other requests' saves). Admission must not stop the prefix at that hole."""
    import torch

    from deepinfer_core.kv.host_cache import HostCache
    from deepinfer_core.kv.tiers import BlockRef, PrefixTiers

    store, chain, parent = make_store(tmp_path), [], FINGERPRINT
    for i in range(4):
        key, parent_key, tokens, payload = block(i, parent)
        store.put(key, parent_key, tokens, payload, "chat")
        chain.append(BlockRef(key, parent_key, tuple(tokens)))
        parent = key
    host = HostCache(2 * 1000, 1000, pin=False)  # two blocks
    tiers = PrefixTiers(host, store)
    for ref in chain[:2]:
        host.put(ref.key, ref.parent, ref.tokens, torch.full((1000,), 9, dtype=torch.uint8))
    assert not tiers.is_ready("r", lambda: chain, lambda key: False)  # reads blocks 2 and 3
    tiers.wait_loading(10)
    _, other_parent, other_tokens, _ = block(50)
    host.put(b"x" * 32, other_parent, tuple(other_tokens), torch.zeros(1000, dtype=torch.uint8))  # evicts block 0
    assert chain[0].key not in host and chain[1].key in host
    assert not tiers.is_ready("r", lambda: chain, lambda key: False)  # block 0 is read again
    tiers.wait_loading(10)
    assert tiers.is_ready("r", lambda: chain, lambda key: False)
    tiers_of = [tiers.take("r", ref) for ref in chain]
    assert [t[0] for t in tiers_of] == ["store", "host", "store", "store"]
    assert bytes(tiers_of[0][1].numpy()) == block(0)[3]
    assert tiers.stats()["prefix_store_rereads"] == 1 and tiers.stats()["prefix_store_loads"] == 1
    tiers.close()
