"""A prompt's images laid into its token ids, as DeepSeek-V4.1's reference lays them: each
`image_token_id` in the ids stands for one image (in order) and is expanded into the image's span, every
position of which carries `image_token_id` (the start, the grid rows each closed by a newline, the end);
the model tells the positions apart by their place in the span, and the vision encoder gives each its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer_core.models.deepseek_v41.vision import image_span
from deepinfer_core.multimodal.decode import DEFAULT_LIMITS, ImageError, ImageLimits, decode_image
from deepinfer_core.multimodal.processor import VisionGeometry, process_image
from deepinfer_core.plan import ImageInput


def vision_geometry(model_config: Any) -> VisionGeometry:
    """The processor's geometry for a model, or `ImageError` when the model takes no images."""
    vision = getattr(model_config, "vision_config", None)
    if vision is None or getattr(vision, "num_hidden_layers", 0) == 0 or not hasattr(model_config, "image_token_id"):
        model_type = getattr(model_config, "model_type", type(model_config).__name__)
        raise ImageError(f"this model ({model_type}) has no vision tower: it takes text only, not images")
    return VisionGeometry.from_vision_config(vision)


def lay_images(prompt_token_ids: Sequence[int], images: Sequence[Any], model_config: Any,
               limits: ImageLimits = DEFAULT_LIMITS) -> tuple[list[int], tuple[ImageInput, ...]]:
    """Decode, process and lay `images` (encoded bytes or `PIL.Image`s) into the prompt.

    :returns: the token ids with each placeholder expanded into its span, and the `ImageInput`s.
    :raises ImageError: a model without a vision tower, a count of placeholders other than the images',
        more images than `limits` allow, or an image that is not acceptable (`decode_image`).
    """
    geometry = vision_geometry(model_config)
    limits.check_count(len(images))
    image_id = model_config.image_token_id
    num_placeholders = sum(1 for t in prompt_token_ids if t == image_id)
    if num_placeholders != len(images):
        raise ImageError(f"the prompt has {num_placeholders} image placeholders (token {image_id}) but "
                         f"{len(images)} images were given; put one placeholder where each image goes")
    processed = iter([process_image(decode_image(image, limits), geometry) for image in images])
    ids: list[int] = []
    laid: list[ImageInput] = []
    for token in prompt_token_ids:
        if token != image_id:
            ids.append(token)
            continue
        image = next(processed)
        span = image_span(model_config, *image.size)  # the model's own layout of the span
        laid.append(ImageInput(len(ids), span.length, image.content_hash, image.pixel_values))
        ids.extend(span.token_ids)
    return ids, tuple(laid)
