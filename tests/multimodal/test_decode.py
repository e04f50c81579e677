"""Untrusted image bytes: each hostile image is one clear `ImageError`, never a crash or a hang."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("PIL.Image")
from PIL import Image

from deepinfer_core.multimodal import ImageError, ImageLimits, decode_image, image_bytes_from_url
from tests.multimodal.images import HOSTILE, cmyk_jpeg, png_bytes


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_image_is_a_clear_error(name):
    make, words = HOSTILE[name]
    start = time.perf_counter()
    with pytest.raises(ImageError, match=words) as info:
        decode_image(make())
    assert time.perf_counter() - start < 5  # never a hang: the bomb is refused from its header
    assert "\n" not in str(info.value)


def test_limits_are_checked_before_decoding():
    data = png_bytes(64, 64)
    with pytest.raises(ImageError, match="max_image_bytes"):
        decode_image(data, ImageLimits(max_image_bytes=len(data) - 1))
    with pytest.raises(ImageError, match="max_image_pixels"):
        decode_image(data, ImageLimits(max_image_pixels=64 * 64 - 1))
    assert decode_image(data, ImageLimits(max_image_pixels=64 * 64)).size == (64, 64)
    with pytest.raises(ImageError, match="max_images_per_prompt"):
        ImageLimits(max_images_per_prompt=2).check_count(3)


def test_zero_size_pil_image_is_refused():
    with pytest.raises(ImageError, match="zero size"):
        decode_image(Image.new("RGB", (0, 5)))


@pytest.mark.parametrize("mode", ["P", "RGBA", "LA", "L", "1"])
def test_other_modes_convert_as_the_reference_does(mode):
    image = decode_image(png_bytes(20, 10, mode=mode))
    reference = Image.open(__import__("io").BytesIO(png_bytes(20, 10, mode=mode))).convert("RGB")
    assert image.mode == "RGB" and image.tobytes() == reference.tobytes()


def test_cmyk_converts():
    assert decode_image(cmyk_jpeg()).mode == "RGB"


def test_pil_input_is_taken_as_is():
    source = Image.new("RGB", (7, 9), (1, 2, 3))
    assert decode_image(source).tobytes() == source.tobytes()
    with pytest.raises(ImageError, match="not str"):
        decode_image("picture.png")


def test_data_urls_decode_and_other_urls_are_refused():
    import base64

    data = png_bytes(8, 8)
    assert image_bytes_from_url("data:image/png;base64," + base64.b64encode(data).decode()) == data
    with pytest.raises(ImageError, match="not fetched"):
        image_bytes_from_url("https://example.com/cat.png")
    with pytest.raises(ImageError, match="not fetched"):
        image_bytes_from_url("file:///etc/passwd")
    with pytest.raises(ImageError, match="base64-encoded"):
        image_bytes_from_url("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="base64 data is invalid"):
        image_bytes_from_url("data:image/png;base64,@@@")


def test_a_missing_pillow_says_what_to_install(monkeypatch):
    import sys

    from deepinfer_core.multimodal.decode import pil_image_module

    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL now fails as if it were not installed
    with pytest.raises(ImportError, match=r"deepinfer\[vision\]"):
        pil_image_module()
