"""The MoonViT vision tower and multimodal projector (Kimi K2.5 / K3) as one Flax nnx module and one function.

``encode_images(model, batch)`` runs B padded images of up to L patches each (``ImageBatch``, built on the host by
``pack_images``) and returns the projected merged tokens ``[B, L/4, D_text]`` that replace the image's
``<|media_pad|>`` rows in the text stream. Per block: LayerNorm -> fused qkv (q and k rows in interleaved
rotary pairs, the checkpoint's order) -> axial 2D RoPE (pair 2m turns by column * f_m, pair 2m+1 by row * f_m)
-> attention within the image -> output projection; LayerNorm -> GELU-tanh MLP. Then the final LayerNorm, the
projector's LayerNorm per patch, the 2x2 merge (a reshape: patches arrive in merge-block order), Linear, exact
GELU, Linear. Layer parameters are stacked ``[L_vit, ...]`` and the blocks run under ``lax.scan``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.layers.common import F32, constant, linear, normal
from kimi_jax.vision.config import VisionConfig
from kimi_jax.vision.preprocess import PreparedImage, position_taps


@partial(jax.tree_util.register_dataclass, data_fields=["pixels", "rows", "cols", "taps", "tap_weights", "valid"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ImageBatch:
    """B images padded to L patches (merge-block order; an image's patches first, then padding).

    pixels      [B, L, 3*P*P] f32   normalised patches
    rows, cols  [B, L] int32        patch grid coordinates (RoPE)
    taps        [B, L, 16] int32    flattened position-table indices of the bicubic resampling
    tap_weights [B, L, 16] f32      their weights
    valid       [B, L] bool         real patches (a prefix of each lane)
    """

    pixels: jax.Array
    rows: jax.Array
    cols: jax.Array
    taps: jax.Array
    tap_weights: jax.Array
    valid: jax.Array


def pack_images(images: list[PreparedImage], batch: int, patches: int, cfg: VisionConfig) -> ImageBatch:
    """Host-side ImageBatch (numpy) of ``images`` in lanes 0.. (unused lanes all padding)."""
    if len(images) > batch or any(im.num_patches > patches for im in images):
        raise ValueError(f"pack_images: {len(images)} images do not fit a batch of {batch} x {patches} patches")
    out = ImageBatch(pixels=np.zeros((batch, patches, cfg.patch_dim), np.float32),
                     rows=np.zeros((batch, patches), np.int32), cols=np.zeros((batch, patches), np.int32),
                     taps=np.zeros((batch, patches, 16), np.int32),
                     tap_weights=np.zeros((batch, patches, 16), np.float32), valid=np.zeros((batch, patches), bool))
    for b, im in enumerate(images):
        n = im.num_patches
        taps, weights = position_taps(im.rows, im.cols, im.grid, cfg)
        out.pixels[b, :n], out.rows[b, :n], out.cols[b, :n] = im.pixels, im.rows, im.cols
        out.taps[b, :n], out.tap_weights[b, :n], out.valid[b, :n] = taps, weights, True
    return out


class VisionModel(nnx.Module):
    """Tower + projector parameters ([in, out] linear weights; per-block ones stacked over ``num_layers``).

    patch_w [3*P*P, D], patch_b [D], pos_emb [Hp, Wp, D]; per block norm0/norm1 (w, b) [L, D], wqkv [L, D, 3A],
    wqkv_b [L, 3A], wo [L, A, D], wo_b [L, D] (A = heads x head dim), fc0 [L, D, F], fc0_b [L, F], fc1 [L, F, D], fc1_b [L, D];
    final_w/b [D]; projector pre_w/b [D], proj0 [4D, 4D], proj0_b [4D], proj2 [4D, D_text], proj2_b [D_text].
    """

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        d, f, n, m, t = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, 4 * cfg.hidden_size, \
            cfg.text_hidden_size
        a = cfg.attn_width
        self.patch_w = normal(rngs, (cfg.patch_dim, d), cfg.patch_dim ** -0.5, dtype)
        self.patch_b = constant((d,), 0.0, dtype)
        self.pos_emb = normal(rngs, (cfg.pos_emb_height, cfg.pos_emb_width, d), 0.02, dtype)
        self.norm0_w, self.norm0_b = constant((n, d), 1.0, dtype), constant((n, d), 0.0, dtype)
        self.wqkv, self.wqkv_b = normal(rngs, (n, d, 3 * a), d ** -0.5, dtype), constant((n, 3 * a), 0.0, dtype)
        self.wo, self.wo_b = normal(rngs, (n, a, d), a ** -0.5 / n ** 0.5, dtype), constant((n, d), 0.0, dtype)
        self.norm1_w, self.norm1_b = constant((n, d), 1.0, dtype), constant((n, d), 0.0, dtype)
        self.fc0, self.fc0_b = normal(rngs, (n, d, f), d ** -0.5, dtype), constant((n, f), 0.0, dtype)
        self.fc1, self.fc1_b = normal(rngs, (n, f, d), f ** -0.5 / n ** 0.5, dtype), constant((n, d), 0.0, dtype)
        self.final_w, self.final_b = constant((d,), 1.0, dtype), constant((d,), 0.0, dtype)
        self.pre_w, self.pre_b = constant((d,), 1.0, dtype), constant((d,), 0.0, dtype)
        self.proj0, self.proj0_b = normal(rngs, (m, m), m ** -0.5, dtype), constant((m,), 0.0, dtype)
        self.proj2, self.proj2_b = normal(rngs, (m, t), m ** -0.5, dtype), constant((t,), 0.0, dtype)

    @property
    def dtype(self):
        return self.patch_w.dtype


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in fp32, result in x's dtype."""
    xf = x.astype(F32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w.astype(F32) + b.astype(F32)).astype(x.dtype)


def rope_angles(rows: jax.Array, cols: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Axial 2D RoPE angles of interleaved pairs: pair 2m uses col * f_m, pair 2m + 1 row * f_m, with
    f_m = theta^(-4m / head_dim). [..., L] -> [..., L, head_dim / 2] f32."""
    freqs = theta ** (-jnp.arange(0, head_dim // 2, 2, dtype=F32) / (head_dim // 2))  # [head_dim / 4]
    by_col = cols[..., None].astype(F32) * freqs
    by_row = rows[..., None].astype(F32) * freqs
    return jnp.stack([by_col, by_row], axis=-1).reshape(*rows.shape, head_dim // 2)


def rotate_pairs(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate interleaved pairs of x [B, L, H, K] by angles [B, L, K/2] (fp32 math, x's dtype out)."""
    pairs = x.astype(F32).reshape(*x.shape[:-1], -1, 2)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    a, b = pairs[..., 0], pairs[..., 1]
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape).astype(x.dtype)


def _block(cfg: VisionConfig, lengths: jax.Array, attention: str | None, angles: jax.Array, x: jax.Array,
           p: dict) -> jax.Array:
    bsz, length, _ = x.shape
    h = layer_norm(x, p["norm0_w"], p["norm0_b"], cfg.norm_eps)
    qkv = linear(h, p["wqkv"]) + p["wqkv_b"].astype(x.dtype)
    q, k, v = (t.reshape(bsz, length, cfg.num_heads, cfg.attn_head_dim) for t in jnp.split(qkv, 3, axis=-1))
    q, k = rotate_pairs(q, angles), rotate_pairs(k, angles)
    o = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation=attention)
    x = x + linear(o.reshape(bsz, length, -1), p["wo"]) + p["wo_b"].astype(x.dtype)
    h = layer_norm(x, p["norm1_w"], p["norm1_b"], cfg.norm_eps)
    h = jax.nn.gelu(linear(h, p["fc0"]) + p["fc0_b"].astype(x.dtype), approximate=True)
    return x + linear(h, p["fc1"]) + p["fc1_b"].astype(x.dtype)


