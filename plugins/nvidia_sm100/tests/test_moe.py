"""Triton MoE against the reference (conformance suite) and at DeepSeek-V4-Flash shapes; CUDA only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.backends import MoESpec, MoEWeights
from deepinfer_core.reference.moe import ReferenceMoE
from deepinfer_core.testing import conformance

SMALL = MoESpec(
    hidden_size=256,
    intermediate_size=128,
    num_experts=16,
    top_k=4,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    swiglu_limit=7.0,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("is_hash", [False, True])
def test_conformance(cuda_device: torch.device, dtype: torch.dtype, scoring_func: str, is_hash: bool) -> None:
    from deepinfer_nvidia_sm100.moe import TritonMoE

    spec = dataclasses.replace(SMALL, scoring_func=scoring_func, is_hash=is_hash, dtype=dtype)
    conformance.check_moe(TritonMoE(spec), cuda_device, num_tokens_list=(1, 7, 33, 300))


@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_v4_flash_shapes_match_reference_on_gpu(cuda_device: torch.device, num_tokens: int) -> None:
    """Real sizes exercise every tile config; the reference runs the same bf16 weights on the GPU."""
    from deepinfer_nvidia_sm100.moe import TritonMoE

    spec = MoESpec(
        hidden_size=4096,
        intermediate_size=2048,
        num_experts=64,
        top_k=6,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        dtype=torch.bfloat16,
    )
    gen = torch.Generator(device=cuda_device).manual_seed(num_tokens)
    opts = {"device": cuda_device, "generator": gen}
    weights = MoEWeights(
        router=torch.randn(64, 4096, **opts).bfloat16() * 0.02,
        gate_up=torch.randn(64, 4096, 4096, **opts).bfloat16() * 0.02,
        down=torch.randn(64, 4096, 2048, **opts).bfloat16() * 0.02,
        score_bias=torch.randn(64, **opts) * 0.01,
    )
    x = torch.randn(num_tokens, 4096, **opts).bfloat16()
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=cuda_device)
    out = TritonMoE(spec).forward(x, input_ids, weights)
    float_weights = dataclasses.replace(
        weights, router=weights.router.float(), gate_up=weights.gate_up.float(), down=weights.down.float()
    )
    expected = ReferenceMoE(dataclasses.replace(spec, dtype=torch.float32), cuda_device).forward(
        x.float(), input_ids, float_weights
    )
    error = float((out.float() - expected).norm() / expected.norm())
    assert error < 1e-2, error


@pytest.mark.parametrize("element_size", [2, 4])
def test_gemm_tiles_fit_hopper_shared_memory(element_size: int) -> None:
    """Triton keeps `num_stages - 1` copies of the gate_up kernel's tiles (x, gate and up; down: act and
    the weight) in shared memory; an fp32 run of bf16 prefill tiles asked for 294,912 bytes on the H200
    (227 KiB a block)."""
    pytest.importorskip("triton")
    from deepinfer_nvidia_sm100.moe import pick_config, pick_down_config

    for num_rows in (1, 64 * 6, 512 * 6, 2048 * 6, 8192 * 6, 65536 * 6):
        c = pick_config(num_rows, 256, element_size)
        gate_up_bytes = (c.num_stages - 1) * (c.block_m + 2 * c.block_n) * c.block_k * element_size
        assert gate_up_bytes <= 227 * 1024, (num_rows, c)
        d = pick_down_config(c, element_size)
        assert d.block_m == c.block_m
        assert (d.num_stages - 1) * (d.block_m + d.block_n) * d.block_k * element_size <= 227 * 1024, (num_rows, d)
    assert pick_config(8192 * 6, 256, 4) != pick_config(8192 * 6, 256, 2)


def test_down_tiles_must_share_the_row_blocks() -> None:
    pytest.importorskip("triton")
    from deepinfer_nvidia_sm100.moe import GemmConfig, TritonMoE

    x = torch.zeros(4, SMALL.hidden_size)
    ids = torch.zeros(4, SMALL.top_k, dtype=torch.int32)
    weights = MoEWeights(router=torch.zeros(16, 256), gate_up=torch.zeros(16, 256, 256),
                         down=torch.zeros(16, 256, 128))
    with pytest.raises(ValueError, match="block_m 16 and 32 differ"):
        TritonMoE(SMALL).experts(x, ids, torch.ones(4, SMALL.top_k), weights, GemmConfig(16, 32, 32, 4, 2),
                                 GemmConfig(32, 32, 32, 4, 2))


def test_launch_orders_agree(kernel_device: torch.device) -> None:
    """Both launch orders run the same tiles: identical results, compiled or in the interpreter (fp32:
    the interpreter's bf16 `tl.dot` returns garbage)."""
    from deepinfer_nvidia_sm100.moe import GemmConfig, TritonMoE

    spec = dataclasses.replace(SMALL, hidden_size=64, intermediate_size=64, num_experts=4, top_k=2,
                               dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    weights = MoEWeights(
        router=torch.randn(4, 64, generator=gen).to(kernel_device),
        gate_up=(torch.randn(4, 128, 64, generator=gen) * 0.1).to(kernel_device),
        down=(torch.randn(4, 64, 64, generator=gen) * 0.1).to(kernel_device),
    )
    x = torch.randn(37, 64, generator=gen).to(kernel_device)
    ids = torch.randint(0, 4, (37, 2), generator=gen).to(torch.int32).to(kernel_device)
    topk_weights = torch.rand(37, 2, generator=gen).to(kernel_device)
    moe = TritonMoE(spec)
    outs = [moe.experts(x, ids, topk_weights, weights, GemmConfig(16, 32, 32, 4, 2, n_fastest=order))
            for order in (False, True)]
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])
    expected = ReferenceMoE(spec, kernel_device)._gathered(x, ids.long(), topk_weights, weights)
    torch.testing.assert_close(outs[1], expected, rtol=1e-4, atol=1e-5)


def test_grid_keeps_row_blocks_within_cuda_limits() -> None:
    pytest.importorskip("triton")
    from deepinfer_nvidia_sm100.moe import MAX_GRID_Y, GemmConfig

    config = GemmConfig(128, 128, 64, 8, 3, n_fastest=True)
    assert config.grid(1000, 4096) == ((32, 1000), True)
    assert config.grid(MAX_GRID_Y + 1, 4096) == ((MAX_GRID_Y + 1, 32), False)
    assert GemmConfig(16, 64, 128, 4, 3).grid(1000, 4096) == ((1000, 64), False)
