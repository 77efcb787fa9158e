"""Parity with Hugging Face transformers' own KimiLinear on a tiny random checkpoint (tests/data, float32).

Tolerance: 1e-4 relative (fp32 end to end; measured ~2e-6, the difference being summation order)."""

import numpy as np
import pytest

import kimi_jax

DATA = "tests/data/kimi_linear_tiny"


@pytest.fixture(scope="module")
def expected():
    return np.load(f"{DATA}/expected.npz")


@pytest.fixture(scope="module")
def lm():
    return kimi_jax.load(DATA, dtype="float32")


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def test_logits_match_transformers(lm, expected):
    logits = np.asarray(lm.logits(expected["input_ids"]))
    assert logits.shape == expected["logits"].shape
    assert _rel(logits, expected["logits"]) < 1e-4


def test_greedy_continuation_identical(lm, expected):
    out = lm.generate(expected["greedy_prompt"], max_new_tokens=16, stop_token_ids=[])
    assert out[0] == expected["greedy_output"][0].tolist()


def test_hub_format_config_gives_same_logits(tmp_path, lm, expected):
    import shutil
    shutil.copy(f"{DATA}/model.safetensors", tmp_path / "model.safetensors")
    shutil.copy(f"{DATA}/config.hub_format.json", tmp_path / "config.json")
    other = kimi_jax.load(str(tmp_path), dtype="float32")
    ids = expected["input_ids"][:1, :9]
    np.testing.assert_allclose(np.asarray(other.logits(ids)), np.asarray(lm.logits(ids)), rtol=1e-5, atol=1e-5)
