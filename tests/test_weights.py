"""Hub checkpoint loading/writing: layouts of both families, sharding, MXFP4 experts, and clear errors."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import kimi_jax
from kimi_jax.model import KimiModel
from kimi_jax.weights.loader import load_into, param_leaves
from kimi_jax.weights.snapshot import restore_snapshot, save_snapshot
from kimi_jax.weights.writer import save_checkpoint
from pallas_kernels.mxfp4 import quant as mxfp4

from .test_model_incremental import K3

GOLDEN = "tests/data/kimi_linear_tiny"


def _params(model):
    return {k: np.asarray(v.get_value()) for k, v in param_leaves(model).items()}


def _rewrite(src, dst, edit):
    """Copy checkpoint src to dst with its tensors passed through edit(dict) -> dict."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file(edit(tensors), os.path.join(dst, "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("k3"))
    model = KimiModel(K3, dtype=jnp.float32, rngs=nnx.Rngs(7))
    save_checkpoint(model, folder)
    return folder, _params(model)


def _load(folder, cfg=K3):
    return load_into(KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), folder)


def test_tiny_k3_round_trip_is_exact(k3_dir):
    folder, want = k3_dir
    got = _params(_load(folder))
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    names = load_file(os.path.join(folder, "model.safetensors"))
    assert names["model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"].dtype == np.uint8
    assert names["model.layers.0.self_attn.A_log"].shape == (1, 1, K3.kda_num_v_heads, 1)


def test_tiny_k3_runs_end_to_end_from_checkpoint(k3_dir):
    lm = kimi_jax.load(k3_dir[0], dtype="float32")
    out = lm.generate([[5, 6, 7, 8]], max_new_tokens=3, stop_token_ids=[])
    assert len(out[0]) == 7 and all(0 <= t < K3.vocab_size for t in out[0])
    assert np.isfinite(np.asarray(lm.logits(np.asarray([out[0]])))).all()


def test_sharded_checkpoint_with_index(k3_dir, tmp_path):
    folder, want = k3_dir
    model = _load(folder)
    save_checkpoint(model, str(tmp_path), max_shard_bytes=20_000)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 2
    got = _params(_load(str(tmp_path)))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_alternative_layouts_load_identically(k3_dir, tmp_path):
    """language_model. prefix, A_log padded to head_dim or flat [H], conv taps [C, 4], gpt-oss MXFP4 blocks."""
    folder, want = k3_dir

    def edit(t):
        out = {}
        for name, a in t.items():
            if name.endswith("A_log"):
                flat = a.reshape(-1)
                a = np.concatenate([flat, np.zeros(K3.kda_head_dim - flat.size, flat.dtype)]) if "layers.0." in name else flat
            elif "conv1d" in name:
                a = a.reshape(a.shape[0], -1)
            if name.endswith(".weight_packed") and "experts.1." in name:
                scales = t[name.replace("weight_packed", "weight_scale")]
                blocks, sc = mxfp4.packed_to_blocks(a, scales)
                out[("language_model." + name).replace("weight_packed", "weight_blocks")] = np.asarray(blocks)
                out[("language_model." + name).replace("weight_packed", "weight_scales")] = np.asarray(sc)
                continue
            if name.endswith(".weight_scale") and "experts.1." in name:
                continue
            out["language_model." + name] = a
        return out

    got = _params(_load(_rewrite(folder, str(tmp_path), edit)))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("edit, message", [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.2.self_attn.q_proj.weight"}, "kda.q_proj"),
    (lambda t: {**t, "model.layers.1.block_sparse_moe.experts.99.w1.weight_packed": np.zeros((32, 16), np.uint8)},
     "expert 99"),
    (lambda t: {**t, "model.layers.0.self_attn.mystery.weight": np.zeros(3, np.float32)}, "mystery"),
    (lambda t: {**t, "model.layers.0.self_attn.o_proj.weight": np.zeros((3, 3), np.float32)}, "o_proj"),
    (lambda t: {k: v for k, v in t.items() if not k.startswith("model.layers.1.block_sparse_moe.experts.3.")},
     "moe.w"),
    (lambda t: {**t, "model.layers.0.self_attn.A_log": np.ones(16, np.float32)}, "A_log"),
])
def test_bad_checkpoints_raise_clear_errors(k3_dir, tmp_path, edit, message):
    folder = _rewrite(k3_dir[0], str(tmp_path), edit)
    with pytest.raises(ValueError, match=message):
        _load(folder)


def test_golden_kimi_linear_layouts_are_understood():
    """HF's checkpoint stores A_log [1,1,H,1], dt_bias flat, conv [C,1,4] and layer 0's dense MLP under
    block_sparse_moe.*; all of it lands (the golden logits test checks the values)."""
    lm = kimi_jax.load(GOLDEN, dtype="float32")
    assert lm.model.kda.A_log.shape == (3, 4)
    assert lm.model.dense_mlp.gate.shape == (1, 128, 256)


def test_orbax_snapshot_round_trip(k3_dir, tmp_path):
    folder, want = k3_dir
    save_snapshot(_load(folder), str(tmp_path / "snap"))
    got = _params(restore_snapshot(KimiModel(K3, dtype=jnp.float32, rngs=nnx.Rngs(1)), str(tmp_path / "snap")))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
