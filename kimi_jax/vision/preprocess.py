"""Image bytes -> the tower's inputs: decode and check with Pillow, resize to the patch grid, normalise, patchify.

The resize rule is Kimi-K2.5's processor (``navit_resize``): scale down (never up) so that the patch grid holds at
most ``max_patches`` patches and 512 per side, then pad right and bottom with black to a multiple of
``patch * merge`` pixels; when that padding overshoots ``max_patches`` (the reference allows it), the image is
scaled down further until it fits, since serving compiles the encoder for a fixed largest grid. Resampling is
Pillow's bicubic. Patches are emitted in merge-block order (the 4 patches of each merged token adjacent, in
row-major order within the 2x2 block; merged tokens row-major), so the 2x2 merge is a reshape.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math

import numpy as np
from PIL import Image, UnidentifiedImageError

from kimi_jax.vision.config import VisionConfig

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
"""Image formats accepted (the first frame of an animated GIF / WebP is used)."""
MAX_PIXELS = 64 * 1024 * 1024
"""Largest decoded image (width x height) accepted; larger ones are refused before decoding."""
MAX_SIDE_PATCHES = 512


class ImageError(ValueError):
    """An image that cannot be used; the message says why (safe to show to a client)."""


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """One image ready for the encoder.

    pixels    [L, 3*P*P] f32  normalised patches in merge-block order (channel, row, column within a patch)
    rows/cols [L] int32       each patch's row / column in the patch grid (for the 2D RoPE)
    grid      (h, w)          patch grid; L = h * w, merged tokens L / 4
    size      (width, height) of the decoded image before resizing
    digest    bytes           blake2b of the image bytes (prefix-cache identity)
    """

    pixels: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    grid: tuple[int, int]
    size: tuple[int, int]
    digest: bytes

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_patches // 4


def navit_resize(height: int, width: int, patch: int, merge: int, max_patches: int,
                 max_side: int = MAX_SIDE_PATCHES) -> tuple[tuple[int, int], tuple[int, int]]:
    """Kimi-K2.5's resize rule: -> ((resized height, width), (padded height, width)) in pixels."""
    current = max(1.0, height // patch) * max(1.0, width // patch)
    scale = min(1.0, math.sqrt(max_patches / current), max_side * patch / height, max_side * patch / width)
    new_h = min(max(1, int(height * scale)), max_side * patch)
    new_w = min(max(1, int(width * scale)), max_side * patch)
    factor = merge * patch
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def fit_grid(height: int, width: int, cfg: VisionConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """``navit_resize`` shrunk further until the padded grid holds at most ``cfg.max_patches`` patches."""
    budget = cfg.max_patches
    while True:
        resized, padded = navit_resize(height, width, cfg.patch_size, cfg.merge[0], budget)
        if (padded[0] // cfg.patch_size) * (padded[1] // cfg.patch_size) <= cfg.max_patches:
            return resized, padded
        budget = max(1, int(budget * 0.9))


def decode_image(data: bytes, *, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Bytes -> an RGB image, or ImageError (empty, not an image, an unsupported format, too large, truncated)."""
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as err:
        raise ImageError(f"the image is too large; at most {max_pixels} pixels are accepted") from err
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ImageError("the data is not an image Pillow can read (PNG, JPEG, GIF, WebP or BMP)") from err
    if image.format not in FORMATS:
        raise ImageError(f"unsupported image format {image.format}; use one of {', '.join(FORMATS)}")
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"the image has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(f"the image is {width}x{height} pixels; at most {max_pixels} pixels are accepted")
    try:
        image.load()  # decodes now: truncated or corrupt data fails here
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise ImageError("the image data is truncated or corrupt") from err


def merge_block_order(h: int, w: int) -> np.ndarray:
    """Raster patch indices of a (h, w) grid in merge-block order. [h*w] int64."""
    raster = np.arange(h * w).reshape(h // 2, 2, w // 2, 2)
    return raster.transpose(0, 2, 1, 3).reshape(-1)


def patchify(array: np.ndarray, patch: int) -> np.ndarray:
    """[H, W, 3] f32 -> [H/P * W/P, 3*P*P] raster-order patches, each flattened as (channel, row, column)."""
    h, w = array.shape[0] // patch, array.shape[1] // patch
    patches = array.reshape(h, patch, w, patch, 3).transpose(0, 2, 4, 1, 3)
    return patches.reshape(h * w, 3 * patch * patch)


def prepare_pil(image: Image.Image, cfg: VisionConfig, digest: bytes) -> PreparedImage:
    """A decoded RGB image -> PreparedImage (resize, pad, normalise, patchify in merge-block order)."""
    width, height = image.size
    (new_h, new_w), (pad_h, pad_w) = fit_grid(height, width, cfg)
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    canvas = np.zeros((pad_h, pad_w, 3), np.float32)
    canvas[:new_h, :new_w] = np.asarray(image, np.float32) / 255.0
    canvas = (canvas - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    p = cfg.patch_size
    gh, gw = pad_h // p, pad_w // p
    order = merge_block_order(gh, gw)
    return PreparedImage(pixels=patchify(canvas, p)[order], rows=(order // gw).astype(np.int32),
                         cols=(order % gw).astype(np.int32), grid=(gh, gw), size=(width, height), digest=digest)


def prepare_image(data: bytes, cfg: VisionConfig) -> PreparedImage:
    """Image bytes -> PreparedImage; ImageError when the bytes are not a usable image."""
    return prepare_pil(decode_image(data), cfg, hashlib.blake2b(data, digest_size=16).digest())


def bicubic_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Resampling a ``side``-long table to ``size`` positions (half-pixel centres, Keys a = -0.75, edge clamp):
    the 4 source taps and weights of each target ``index``. -> ([n, 4] int32, [n, 4] f32)."""
    src = (index.astype(np.float64) + 0.5) * side / size - 0.5
    floor = np.floor(src)
    offsets = np.arange(-1, 3)
    taps = np.clip(floor[:, None].astype(np.int64) + offsets, 0, side - 1)
    d = np.abs(src[:, None] - floor[:, None] - offsets)
    a = -0.75
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return taps.astype(np.int32), np.where(d <= 1, near, far).astype(np.float32)


def position_taps(rows: np.ndarray, cols: np.ndarray, grid: tuple[int, int], cfg: VisionConfig
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the flattened learned position table and their weights for each patch (bicubic resampling
    of the ``pos_emb_height x pos_emb_width`` table to the image's grid). -> ([L, 16] int32, [L, 16] f32)."""
    n = len(rows)
    r_taps, r_w = bicubic_taps(rows, np.full(n, grid[0]), cfg.pos_emb_height)
    c_taps, c_w = bicubic_taps(cols, np.full(n, grid[1]), cfg.pos_emb_width)
    index = r_taps[:, :, None] * cfg.pos_emb_width + c_taps[:, None, :]
    return index.reshape(n, 16).astype(np.int32), (r_w[:, :, None] * c_w[:, None, :]).reshape(n, 16)
