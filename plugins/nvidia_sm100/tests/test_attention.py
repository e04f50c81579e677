"""Triton attention and indexer against the reference (conformance suite); CUDA only."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import AttentionSpec
from deepinfer_core.testing import conformance

SPECS = {
    "sliding": AttentionSpec(num_heads=16, head_dim=64, sliding_window=32, compress_rate=0),
    "hca": AttentionSpec(num_heads=20, head_dim=64, sliding_window=32, compress_rate=128),
    "csa": AttentionSpec(
        num_heads=16,
        head_dim=64,
        sliding_window=32,
        compress_rate=4,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=16,
    ),
    "v4_flash_hca": AttentionSpec(num_heads=64, head_dim=512, sliding_window=128, compress_rate=128),
    "v4_flash_csa": AttentionSpec(
        num_heads=64,
        head_dim=512,
        sliding_window=128,
        compress_rate=4,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=64,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPECS))
def test_conformance(cuda_device: torch.device, name: str, dtype: torch.dtype) -> None:
    from deepinfer_nvidia_sm100.attention import TritonAttention

    spec = SPECS[name]
    spec = AttentionSpec(**{**spec.__dict__, "dtype": dtype})
    conformance.check_attention(TritonAttention(spec), cuda_device)
