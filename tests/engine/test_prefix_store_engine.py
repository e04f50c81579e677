"""The engine over the prefix tiers: host hits, store hits across a restart, damaged files, loading."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import zlib

import pytest
import torch

from deepinfer_core import SamplingParams, hookimpl
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.kv.prefix_store import MAGIC, PrefixStore, encode_block
from deepinfer_core.kv.store_backends import PosixBackend
from deepinfer_core.kv.store_key import KEY_FILE, key_file
from deepinfer_core.testing.checkpoints import write_checkpoint
from deepinfer_core.testing.serving import serve
from tests.oracle import parity_config, random_state_dict

CONFIG = parity_config("hca128")  # 3 layers, window 16: exact replay recomputes 48 tokens per hit
NUM_SESSIONS = 5
OPTIONS = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 128, "num_kv_blocks": 24,
           "device": "cpu"}


def sessions() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(2, CONFIG["vocab_size"], (260,), generator=generator).tolist() for _ in range(NUM_SESSIONS)]


def run(engine: Engine, prompts: list[list[int]], max_tokens: int = 4, **params) -> list:
    return serve(engine, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                                                 **params))


def engine_of(model_dir, **options) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **{**OPTIONS, **options}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("model"), CONFIG, random_state_dict(CONFIG, seed=11))


@pytest.fixture(scope="module")
def cold(model_dir):
    """Turn 1 and turn 2 of every session without any cache; turn 2 resends turn 1 + answer + 10 tokens."""
    engine = engine_of(model_dir)
    first = sessions()
    answers = [o.outputs[0].token_ids for o in run(engine, first)]
    second = [p + a + list(range(20, 30)) for p, a in zip(first, answers)]
    return second, run(engine, second)


_WRITER = textwrap.dedent("""
    import json, sys
    from deepinfer_core import SamplingParams
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine

    model_dir, store, options, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    engine = Engine(EngineConfig(model=model_dir, enable_prefix_caching=True, prefix_store_path=store, **options))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    print(json.dumps(engine.stats()))
""")


@pytest.fixture(scope="module")
def written_store(model_dir, tmp_path_factory):
    """A store written by another process that served every session's first turn, then exited."""
    store = tmp_path_factory.mktemp("store") / "kv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _WRITER, str(model_dir), str(store), json.dumps(OPTIONS),
                           json.dumps(sessions())], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["prefix_store_blocks_written"] == 2 * NUM_SESSIONS  # two full blocks per 264-token turn
    return store


def same_tokens(outputs, cold_outputs) -> bool:
    return [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in cold_outputs]


def test_a_new_process_hits_the_store_and_answers_as_a_cold_run(model_dir, cold, written_store, tmp_path):
    store = tmp_path / "kv"
    shutil.copytree(written_store, store)
    prompts, cold_outputs = cold
    engine = engine_of(model_dir, enable_prefix_caching=True, prefix_store_path=str(store))
    warm = run(engine, prompts)
    assert [o.num_cached_tokens for o in warm] == [256] * NUM_SESSIONS
    assert same_tokens(warm, cold_outputs)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens_store"] == 256 * NUM_SESSIONS
    assert stats["prefix_cache_hit_tokens_device"] == stats["prefix_cache_hit_tokens_host"] == 0
    assert stats["prefix_store_hits"] == 2 * NUM_SESSIONS and stats["prefix_store_corrupt_blocks"] == 0
    assert stats["prefix_cache_replay_tokens"] == 3 * 16 * NUM_SESSIONS  # exact: layers x window per hit
    engine.shutdown()


def test_damaged_or_foreign_files_are_never_served(model_dir, cold, written_store, tmp_path):
    store = tmp_path / "kv"
    shutil.copytree(written_store, store)
    prompts, cold_outputs = cold
    files = block_files(store)
    damaged = [files[tuple(prompt[index * 128 : (index + 1) * 128])] for prompt, index in zip(sessions(), (0, 1, 0, 0))]
    truncated, flipped, deleted, foreign = damaged
    truncated.write_bytes(truncated.read_bytes()[:100])
    raw = bytearray(flipped.read_bytes())
    raw[-7] ^= 0x10
    flipped.write_bytes(bytes(raw))
    deleted.unlink()
    forge_foreign(foreign, store)
    engine = engine_of(model_dir, enable_prefix_caching=True, prefix_store_path=str(store))
    warm = run(engine, prompts)
    assert [o.num_cached_tokens for o in warm] == [0, 128, 0, 0, 256]  # session 1 keeps its first block
    assert same_tokens(warm, cold_outputs)
    stats = engine.stats()
    assert (stats["prefix_store_corrupt_truncated"], stats["prefix_store_corrupt_checksum"],
            stats["prefix_store_corrupt_fingerprint"]) == (1, 1, 1)
    engine.prefix_tiers.flush()
    for path in (truncated, flipped, deleted, foreign):  # deleted, recomputed and written again, whole
        assert is_valid(store, path, files[tuple(sessions()[4][:128])])
    engine.shutdown()


