"""DeepSeek-V4.1's vision side as the model sees it: the tower's configuration and the image span's layout.

An image whose processed size is H x W pixels (both multiples of `patch_size`, 14 in the release) is an
`n_vit_h x n_vit_w` grid of patches for the ViT (`vision_tower.py`); the 3x3 unfold of the aligner turns
it into an `n_llm_h x n_llm_w` grid (`ceil(n_vit / 3)`, the last row and column zero-padded), which the
language model reads as one span of prompt positions, in this order (DeepSeek's `image_processor.py`):

    image_start, (image row 0 ... image row n_llm_w - 1, image_newline) x n_llm_h, image_end

so `n_llm_h * (n_llm_w + 1) + 2` positions, every one carrying `image_token_id` (129264) in the ids: only
the position's kind (`ImageSpan.kinds`) tells them apart. Every position of the span, the delimiters
included, is an image position for the language model: the router selects with `bias_vl` there, Engram's
gate is 0 there and its n-grams break there (the reference's `token_types >= 0`).

Under tensor, expert and data parallelism the tower (about 0.5 B parameters in the release) is replicated:
every rank holds it whole, loaded from the same tensors, and the rank that prefills a request encodes its
images (`DeepseekV41ForCausalLM.encode_image`); tensor-parallel ranks each encode the same image (the
residual streams are whole on every rank). Image positions under expert parallelism are refused (their
`bias_vl` routing would be a second MoE dispatch every rank must pair; `DeepseekV41ForCausalLM.moe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = range(4)
"""The kinds of an image span's positions (the reference's token types; text is -1 there)."""


@dataclass(frozen=True)
class VisionConfig:
    """The vision fields of a V4.1 config (`vision_config`, plus the root's `image_token_id` and the
    language model's width the aligner projects into). Build it with `VisionConfig.of(config)`."""

    num_layers: int
    dim: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    downsample_ratio: int
    rope_theta: float
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None
    image_token_id: int
    text_hidden_size: int
    norm_eps: float = 1e-6
    """The ViT's RMSNorm epsilon (the reference's default; not in config.json)."""

    @classmethod
    def of(cls, config) -> VisionConfig | None:
        """The vision configuration of a `V41Config`; None when it has no tower (no `vision_config`, or
        `num_hidden_layers` 0, as the reference's `vision_enabled`)."""
        vc = getattr(config, "vision_config", None)
        if vc is None or vc.num_hidden_layers == 0:
            return None
        return cls(num_layers=vc.num_hidden_layers, dim=vc.hidden_size, num_heads=vc.num_attention_heads,
                   intermediate_size=vc.intermediate_size, patch_size=vc.patch_size,
                   downsample_ratio=vc.downsample_ratio, rope_theta=vc.rope_theta,
                   max_image_tokens=vc.max_image_tokens, min_pixels=vc.min_pixels, max_wh_ratio=vc.max_wh_ratio,
                   image_token_id=config.image_token_id, text_hidden_size=config.hidden_size)

    def __post_init__(self) -> None:
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.dim} must split into {self.num_heads} heads of a width "
                             "divisible by 4 (the 2-D rope rotates two halves of two halves)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_dim(self) -> int:
        """Rope angles per head: half the head width (each of the two halves rotated by them)."""
        return self.head_dim // 2

    @property
    def unfolded_dim(self) -> int:
        """The aligner's input width: one `downsample_ratio`² block of ViT rows."""
        return self.dim * self.downsample_ratio**2


@dataclass(frozen=True)
class ImageSpan:
    """The prompt positions an image of processed size `height x width` takes (`image_span`)."""

    height: int
    width: int
    n_vit_h: int
    """Patch rows the ViT sees (`height // patch_size`)."""
    n_vit_w: int
    n_llm_h: int
    """Aligner rows (`ceil(n_vit_h / downsample_ratio)`): the span's image rows."""
    n_llm_w: int
    image_token_id: int

    @property
    def length(self) -> int:
        """Positions in the span: `n_llm_h * (n_llm_w + 1) + 2`."""
        return num_span_positions(self.n_llm_h, self.n_llm_w)

    @property
    def num_patches(self) -> int:
        return self.n_vit_h * self.n_vit_w

    @property
    def kinds(self) -> list[int]:
        """Each position's kind (`IMAGE_START`, `IMAGE`, `IMAGE_NEWLINE`, `IMAGE_END`), in order."""
        return [IMAGE_START, *([IMAGE] * self.n_llm_w + [IMAGE_NEWLINE]) * self.n_llm_h, IMAGE_END]

    @property
    def token_ids(self) -> list[int]:
        """The ids the span lays into the prompt: `image_token_id` at every position."""
        return [self.image_token_id] * self.length


def num_span_positions(n_llm_h: int, n_llm_w: int) -> int:
    """Positions of the span of an `n_llm_h x n_llm_w` aligner grid (start, rows with their newline, end)."""
    return n_llm_h * (n_llm_w + 1) + 2


def vision_config(config) -> VisionConfig:
    """`config` itself when it is a `VisionConfig`, else the `V41Config`'s (a `ValueError` without a tower)."""
    if isinstance(config, VisionConfig):
        return config
    found = VisionConfig.of(config)
    if found is None:
        raise ValueError("this DeepSeek-V4.1 config has no vision tower (no vision_config, or 0 layers): "
                         "it cannot take images")
    return found


def check_image_input(config, expert_parallel: bool = False) -> None:
    """Raise unless a model of `config` (a `V41Config`) can take images: a `ValueError` without a tower, a
    `NotImplementedError` under expert parallelism. Check it when a request with images is admitted: a
    refusal in the middle of a step would leave the other expert-parallel ranks waiting on its dispatch."""
    vision_config(config)
    if expert_parallel:
        raise NotImplementedError("images under expert parallelism: their bias_vl routing would be a second MoE "
                                  "dispatch every rank must pair; serve images without enable_expert_parallel")


def image_span(config, height: int, width: int) -> ImageSpan:
    """The span an image of processed size `height x width` pixels takes (`config`: a `VisionConfig` or
    a `V41Config`); both must be positive multiples of the patch size, as the image processor makes them."""
    vc = vision_config(config)
    p, r = vc.patch_size, vc.downsample_ratio
    for name, size in (("height", height), ("width", width)):
        if not isinstance(size, int) or size <= 0 or size % p:
            raise ValueError(f"an image's processed {name} must be a positive multiple of the patch size {p}, "
                             f"got {size!r}")
    n_vit_h, n_vit_w = height // p, width // p
    return ImageSpan(height, width, n_vit_h, n_vit_w, math.ceil(n_vit_h / r), math.ceil(n_vit_w / r),
                     vc.image_token_id)
