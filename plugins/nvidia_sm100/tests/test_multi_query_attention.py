"""Multi-query decode attention (a verification step: every request its last token and its drafts)
against the reference on caches poisoned wherever no query may read; on the CPU through Triton's
interpreter, compiled on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.backends import AttentionSpec
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.testing.cases import random_attention_case

SPECS = {
    "sliding": AttentionSpec(num_heads=16, head_dim=64, sliding_window=32, compress_rate=0),
    "hca": AttentionSpec(num_heads=20, head_dim=64, sliding_window=32, compress_rate=16),
    "csa": AttentionSpec(num_heads=16, head_dim=64, sliding_window=32, compress_rate=4, index_n_heads=8,
                         index_head_dim=32, index_topk=16),
}
STARTS = [3, 31, 40, 77, 600]  # the ring not yet full, just full, past it; HCA: entries, then two key blocks (splits)
MAX_MODEL_LEN = 1024


def graph_shaped(metadata):
    """The metadata as decode graphs give it: stale host starts, the static length bound, and block
    tables zero-padded to it."""
    tables = torch.zeros(metadata.num_seqs, MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.long)
    tables[:, : metadata.block_tables.shape[1]] = metadata.block_tables.clamp(min=0)
    return dataclasses.replace(metadata, block_tables=tables, max_seq_len=MAX_MODEL_LEN,
                               start_positions_host=[0] * metadata.num_seqs, needs_static_shapes=True)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("width", [2, 4])
def test_multi_query_steps_match_the_reference(kernel_device, monkeypatch, name, width):
    from deepinfer_nvidia_sm100 import multi_query_kernels
    from deepinfer_nvidia_sm100.attention import TritonAttention

    launches = []
    launch = multi_query_kernels.launch
    monkeypatch.setattr(multi_query_kernels, "launch", lambda *a, **k: launches.append(a[-2]) or launch(*a, **k))
    spec = SPECS[name]
    case = random_attention_case(spec, [width] * len(STARTS), STARTS, seed=width)
    if name == "hca":  # SWA replay: request 2 may not read window keys before position 30
        case.metadata = dataclasses.replace(case.metadata, window_start_positions_host=[0, 0, 30, 0, 0],
                                            window_starts=torch.tensor([0, 0, 30, 0, 0]))
    expected = ReferenceAttention(spec, torch.device("cpu")).forward(
        case.q, case.kv, case.window, case.compressed, case.sinks, case.metadata, case.topk_indices,
        case.num_entries)
    backend = TritonAttention(spec)
    for metadata in (case.metadata, graph_shaped(case.metadata)):
        moved = dataclasses.replace(case, metadata=metadata).to(kernel_device, torch.float32)
        out = backend.forward(moved.q, moved.kv, moved.window, moved.compressed, moved.sinks, moved.metadata,
                              moved.topk_indices, moved.num_entries)
        torch.testing.assert_close(out.cpu(), expected, atol=2e-4, rtol=2e-4)
    # window and HCA keys are shared by a request's queries; CSA's own top-k keep the per-token kernel
    assert launches == ([] if spec.is_sparse else [width, width])


def test_only_uniform_small_widths_take_the_multi_query_path():
    from deepinfer_nvidia_sm100.multi_query_kernels import MAX_WIDTH, uniform_width

    def width(query_lens):
        case = random_attention_case(SPECS["sliding"], query_lens, [40] * len(query_lens), poison=False)
        return uniform_width(case.metadata, sum(query_lens))

    assert width([4, 4, 4]) == 4 and width([MAX_WIDTH] * 2) == MAX_WIDTH
    assert width([1, 1]) == 0 and width([4, 3]) == 0 and width([MAX_WIDTH + 1] * 2) == 0
