"""The linear contract and its reference: FP8 block-scaled projections computed on dequantised weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core import plugins
from deepinfer_core.backends import LinearBackend, LinearSpec, quant
from deepinfer_core.backends.linear import LinearSpecError
from deepinfer_core.models.deepseek_v4.layers import ConcatenatedLinears, FP8Linear, GroupedLinear
from deepinfer_core.reference.linear import ReferenceLinear
from deepinfer_core.testing import conformance

CPU = torch.device("cpu")


def fp8_weight(out_features: int, in_features: int, block: tuple[int, int], scale_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=gen) * 0.05
    values, scale = quant.quantize_fp8(dense, block, scale_dtype)
    return values, scale.float()


def test_spec_validates_its_fields():
    assert LinearSpec(in_features=200, out_features=300).scale_shape == (3, 2)
    assert LinearSpec(in_features=64, out_features=96, block=(32, 32)).scale_shape == (3, 2)
    with pytest.raises(LinearSpecError, match="weight_format"):
        LinearSpec(in_features=8, out_features=8, weight_format="int4")
    with pytest.raises(LinearSpecError, match="groups"):
        LinearSpec(in_features=8, out_features=9, groups=2)
    with pytest.raises(LinearSpecError, match="scale_format"):
        LinearSpec(in_features=8, out_features=8, scale_format="e4m3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_reference_equals_the_dequantise_at_load_values(dtype, block):
    """Bit for bit what a model holding `dequantize_fp8(...).to(dtype)` computes."""
    spec = LinearSpec(in_features=160, out_features=96, block=block, dtype=dtype)
    weight, scale = fp8_weight(96, 160, block)
    x = torch.randn(5, 160).to(dtype)
    backend = plugins.make_linear(spec, CPU)
    assert isinstance(backend, ReferenceLinear) and isinstance(backend, LinearBackend)
    want = F.linear(x, quant.dequantize_fp8(weight, scale, block).to(dtype))
    assert torch.equal(backend.forward(x, weight, scale), want)


def test_reference_grouped_equals_the_grouped_projection_on_dequantised_weights():
    groups, per_group_in, out_features = 2, 64, 64
    spec = LinearSpec(in_features=per_group_in, out_features=out_features, groups=groups, block=(32, 32),
                      dtype=torch.float32)
    weight, scale = fp8_weight(out_features, per_group_in, (32, 32), seed=1)
    dense = GroupedLinear(per_group_in, out_features, groups, torch.float32)
    dense.weight.data = quant.dequantize_fp8(weight, scale, (32, 32))
    x = torch.randn(3, groups, per_group_in)
    got = ReferenceLinear(spec, CPU).forward(x, weight, scale)
    assert got.shape == (3, out_features)
    assert torch.equal(got, dense(x))


def test_reference_dense_format_is_f_linear():
    spec = LinearSpec(in_features=16, out_features=8, weight_format="dense", dtype=torch.float32)
    weight, x = torch.randn(8, 16), torch.randn(2, 16)
    assert torch.equal(ReferenceLinear(spec, CPU).forward(x, weight, None), F.linear(x, weight))


def test_concatenated_linears_run_fp8_members_alone_and_join_dense_neighbours():
    torch.manual_seed(0)
    spec = LinearSpec(in_features=32, out_features=64, block=(32, 32), dtype=torch.float32)
    fp8 = FP8Linear(spec)
    fp8.weight.data, fp8.weight_scale.data = fp8_weight(64, 32, (32, 32))
    fp8.backend = ReferenceLinear(spec, CPU)
    dense = [nn.Linear(32, n, bias=False) for n in (8, 16, 4)]
    expected_dense = [linear.weight.detach().clone() for linear in dense]
    joined = ConcatenatedLinears([dense[0], fp8, dense[1], dense[2]])
    assert [module is not None for _, _, module in joined.parts] == [False, True, False]
    x = torch.randn(3, 32)
    outputs = joined(x)
    assert [o.shape[-1] for o in outputs] == [8, 64, 16, 4]
    torch.testing.assert_close(outputs[1], fp8(x), atol=0, rtol=0)
    for out, weight in zip((outputs[0], outputs[2], outputs[3]), expected_dense):
        torch.testing.assert_close(out, F.linear(x, weight), atol=1e-6, rtol=1e-6)


def test_fp8_linear_without_a_backend_says_so():
    layer = FP8Linear(LinearSpec(in_features=32, out_features=32, block=(32, 32)))
    with pytest.raises(RuntimeError, match="bind_linears"):
        layer(torch.zeros(1, 32))


@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
def test_the_reference_passes_its_own_conformance_check(scale_format):
    spec = LinearSpec(in_features=256, out_features=96, block=(128, 128), scale_format=scale_format,
                      dtype=torch.float32)
    conformance.check_linear(ReferenceLinear(spec, CPU), CPU)
