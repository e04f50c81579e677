"""Whole blocks as bytes: the layout, and copies between the device cache and host memory."""

from __future__ import annotations

import pickle

import pytest
import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.kv.blocks import (
    LOAD,
    LOAD_STATE,
    SAVE,
    SAVE_STATE,
    BlockIO,
    block_layout,
    describe_layout,
    layout_bytes,
)
from deepinfer_core.kv.cache import KVCache, bytes_per_block
from deepinfer_core.models.layer_plan import build_layer_plan
from deepinfer_core.plan import CacheOp
from tests.oracle import parity_config

CONFIG = ModelConfig.from_dict(parity_config("hca128"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layout_is_the_compressed_state_of_a_block(dtype):
    plans = build_layer_plan(CONFIG, dtype)
    layout = block_layout(plans, dtype)
    assert layout_bytes(layout) == bytes_per_block(plans, dtype)  # windows and tails are not in a block
    assert {s.name for s in layout} == {"compressed", "index_keys"}
    assert str(dtype).removeprefix("torch.") in describe_layout(layout)


def test_saved_blocks_load_into_other_blocks_unchanged():
    plans = build_layer_plan(CONFIG, torch.bfloat16)
    cache = KVCache(plans, num_blocks=6, num_slots=2, dtype=torch.bfloat16, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        for pool in (layer.compressed, layer.index_keys):
            if pool is not None:
                pool.copy_(torch.randn(pool.shape, generator=generator).to(pool.dtype))
    io = BlockIO(block_layout(plans, torch.bfloat16), cache.layers)
    (pending,) = io.apply((CacheOp(SAVE, (1, 4), (b"a", b"b")),))
    assert pending.is_done()  # on the CPU the copy is done at once (the same path as the device's)
    saved = pending.wait()
    assert saved.shape == (2, io.block_bytes) and saved.dtype == torch.uint8
    io.apply((CacheOp(LOAD, (0, 5), (b"a", b"b"), saved),))
    for layer_plan, layer in zip(plans, cache.layers):
        if not layer_plan.owns_compressed:
            continue
        rows = layer_plan.attention.entries_per_block
        for pool in (layer.compressed, layer.index_keys):
            if pool is not None:
                assert torch.equal(pool[0:rows], pool[rows : 2 * rows])
                assert torch.equal(pool[5 * rows : 6 * rows], pool[4 * rows : 5 * rows])
    with pytest.raises(ValueError, match="uint8 data of shape"):
        io.scatter((0,), saved)


def test_a_request_state_moves_into_another_slot_and_block_unchanged():
    plans = build_layer_plan(CONFIG, torch.bfloat16)
    cache = KVCache(plans, num_blocks=4, num_slots=2, dtype=torch.bfloat16, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    rings = [getattr(layer, name) for layer in cache.layers
             for name in ("window", "kv_tail", "gate_tail", "index_kv_tail", "index_gate_tail")
             if getattr(layer, name) is not None]
    for tensor in rings + [p for layer in cache.layers for p in (layer.compressed, layer.index_keys) if p is not None]:
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    io = BlockIO(block_layout(plans, torch.bfloat16), cache.layers)
    (pending,) = io.apply((CacheOp(SAVE_STATE, (2,), (b"r",), slot=0),))
    state = pickle.loads(pickle.dumps(pending)).tensor  # what a worker process sends
    assert state.shape == (io.slot_bytes + io.block_bytes,)
    saved_block = io.gather((2,)).wait()
    io.apply((CacheOp(LOAD_STATE, (3,), (b"r",), state, slot=1),))
    for ring in rings:
        assert torch.equal(ring[1], ring[0])
    assert torch.equal(io.gather((3,)).wait(), saved_block)
    with pytest.raises(ValueError, match="request state"):
        io.scatter_state(1, (), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream exists on CUDA only (the H200 runs it)")
def test_on_cuda_a_save_copies_asynchronously_and_keeps_the_bytes_of_its_step():
    plans = build_layer_plan(CONFIG, torch.bfloat16)
    cache = KVCache(plans, num_blocks=8, num_slots=2, dtype=torch.bfloat16, device=torch.device("cuda"))
    pools = [p for layer in cache.layers for p in (layer.compressed, layer.index_keys) if p is not None]
    for pool in pools:
        pool.normal_()
    io = BlockIO(block_layout(plans, torch.bfloat16), cache.layers)
    want = io.gather((1, 4)).wait().clone()
    (pending,) = io.apply((CacheOp(SAVE, (1, 4), (b"a", b"b")),))
    for pool in pools:  # the next step's forward overwrites the blocks: after the gather in stream order
        pool.fill_(7)
    saved = pending.wait()
    assert saved.is_pinned() and torch.equal(saved, want)
    (state,) = io.apply((CacheOp(SAVE_STATE, (2,), (b"r",), slot=0),))
    assert state.wait().shape == (io.slot_bytes + io.block_bytes,) and state.is_done()
