"""Untrusted image bytes to an RGB `PIL.Image`, under limits, with one clear error for anything wrong.

Every failure is an `ImageError` (a `ValueError`: the server answers 400): too many bytes, too many
pixels (checked from the header, before any pixel is decoded, so a decompression bomb never expands),
zero size, an animation, a truncated or undecodable file, a bit depth the processor cannot keep
(16-bit and float images: Pillow's conversion would clip them to white). Palette, alpha, grey, CMYK
and YCbCr images are converted to RGB as DeepSeek's processor converts them (`convert("RGB")`: alpha
is dropped, not composited).
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import Any

from deepinfer_core.config import EngineConfig

_FIELDS = EngineConfig.model_fields
DEFAULT_MAX_IMAGE_BYTES: int = _FIELDS["max_image_bytes"].default
DEFAULT_MAX_IMAGE_PIXELS: int = _FIELDS["max_image_pixels"].default
DEFAULT_MAX_IMAGES_PER_PROMPT: int = _FIELDS["max_images_per_prompt"].default
_HIGH_DEPTH_MODES = ("I", "F")
"""Pillow modes (and the "I;16..." family) that `convert("RGB")` would clip to 8 bits."""


class ImageError(ValueError):
    """An image the engine cannot take; the message says why in one sentence."""


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on one request's images (`EngineConfig.max_image_bytes`, `max_image_pixels`,
    `max_images_per_prompt`)."""

    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images_per_prompt: int = DEFAULT_MAX_IMAGES_PER_PROMPT

    @classmethod
    def from_config(cls, config: Any) -> ImageLimits:
        """The limits an `EngineConfig` sets."""
        return cls(config.max_image_bytes, config.max_image_pixels, config.max_images_per_prompt)

    def check_count(self, num_images: int) -> None:
        """Raise `ImageError` when a prompt carries more images than allowed."""
        if num_images > self.max_images_per_prompt:
            raise ImageError(f"the prompt has {num_images} images but at most {self.max_images_per_prompt} are "
                             "allowed (max_images_per_prompt)")


DEFAULT_LIMITS = ImageLimits()
"""The engine's default limits (`EngineConfig`'s defaults)."""


def pil_image_module():
    """`PIL.Image`, or an `ImportError` saying how to install it."""
    try:
        from PIL import Image
    except ImportError as err:
        from deepinfer_core.plugins import install_hint

        raise ImportError(f"image input needs Pillow: {install_hint('vision')}") from err
    return Image


def image_bytes_from_url(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; any other URL is refused (nothing is fetched)."""
    if not isinstance(url, str) or not url:
        raise ImageError("an image URL must be a non-empty string")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ImageError(f"image URLs with scheme {scheme!r} are not fetched; send the image inline as a "
                         "data:image/...;base64,... URL")
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise ImageError("a data: image URL must be base64-encoded (data:image/png;base64,...)")
    return decode_base64(payload)


def decode_base64(payload: str) -> bytes:
    """Strict base64 (Anthropic's `source.data`, a data URL's payload) to bytes, or `ImageError`."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError(f"the image's base64 data is invalid ({err})") from None


def decode_image(source: Any, limits: ImageLimits = DEFAULT_LIMITS):
    """An RGB `PIL.Image` from encoded bytes or a `PIL.Image`, checked against `limits`."""
    Image = pil_image_module()
    if isinstance(source, Image.Image):
        _check_size(source.size, limits)
        image = source
    elif isinstance(source, (bytes, bytearray, memoryview)):
        image = _open_bytes(Image, bytes(source), limits)
    else:
        raise ImageError(f"an image is encoded bytes or a PIL.Image, not {type(source).__name__}")
    if getattr(image, "is_animated", False):
        raise ImageError("animated images are not supported; send a single frame")
    if image.mode.startswith(_HIGH_DEPTH_MODES):
        raise ImageError(f"{image.mode!r} images (16-bit or floating point) are not supported; send 8-bit RGB")
    try:
        return image.convert("RGB")
    except Exception as err:  # noqa: BLE001 - Pillow raises ValueError or OSError by mode: one answer
        raise ImageError(f"the image cannot be converted to RGB ({err})") from None


def _check_size(size: tuple[int, int], limits: ImageLimits) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"the image has zero size ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise ImageError(f"the image has {width}x{height} = {width * height} pixels but at most "
                         f"{limits.max_image_pixels} are allowed (max_image_pixels)")


def _open_bytes(Image, data: bytes, limits: ImageLimits):
    if len(data) > limits.max_image_bytes:
        raise ImageError(f"the image is {len(data)} bytes but at most {limits.max_image_bytes} are allowed "
                         "(max_image_bytes)")
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    with warnings.catch_warnings():
        # Pillow only warns below twice its own bound; our bound, checked first, is the one that counts
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageError(f"the image has more pixels than Pillow's bound (a decompression bomb); at most "
                             f"{limits.max_image_pixels} are allowed (max_image_pixels)") from None
        except Exception as err:  # noqa: BLE001 - UnidentifiedImageError, SyntaxError, struct errors: not an image
            raise ImageError(f"the data is not an image Pillow can read ({type(err).__name__})") from None
        _check_size(image.size, limits)  # from the header: nothing decoded yet
        try:
            image.load()
        except Exception as err:  # noqa: BLE001 - truncated data, corrupt streams: one answer
            raise ImageError(f"the image could not be decoded ({err})") from None
    return image
