"""FP4 routed experts in the Triton MoE: packed e2m1 weights decoded in the grouped GEMMs' inner loops.

Runs on a suitable GPU, else on the CPU through Triton's interpreter (see conftest.py), against the
reference backend, which dequantises the same packed weights per call.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.backends import MoESpec, quant
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_moe_case

FP4_SPEC = MoESpec(
    hidden_size=64,
    intermediate_size=64,
    num_experts=8,
    top_k=2,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    swiglu_limit=7.0,
    expert_format="fp4",
)


@pytest.mark.parametrize("is_hash", [False, True])
def test_fp4_conformance(kernel_device: torch.device, is_hash: bool) -> None:
    from deepinfer_nvidia_sm100.moe import TritonMoE

    spec = dataclasses.replace(FP4_SPEC, is_hash=is_hash)
    conformance.check_moe(TritonMoE(spec), kernel_device, num_tokens_list=(1, 5))


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_fp4_bf16_conformance_on_gpu(cuda_device: torch.device, num_tokens: int) -> None:
    """bf16 activations (Triton's interpreter multiplies bf16 tiles wrongly, dense ones too: GPU only);
    300 tokens take the prefill tiles."""
    from deepinfer_nvidia_sm100.moe import TritonMoE

    spec = dataclasses.replace(FP4_SPEC, hidden_size=256, intermediate_size=128, num_experts=16, top_k=4,
                               dtype=torch.bfloat16)
    conformance.check_moe(TritonMoE(spec), cuda_device, num_tokens_list=(num_tokens,))


def test_fp4_kernel_equals_dense_kernel_on_dequantised_weights(kernel_device: torch.device) -> None:
    """Decoding in the kernel gives the dense kernel's result on the dequantised weights (both fp32):
    every code, sign and scale is decoded right."""
    from deepinfer_nvidia_sm100.moe import TritonMoE

    spec = dataclasses.replace(FP4_SPEC, intermediate_size=96)  # a partial 64-wide tile as well
    x, input_ids, weights = random_moe_case(spec, 6, seed=3)
    packed = conformance.fp4_moe_weights(weights)
    codes = packed.gate_up.view(torch.uint8)
    assert {int(c) for c in (codes & 0xF).unique()} | {int(c) for c in (codes >> 4).unique()} >= set(range(16)) - {8}
    dense = dataclasses.replace(
        packed,
        gate_up=quant.dequantize_fp4(packed.gate_up, packed.gate_up_scale),
        down=quant.dequantize_fp4(packed.down, packed.down_scale),
        gate_up_scale=None,
        down_scale=None,
    )
    on = {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed)}
    packed = dataclasses.replace(packed, **{k: v.to(kernel_device) for k, v in on.items() if v is not None})
    dense = dataclasses.replace(
        dense, **{f.name: getattr(dense, f.name).to(kernel_device) for f in dataclasses.fields(dense)
                  if getattr(dense, f.name) is not None})
    x, input_ids = x.to(kernel_device), input_ids.to(kernel_device)
    got = TritonMoE(spec).forward(x, input_ids, packed)
    want = TritonMoE(dataclasses.replace(spec, expert_format="dense")).forward(x, input_ids, dense)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp4_needs_e8m0_scales(kernel_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.moe import TritonMoE

    x, input_ids, weights = random_moe_case(FP4_SPEC, 2, seed=1)
    packed = conformance.fp4_moe_weights(weights)
    packed = dataclasses.replace(packed, down_scale=packed.down_scale.float())
    packed = dataclasses.replace(packed, **{f.name: getattr(packed, f.name).to(kernel_device)
                                            for f in dataclasses.fields(packed) if getattr(packed, f.name) is not None})
    with pytest.raises(ValueError, match="e8m0"):
        TritonMoE(FP4_SPEC).forward(x.to(kernel_device), input_ids.to(kernel_device), packed)


def _on(weights, device, router_dtype):
    """`weights`' tensors on `device`, the router in `router_dtype` (the activations')."""
    moved = {f.name: getattr(weights, f.name).to(device) for f in dataclasses.fields(weights)
             if isinstance(getattr(weights, f.name), torch.Tensor)}
    return dataclasses.replace(weights, **{**moved, "router": weights.router.to(device, router_dtype)})


# 3 tokens over 16 experts: idle experts and blocks of 1-3 rows; 20 over 8: blocks of up to 13 rows (as
# 40 tokens over 16 experts, in half the rows the interpreter runs one by one)
@pytest.mark.parametrize(("num_experts", "num_tokens"), [(16, 3), (8, 20)])
def test_fp4_gemv_gives_the_fp32_tile_result(kernel_device: torch.device, num_experts: int, num_tokens: int) -> None:
    """At decode sizes (at most 16 rows an expert) the CUDA-core products ("gemv") give the fp32
    tensor-core tiles' result on the same weights and inputs: to fp32 rounding in fp32, within bf16's
    rounding in bf16."""
    from deepinfer_nvidia_sm100.moe import FP4_GEMV, GemmConfig, TritonMoE, pick_config

    spec = dataclasses.replace(FP4_SPEC, hidden_size=256, intermediate_size=96, num_experts=num_experts, top_k=4)
    x, input_ids, weights = random_moe_case(spec, num_tokens, seed=5)
    packed = conformance.fp4_moe_weights(weights)
    x, input_ids = x.to(kernel_device), input_ids.to(kernel_device)
    fp32 = TritonMoE(spec)
    ids, topk_weights = fp32.route(x, input_ids, _on(packed, kernel_device, torch.float32))
    tile = GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    want = fp32.experts(x, ids, topk_weights, _on(packed, kernel_device, torch.float32), tile)
    assert pick_config(num_tokens * spec.top_k, spec.num_experts, 4, fp4=True) == FP4_GEMV
    config = FP4_GEMV
    got = fp32.experts(x, ids, topk_weights, _on(packed, kernel_device, torch.float32), config)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    bf16 = TritonMoE(dataclasses.replace(spec, dtype=torch.bfloat16))
    got = bf16.experts(x.bfloat16(), ids, topk_weights, _on(packed, kernel_device, torch.bfloat16), config)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_fp4_dequantised_experts_equal_the_reference_dequantisation(kernel_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.fp4_gemv_kernels import dequantize_experts

    spec = dataclasses.replace(FP4_SPEC, hidden_size=96, intermediate_size=160)  # partial tiles both ways
    _, _, weights = random_moe_case(spec, 2, seed=7)
    packed = conformance.fp4_moe_weights(weights)
    for codes, scales in ((packed.gate_up, packed.gate_up_scale), (packed.down, packed.down_scale)):
        got = dequantize_experts(codes.to(kernel_device), scales.view(torch.uint8).to(kernel_device), torch.float32)
        assert torch.equal(got.cpu(), quant.dequantize_fp4(codes, scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_dequant_kernel_gives_the_tile_result(kernel_device: torch.device, dtype: torch.dtype) -> None:
    """Prefill sizes: the experts dequantised, then the dense tiles (the default there with fp32
    activations; bf16 ones take the MMA kernels), give the FP4 tiles' result."""
    from deepinfer_nvidia_sm100.moe import FP4_MMA_PREFILL, GemmConfig, TritonMoE, pick_config

    spec = dataclasses.replace(FP4_SPEC, hidden_size=256, intermediate_size=96, num_experts=4, dtype=dtype)
    x, input_ids, weights = random_moe_case(spec, 64, seed=9)
    packed = _on(conformance.fp4_moe_weights(weights), kernel_device, dtype)
    moe = TritonMoE(spec)
    x = x.to(kernel_device, dtype)
    ids, topk_weights = moe.route(x, input_ids.to(kernel_device), packed)
    tiles = (64, 64, 64, 4, 4, True)
    picked = pick_config(64 * spec.top_k, spec.num_experts, x.element_size(), fp4=True)
    assert picked == (GemmConfig(*tiles, kernel="dequant") if dtype == torch.float32 else FP4_MMA_PREFILL[0])
    want = moe.experts(x, ids, topk_weights, packed, GemmConfig(*tiles)).float()
    got = moe.experts(x, ids, topk_weights, packed, GemmConfig(*tiles, kernel="dequant")).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    torch.testing.assert_close(got, want, atol=tolerance, rtol=1e-5 if dtype == torch.float32 else 2e-2)


