"""DeepSeek-V4.1's ViT and aligner: pixels of one image -> the embeddings of its whole prompt span.

The tower (research-v41.md §8; DeepSeek's `inference/vision.py` decides the details): 14x14 RGB patches
flattened channel-major into a biased `patch_embed.proj`; `num_layers` pre-norm blocks of full
bidirectional attention (`attn.wqkv` and `attn.wo`, biased; SDPA) with a 2-D split-half rope and a SwiGLU
MLP (`mlp.w1` gives gate then up, `mlp.w2`; unbiased), RMSNorms with fp32 weights (epsilon 1e-6) and a
final `norm`. The rope: head width `d`, `d / 2` angles per patch, the first `d / 4` its row times the
frequencies `theta^(-2i / (d / 2))`, the next `d / 4` its column times the same; the two halves of each
head are rotated by them (`x1 cos - x2 sin`, `x2 cos + x1 sin`, in fp32). The aligner: the `n_h x n_w`
grid of ViT rows zero-padded to multiples of 3, each 3x3 block laid out channel-major (the channel, then
the block's row, then its column) into `aligner.w1`, exact GELU, `aligner.w2`; blocks in reading order.

Everything runs in the parameters' dtype (bf16 as shipped; fp32 in the tests), the norms and the rope in
fp32 and cast back, as the reference. The module names are the checkpoint's (`vision.*`, `aligner.*`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.models.deepseek_v41.vision import VisionConfig, image_span

FP32 = torch.float32


class VisionRMSNorm(nn.Module):
    """RMSNorm with an fp32 weight, computed in fp32 and cast back to the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=FP32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class VisionLinear(nn.Module):
    """A projection with BF16 weights as shipped (`weight` `[out, in]`, optional `bias`). Not an `nn.Linear`,
    so the loader's FP8 handling (`loading/weight_formats.py`, for the text model's FP8 projections) and
    the FP8 linear specs never count it."""

    def __init__(self, inputs: int, outputs: int, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(outputs, inputs, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(outputs, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = VisionLinear(3 * vc.patch_size**2, vc.dim, dtype)


class VisionAttention(nn.Module):
    def __init__(self, vc: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = vc.num_heads
        self.wqkv = VisionLinear(vc.dim, 3 * vc.dim, dtype)
        self.wo = VisionLinear(vc.dim, vc.dim, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = split_half_rotary(q, cos, sin), split_half_rotary(k, cos, sin)
        # [heads, patches, head_dim]: one image, every patch attends every patch (flash/efficient on the GPU)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = VisionLinear(vc.dim, 2 * vc.intermediate_size, dtype, bias=False)
        self.w2 = VisionLinear(vc.intermediate_size, vc.dim, dtype, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1, self.norm2 = VisionRMSNorm(vc.dim, vc.norm_eps), VisionRMSNorm(vc.dim, vc.norm_eps)
        self.attn = VisionAttention(vc, dtype)
        self.mlp = VisionMLP(vc, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """The ViT (`vision.*`): flattened patches `[n_h * n_w, 3 * p * p]` -> normed rows `[n_h * n_w, dim]`."""

    def __init__(self, vc: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.vc = vc
        self.patch_embed = PatchEmbed(vc, dtype)
        self.blocks = nn.ModuleList(VisionBlock(vc, dtype) for _ in range(vc.num_layers))
        self.norm = VisionRMSNorm(vc.dim, vc.norm_eps)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        x = self.patch_embed.proj(patches)
        cos, sin = (t.to(x.device) for t in grid_rope(n_h, n_w, self.vc.rope_dim, self.vc.rope_theta))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """`aligner.*`: the ViT grid's 3x3 blocks (zero-padded) -> `[ceil(n_h/3) * ceil(n_w/3), text width]`."""

    def __init__(self, vc: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio = vc.downsample_ratio
        self.w1 = VisionLinear(vc.unfolded_dim, vc.text_hidden_size, dtype)
        self.w2 = VisionLinear(vc.text_hidden_size, vc.text_hidden_size, dtype)

    def forward(self, rows: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        r = self.ratio
        grid = F.pad(rows.view(n_h, n_w, -1), (0, 0, 0, -n_w % r, 0, -n_h % r))
        bh, bw = grid.shape[0] // r, grid.shape[1] // r
        # [bh, r, bw, r, C] -> [bh, bw, C, r, r]: channel-major within a block, blocks in reading order
        blocks = grid.view(bh, r, bw, r, -1).permute(0, 2, 4, 1, 3).reshape(bh * bw, -1)
        return self.w2(F.gelu(self.w1(blocks)))


def split_half_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[n, heads, d]` with its two halves rotated by `cos`/`sin` `[n, d / 2]` (fp32), in `x`'s dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@functools.lru_cache(maxsize=16)
def grid_rope(n_h: int, n_w: int, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[n_h * n_w, rope_dim]` (CPU, fp32) of the patches in reading order: the first half
    of the angles the patch's row times the frequencies, the second half its column times them."""
    freqs = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=FP32) / rope_dim)
    rows = torch.arange(n_h, dtype=FP32).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=FP32).repeat(n_h)
    angles = torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=-1)
    return angles.cos(), angles.sin()


def to_patches(pixel_values: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`[3, H, W]` -> `[(H/p) * (W/p), 3 * p * p]`: patches in reading order, each channel-major."""
    p = patch_size
    _, height, width = pixel_values.shape
    grid = pixel_values.reshape(3, height // p, p, width // p, p).permute(1, 3, 0, 2, 4)
    return grid.reshape((height // p) * (width // p), 3 * p * p)


def encode_span(tower: VisionTower, aligner: Aligner, delimiters: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                pixel_values: torch.Tensor) -> torch.Tensor:
    """The embeddings `[span length, text width]` of an image's whole span (`vision.image_span`):
    `delimiters` (image_start, image_newline, image_end) around the aligner's rows, a newline after each
    row of them; in the aligner's dtype. `pixel_values` `[3, H, W]` are the processor's normalised pixels."""
    vc = tower.vc
    if pixel_values.dim() != 3 or pixel_values.shape[0] != 3:
        raise ValueError(f"an image's pixel values must be [3, H, W], got {list(pixel_values.shape)}")
    span = image_span(vc, int(pixel_values.shape[1]), int(pixel_values.shape[2]))
    dtype = aligner.w1.weight.dtype
    patches = to_patches(pixel_values.to(device=aligner.w1.weight.device, dtype=dtype), vc.patch_size)
    rows = aligner(tower(patches, span.n_vit_h, span.n_vit_w), span.n_vit_h, span.n_vit_w)
    start, newline, end = (t.to(dtype).view(1, -1) for t in delimiters)
    grid = torch.cat([rows.view(span.n_llm_h, span.n_llm_w, -1),
                      newline.expand(span.n_llm_h, 1, -1)], dim=1).flatten(0, 1)
    return torch.cat([start, grid, end])
