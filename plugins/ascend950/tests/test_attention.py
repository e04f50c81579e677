"""AscendAttention over the sparse_flash_mla doubles: the conformance suite, and its pure helpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from deepinfer_ascend950.attention import AscendAttention, plan_window, prepare_compressed, prepare_window_kv
from deepinfer_ascend950.check import check_attention_on_op_path, without_block_zero
from deepinfer_ascend950.constraints import AscendConstraintError

from deepinfer_core.backends import AttentionSpec
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_attention_case

CPU = torch.device("cpu")
SPECS = {  # head_dim 512 and 128-token windows, as the op and V4 take; few heads to stay fast on a CPU
    "swa": AttentionSpec(num_heads=4, head_dim=512, sliding_window=128, compress_rate=0, dtype=torch.bfloat16),
    "hca": AttentionSpec(num_heads=4, head_dim=512, sliding_window=128, compress_rate=128, dtype=torch.bfloat16),
    "csa": AttentionSpec(num_heads=4, head_dim=512, sliding_window=128, compress_rate=4, index_n_heads=4,
                         index_head_dim=64, index_topk=16, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_conformance_over_the_op_doubles(doubles, name):
    """The suite as it stands: its random block tables often hold block 0, which takes the fallback."""
    backend = AscendAttention(SPECS[name], CPU, doubles.cann_ops_module())
    conformance.check_attention(backend, CPU)
    assert sum(backend.path_counts.values()) == len(conformance.attention_scenarios(SPECS[name]))
    if SPECS[name].compress_rate == 0:  # the window's blocks are the plugin's own: always the op
        assert backend.path_counts["fallback (block id 0)"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(SPECS))
def test_every_scenario_on_the_op_path(doubles, name, dtype):
    """The suite's scenarios with positive block ids only: every call goes through sparse_flash_mla."""
    backend = AscendAttention(dataclasses.replace(SPECS[name], dtype=dtype), CPU, doubles.cann_ops_module())
    check_attention_on_op_path(backend, CPU)
    assert backend.path_counts["fallback (block id 0)"] == 0


def test_block_zero_used_as_a_real_block_takes_the_fallback(doubles):
    spec = SPECS["hca"]
    backend = AscendAttention(spec, CPU, doubles.cann_ops_module())
    case = random_attention_case(spec, [1, 1], [300, 200], seed=2)
    case.metadata.block_tables[0, 0] = 0
    c = case.to(CPU, torch.bfloat16)
    backend.forward(c.q, c.kv, c.window, c.compressed, c.sinks, c.metadata, None, c.num_entries)
    assert backend.path_counts == {"sparse_flash_mla": 0, "fallback (block id 0)": 1}


@pytest.mark.parametrize("name", ["hca", "csa"])
def test_static_shapes_take_the_op_with_null_block_padding(doubles, name):
    """Under decode graphs the runner pads each table with the engine's null block (0) past a request's
    blocks: the op gets them as a positive id, never reads them, and the step matches the reference."""
    spec = SPECS[name]
    backend = AscendAttention(spec, CPU, doubles.cann_ops_module())
    assert backend.supports_cuda_graphs
    case = without_block_zero(random_attention_case(spec, [1, 1], [300, 200], seed=2), spec)
    tables = case.metadata.block_tables
    padded = torch.cat((tables, torch.zeros(tables.shape[0], 3, dtype=tables.dtype)), dim=1)
    padded[padded < 0] = 0  # the runner's graph tables hold zeros, not -1, past a request's blocks
    case.metadata.block_tables = padded
    case.metadata.needs_static_shapes = True
    ref_case = case.to(CPU, torch.float32)
    reference = ReferenceAttention(dataclasses.replace(spec, dtype=torch.float32), CPU)
    topk = None
    if spec.is_sparse:
        topk = reference.indexer_topk(ref_case.index_q, ref_case.index_weights, ref_case.index_keys,
                                      ref_case.metadata, ref_case.num_entries)
    expected = reference.forward(ref_case.q.bfloat16().float(), ref_case.kv.bfloat16().float(),
                                 ref_case.window.bfloat16().float(), ref_case.compressed.bfloat16().float(),
                                 ref_case.sinks, ref_case.metadata, topk, ref_case.num_entries)
    c = case.to(CPU, torch.bfloat16)
    got = backend.forward(c.q, c.kv, c.window, c.compressed, c.sinks, c.metadata, topk, c.num_entries)
    assert backend.path_counts == {"sparse_flash_mla": 1, "fallback (block id 0)": 0}
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_float16_and_a_short_window(doubles):
    spec = AttentionSpec(num_heads=2, head_dim=512, sliding_window=16, compress_rate=4, index_n_heads=2,
                         index_head_dim=32, index_topk=8, dtype=torch.float16)
    check_attention_on_op_path(AscendAttention(spec, CPU, doubles.cann_ops_module()), CPU, seed=1)


