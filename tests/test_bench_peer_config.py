"""The transformers peer's config (serve/bench/peer.py) speaks transformers' native KimiLinear schema:
built from the golden tiny checkpoint's own config, it reproduces that config.json's fields (the file was
written by transformers itself), so the peer benchmark runs the same model shape as ours."""

import json
from pathlib import Path

import pytest

from kimi_jax.config import ModelConfig
from serve.bench.peer import hf_config_dict

GOLDEN = Path(__file__).parent / "data" / "kimi_linear_tiny"


def test_peer_config_matches_transformers_own_config():
    hf = json.loads((GOLDEN / "config.json").read_text())
    ours = hf_config_dict(ModelConfig.from_json_file(GOLDEN / "config.json"))
    for key, value in ours.items():
        if key in hf:
            assert hf[key] == value, key
    missing = {"layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "num_experts",
               "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"} - set(ours)
    assert not missing


def test_peer_refuses_k3_only_features():
    from kimi_jax.presets import get_preset

    with pytest.raises(ValueError, match="AttnRes"):
        hf_config_dict(get_preset("k3-slice"))
