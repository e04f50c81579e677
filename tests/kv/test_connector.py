"""The KV connector: its scheduler half (saves pin blocks, tier loads, hit accounting, the one SWA-replay
decision, carried on the plan), its worker half, the typed `CacheOp` and `KvTransferParams`, and the
null block in padded block tables."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer_core.kv.cache import NULL_BLOCK
from deepinfer_core.kv.connector import KvConnector, ReplayPolicy
from deepinfer_core.kv.host_cache import HostCache
from deepinfer_core.kv.tiers import PrefixTiers
from deepinfer_core.plan import CacheOp, ReplayRange
from deepinfer_core.sampling_params import KvTransferParams, SamplingParams
from deepinfer_core.sched.block_pool import BlockPool
from deepinfer_core.sched.scheduler import Scheduler, SchedulerConfig
from deepinfer_core.sched.sequence import Sequence, SequenceStatus
from deepinfer_core.worker.graphs import SlotBlockTables

BS = 4


def make_seq(tokens, request_id="r", **params) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(**params))


def compute_all(pool: BlockPool, connector: KvConnector, seq: Sequence) -> None:
    pool.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    connector.on_cached(seq, pool.cache_full_blocks(seq))


# -- the scheduler half ---------------------------------------------------------------------------


class _SlowCopy:
    """A device-to-host copy still running until `wait` (what a CUDA copy stream's event reports)."""

    def __init__(self, rows: int) -> None:
        self.tensor, self._done = torch.zeros(rows, 8, dtype=torch.uint8), False

    def is_done(self) -> bool:
        return self._done

    def wait(self):
        self._done = True
        return self.tensor


def test_a_block_is_evictable_only_once_its_save_finished():
    tiers = PrefixTiers(HostCache(1 << 12, 8, pin=False), None)
    pool = BlockPool(3, BS, enable_prefix_caching=True)
    connector = KvConnector(pool, tiers)
    seq = make_seq(range(9))  # two full blocks, saved when registered
    compute_all(pool, connector, seq)
    ops = connector.take_cache_ops()
    assert [(op.kind, op.block_ids) for op in ops] == [("save", tuple(seq.block_table[:2]))]
    tiers.accept_saved(ops, (_SlowCopy(2),))
    connector.on_free(seq)
    pool.free(seq)
    assert pool.num_free_blocks == 1 and tiers.num_pending_saves == 1  # the saving blocks are pinned
    other = make_seq(range(100, 112), "o")
    assert pool.can_allocate(other, 12)  # short of blocks: it waits for the copy, then may evict them
    assert tiers.num_pending_saves == 0 and len(tiers.host) == 2  # nothing lost: both blocks are in host memory
    assert pool.num_free_blocks == 3


def test_a_block_evicted_from_the_device_is_loaded_back_from_the_host_tier_and_counted():
    tiers = PrefixTiers(HostCache(1 << 12, 8, pin=False), None)
    pool = BlockPool(3, BS, enable_prefix_caching=True)
    connector = KvConnector(pool, tiers)
    a = make_seq(range(9), "a")
    compute_all(pool, connector, a)
    ops = connector.take_cache_ops()
    tiers.accept_saved(ops, (_Done(torch.arange(16, dtype=torch.uint8).view(2, 8)),))
    connector.on_free(a)
    pool.free(a)
    filler = make_seq(range(100, 112), "f")  # takes every block: a's evicted from the device
    pool.allocate(filler, 12)
    pool.free(filler)
    assert pool.num_cached_blocks == 0
    b = make_seq(range(9), "b")
    connector.admit(b, ReplayPolicy("bounded", BS))
    assert b.num_cached_tokens == 8 and len(b.block_table) == 2 and NULL_BLOCK not in b.block_table
    (load,) = connector.take_cache_ops()
    assert load.kind == "load" and load.block_ids == tuple(b.block_table)
    assert torch.equal(load.data, torch.arange(16, dtype=torch.uint8).view(2, 8))
    b.slot = 0
    connector.record_hit(b)
    assert connector.hit_tokens == {"device": 0, "host": 8, "store": 0, "remote": 0}


class _Done:
    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def is_done(self) -> bool:
        return True

    def wait(self):
        return self.tensor


@pytest.mark.parametrize(("mode", "layers", "window", "hit", "want"), [
    ("bounded", 3, 4, 12, ReplayRange(False, 8, 12)),
    ("exact", 2, 4, 12, ReplayRange(True, 4, 12)),
    ("exact", 40, 4, 12, ReplayRange(True, 0, 12)),
    ("bounded", 1, 16, 8, ReplayRange(False, 0, 8)),
])
def test_replay_policy_is_the_one_decision_of_the_replay_range(mode, layers, window, hit, want):
    assert ReplayPolicy(mode, window, layers).range_for(hit) == want


@pytest.mark.parametrize("mode", ["bounded", "exact"])
def test_the_plan_carries_the_replay_until_the_hit_is_recomputed(mode):
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=6, max_model_len=64, block_size=BS,
                             sliding_window=BS, enable_prefix_caching=True, swa_replay=mode, num_layers=2)
    scheduler = Scheduler(config, BlockPool(16, BS, enable_prefix_caching=True), num_slots=2)
    a = make_seq(range(13), "a")
    scheduler.add(a)
    while a.num_computed_tokens < 13:
        plan = scheduler.schedule()
        assert all(r.replay is None for r in plan.requests)  # a cold prompt replays nothing
        scheduler.postprocess(plan)
    scheduler.finish(a, SequenceStatus.FINISHED_STOPPED)  # its full blocks stay cached
    scheduler.add(make_seq(range(13), "b"))
    b = scheduler._seqs["b"]
    replays = []
    while b.num_computed_tokens < 13:
        plan = scheduler.schedule()
        (request,) = [r for r in plan.requests if r.request_id == "b"]
        replays.append((request.start, request.replay))
        scheduler.postprocess(plan)
    want = ReplayRange(mode == "exact", 8 if mode == "bounded" else 4, 12)
    assert replays[0] == (want.start, want)  # the first chunk starts at the replay's start
    assert all(replay == want for start, replay in replays if start < 12)
    assert all(replay is None for start, replay in replays if start >= 12)


