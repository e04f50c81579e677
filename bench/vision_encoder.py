"""DeepSeek-V4.1's vision encoder time per image: the ViT, the 3x3 unfold and the aligner, with the span's
delimiter rows (`deepinfer_core.models.deepseek_v41.vision_tower.encode_span`, what
`DeepseekV41ForCausalLM.encode_image` runs), at the release's tower size, in bf16 on one CUDA GPU (the
attention through `scaled_dot_product_attention`, on tensor cores).

    python bench/vision_encoder.py [--sizes 546x546,1036x1036] [--repeats 20] [--tiny]

`--sizes` are processed sizes (multiples of 14): the defaults are what 448x448 and 1024x1024 images become
under the release's image processor (a 448² image is below `min_pixels` 295,936, so it is scaled to 544²
and rounded up to whole patches: 39x39 patches, a 13x13 span grid, 184 positions; 1024² rounds up to 74x74
patches, 25x25, 652 positions). The weights are random (the time does not depend on their values). One
JSON line per size: patches, span positions, the median and best milliseconds per image (after warm-up,
the device synchronised around each image), and the tower's share. Record GPU results in bench/RESULTS.md.

`--tiny` is the smoke mode the test suite runs on the CPU: the tiny checkpoint's tower
(`v41_tiny.TINY_VISION`), fp32, small sizes, one repeat. Its times mean nothing; it proves the bench runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from deepinfer_core.models.deepseek_v41.config import V41VisionConfig
from deepinfer_core.models.deepseek_v41.vision import VisionConfig, image_span
from deepinfer_core.models.deepseek_v41.vision_tower import Aligner, VisionTower, encode_span, to_patches
from deepinfer_core.models.v41_tiny import TINY_VISION

RELEASE_TEXT_WIDTH = 5120


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        height, _, width = item.strip().partition("x")
        sizes.append((int(height), int(width or height)))
    return sizes


def build(vision: dict, text_width: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A tower, an aligner and the three delimiter rows with random weights (scaled as a trained tower's)."""
    vc = VisionConfig.of(SimpleNamespace(vision_config=V41VisionConfig(**vision), image_token_id=129264,
                                         hidden_size=text_width))
    torch.manual_seed(seed)
    tower, aligner = VisionTower(vc, dtype).to(device), Aligner(vc, dtype).to(device)
    with torch.no_grad():
        for name, param in [*tower.named_parameters(), *aligner.named_parameters()]:
            if not name.endswith("norm.weight") and "norm1" not in name and "norm2" not in name:
                param.normal_(0, 0.02)
    delimiters = tuple(torch.randn(text_width, dtype=dtype, device=device) * 0.02 for _ in range(3))
    return vc, tower, aligner, delimiters


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_size(parts, size: tuple[int, int], repeats: int, warmup: int, device: torch.device) -> dict:
    """Milliseconds per image for `size`: the whole span, and the tower alone."""
    vc, tower, aligner, delimiters = parts
    span = image_span(vc, *size)
    pixels = (torch.rand(3, *size, device=device) * 2 - 1).to(aligner.w1.weight.dtype)
    patches = to_patches(pixels, vc.patch_size)
    whole, alone = [], []
    for i in range(warmup + repeats):
        sync(device)
        start = time.perf_counter()
        out = encode_span(tower, aligner, delimiters, pixels)
        sync(device)
        middle = time.perf_counter()
        tower(patches, span.n_vit_h, span.n_vit_w)
        sync(device)
        if i >= warmup:
            whole.append((middle - start) * 1e3)
            alone.append((time.perf_counter() - middle) * 1e3)
    assert out.shape == (span.length, aligner.w2.weight.shape[0])
    return {"size": f"{size[0]}x{size[1]}", "patches": span.num_patches, "span_positions": span.length,
            "ms_per_image": round(statistics.median(whole), 3), "best_ms": round(min(whole), 3),
            "tower_ms": round(statistics.median(alone), 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help="processed sizes HxW, comma-separated (multiples of 14)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke mode (tiny tower, fp32)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        vision, width, dtype = dict(TINY_VISION), 64, torch.float32
        sizes, repeats, warmup = parse_sizes(args.sizes or "126x126,42x168"), 1, 0
    else:
        vision, width, dtype = {}, RELEASE_TEXT_WIDTH, torch.bfloat16
        sizes, repeats, warmup = parse_sizes(args.sizes or "546x546,1036x1036"), args.repeats, args.warmup
    parts = build(vision, width, dtype, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "dtype": str(dtype).removeprefix("torch."), "vision_layers": parts[0].num_layers,
                      "vision_dim": parts[0].dim, "text_width": width}))
    for size in sizes:
        print(json.dumps(time_size(parts, size, repeats, warmup, device)), flush=True)


if __name__ == "__main__":
    main()