def block_files(store) -> dict[tuple[int, ...], object]:
    """Each store file by the token ids its header names (every session's blocks differ)."""
    return {tuple(header_of(path)["tokens"]): path for path in store.rglob("*.blk")}


def header_of(path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[16 : 16 + int.from_bytes(raw[8:12], "little")])


def is_valid(store, path, intact) -> bool:
    """Whether `path` reads back as a block of the model that wrote `intact`."""
    reference = header_of(intact)
    reader = PrefixStore(PosixBackend(store), bytes.fromhex(reference["fingerprint"]), reference["layout"])
    header = header_of(path)
    return reader.get(bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]), header["tokens"]) is not None


def forge_foreign(path, store) -> None:
    """Rewrite `path` as a valid block file of another model of the deployment (same key, parent, tokens
    and layout, and the store's key)."""
    raw, header = path.read_bytes(), header_of(path)
    payload = raw[len(raw) - header["payload_bytes"] :]
    path.write_bytes(encode_block(bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]), header["tokens"],
                                  b"another model".ljust(32), header["layout"], payload, header["traffic_class"],
                                  auth_key=key_file(store / KEY_FILE)))


def test_crafted_store_files_never_stop_the_engine_and_are_removed(model_dir, written_store, tmp_path):
    """The files of issue 43: a valid header CRC around `payload_bytes: 1e400`, a 100k-deep header, a 64 GiB
    sparse file and a forged block with recomputed CRCs, each in place of a session's first block."""
    store = tmp_path / "kv"
    shutil.copytree(written_store, store)
    files = block_files(store)
    first = [files[tuple(prompt[:128])] for prompt in sessions()]
    header = header_of(first[0])
    crafted = json.dumps(header).replace(f'"payload_bytes": {header["payload_bytes"]}', '"payload_bytes": 1e400')
    first[0].write_bytes(with_crc(crafted.encode()) + b"\0" * header["payload_bytes"])
    first[1].write_bytes(with_crc(b"[" * 100_000 + b"]" * 100_000))
    with first[2].open("r+b") as f:
        f.truncate(64 << 30)
    raw, header = first[3].read_bytes(), header_of(first[3])
    forged = bytes(b ^ 0x5A for b in raw[len(raw) - header["payload_bytes"] :])
    header["payload_crc32"] = zlib.crc32(forged)
    first[3].write_bytes(with_crc(json.dumps(header).encode()) + forged)
    cold_run = run(engine_of(model_dir), sessions())
    engine = engine_of(model_dir, enable_prefix_caching=True, prefix_store_path=str(store))
    warm = run(engine, sessions())
    assert [o.num_cached_tokens for o in warm] == [0, 0, 0, 0, 256]
    assert same_tokens(warm, cold_run)
    stats = engine.stats()
    assert (stats["prefix_store_corrupt_format"], stats["prefix_store_corrupt_oversized"],
            stats["prefix_store_corrupt_unauthenticated"]) == (2, 1, 1)
    engine.prefix_tiers.flush()
    for path in first[:4]:  # removed, recomputed and written again, whole
        assert is_valid(store, path, first[4])
    engine.shutdown()


def test_another_checkpoint_with_identical_headers_gets_no_hits(model_dir, written_store, tmp_path):
    """Checkpoint B holds A's weights x 1.05 under identical file names, sizes and safetensors headers, and
    is pointed at the store A wrote: it must hit nothing there, and answer as its own cold run."""
    weights = random_state_dict(CONFIG, seed=11)
    b_dir = write_checkpoint(tmp_path / "b", CONFIG, {n: t * 1.05 if t.is_floating_point() else t
                                                      for n, t in weights.items()})
    a_files, b_files = sorted(model_dir.glob("*.safetensors")), sorted(b_dir.glob("*.safetensors"))
    assert [(p.name, p.stat().st_size, safetensors_header(p)) for p in a_files] == \
        [(p.name, p.stat().st_size, safetensors_header(p)) for p in b_files]
    store = tmp_path / "kv"
    shutil.copytree(written_store, store)
    b_cold = run(engine_of(b_dir), sessions())
    engine = engine_of(b_dir, enable_prefix_caching=True, prefix_store_path=str(store))
    warm = run(engine, sessions())
    stats = engine.stats()
    assert stats["prefix_store_hits"] == 0 and stats["prefix_cache_hit_tokens_store"] == 0
    assert [o.num_cached_tokens for o in warm] == [0] * NUM_SESSIONS
    assert same_tokens(warm, b_cold)
    engine.shutdown()


