"""Checkpoint number formats: block-scaled FP8 (e4m3) and group-scaled FP4 (e2m1), both directions.

FP8: a weight `w[..., rows, cols]` is stored as `q` (float8_e4m3fn) with one scale per
`block_rows x block_cols` tile of the last two dims (`scale[..., ceil(rows/br), ceil(cols/bc)]`), and
`w ~= q * scale`. Partial tiles at the edges share their tile's scale. DeepSeek calls the scale
`<name>.scale`; transformers' FP8 integration calls it `<name>.weight_scale_inv` (same meaning: multiply).

FP4: a weight `w[..., rows, cols]` is stored as `packed[..., rows, cols / 2]` (int8 or uint8) holding two
e2m1 codes per byte, the LOW nibble for the even column and the HIGH nibble for the odd column, and one
scale per 32 consecutive input columns (`scale[..., rows, cols / 32]`), `w ~= e2m1(code) * scale`.
An e2m1 code is `sign << 3 | magnitude_index` with magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Scales may be float32, bfloat16 or float8_e8m0fnu (a power of two, DeepSeek's "ue8m0").
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_GROUP_SIZE = 32
FP4_MAX = 6.0
FP4_SCALE_DTYPE = torch.float8_e8m0fnu
"""The dtype FP4 group scales are held in when the experts stay packed (`layers.FP4Experts`)."""
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e8m0fnu)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the block scales for an FP8 weight of `shape` (last two dims are tiled)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def fp4_packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the packed int8 storage for an FP4 weight of logical `shape`."""
    return (*shape[:-1], shape[-1] // 2)


def fp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the per-32-column scales for an FP4 weight of logical `shape`."""
    return (*shape[:-1], shape[-1] // FP4_GROUP_SIZE)


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    scale = scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return scale[..., :rows, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Float32 values of a block-scaled FP8 weight."""
    rows, cols = weight.shape[-2:]
    return weight.float() * _expand_blocks(scale, rows, cols, block)


def _round_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    if scale_dtype == torch.float8_e8m0fnu:  # power of two, rounded up so no value overflows
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale.to(scale_dtype)


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to (float8_e4m3fn values, block scales); inverse of `dequantize_fp8` up to rounding."""
    *lead, rows, cols = weight.shape
    padded_rows, padded_cols = -(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1]
    padded = weight.new_zeros(*lead, padded_rows, padded_cols, dtype=torch.float32)
    padded[..., :rows, :cols] = weight.float()
    tiles = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = _round_scale(amax / FP8_MAX, scale_dtype)
    values = (weight.float() / _expand_blocks(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX)
    return values.to(FP8_DTYPE), scale


def quantize_activations_fp8(
    x: torch.Tensor, group: int = 128, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and `group` inputs: (float8_e4m3fn values, float32 scales `[..., ceil(K / group)]`),
    `scale = amax / 448` (rounded up to a power of two with `power_of_two`), values rounded to nearest
    even after saturating at +-448. What an FP8 GEMM that quantises its activations computes with."""
    cols = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, -cols % group)).unflatten(-1, (-1, group))
    scale = padded.abs().amax(dim=-1).clamp(min=1e-30) / FP8_MAX
    if power_of_two:  # from the bits: the exponent, plus one when any mantissa bit is set
        bits = scale.view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
        scale = (exponent << 23).view(torch.float32)
    values = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :cols]
    return values.to(FP8_DTYPE), scale


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 values of a packed e2m1 weight with one scale per 32 input columns."""
    codes = packed.view(torch.uint8)
    low, high = codes & 0x0F, codes >> 4
    codes = torch.stack((low, high), dim=-1).flatten(-2).long()
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=packed.device)[codes & 0x7]
    values = torch.where(codes >= 8, -magnitudes, magnitudes)
    return values * scale.float().repeat_interleave(FP4_GROUP_SIZE, dim=-1)


def quantize_fp4(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float8_e8m0fnu
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to (packed int8 e2m1 codes, per-32-column scales), rounding to the nearest value."""
    cols = weight.shape[-1]
    if cols % FP4_GROUP_SIZE:
        raise ValueError(f"FP4 needs the input dim to be a multiple of {FP4_GROUP_SIZE}, got {cols}")
    groups = weight.float().unflatten(-1, (-1, FP4_GROUP_SIZE))
    scale = _round_scale(groups.abs().amax(dim=-1) / FP4_MAX, scale_dtype)
    scaled = (groups / scale.float().unsqueeze(-1)).flatten(-2)
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=weight.device)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = (index | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), scale


def fp8_rounding_bound(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Largest round-to-nearest error `quantize_fp8` may make per element, in weight units.

    Half an e4m3 ulp of x = w / scale: at most |x| * 2^-4 for normal x, and 2^-10 (half the subnormal
    spacing 2^-9) below the smallest normal 2^-6; plus float32 slack.
    """
    full_scale = _expand_blocks(scale, *weight.shape[-2:], block)
    x = weight.float().abs() / full_scale
    return full_scale * torch.clamp(x * 2**-4, min=2**-10) + 1e-6 * weight.float().abs() + 1e-12


def fp4_rounding_bound(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest round-to-nearest error `quantize_fp4` may make per element, in weight units.

    Half the gap between neighbouring e2m1 magnitudes around |w / scale|: 0.25 below 2, 0.5 below 4,
    else 1; plus float32 slack.
    """
    full_scale = scale.float().repeat_interleave(FP4_GROUP_SIZE, dim=-1)
    x = weight.float().abs() / full_scale
    half_gap = torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0))
    return full_scale * half_gap + 1e-6 * weight.float().abs() + 1e-12
