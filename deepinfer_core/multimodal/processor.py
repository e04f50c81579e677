"""DeepSeek-V4.1's image processor: an RGB image to the ViT's pixels, equal to DeepSeek's reference
(`inference/image_processor.py` of the release).

The plan (`plan_grid`) is a pure function of the image's size: cap the width at `max_wh_ratio` times
the height, scale a small image up to `min_pixels`, round both sides up to whole 14-pixel patches, and,
when the token grid after the 3x3 downsample would cost more than `max_image_tokens` LLM positions
(`h * (w + 1) + 2`: a newline row per grid row, a start and an end), shrink to the largest size with
the same aspect that fits. The pixels: the image letterboxed into that size on grey 127 (or stretched,
when a `max_wh_ratio` is set and the image is at least that wide), scaled to [-1, 1] and rounded to
bf16, as the reference's processor rounds them. `content_hash` (SHA-256 of the size and the bf16 bytes)
identifies the processed pixels: the prefix cache's block keys and the encoder cache use it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.multimodal.decode import pil_image_module

GREY = (127, 127, 127)
"""The letterbox colour of the reference's padding."""


@dataclass(frozen=True)
class VisionGeometry:
    """What the processor reads of a model's `vision_config`."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    @classmethod
    def from_vision_config(cls, vision: Any) -> VisionGeometry:
        """From a `V41VisionConfig` (or anything with its field names)."""
        return cls(vision.patch_size, vision.downsample_ratio, vision.max_image_tokens, vision.min_pixels,
                   vision.max_wh_ratio)


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image ready for the ViT."""

    pixel_values: torch.Tensor
    """`[3, height, width]` bf16 in [-1, 1]; height and width are whole patches."""
    grid: tuple[int, int]
    """The LLM token grid `(rows, columns)` after the aligner's downsample."""
    content_hash: bytes
    """SHA-256 of the pixel size and the bf16 bytes."""

    @property
    def size(self) -> tuple[int, int]:
        """`(height, width)` in pixels."""
        return int(self.pixel_values.shape[1]), int(self.pixel_values.shape[2])


def span_length(grid: tuple[int, int]) -> int:
    """LLM positions of an image with this token grid: start, each row's cells and newline, end."""
    rows, columns = grid
    return rows * (columns + 1) + 2


def _grid_of(height: int, width: int, g: VisionGeometry) -> tuple[int, int]:
    return (math.ceil(height // g.patch_size / g.downsample_ratio),
            math.ceil(width // g.patch_size / g.downsample_ratio))


def _fit_budget(height: float, width: float, g: VisionGeometry) -> tuple[int, int]:
    """The largest pixel size of this aspect whose grid fits `max_image_tokens` (the reference's rule,
    with its collapse to one column or one row for extreme aspects)."""
    budget, cell = g.max_image_tokens, g.patch_size * g.downsample_ratio
    aspect = height / width
    # columns w with rows = w * aspect costing rows * (w + 1) + 2 <= budget, solved for w
    columns = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    rows = columns * aspect
    if columns < 1.0:
        return (budget - 2) // 2 * cell, cell
    if rows < 1.0:
        return cell, (budget - 3) * cell
    scale = min(math.floor(columns) * cell / width, math.floor(rows) * cell / height)
    p = g.patch_size
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, g: VisionGeometry) -> tuple[tuple[int, int], tuple[int, int]]:
    """`(grid, (pixel_height, pixel_width))` for an image of this original size."""
    if width <= 0 or height <= 0:
        raise ValueError(f"the image has zero size ({width}x{height})")
    w, h = width, height
    if g.max_wh_ratio is not None and w > h * g.max_wh_ratio:
        w = h * g.max_wh_ratio
    if w * h < g.min_pixels:
        up = (g.min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    p = g.patch_size
    pixel_h, pixel_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    grid = _grid_of(pixel_h, pixel_w, g)
    if span_length(grid) > g.max_image_tokens:
        pixel_h, pixel_w = _fit_budget(h, w, g)
        grid = _grid_of(pixel_h, pixel_w, g)
    return grid, (pixel_h, pixel_w)


def process_image(image, g: VisionGeometry) -> ProcessedImage:
    """An RGB `PIL.Image` (`decode.decode_image`'s) to the ViT's pixels."""
    pil_image_module()  # Pillow present, or the install hint
    from PIL import ImageOps

    if image.mode != "RGB":
        raise ValueError(f"the processor takes RGB images (decode_image converts them), got mode {image.mode!r}")
    grid, (pixel_h, pixel_w) = plan_grid(image.width, image.height, g)
    if g.max_wh_ratio is not None and image.width >= g.max_wh_ratio * image.height:
        fitted = image.resize((pixel_w, pixel_h))
    else:
        fitted = ImageOps.pad(image, (pixel_w, pixel_h), color=GREY)
    data = torch.frombuffer(bytearray(fitted.tobytes()), dtype=torch.uint8).view(pixel_h, pixel_w, 3)
    pixels = ((data.permute(2, 0, 1).float() / 255 - 0.5) / 0.5).to(torch.bfloat16).contiguous()
    return ProcessedImage(pixels, grid, pixel_hash(pixels))


def pixel_hash(pixels: torch.Tensor) -> bytes:
    """SHA-256 over `height x width` and the bf16 pixel bytes."""
    height, width = pixels.shape[-2:]
    digest = hashlib.sha256(f"{height}x{width}:".encode())
    digest.update(pixels.contiguous().view(torch.int16).numpy().tobytes())
    return digest.digest()