def test_window_replay_starts_hide_older_keys(doubles):
    spec = SPECS["hca"]
    backend = AscendAttention(spec, CPU, doubles.cann_ops_module())
    case = without_block_zero(random_attention_case(spec, [5, 1], [300, 200], seed=3), spec)
    case.metadata.window_start_positions_host = [250, 150]
    case.metadata.window_starts = torch.tensor([250, 150])
    ref_case = case.to(CPU, torch.float32)
    expected = ReferenceAttention(dataclasses.replace(spec, dtype=torch.float32), CPU).forward(
        ref_case.q.bfloat16().float(), ref_case.kv.bfloat16().float(), ref_case.window.bfloat16().float(),
        ref_case.compressed.bfloat16().float(), ref_case.sinks, ref_case.metadata, None, ref_case.num_entries)
    c = case.to(CPU, torch.bfloat16)
    got = backend.forward(c.q, c.kv, c.window, c.compressed, c.sinks, c.metadata, None, c.num_entries)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_window_layout_is_bottom_right_aligned_with_positive_blocks():
    spec = SPECS["swa"]
    case = random_attention_case(spec, [1, 3, 200], [0, 50, 400], seed=1)
    layout = plan_window(case.metadata, spec.sliding_window)
    assert layout.old_keys.tolist() == [0, 50, 127]  # none before 0; all 50; window - 1
    assert layout.seqused.tolist() == [1, 53, 327]
    assert layout.first_block == [1, 2, 4] and layout.num_blocks == 7  # block 0 left unused
    assert int(layout.block_table.min()) >= 1 and layout.block_table.dtype == torch.int32
    gathered = prepare_window_kv(case.kv, case.window, case.metadata, layout).view(-1, 512)
    # request 1: ring keys of positions 0..49, then its 3 new keys
    slot = int(case.metadata.slots[1])
    torch.testing.assert_close(gathered[2 * 128: 2 * 128 + 50], case.window[slot, :50])
    torch.testing.assert_close(gathered[2 * 128 + 50: 2 * 128 + 53], case.kv[1:4])
    # request 2 starts at 400: its first old key is position 273 (ring row 273 % 128)
    torch.testing.assert_close(gathered[4 * 128], case.window[int(case.metadata.slots[2]), 273 % 128])


def test_compressed_view_is_zero_copy_with_positive_padding():
    pool = torch.arange((5 * 4 + 1) * 2, dtype=torch.float32).view(21, 2)  # 5 blocks of 4, a scratch row
    view, table = prepare_compressed(pool, torch.tensor([[3, 2, -1], [4, -1, -1]]), 4)
    assert table.tolist() == [[3, 2, 1], [4, 1, 1]] and table.dtype == torch.int32
    assert view.shape == (5, 4, 1, 2) and view.data_ptr() == pool.data_ptr()
    torch.testing.assert_close(view[3, 2, 0], pool[14])


def test_unsupported_specs_name_the_op_and_argument(doubles):
    with pytest.raises(AscendConstraintError, match="sparse_flash_mla: head_dim is 64; only 512"):
        AscendAttention(AttentionSpec(num_heads=4, head_dim=64, sliding_window=128, compress_rate=0,
                                      dtype=torch.bfloat16), CPU, doubles.cann_ops_module())
    with pytest.raises(AscendConstraintError, match="dtype is torch.float32; only bfloat16 and float16"):
        AscendAttention(dataclasses.replace(SPECS["swa"], dtype=torch.float32), CPU, doubles.cann_ops_module())
    with pytest.raises(AscendConstraintError, match="num_heads_q is 256"):
        AscendAttention(dataclasses.replace(SPECS["swa"], num_heads=256), CPU, doubles.cann_ops_module())


def test_the_doubles_reject_block_id_zero(doubles):
    """The double enforces the doc's positive block ids: passing the engine's block 0 would fail here."""
    with pytest.raises(doubles.DocumentedConstraintError, match="positive integers"):
        doubles._check_table(torch.tensor([[0, 2]], dtype=torch.int32), "cmp_block_table", 1)
