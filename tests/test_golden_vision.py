"""The vision tower + projector equal transformers' Kimi-K2.5 vision model on a tiny random checkpoint.

Golden data: tests/data/kimi_k25_vision_tiny (made by its make_golden.py with transformers 5.24.0).
"""

import io
import os
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from kimi_jax.vision.preprocess import (ImageError, PreparedImage, fit_grid, merge_block_order, navit_resize,
                                        prepare_image)
from kimi_jax.vision.tower import encode_tower, pack_images, project
from kimi_jax.vision.weights import load_vision, save_vision

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "kimi_k25_vision_tiny")


@pytest.fixture(scope="module")
def golden():
    return np.load(os.path.join(GOLDEN, "expected.npz"))


@pytest.fixture(scope="module")
def model():
    return load_vision(GOLDEN)


def _images(golden) -> list[PreparedImage]:
    out = []
    for i in range(3):
        pixels = golden[f"pixel_values_{i}"]
        _, h, w = golden[f"grid_{i}"]
        order = merge_block_order(h, w)
        out.append(PreparedImage(pixels.reshape(len(pixels), -1)[order], (order // w).astype(np.int32),
                                 (order % w).astype(np.int32), (int(h), int(w)), (0, 0), b""))
    return out


def _run(model, images, swap=False):
    batch = pack_images(images, 4, 64, model.config)  # one padded batch: 3 images of 24, 64, 40 patches + 1 empty
    if swap:
        batch = type(batch)(**{**batch.__dict__, "rows": batch.cols, "cols": batch.rows})
    with jax.default_matmul_precision("highest"):
        states = encode_tower(model, jax.tree.map(jnp.asarray, batch))
        return np.asarray(states), np.asarray(project(model, states))


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_encoder_equals_transformers(model, golden):
    images = _images(golden)
    states, embeds = _run(model, images)
    for i, im in enumerate(images):
        n = im.num_patches
        order = merge_block_order(*im.grid)
        assert _rel(states[i, :n], golden[f"hidden_{i}"][order]) <= 1e-4
        assert _rel(states[i, :n].reshape(n // 4, 4, -1), golden[f"pooled_{i}"]) <= 1e-4
        assert _rel(embeds[i, :n // 4], golden[f"embeds_{i}"]) <= 1e-4


def test_comparison_can_fail(model, golden):
    """Negative controls: rows and columns exchanged in the RoPE; patches in raster instead of merge-block order."""
    images = _images(golden)
    _, embeds = _run(model, images, swap=True)
    assert _rel(embeds[0, :6], golden["embeds_0"]) > 1e-4
    im = images[0]
    raster = PreparedImage(golden["pixel_values_0"].reshape(24, -1), np.arange(24, dtype=np.int32) // 6,
                           np.arange(24, dtype=np.int32) % 6, im.grid, im.size, b"")
    _, embeds = _run(model, [raster])
    assert _rel(embeds[0, :6], golden["embeds_0"]) > 1e-2


def _rotate_half_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' PermuteForRope: each head's interleaved pairs -> its two halves."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_transformers_names_load_equal(model, golden, tmp_path):
    """The same weights under transformers' own names (q/k split, rotate-half order) load to the same model."""
    hub = load_file(os.path.join(GOLDEN, "model.safetensors"))
    heads = model.config.num_heads
    ren = {"norm0": "norm1", "norm1": "norm2", "wo": "attn.proj", "mlp.fc0": "mlp.fc1", "mlp.fc1": "mlp.fc2"}
    out = {"model.vision_tower.patch_embed.pos_emb.position_embeddings": hub["vision_tower.patch_embed.pos_emb.weight"]}
    for p in ("weight", "bias"):
        out[f"model.vision_tower.patch_embed.proj.{p}"] = hub[f"vision_tower.patch_embed.proj.{p}"]
        out[f"model.vision_tower.final_layernorm.{p}"] = hub[f"vision_tower.encoder.final_layernorm.{p}"]
        for a, b in (("pre_norm", "pre_norm"), ("proj.0", "in_proj"), ("proj.2", "out_proj")):
            out[f"model.mm_projector.{b}.{p}"] = hub[f"mm_projector.{a}.{p}"]
        for i in range(model.config.num_layers):
            src, dst = f"vision_tower.encoder.blocks.{i}.", f"model.vision_tower.layers.{i}."
            for a, b in ren.items():
                out[f"{dst}{b}.{p}"] = hub[f"{src}{a}.{p}"]
            q, k, v = np.split(hub[f"{src}wqkv.{p}"], 3)
            out.update({f"{dst}attn.q_proj.{p}": _rotate_half_rows(q, heads),
                        f"{dst}attn.k_proj.{p}": _rotate_half_rows(k, heads), f"{dst}attn.v_proj.{p}": v})
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(GOLDEN, "config.json")).read())
    other = load_vision(str(tmp_path))
    assert np.array_equal(np.asarray(other.wqkv[...]), np.asarray(model.wqkv[...]))
    assert np.array_equal(np.asarray(other.proj0[...]), np.asarray(model.proj0[...]))


def test_save_load_round_trip(model, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "kimi_linear", "hidden_size": 32}')
    save_vision(model, str(tmp_path))
    again = load_vision(str(tmp_path))
    for name in ("patch_w", "pos_emb", "wqkv", "fc1", "proj2_b"):
        assert np.array_equal(np.asarray(getattr(again, name)[...]), np.asarray(getattr(model, name)[...]))


def test_missing_tensor_is_named(tmp_path):
    hub = load_file(os.path.join(GOLDEN, "model.safetensors"))
    del hub["vision_tower.encoder.blocks.1.wo.weight"]
    save_file(hub, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(GOLDEN, "config.json")).read())
    with pytest.raises(ValueError, match="blocks.1.wo.weight"):
        load_vision(str(tmp_path))


def test_resize_rule_equals_reference(golden, model):
    for (h, w, m), want in zip(golden["sizes"], golden["resized"]):
        assert navit_resize(int(h), int(w), 14, 2, int(m)) == ((want[0], want[1]), (want[2], want[3]))
    cfg = model.config
    for h, w in [(97, 150), (1000, 30), (13, 13), (5000, 20), (20, 5000)]:
        _, (ph, pw) = fit_grid(h, w, cfg)
        assert ph % 28 == 0 and pw % 28 == 0 and (ph // 14) * (pw // 14) <= cfg.max_patches


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_prepare_normalises_and_orders(model):
    cfg = model.config
    image = Image.new("RGB", (56, 28), (255, 0, 128))
    image.paste((0, 0, 0), (28, 0, 56, 28))  # right half black
    prepared = prepare_image(_png(image), cfg)
    assert prepared.grid == (2, 4) and prepared.num_tokens == 2 and prepared.size == (56, 28)
    first = prepared.pixels[:4].reshape(4, 3, 14, 14)  # merged token 0: the left 2x2 block, red-pink
    assert np.allclose(first[:, 0], 1.0) and np.allclose(first[:, 1], -1.0)
    assert np.allclose(first[:, 2], 128 / 255 * 2 - 1, atol=1e-6)
    assert np.allclose(prepared.pixels[4:], -1.0)
    assert list(prepared.rows) == [0, 0, 1, 1, 0, 0, 1, 1] and list(prepared.cols) == [0, 1, 0, 1, 2, 3, 2, 3]
    other = prepare_image(_png(Image.new("RGB", (56, 28), (1, 2, 3))), cfg)
    assert other.digest != prepared.digest


def _huge_png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n", "not an image"),
    (b"GIF89a\x01", "not an image"),
    (_huge_png_header(20000, 20000), "at most"),
    (None, "truncated"),
    ("tiff", "unsupported image format"),
])
def test_bad_images_raise_image_error(model, data, message):
    if data is None:
        data = _png(Image.effect_noise((64, 64), 50).convert("RGB"))[:-200]
    elif data == "tiff":
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format="TIFF")
        data = buf.getvalue()
    with pytest.raises(ImageError, match=message):
        prepare_image(data, model.config)
