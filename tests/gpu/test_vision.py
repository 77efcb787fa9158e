"""The vision tower on the GPU: XLA's and cuDNN's attention against the fp32 tower on one padded batch of images of
different sizes (so the per-image key lengths matter), at the real tower's head size (128).

Tolerance: bf16 weights and activations through 4 blocks: 2e-2 of the largest fp32 output (the bf16 bound of the
CPU tests); both implementations must meet it, and rows past an image's patches are not compared (padding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.vision.config import VisionConfig
from kimi_jax.vision.preprocess import PreparedImage, merge_block_order
from kimi_jax.vision.tower import VisionModel, encode_tower, pack_images


def _image(h: int, w: int, cfg: VisionConfig, rng) -> PreparedImage:
    order = merge_block_order(h, w)
    pixels = rng.standard_normal((h * w, cfg.patch_dim)).astype(np.float32)
    return PreparedImage(pixels, (order // w).astype(np.int32), (order % w).astype(np.int32), (h, w),
                         (h * 14, w * 14), b"")


@pytest.mark.kernel("vision tower attention")
@pytest.mark.parametrize("attention", [None, "cudnn"])
def test_tower_attention_bf16(attention, check):
    cfg = VisionConfig(text_hidden_size=256, hidden_size=512, num_layers=4, num_heads=4, head_dim=128,
                       intermediate_size=1024, max_patches=1024)
    model32 = VisionModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model32)
    model16 = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
    rng = np.random.default_rng(1)
    images = [_image(h, w, cfg, rng) for h, w in ((32, 32), (10, 6), (2, 2), (20, 14))]
    batch = jax.tree.map(jnp.asarray, pack_images(images, 4, 1024, cfg))
    with jax.default_matmul_precision("highest"):
        want = np.asarray(encode_tower(model32, batch))
    got = np.asarray(encode_tower(model16, batch, attention).astype(jnp.float32))
    error = max(float(np.abs(got[i, :im.num_patches] - want[i, :im.num_patches]).max()) for i, im in enumerate(images))
    check(f"attention={attention or 'xla'} max error / max |fp32|", error / float(np.abs(want).max()), 2e-2)
