"""ModelConfig: the architecture of a Kimi-Linear / Kimi K3 text stack, built from a hub ``config.json``.

Two hub schemas are understood:
* ``kimi_linear`` (Kimi-Linear-48B-A3B and Hugging Face transformers' ``KimiLinearConfig``): flat fields plus
  either a ``linear_attn_config`` sub-dict with 1-indexed ``kda_layers``/``full_attn_layers`` or ``layer_types``.
* ``kimi_k3`` (``KimiK3ForConditionalGeneration``): the text stack nested under ``text_config``, with the K3
  extensions (AttnRes, latent MoE, SiTU, gate lower bound, full-rank gate, MXFP4 ``quantization_config``).

Unknown fields and contradictions raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal

LayerKind = Literal["kda", "mla"]
MlpKind = Literal["dense", "moe"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture only (no engine or sharding settings). All per-layer choices are tuples of length L."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[LayerKind, ...]
    mlp_types: tuple[MlpKind, ...]
    rms_norm_eps: float = 1e-5
    # KDA
    kda_num_heads: int = 32
    kda_num_v_heads: int = 32
    kda_head_dim: int = 128
    kda_v_head_dim: int = 128
    kda_conv_kernel: int = 4
    kda_gate_lower_bound: float | None = None
    kda_full_rank_gate: bool = False
    # MLA
    mla_num_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = False
    # FFN
    hidden_act: Literal["silu", "situ"] = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    intermediate_size: int = 9216
    num_experts: int = 256
    num_experts_per_token: int = 8
    moe_intermediate_size: int = 1024
    num_shared_experts: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    latent_dim: int | None = None
    latent_norm: bool = False
    experts_mxfp4: bool = False
    # residual stream
    attn_res_block_size: int = 0
    tie_word_embeddings: bool = False
    # tokens
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int = 1048576

    def __post_init__(self) -> None:
        _check(len(self.layer_types) == self.num_layers, "layer_types",
               f"has {len(self.layer_types)} entries for {self.num_layers} layers")
        _check(len(self.mlp_types) == self.num_layers, "mlp_types",
               f"has {len(self.mlp_types)} entries for {self.num_layers} layers")
        _check(all(t in ("kda", "mla") for t in self.layer_types), "layer_types", f"{self.layer_types}")
        _check(all(t in ("dense", "moe") for t in self.mlp_types), "mlp_types", f"{self.mlp_types}")
        _check(self.kda_num_v_heads % self.kda_num_heads == 0, "kda_num_v_heads",
               f"{self.kda_num_v_heads} is not a multiple of kda_num_heads={self.kda_num_heads}")
        _check(self.hidden_act in ("silu", "situ"), "hidden_act", f"{self.hidden_act!r} (expected silu or situ)")
        _check(1 <= self.num_experts_per_token <= self.num_experts or "moe" not in self.mlp_types,
               "num_experts_per_token", f"{self.num_experts_per_token} with {self.num_experts} experts")
        _check(self.num_experts % self.num_expert_group == 0, "num_expert_group",
               f"{self.num_expert_group} does not divide num_experts={self.num_experts}")
        _check(self.topk_group <= self.num_expert_group, "topk_group",
               f"{self.topk_group} > num_expert_group={self.num_expert_group}")
        lb = self.kda_gate_lower_bound
        _check(lb is None or -5.0 <= lb < 0.0, "gate_lower_bound", f"{lb} (must satisfy -5 <= L < 0)")
        _check(self.attn_res_block_size >= 0, "attn_res_block_size", f"{self.attn_res_block_size}")
        _check(not self.latent_norm or self.latent_dim is not None, "latent_moe_use_norm",
               "is set but routed_expert_hidden_size is missing")

    # ---- derived ----
    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_types) if t == "moe")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_types) if t == "dense")

    @property
    def kda_conv_channels(self) -> int:
        """Channels of the packed q/k/v conv state: 2*H*K + HV*V."""
        return 2 * self.kda_num_heads * self.kda_head_dim + self.kda_num_v_heads * self.kda_v_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: normalised c_kv (R) + un-rotated k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def uses_attnres(self) -> bool:
        return self.attn_res_block_size > 0

    @property
    def expert_input_dim(self) -> int:
        """Width the routed experts read: the latent dim for LatentMoE, else the model width."""
        return self.latent_dim if self.latent_dim is not None else self.hidden_size

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- hub config ----
    @classmethod
    def from_hub_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed hub ``config.json`` (``kimi_linear`` or ``kimi_k3`` schema)."""
        return _parse_hub(raw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hub_dict(json.load(f))

    def to_hub_dict(self) -> dict[str, Any]:
        """The ``kimi_linear``-schema dict (with K3 extensions) that :meth:`from_hub_dict` reads back."""
        out: dict[str, Any] = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.mla_num_heads,
            "num_key_value_heads": self.mla_num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_use_output_gate": self.mla_output_gate,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.kda_conv_kernel,
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "use_full_rank_gate": self.kda_full_rank_gate,
            },
            "mlp_layer_types": ["dense" if t == "dense" else "sparse" for t in self.mlp_types],
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "tie_word_embeddings": self.tie_word_embeddings,
            "model_max_length": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.kda_num_v_heads != self.kda_num_heads:
            out["linear_attn_config"]["num_v_heads"] = self.kda_num_v_heads
        if self.kda_v_head_dim != self.kda_head_dim:
            out["linear_attn_config"]["v_head_dim"] = self.kda_v_head_dim
        if self.kda_gate_lower_bound is not None:
            out["linear_attn_config"]["gate_lower_bound"] = self.kda_gate_lower_bound
        if self.hidden_act == "situ":
            out["activation_situ_beta"] = self.situ_beta
            out["activation_situ_linear_beta"] = self.situ_linear_beta
        if self.attn_res_block_size:
            out["attn_res_block_size"] = self.attn_res_block_size
        if self.latent_dim is not None:
            out["routed_expert_hidden_size"] = self.latent_dim
            out["latent_moe_use_norm"] = self.latent_norm
        if self.experts_mxfp4:
            out["quantization_config"] = dict(MXFP4_QUANT_CONFIG)
        return out