def _fp32_experts(x, ids, topk_weights, packed, spec) -> torch.Tensor:
    """The routed experts in fp32 on the dequantised weights, expert by expert (only the touched ones),
    with the SwiGLU activation rounded to the activations' dtype as the kernels store it."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter, limit = spec.intermediate_size, spec.swiglu_limit
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        gate_up = quant.dequantize_fp4(packed.gate_up[expert], packed.gate_up_scale[expert]).float()
        down = quant.dequantize_fp4(packed.down[expert], packed.down_scale[expert]).float()
        h = x[token].float() @ gate_up.T
        gate, up = h[:, :inter].clamp(max=limit), h[:, inter:].clamp(-limit, limit)
        act = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
        out.index_add_(0, token, topk_weights[token, slot, None] * (act @ down.T))
    return out


def _check_mma(spec, num_tokens: int, device: torch.device, config=None, seed: int = 11) -> None:
    """The FP4 experts with bf16 activations (`config`, default the plugin's pick) against `_fp32_experts`
    within bf16's rounding of the output (2% of its largest value: one bf16 step is 0.4-0.8%)."""
    from deepinfer_nvidia_sm100.moe import TritonMoE

    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter, experts = spec.hidden_size, spec.intermediate_size, spec.num_experts

    def packed(rows: int, cols: int):
        codes = torch.randint(-128, 128, (experts, rows, cols // 2), dtype=torch.int8, device=device, generator=gen)
        exponents = torch.randint(-9, -5, (experts, rows, cols // quant.FP4_GROUP_SIZE), device=device, generator=gen)
        return codes, torch.exp2(exponents.float()).to(quant.FP4_SCALE_DTYPE)

    (gate_up, gate_up_scale), (down, down_scale) = packed(2 * inter, hidden), packed(hidden, inter)
    from deepinfer_core.backends.moe import MoEWeights

    weights = MoEWeights(router=torch.zeros(experts, hidden, device=device, dtype=torch.bfloat16), gate_up=gate_up,
                         down=down, gate_up_scale=gate_up_scale, down_scale=down_scale)
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    ids = torch.rand(num_tokens, experts, device=device, generator=gen).topk(spec.top_k).indices.to(torch.int32)
    topk_weights = torch.rand(num_tokens, spec.top_k, device=device, generator=gen)
    got = TritonMoE(spec).experts(x, ids, topk_weights, weights, config).float()
    want = _fp32_experts(x, ids, topk_weights, weights, spec)
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


MMA_SPEC = dataclasses.replace(FP4_SPEC, hidden_size=256, intermediate_size=96, num_experts=8, top_k=2,
                               dtype=torch.bfloat16)
"""Partial weight tiles (96 columns in tiles of 64) and blocks of one to a dozen rows."""


@pytest.mark.parametrize(("num_tokens", "tiles"), [(3, (16, 64, 128, 4, 3)), (40, (64, 64, 64, 4, 4, True))])
def test_fp4_mma_gives_the_fp32_result(kernel_device: torch.device, num_tokens: int, tiles: tuple) -> None:
    """The weights as the MMA's first operand, decoded by `tl.dot_scaled` (the bf16 FP4 path)."""
    from deepinfer_nvidia_sm100.moe import GemmConfig

    _check_mma(MMA_SPEC, num_tokens, kernel_device, GemmConfig(*tiles, kernel="mma"))


@pytest.mark.parametrize("num_tokens", [3, 40])
@pytest.mark.parametrize("kernel", ["mma_halves", "mma_words", "mma_pairs"])
def test_fp4_mma_decoded_by_hand_gives_the_fp32_result_on_gpu(cuda_device: torch.device, kernel: str,
                                                              num_tokens: int) -> None:
    """The same product decoded by hand (Triton's interpreter multiplies bf16 tiles wrongly: GPU only)."""
    from deepinfer_nvidia_sm100.moe import GemmConfig

    _check_mma(MMA_SPEC, num_tokens, cuda_device, GemmConfig(16, 64, 256, 4, 3, kernel=kernel))


RELEASE_SHAPES = {
    "v4-flash": dataclasses.replace(FP4_SPEC, hidden_size=4096, intermediate_size=2048, num_experts=256, top_k=6,
                                    dtype=torch.bfloat16),
    "v41-flash": dataclasses.replace(FP4_SPEC, hidden_size=5120, intermediate_size=2304, num_experts=384, top_k=6,
                                     dtype=torch.bfloat16),
}


@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256, 2048])
@pytest.mark.parametrize("shape", sorted(RELEASE_SHAPES))
def test_fp4_bf16_experts_at_release_shapes_on_gpu(cuda_device: torch.device, shape: str, num_tokens: int) -> None:
    """The kernels the plugin picks for bf16 activations, at the release configs' expert shapes and the
    row counts of decode and prefill, against the fp32 computation on the dequantised weights."""
    _check_mma(RELEASE_SHAPES[shape], num_tokens, cuda_device)


PAIR_SHIFTS = ((6, 12), (2, 8), (-2, 4), (-6, 0))
"""`fp4_mma_kernels._paired_codes`' shifts for codes `j` and `j + 4` (magnitude, sign; negative: right)."""


def test_pair_widening_bits_give_the_e2m1_values() -> None:
    """The bit layout `_paired_codes` builds in PTX (not runnable off the GPU), done in torch: both codes'
    magnitude bits under a bf16's exponent and mantissa, the signs on bits 15 and 31, times the bf16
    2^(s - 1), give each code's e2m1 value times 2^(s - 127) for every code, position and scale it takes."""
    codes = torch.arange(256, dtype=torch.int32)
    words = codes[:, None] * 0x01010101 + torch.arange(4)[None, :] * 0x10101010  # every nibble everywhere
    words = words.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1)
    for j, (magnitude, sign) in enumerate(PAIR_SHIFTS):
        moved = words << magnitude if magnitude >= 0 else words >> -magnitude
        pair = (moved & 0x01C001C0) | ((words << sign) & 0x80008000)
        for scale in (100, 117, 127, 128):
            factor = torch.tensor([(scale + 126) << 7], dtype=torch.int16).view(torch.bfloat16).float()
            for half, code in ((pair & 0xFFFF, nibbles[:, j]), ((pair >> 16) & 0xFFFF, nibbles[:, j + 4])):
                widened = half.to(torch.int32).to(torch.int16).view(torch.bfloat16).float() * factor
                want = torch.tensor(quant.E2M1_MAGNITUDES)[code & 7] * torch.where(code >= 8, -1.0, 1.0)
                assert torch.equal(widened, want * 2.0 ** (scale - 127)), (j, scale)
