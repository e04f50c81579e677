"""Image input: decoding untrusted bytes under limits (`decode`), DeepSeek-V4.1's image processor
(`processor`), and a prompt's images laid into their spans (`spans`).

Pillow is the optional `deepinfer[vision]` extra, imported only when an image arrives.
"""

from deepinfer_core.multimodal.decode import ImageError, ImageLimits, decode_image, image_bytes_from_url
from deepinfer_core.multimodal.processor import ProcessedImage, VisionGeometry, plan_grid, process_image
from deepinfer_core.multimodal.spans import lay_images, vision_geometry

__all__ = ["ImageError", "ImageLimits", "ProcessedImage", "VisionGeometry", "decode_image",
           "image_bytes_from_url", "lay_images", "plan_grid", "process_image", "vision_geometry"]