MXFP4_QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32, "type": "float"},
                                  "targets": ["Linear"]}},
    "ignore": ["re:.*shared_experts.*"],
}


def _check(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"config field {field!r}: {msg}")


# Fields we read (value used) and fields we accept but ignore (training-only / informational).
_IGNORED = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "initializer_range",
    "attention_dropout", "attention_bias", "pretraining_tp", "use_cache", "output_router_logits",
    "num_nextn_predict_layers", "moe_layer_freq", "topk_method", "use_grouped_topk", "head_dim",
    "qk_head_dim", "rope_theta", "rope_scaling", "_name_or_path", "model_type", "use_bfloat16",
    "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "scoring_func", "norm_topk_prob_legacy",
    "generation_config", "is_decoder", "return_dict", "chunk_size_feed_forward", "tie_encoder_decoder",
    "output_attentions", "output_hidden_states", "id2label", "label2id", "problem_type",
    "dense_ffn_hidden", "tokenizer_class", "vision_config", "media_placeholder_token_id",
    "image_token_id", "video_token_id", "ignore_index", "projector_hidden_act", "projection_hidden_size",
    "projection_layer_norm_eps",
}
_LINEAR_KEYS = {"num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers",
                "gate_lower_bound", "use_full_rank_gate", "num_v_heads", "v_head_dim"}


