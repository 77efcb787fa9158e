"""Native vision: the MoonViT tower and projector of Kimi K2.5 / K3 (``tower.py``), their config (``config.py``),
hub-layout weights (``weights.py``), and image preprocessing with Pillow (``preprocess.py``)."""

from kimi_jax.vision.config import VisionConfig
from kimi_jax.vision.preprocess import ImageError, PreparedImage, prepare_image
from kimi_jax.vision.tower import VisionModel, encode_images

__all__ = ["VisionConfig", "VisionModel", "encode_images", "ImageError", "PreparedImage", "prepare_image"]
