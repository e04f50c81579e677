"""The image processor equals DeepSeek's reference (`inference/image_processor.py` of V4.1).

`reference_pixels` below is a second implementation, written in the test from the reference's code
(its `plan_image_grid`, `safe_resize`, `solve_resize_ratio` and `load_image`), in numpy, independent
of `deepinfer_core.multimodal.processor`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

PIL = pytest.importorskip("PIL.Image")
from PIL import Image, ImageOps

from deepinfer_core.multimodal import VisionGeometry, plan_grid, process_image
from deepinfer_core.multimodal.processor import pixel_hash, span_length

RELEASE = VisionGeometry()  # the release's vision_config: 14, 3, 1024 tokens, 295,936 pixels, no ratio cap
SMALL = VisionGeometry(patch_size=14, downsample_ratio=3, max_image_tokens=20, min_pixels=42 * 42)
RATIO = VisionGeometry(patch_size=14, downsample_ratio=3, max_image_tokens=64, min_pixels=42 * 42, max_wh_ratio=2.0)


def reference_plan(width, height, g):
    """The reference's grid and pixel size, step by step as its code takes them."""
    p, d, budget = g.patch_size, g.downsample_ratio, g.max_image_tokens
    if g.max_wh_ratio is not None and width > height * g.max_wh_ratio:
        width = height * g.max_wh_ratio
    if 0 < width * height < g.min_pixels:
        k = (g.min_pixels / (width * height)) ** 0.5
        width, height = int(width * k), int(height * k)
    bw, bh = math.ceil(width / p) * p, math.ceil(height / p) * p

    def grid(h, w):
        return math.ceil((h // p) / d), math.ceil((w // p) / d)

    n_h, n_w = grid(bh, bw)
    if n_h * (n_w + 1) + 2 > budget:
        r = height / width
        mw = math.sqrt((budget - 2) / r + 0.25) - 0.5
        mh = mw * r
        cell = p * d
        if mw < 1.0:
            bh, bw = (budget - 2) // 2 * cell, cell
        elif mh < 1.0:
            bh, bw = cell, (budget - 3) * cell
        else:
            beta = min(math.floor(mw) * cell / width, math.floor(mh) * cell / height)
            bh, bw = math.floor(height * beta / p) * p, math.floor(width * beta / p) * p
        n_h, n_w = grid(bh, bw)
        assert n_h * (n_w + 1) + 2 <= budget
    return (n_h, n_w), (bh, bw)


def reference_pixels(image, g):
    _, (bh, bw) = reference_plan(image.width, image.height, g)
    if g.max_wh_ratio is not None and image.width >= g.max_wh_ratio * image.height:
        image = image.resize((bw, bh))
    else:
        image = ImageOps.pad(image, (bw, bh), color=(127, 127, 127))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    return ((x - 0.5) / 0.5).to(torch.bfloat16)


def noise_image(width, height, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


SIZES = [(448, 448), (1024, 768), (640, 480), (300, 1800), (2000, 90), (50, 50), (1, 3000), (3000, 1),
         (97, 211), (4096, 4096)]


@pytest.mark.parametrize("g", [RELEASE, SMALL, RATIO], ids=["release", "small", "ratio"])
@pytest.mark.parametrize("size", SIZES)
def test_plan_equals_the_reference(size, g):
    grid, pixels = plan_grid(*size, g)
    assert (grid, pixels) == reference_plan(*size, g)
    assert span_length(grid) <= g.max_image_tokens
    assert pixels[0] % g.patch_size == 0 and pixels[1] % g.patch_size == 0


@pytest.mark.parametrize("g", [RELEASE, SMALL, RATIO], ids=["release", "small", "ratio"])
@pytest.mark.parametrize("size", [(448, 448), (640, 480), (300, 900), (500, 60), (37, 23)])
def test_pixels_equal_the_reference_bit_for_bit(size, g):
    image = noise_image(*size, seed=size[0])
    processed = process_image(image, g)
    expected = reference_pixels(image, g)
    assert processed.pixel_values.dtype == torch.bfloat16
    assert processed.pixel_values.shape == expected.shape
    assert torch.equal(processed.pixel_values, expected)
    assert processed.grid == reference_plan(*size, g)[0]


def test_release_sizes_hit_the_budget_and_the_floor():
    # a 448x448 image is below min_pixels (544^2): scaled up to 546x546 (39 patches), 13x13 tokens
    assert plan_grid(448, 448, RELEASE) == ((13, 13), (546, 546))
    # a large square is shrunk to fit 1024 positions: rows * (cols + 1) + 2 <= 1024
    grid, _ = plan_grid(4096, 4096, RELEASE)
    assert span_length(grid) <= 1024 and grid[0] == grid[1] == 31


def test_content_hash_tracks_the_pixels_and_the_size():
    a, b = noise_image(64, 64, seed=1), noise_image(64, 64, seed=2)
    pa, pb = process_image(a, SMALL), process_image(b, SMALL)
    assert pa.content_hash != pb.content_hash
    assert process_image(a.copy(), SMALL).content_hash == pa.content_hash
    flat = torch.zeros(3, 14, 28, dtype=torch.bfloat16)
    assert pixel_hash(flat) != pixel_hash(flat.reshape(3, 28, 14))  # same bytes, other size


def test_zero_size_is_refused():
    with pytest.raises(ValueError, match="zero size"):
        plan_grid(0, 10, RELEASE)