def _parse_hub(raw: dict[str, Any]) -> ModelConfig:
    raw = dict(raw)
    top_model_type = raw.get("model_type")
    if "text_config" in raw:  # kimi_k3 multimodal wrapper: text stack nested
        text = dict(raw.pop("text_config"))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config", "tie_word_embeddings"):
            if key in raw and key not in text:
                text[key] = raw[key]
        raw = text
    elif top_model_type not in (None, "kimi_linear", "kimi_k3"):
        raise ValueError(f"config field 'model_type': unsupported {top_model_type!r} (expected kimi_linear or kimi_k3)")

    used: set[str] = set()

    def get(key: str, default: Any = None, *aliases: str) -> Any:
        for k in (key, *aliases):
            if k in raw:
                used.add(k)
                return raw[k]
        return default

    num_layers = int(get("num_hidden_layers"))
    hidden_size = int(get("hidden_size"))
    lin = get("linear_attn_config") or {}
    unknown_lin = set(lin) - _LINEAR_KEYS
    if unknown_lin:
        raise ValueError(f"config field 'linear_attn_config': unknown keys {sorted(unknown_lin)}")

    layer_types = _layer_types(raw, lin, num_layers, used)
    mlp_types = _mlp_types(raw, num_layers, used, get)

    kda_heads = int(lin.get("num_heads", get("linear_num_heads", 32)))
    kda_head_dim = int(lin.get("head_dim", get("linear_head_dim", 128)))
    conv_kernel = int(lin.get("short_conv_kernel_size", get("linear_conv_kernel_dim", 4)))
    lower_bound = lin.get("gate_lower_bound")
    full_rank = bool(lin.get("use_full_rank_gate", False))

    mla_heads = int(get("num_attention_heads", 32))
    kv_heads = get("num_key_value_heads", mla_heads)
    if kv_heads is not None and int(kv_heads) != mla_heads:
        raise ValueError(f"config field 'num_key_value_heads': MLA needs {mla_heads} (num_attention_heads), got {kv_heads}")
    get("mla_use_nope", True)  # NoPE always: the text stack never rotates (spec 2.1)

    experts = int(get("num_experts", 0, "num_local_experts", "n_routed_experts") or 0)
    hidden_act = str(get("hidden_act", "silu"))
    quant = get("quantization_config")
    experts_mxfp4 = _parse_quant(quant)
    eos = get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    moe_router = get("moe_router_activation_func", "sigmoid")
    if moe_router != "sigmoid":
        raise ValueError(f"config field 'moe_router_activation_func': only 'sigmoid' is supported, got {moe_router!r}")

    cfg = ModelConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden_size,
        num_layers=num_layers,
        layer_types=layer_types,
        mlp_types=mlp_types,
        rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
        kda_num_heads=kda_heads,
        kda_num_v_heads=int(lin.get("num_v_heads", kda_heads)),
        kda_head_dim=kda_head_dim,
        kda_v_head_dim=int(lin.get("v_head_dim", kda_head_dim)),
        kda_conv_kernel=conv_kernel,
        kda_gate_lower_bound=None if lower_bound is None else float(lower_bound),
        kda_full_rank_gate=full_rank,
        mla_num_heads=mla_heads,
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=int(get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(get("qk_rope_head_dim", 64)),
        v_head_dim=int(get("v_head_dim", 128)),
        mla_output_gate=bool(get("mla_use_output_gate", False)),
        hidden_act=hidden_act,  # type: ignore[arg-type]
        situ_beta=float(get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(get("activation_situ_linear_beta", 25.0)),
        intermediate_size=int(get("intermediate_size", 0) or 0),
        num_experts=experts,
        num_experts_per_token=int(get("num_experts_per_token", 1, "num_experts_per_tok") or 1),
        moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0),
        num_shared_experts=int(get("num_shared_experts", 0, "n_shared_experts") or 0),
        moe_renormalize=bool(get("moe_renormalize", True, "norm_topk_prob")),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        num_expert_group=int(get("num_expert_group", 1, "n_group") or 1),
        topk_group=int(get("topk_group", 1) or 1),
        latent_dim=get("routed_expert_hidden_size"),
        latent_norm=bool(get("latent_moe_use_norm", False)),
        experts_mxfp4=experts_mxfp4,
        attn_res_block_size=int(get("attn_res_block_size", 0) or 0),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=get("pad_token_id"),
        max_position_embeddings=int(get("max_position_embeddings", 1048576, "model_max_length")),
    )
    used.update(k for k in ("model_max_length", "max_position_embeddings") if k in raw)  # both spellings occur
    unknown = set(raw) - used - _IGNORED
    if unknown:
        raise ValueError(f"config has unknown fields {sorted(unknown)}; refusing to guess their meaning")
    if "moe" in cfg.mlp_types and cfg.num_experts == 0:
        raise ValueError("config field 'num_experts': MoE layers present but num_experts is 0")
    return cfg


