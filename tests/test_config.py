"""ModelConfig from hub configs: both schemas, presets round trip, and clear errors for bad fields."""

import json

import pytest

from kimi_jax.config import ModelConfig
from kimi_jax.presets import PRESETS, get_preset

DATA = "tests/data/kimi_linear_tiny"


def _raw(name="config.hub_format.json"):
    with open(f"{DATA}/{name}") as f:
        return json.load(f)


def test_two_hub_schemas_agree():
    a = ModelConfig.from_json_file(f"{DATA}/config.json")
    b = ModelConfig.from_json_file(f"{DATA}/config.hub_format.json")
    assert a == b
    assert a.layer_types == ("kda", "kda", "kda", "mla")
    assert a.mlp_types == ("dense", "moe", "moe", "moe")
    assert a.routed_scaling_factor == pytest.approx(2.446)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hub_dict(name):
    cfg = get_preset(name)
    assert ModelConfig.from_hub_dict(cfg.to_hub_dict()) == cfg


def test_k3_schedule_and_nesting():
    cfg = get_preset("k3")
    assert len(cfg.kda_layers) == 69 and len(cfg.mla_layers) == 24
    assert cfg.mla_layers[-2:] == (91, 92)
    wrapped = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
               "text_config": {k: v for k, v in cfg.to_hub_dict().items() if k not in ("bos_token_id",)},
               "bos_token_id": 163584, "media_placeholder_token_id": 163605}
    assert ModelConfig.from_hub_dict(wrapped) == cfg


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.update(bogus_field=1), "bogus_field"),
    (lambda r: r["linear_attn_config"].update(kda_layers=[1, 2, 3, 4]), "linear_attn_config"),
    (lambda r: r["linear_attn_config"].update(full_attn_layers=[]), "linear_attn_config"),
    (lambda r: r["linear_attn_config"].update(mystery=3), "linear_attn_config"),
    (lambda r: r.update(layer_types=["full_attention"] * 4), "layer_types"),
    (lambda r: r.update(num_key_value_heads=2), "num_key_value_heads"),
    (lambda r: r.update(hidden_act="gelu"), "hidden_act"),
    (lambda r: r.update(mlp_layer_types=["dense"] * 4), "first_k_dense_replace"),
    (lambda r: r["linear_attn_config"].update(gate_lower_bound=-7.0), "gate_lower_bound"),
    (lambda r: r.update(quantization_config={"quant_method": "awq"}), "quantization_config"),
    (lambda r: r.update(model_type="llama"), "model_type"),
])
def test_bad_fields_raise_naming_the_field(mutate, field):
    raw = _raw()
    mutate(raw)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hub_dict(raw)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="tiny"):
        get_preset("k4")