BLOCK_PARAMS = ("norm0_w", "norm0_b", "wqkv", "wqkv_b", "wo", "wo_b", "norm1_w", "norm1_b", "fc0", "fc0_b", "fc1",
                "fc1_b")


def encode_tower(model: VisionModel, batch: ImageBatch, attention: str | None = None) -> jax.Array:
    """The tower: -> final-LayerNormed patch states [B, L, D] (model dtype). ``attention``: the implementation of
    ``jax.nn.dot_product_attention`` (None: XLA; "cudnn" on a GPU in bf16)."""
    cfg = model.config
    dtype = model.dtype
    x = linear(batch.pixels.astype(dtype), model.patch_w[...]) + model.patch_b[...]
    table = model.pos_emb[...].reshape(-1, cfg.hidden_size).astype(F32)
    pos = jnp.einsum("blt,bltd->bld", batch.tap_weights, table[batch.taps])
    x = (x.astype(F32) + pos).astype(dtype)
    lengths = batch.valid.sum(axis=1, dtype=jnp.int32)
    lengths = jnp.where(lengths > 0, lengths, x.shape[1])  # an empty lane attends to everything, not to nothing
    angles = rope_angles(batch.rows, batch.cols, cfg.attn_head_dim, cfg.rope_theta)
    params = {name: getattr(model, name)[...] for name in BLOCK_PARAMS}
    x, _ = jax.lax.scan(lambda h, p: (_block(cfg, lengths, attention, angles, h, p), None), x, params)
    return layer_norm(x, model.final_w[...], model.final_b[...], cfg.norm_eps)


def project(model: VisionModel, states: jax.Array) -> jax.Array:
    """Projector: patch states [B, L, D] (merge-block order) -> merged tokens [B, L/4, D_text]."""
    cfg = model.config
    h = layer_norm(states, model.pre_w[...], model.pre_b[...], cfg.projector_eps)
    h = h.reshape(h.shape[0], -1, cfg.merge_size * cfg.hidden_size)
    h = jax.nn.gelu(linear(h, model.proj0[...]) + model.proj0_b[...], approximate=False)
    return linear(h, model.proj2[...]) + model.proj2_b[...]


def encode_images(model: VisionModel, batch: ImageBatch, attention: str | None = None) -> jax.Array:
    """Images -> the text-stream rows of their merged tokens [B, L/4, D_text] (model dtype)."""
    return project(model, encode_tower(model, batch, attention))


def image_rows(model: VisionModel, images: list[PreparedImage], *, batch: int = 64) -> np.ndarray:
    """The merged tokens of ``images`` one after another (image i's rows start after those of 0 .. i-1), encoded
    ``batch`` at a time at the largest patch grid. -> [sum of num_tokens, D_text] float32."""
    encode = jax.jit(encode_images)
    rows = []
    for i in range(0, len(images), batch):
        group = images[i:i + batch]
        out = np.asarray(encode(model, jax.tree.map(jnp.asarray, pack_images(group, batch, model.config.max_patches,
                                                                              model.config))), np.float32)
        rows += [out[b, :im.num_tokens] for b, im in enumerate(group)]
    return np.concatenate(rows)