def with_crc(header: bytes) -> bytes:
    """A block file's prefix for `header`, its CRC-32 valid (as a crafted file would carry it)."""
    return struct.pack("<8sII", MAGIC, len(header), zlib.crc32(header)) + header


def safetensors_header(path) -> bytes:
    raw = path.read_bytes()
    return raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]]


def test_blocks_evicted_from_the_device_come_back_from_host_memory(model_dir, cold):
    prompts, cold_outputs = cold
    engine = engine_of(model_dir, enable_prefix_caching=True, host_cache_gib=0.01, num_kv_blocks=7)
    run(engine, sessions())  # five sessions of three blocks through seven: the early ones leave the device
    warm = run(engine, prompts)
    assert same_tokens(warm, cold_outputs)
    assert all(o.num_cached_tokens == 256 for o in warm)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens_host"] >= 256 and stats["prefix_loaded_blocks_host"] >= 2
    assert stats["prefix_cache_hit_tokens"] == sum(stats[f"prefix_cache_hit_tokens_{t}"] for t in ("device", "host", "store"))
    assert stats["host_cache_blocks"] == 2 * NUM_SESSIONS
    assert engine.block_manager.num_free_blocks == 7  # loads leave every reference count as it was


def test_overlapped_decode_saves_and_loads_blocks_between_steps(model_dir, cold):
    prompts, cold_outputs = cold
    engine = engine_of(model_dir, enable_prefix_caching=True, host_cache_gib=0.01, num_kv_blocks=7,
                       async_scheduling=True)
    run(engine, sessions())
    warm = run(engine, prompts)
    assert same_tokens(warm, cold_outputs)
    assert engine.stats()["prefix_cache_hit_tokens_host"] >= 256
    assert not engine.prefix_tiers.has_cache_ops  # every save ran once the engine went idle


class GatedPosix(PosixBackend):
    """POSIX files whose reads wait for `gate` (a slow store)."""

    gate = threading.Event()

    def get(self, name, max_bytes):
        self.gate.wait(30)
        return super().get(name, max_bytes)


class SlowStore:
    @hookimpl
    def register_prefix_stores(self, register):
        register("slow", lambda location: GatedPosix(location.removeprefix("slow://")))


def test_a_request_waits_loading_while_others_run(model_dir, cold, written_store, tmp_path, isolated_plugin_manager):
    isolated_plugin_manager.register(SlowStore(), name="slow-store")
    store = tmp_path / "kv"
    shutil.copytree(written_store, store)
    prompts, cold_outputs = cold
    GatedPosix.gate.clear()
    engine = engine_of(model_dir, enable_prefix_caching=True, prefix_store_path=f"slow://{store}")
    engine.add_request("loading", prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("other", list(range(2, 40)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(6):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "other" in finished and "loading" not in finished
    assert engine.stats()["num_loading"] == 1 and engine.scheduler.waiting[0].is_loading
    GatedPosix.gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["loading"].num_cached_tokens == 256
    assert finished["loading"].outputs[0].token_ids == cold_outputs[0].outputs[0].token_ids
    stats = engine.stats()
    assert stats["num_loading"] == 0 and stats["prefix_store_loads"] == 1
    assert stats["prefix_store_load_seconds_total"] > 0
    engine.shutdown()


def test_traffic_class_names_the_directory_and_unknown_classes_are_refused(model_dir, tmp_path):
    store = tmp_path / "kv"
    engine = engine_of(model_dir, enable_prefix_caching=True, prefix_store_path=str(store), num_kv_blocks=8)
    run(engine, sessions()[:1], max_tokens=1, traffic_class="agent")
    engine.prefix_tiers.flush()
    assert len(list((store / "agent").rglob("*.blk"))) == 2 and not (store / "chat").exists()
    with pytest.raises(ValueError, match="traffic_class 'batch' is not configured"):
        engine.add_request("x", [5, 6], SamplingParams(traffic_class="batch"))
    engine.shutdown()


def test_tiers_need_prefix_caching(model_dir):
    with pytest.raises(ValueError, match="set enable_prefix_caching=True"):
        EngineConfig(model=str(model_dir), host_cache_gib=1)
