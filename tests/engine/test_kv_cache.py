"""The cache allocates what each layer plan declares; a layer with a `kv_source` shares that layer's pools."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.kv.cache import KVCache, bytes_per_block, bytes_per_slot
from deepinfer_core.models.layer_plan import build_layer_plan
from tests.oracle import parity_config

CONFIG = ModelConfig.from_dict(parity_config("hca128", num_hidden_layers=4,
                                             layer_types=["compressed_sparse_attention"] * 4,
                                             mlp_layer_types=["moe"] * 4))


def test_a_reading_layer_shares_its_source_pools_and_costs_only_its_window():
    own = build_layer_plan(CONFIG, torch.float32)
    shared = [own[0], replace(own[1], kv_source=0), own[2], replace(own[3], kv_source=2)]
    cache = KVCache(shared, num_blocks=3, num_slots=2, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.layers[1].compressed is cache.layers[0].compressed
    assert cache.layers[1].index_keys is cache.layers[0].index_keys
    assert cache.layers[1].kv_tail is None and cache.layers[1].index_kv_tail is None  # no compressor of its own
    assert cache.layers[1].window is not cache.layers[0].window  # every layer keeps its own window
    assert cache.layers[3].compressed is cache.layers[2].compressed
    assert bytes_per_block(shared, torch.float32) * 2 == bytes_per_block(own, torch.float32)
    window = own[1].attention.sliding_window * own[1].attention.head_dim * 4
    assert bytes_per_slot(own, torch.float32) - bytes_per_slot(shared, torch.float32) == \
        2 * (bytes_per_slot(own[1:2], torch.float32) - window)


def test_a_layer_must_read_an_earlier_owning_layer():
    own = build_layer_plan(CONFIG, torch.float32)
    for bad in ([replace(own[0], kv_source=1), *own[1:]], [own[0], replace(own[1], kv_source=0),
                                                            replace(own[2], kv_source=1), own[3]]):
        with pytest.raises(ValueError, match="earlier layer that owns"):
            KVCache(bad, num_blocks=2, num_slots=1, dtype=torch.float32, device=torch.device("cpu"))


def test_same_shaped_tensors_of_layers_are_views_of_one_allocation():
    plans = build_layer_plan(CONFIG, torch.float32)
    cache = KVCache(plans, num_blocks=3, num_slots=2, dtype=torch.float32, device=torch.device("cpu"))
    windows = [layer.window for layer in cache.layers]
    [window_stack] = [s for s in cache.stacks if s.name == "window"]
    stack = window_stack.tensor
    assert stack.shape == (len(plans), *windows[0].shape) and window_stack.layers == [[i] for i in range(len(plans))]
    assert all(w.is_contiguous() and w.data_ptr() == stack[i].data_ptr() for i, w in enumerate(windows))
    windows[1].fill_(1.0)  # each layer's rows are its own
    assert [bool(w.eq(1).all()) for w in windows] == [False, True, False, False]
    assert bool(stack[1].eq(1).all()) and not bool(stack[0].any())