def test_the_connector_needs_prefix_caching_for_tiers():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KvConnector(BlockPool(4, BS), PrefixTiers(HostCache(1 << 12, 8, pin=False), None))


def test_block_refs_are_the_pools_key_chain():
    pool = BlockPool(4, BS, enable_prefix_caching=True, cache_fingerprint=b"m")
    connector = KvConnector(pool)
    refs = connector.block_refs(list(range(9)))
    assert [ref.tokens for ref in refs] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert refs[0].parent == b"m" and refs[1].parent == refs[0].key


# -- typed plan and handle ------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "copy", "block_ids": (1,), "keys": (b"k",)}, "unknown cache op kind"),
    ({"kind": "save", "block_ids": (1, 2), "keys": (b"k",)}, "one key per block"),
    ({"kind": "save_state", "block_ids": (), "keys": (b"r",)}, "slot"),
    ({"kind": "load", "block_ids": (1,), "keys": (b"k",)}, "data"),
])
def test_a_malformed_cache_op_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheOp(**kwargs)


def test_kv_transfer_params_keep_their_wire_format():
    wire = {"prefill": "http://p:8000", "id": "abc", "first_token": 5}
    params = KvTransferParams.from_json(json.loads(json.dumps(wire)))
    assert (params.prefill, params.id, params.first_token, params.export, params.source) == \
        ("http://p:8000", "abc", 5, False, True)
    assert params.to_json() == wire and json.dumps(params.to_json()) == json.dumps(wire)  # same key order
    assert KvTransferParams.from_json({**wire, "first_token": None}).to_json() == {**wire, "first_token": None}
    assert KvTransferParams(export=True).to_json() == {"export": True}
    assert SamplingParams(kv_transfer_params=wire).kv_transfer_params == params  # parsed once


@pytest.mark.parametrize(("value", "message"), [
    ([1, 2], "JSON object"),
    ({"prefill": "http://p", "id": "x", "token": 1}, "unknown keys"),
    ({"prefill": "http://p"}, "both"),
    ({"prefill": "http://p", "id": 7}, "id must be a string"),
    ({"prefill": "http://p", "id": "x", "first_token": True}, "first_token must be a token id"),
    ({"prefill": "http://p", "id": "x", "first_token": -1}, "first_token must be a token id"),
    ({"export": "yes"}, "export must be true or false"),
])
def test_a_malformed_kv_transfer_params_is_a_clear_value_error(value, message):
    with pytest.raises(ValueError, match=message):
        KvTransferParams.from_json(value)
    with pytest.raises(ValueError, match=message):
        SamplingParams(kv_transfer_params=value)


# -- the null block -------------------------------------------------------------------------------


class _State:
    def __init__(self, slot: int, block_table: list[int]) -> None:
        self.slot, self.block_table = slot, block_table


def test_padded_block_table_rows_point_to_the_null_block():
    pool = BlockPool(6, BS)
    seq = make_seq(range(9))
    pool.allocate(seq, 9)
    tables = SlotBlockTables(num_slots=2, max_blocks=5, scratch_block=7, device=torch.device("cpu"))
    tables.sync([_State(0, seq.block_table)])
    row = tables.tables[0].tolist()
    assert row[:3] == seq.block_table and NULL_BLOCK not in seq.block_table
    assert row[3:] == [NULL_BLOCK] * 2  # padding reads a block no request owns
    assert tables.tables[1].tolist() == [NULL_BLOCK] * 5  # a slot with no request


@pytest.mark.parametrize(("args", "message"), [(("full", 4), "swa_replay"), (("exact", -1), "sliding_window"),
                                               (("bounded", 4, 0), "num_layers")])
def test_a_replay_policy_refuses_what_it_cannot_replay(args, message):
    with pytest.raises(ValueError, match=message):
        ReplayPolicy(*args)
