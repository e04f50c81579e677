"""The Triton attention and indexer serve DeepSeek-V4.1's compressed layers (ratio 2 and ratio 1, sparse
picks; reuse layers hand the same pools and picks in), against the reference (conformance suite)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import AttentionSpec
from deepinfer_core.testing import conformance

SMALL = {
    "v41_ratio2": AttentionSpec(num_heads=4, head_dim=32, sliding_window=8, compress_rate=2, index_n_heads=2,
                                index_head_dim=16, index_topk=8),
    "v41_ratio1": AttentionSpec(num_heads=4, head_dim=32, sliding_window=8, compress_rate=1, index_n_heads=2,
                                index_head_dim=16, index_topk=8),
}
FLASH = {  # V4.1-Flash's real widths (index_topk cut to 64 to keep the test short)
    "v41_flash_ratio2": AttentionSpec(num_heads=64, head_dim=512, sliding_window=128, compress_rate=2,
                                      index_n_heads=32, index_head_dim=128, index_topk=64),
    "v41_flash_ratio1": AttentionSpec(num_heads=64, head_dim=512, sliding_window=128, compress_rate=1,
                                      index_n_heads=32, index_head_dim=128, index_topk=64),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_v41_rates_in_the_interpreter(kernel_device: torch.device, name: str) -> None:
    from deepinfer_nvidia_sm100.attention import TritonAttention

    conformance.check_attention(TritonAttention(SMALL[name]), kernel_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FLASH))
def test_v41_flash_shapes(cuda_device: torch.device, name: str, dtype: torch.dtype) -> None:
    from deepinfer_nvidia_sm100.attention import TritonAttention

    spec = AttentionSpec(**{**FLASH[name].__dict__, "dtype": dtype})
    conformance.check_attention(TritonAttention(spec), cuda_device)
