import pytest
import torch

from deepinfer_core.backends import quant


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
@pytest.mark.parametrize("shape", [(256, 128), (130, 200), (3, 70, 260)])
def test_fp8_round_trip_is_within_e4m3_rounding(shape, scale_dtype):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    weight[..., 0, 0] = 1.5  # one large value makes its block's small values subnormal
    values, scale = quant.quantize_fp8(weight, (128, 128), scale_dtype)
    assert values.dtype == torch.float8_e4m3fn and values.shape == weight.shape
    assert scale.dtype == scale_dtype and scale.shape == quant.fp8_scale_shape(shape, (128, 128))
    error = (quant.dequantize_fp8(values, scale, (128, 128)) - weight).abs()
    assert (error <= quant.fp8_rounding_bound(weight, scale, (128, 128))).all()
    assert error.max() > 0  # it really was rounded


def test_fp8_scales_are_per_block():
    weight = torch.ones(256, 256)
    weight[128:, 128:] = 100.0
    _, scale = quant.quantize_fp8(weight, (128, 128))
    assert torch.allclose(scale, torch.tensor([[1.0, 1.0], [1.0, 100.0]]) / quant.FP8_MAX)


def test_e8m0_scales_are_powers_of_two_that_do_not_overflow():
    weight = torch.randn(128, 256) * 3
    values, scale = quant.quantize_fp8(weight, (128, 128), torch.float8_e8m0fnu)
    exponents = torch.log2(scale.float())
    assert torch.equal(exponents, exponents.round())
    assert values.float().abs().max() <= quant.FP8_MAX


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_fp4_round_trip_is_within_e2m1_rounding(scale_dtype):
    weight = torch.randn(2, 48, 96, generator=torch.Generator().manual_seed(1)) * 0.02
    packed, scale = quant.quantize_fp4(weight, scale_dtype)
    assert packed.dtype == torch.int8 and packed.shape == quant.fp4_packed_shape(weight.shape)
    assert scale.shape == quant.fp4_scale_shape(weight.shape) == (2, 48, 3)
    error = (quant.dequantize_fp4(packed, scale) - weight).abs()
    assert (error <= quant.fp4_rounding_bound(weight, scale)).all()


def test_fp4_packing_puts_the_even_column_in_the_low_nibble():
    # codes: 0.5 -> 1, 6 -> 7, -1 -> 0b1010, 0 -> 0; scale 1
    packed = torch.tensor([[0x71, 0x0A] + [0] * 14], dtype=torch.uint8).view(torch.int8)
    values = quant.dequantize_fp4(packed, torch.ones(1, 1))
    assert values[0, :4].tolist() == [0.5, 6.0, -1.0, 0.0]
    weight = torch.zeros(1, 32)
    weight[0, :4] = torch.tensor([0.5, 6.0, -1.0, 0.0])
    repacked, scale = quant.quantize_fp4(weight, torch.float32)
    assert scale.item() == 1.0
    assert repacked.view(torch.uint8)[0, :2].tolist() == [0x71, 0x0A]


def test_rounding_bounds_at_known_points():
    scale = torch.ones(1, 1)
    # x = 1.0 is normal: half an ulp is 2^-4; x = 2^-8 is subnormal: the floor 2^-10 applies
    fp8 = quant.fp8_rounding_bound(torch.tensor([[1.0, 2**-8]]), scale, (128, 128))
    assert torch.allclose(fp8, torch.tensor([[2**-4, 2**-10]]), rtol=1e-4)
    fp4 = quant.fp4_rounding_bound(torch.tensor([[1.0, 2.5, 5.0] + [0.0] * 29]), scale)
    assert torch.allclose(fp4[0, :3], torch.tensor([0.25, 0.5, 1.0]), rtol=1e-4)


def test_fp4_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_fp4(torch.zeros(4, 48))