def _layer_types(raw: dict, lin: dict, num_layers: int, used: set) -> tuple[LayerKind, ...]:
    from_lin = None
    if "kda_layers" in lin or "full_attn_layers" in lin:
        kda = set(lin.get("kda_layers", []))
        full = set(lin.get("full_attn_layers", []))
        if kda & full:
            raise ValueError(f"config field 'linear_attn_config': layers {sorted(kda & full)} are both KDA and MLA")
        if kda | full != set(range(1, num_layers + 1)):
            missing = sorted(set(range(1, num_layers + 1)) - (kda | full))
            extra = sorted((kda | full) - set(range(1, num_layers + 1)))
            raise ValueError(f"config field 'linear_attn_config': 1-indexed kda_layers/full_attn_layers must cover "
                             f"1..{num_layers} exactly (missing {missing}, out of range {extra})")
        from_lin = tuple("kda" if (i + 1) in kda else "mla" for i in range(num_layers))
    from_types = None
    if "layer_types" in raw:
        used.add("layer_types")
        names = {"linear_attention": "kda", "full_attention": "mla", "kda": "kda", "mla": "mla"}
        try:
            from_types = tuple(names[t] for t in raw["layer_types"])
        except KeyError as e:
            raise ValueError(f"config field 'layer_types': unknown layer type {e.args[0]!r}") from None
        if len(from_types) != num_layers:
            raise ValueError(f"config field 'layer_types': {len(from_types)} entries for {num_layers} layers")
    if from_lin and from_types and from_lin != from_types:
        raise ValueError("config fields 'layer_types' and 'linear_attn_config' disagree on the layer schedule")
    result = from_lin or from_types
    if result is None:
        raise ValueError("config needs 'linear_attn_config.kda_layers/full_attn_layers' or 'layer_types'")
    return result  # type: ignore[return-value]


def _mlp_types(raw: dict, num_layers: int, used: set, get) -> tuple[MlpKind, ...]:
    first_dense = get("first_k_dense_replace")
    if "mlp_layer_types" in raw:
        used.add("mlp_layer_types")
        names = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        try:
            types = tuple(names[t] for t in raw["mlp_layer_types"])
        except KeyError as e:
            raise ValueError(f"config field 'mlp_layer_types': unknown type {e.args[0]!r}") from None
        if len(types) != num_layers:
            raise ValueError(f"config field 'mlp_layer_types': {len(types)} entries for {num_layers} layers")
        if first_dense is not None:
            expect = tuple("dense" if i < int(first_dense) else "moe" for i in range(num_layers))
            if expect != types:
                raise ValueError("config fields 'mlp_layer_types' and 'first_k_dense_replace' disagree")
        return types  # type: ignore[return-value]
    k = 1 if first_dense is None else int(first_dense)
    return tuple("dense" if i < k else "moe" for i in range(num_layers))  # type: ignore[return-value]


def _parse_quant(quant: dict | None) -> bool:
    if not quant:
        return False
    method = quant.get("quant_method")
    fmt = quant.get("format")
    if method == "compressed-tensors" and fmt in ("mxfp4-pack-quantized", None):
        return True
    if method == "mxfp4":  # gpt-oss style _blocks/_scales
        return True
    raise ValueError(f"config field 'quantization_config': unsupported {method!r}/{fmt!r} "
                     "(only MXFP4 routed experts: compressed-tensors mxfp4-pack-quantized or mxfp4)")
