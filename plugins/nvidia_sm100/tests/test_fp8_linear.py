"""The FP8 projection kernels: activation quantisation, the block-scaled GEMM, and its conformance.

Runs on a suitable GPU, else on the CPU through Triton's interpreter (see conftest.py). Exact checks use
values whose every product and partial sum is exact in fp32 (small integers, power-of-two scales), so
they hold whatever order the dot adds in; random values are checked against the reference within the
FP8 format's tolerance (`conformance.check_linear`).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import LinearSpec, quant
from deepinfer_core.testing import conformance

V4 = LinearSpec(in_features=256, out_features=96, block=(128, 128), dtype=torch.float32)
V41 = LinearSpec(in_features=96, out_features=80, block=(32, 32), scale_format="ue8m0", dtype=torch.float32)
GROUPED = LinearSpec(in_features=128, out_features=64, groups=2, block=(32, 32), scale_format="ue8m0",
                     dtype=torch.float32)


def backend(spec: LinearSpec):
    from deepinfer_nvidia_sm100.linear import TritonFP8Linear

    return TritonFP8Linear(spec, num_sms=4)


@pytest.mark.parametrize("power_of_two", [False, True])
def test_activation_quantisation_equals_torch(kernel_device, power_of_two):
    gen = torch.Generator().manual_seed(0)
    # magnitudes over 12 binades per row, so values land on normal and subnormal e4m3 steps and ties
    x = torch.randn(5, 304, generator=gen) * torch.exp2(torch.randint(-8, 4, (5, 304), generator=gen).float())
    x[1, :128] = 0.0  # an all-zero group
    spec = LinearSpec(in_features=304, out_features=16, block=(32, 32),
                      scale_format="ue8m0" if power_of_two else "float32", dtype=torch.float32)
    q, scales = backend(spec).quantize(x.to(kernel_device))
    want_q, want_scales = quant.quantize_activations_fp8(x, 128, power_of_two)
    assert torch.equal(scales.cpu(), want_scales)
    # byte for byte, except the sign of a zero (the GPU's float8 conversion drops it: -0.0 and 0.0
    # multiply to the same products)
    got_bytes, want_bytes = q.cpu().view(torch.uint8), want_q.view(torch.uint8)
    zero = want_q.float() == 0
    assert torch.equal(q.cpu().float() == 0, zero)
    assert torch.equal(got_bytes[~zero], want_bytes[~zero])


def exact_case(spec: LinearSpec, num_tokens: int, seed: int):
    """Integer activations with one 448 per 128-group (so their scale is 1 and they quantise exactly) and
    integer FP8 weights with power-of-two tile scales: every product and sum is exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    width = spec.in_features * spec.groups
    x = torch.randint(-16, 17, (num_tokens, width), generator=gen).float()
    x[:, ::128] = 448.0
    weight = torch.randint(-8, 9, (spec.out_features, spec.in_features), generator=gen).float()
    scale = torch.exp2(torch.randint(-4, 2, spec.scale_shape, generator=gen).float())
    return x, weight.to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("spec", [V4, V41, GROUPED], ids=["v4-128x128", "v41-32x32", "grouped"])
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gemm_is_exact_on_exact_values(kernel_device, spec, num_tokens, split_k):
    from deepinfer_nvidia_sm100.linear import GemmTiles

    x, weight, scale = exact_case(spec, num_tokens, seed=num_tokens)
    tiles = GemmTiles(block_m=16, block_n=32, block_k=min(128, spec.block[1]), split_k=split_k)
    shaped = x if spec.groups == 1 else x.view(num_tokens, spec.groups, spec.in_features)
    got = backend(spec).forward(shaped.to(kernel_device), weight.to(kernel_device), scale.to(kernel_device), tiles)
    dense = quant.dequantize_fp8(weight, scale, spec.block)
    if spec.groups == 1:
        want = x @ dense.T
    else:
        want = torch.cat([x[:, g * spec.in_features:(g + 1) * spec.in_features]
                          @ dense[g * 32:(g + 1) * 32].T for g in range(spec.groups)], dim=1)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("spec", [V4, V41, GROUPED], ids=["v4-128x128", "v41-32x32", "grouped"])
def test_conformance_fp32(kernel_device, spec):
    conformance.check_linear(backend(spec), kernel_device, num_tokens_list=(1, 7, 70))


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_conformance_bf16_on_gpu(cuda_device, block, num_tokens):
    """bf16 activations at V4-like sizes (the interpreter's bf16 is not trusted: GPU only); 300 tokens take
    the prefill tiles, 1 the split-K decode tiles."""
    from deepinfer_nvidia_sm100.linear import TritonFP8Linear

    spec = LinearSpec(in_features=1024, out_features=512, block=block, dtype=torch.bfloat16,
                      scale_format="ue8m0" if block == (32, 32) else "float32")
    sms = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    conformance.check_linear(TritonFP8Linear(spec, sms), cuda_device, num_tokens_list=(num_tokens,))


def test_tiles_split_k_for_few_tokens_only():
    from deepinfer_nvidia_sm100.linear import pick_tiles

    spec = LinearSpec(in_features=4096, out_features=1024, block=(128, 128))
    decode, prefill = pick_tiles(1, spec, 132), pick_tiles(512, spec, 132)
    assert decode.split_k > 1 and decode.block_m == 16
    assert prefill.split_k == 1 and (prefill.block_m, prefill.block_n, prefill.block_k) == (128, 128, 128)
    assert pick_tiles(1, LinearSpec(in_features=4096, out_features=1024, block=(32, 32)), 132).block_k == 32


def test_unsupported_layouts_are_named():
    from deepinfer_nvidia_sm100.platform import linear_problem

    assert linear_problem(V4) is None and linear_problem(GROUPED) is None
    assert "dense" in linear_problem(LinearSpec(in_features=64, out_features=64, weight_format="dense"))
    assert "scale tile" in linear_problem(LinearSpec(in_features=64, out_features=64, block=(128, 48)))
    assert "grouped" in linear_problem(LinearSpec(in_features=96, out_features=64, groups=2, block=(32, 32)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks declining on a machine without CUDA")
def test_make_linear_declines_without_cuda():
    import pluggy
    from deepinfer_nvidia_sm100 import hooks

    from deepinfer_core import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(hooks, name="nvidia_sm100")
    reasons: list[str] = []
    assert pm.hook.make_linear(spec=V4, device=torch.device("cpu"), decline=reasons.append) is None
    assert reasons == ["device cpu is not a CUDA device"]
