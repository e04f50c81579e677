"""Image bytes for the multimodal tests: ordinary ones and hostile ones, built in memory."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np


def png_bytes(width: int = 64, height: int = 48, seed: int = 0, mode: str = "RGB") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    if mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def truncated_png() -> bytes:
    data = png_bytes(128, 128)
    return data[: len(data) // 2]


def bomb_png(side: int = 60000) -> bytes:
    """A valid PNG header claiming `side` x `side` pixels (3.6 G pixels) whose IDAT is a tiny zlib stream:
    a decompression bomb if decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit grey
    row = b"\x00" + b"\x00" * side
    body = zlib.compress(row * 16, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def animated_gif() -> bytes:
    from PIL import Image

    frames = [Image.new("RGB", (16, 16), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    return out.getvalue()


def sixteen_bit_png() -> bytes:
    from PIL import Image

    image = Image.fromarray(np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def cmyk_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("CMYK", (32, 32), (10, 200, 30, 40)).save(out, format="JPEG")
    return out.getvalue()


HOSTILE = {
    "truncated": (truncated_png, "could not be decoded"),
    "bomb": (bomb_png, "max_image_pixels"),
    "bomb below Pillow's bound": (lambda: bomb_png(9000), "pixels but at most"),
    "animated": (animated_gif, "animated"),
    "16-bit": (sixteen_bit_png, "16-bit"),
    "not an image": (lambda: b"GIF89a-no-really" + b"\x00" * 40, "not an image"),
    "empty": (lambda: b"", "empty"),
}
"""name -> (bytes factory, words the error says)."""
