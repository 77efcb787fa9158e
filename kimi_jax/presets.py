"""Named model configurations.

* ``tiny``: the Kimi K3 architecture at toy size (KDA with the lower-bound gate and full-rank output gate,
  gated NoPE MLA with q-LoRA, Block AttnRes, Stable LatentMoE with SiTU and MXFP4 experts, dense layer 0).
  Runs on a CPU in seconds; its vocabulary matches the embedded tokenizer (4096 ids, K3 specials at the top).
  Its shipped checkpoint is chat-tuned (``kimi_jax/assets/tiny``).
* ``tiny-code``: the same configuration; its shipped checkpoint is the code-only model the chat model was
  tuned from (``kimi_jax/assets/tiny-code``).
* ``kimi-linear-48b``: the real Kimi-Linear-48B-A3B dimensions (27 layers, 20 KDA + 7 MLA, 256 bf16 experts).
* ``k3``: the full Kimi K3 text stack (93 layers, 896 MXFP4 experts, 2.8T parameters), for memory planning.
* ``k3-slice``: K3's true per-layer dimensions (H=96 KDA and MLA, 7168 width, 896 MXFP4 experts of the
  3584-wide latent) with only 4 layers (KDA, KDA, KDA, MLA; AttnRes block 2, like the public 4-layer slice),
  about 57 GB in bf16 + MXFP4: fits one 141 GB H200 with room for caches, for benchmarks.
"""

from __future__ import annotations

from kimi_jax.config import ModelConfig

_K3_SPECIAL = dict(bos_token_id=163584, eos_token_id=163586, pad_token_id=163839)


def _schedule(num_layers: int, mla_every: int = 4, last_is_mla: bool = False) -> tuple[str, ...]:
    kinds = ["mla" if (i + 1) % mla_every == 0 else "kda" for i in range(num_layers)]
    if last_is_mla:
        kinds[-1] = "mla"
    return tuple(kinds)


def _k3_common(num_layers: int, num_experts: int, attn_res_block: int, last_is_mla: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=163840, hidden_size=7168, num_layers=num_layers,
        layer_types=_schedule(num_layers, last_is_mla=last_is_mla),  # type: ignore[arg-type]
        mlp_types=("dense",) + ("moe",) * (num_layers - 1),
        kda_num_heads=96, kda_num_v_heads=96, kda_head_dim=128, kda_v_head_dim=128,
        kda_gate_lower_bound=-5.0, kda_full_rank_gate=True,
        mla_num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_output_gate=True,
        hidden_act="situ", situ_beta=4.0, situ_linear_beta=25.0, intermediate_size=33792,
        num_experts=num_experts, num_experts_per_token=16, moe_intermediate_size=3072, num_shared_experts=2,
        routed_scaling_factor=1.0, latent_dim=3584, latent_norm=True, experts_mxfp4=True,
        attn_res_block_size=attn_res_block, **_K3_SPECIAL)


def tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=4096, hidden_size=256, num_layers=8,
        layer_types=("kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla"),
        mlp_types=("dense",) + ("moe",) * 7,
        kda_num_heads=4, kda_num_v_heads=4, kda_head_dim=64, kda_v_head_dim=64,
        kda_gate_lower_bound=-5.0, kda_full_rank_gate=True,
        mla_num_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
        v_head_dim=32, mla_output_gate=True,
        hidden_act="situ", intermediate_size=512,
        num_experts=16, num_experts_per_token=4, moe_intermediate_size=128, num_shared_experts=1,
        latent_dim=128, latent_norm=True, experts_mxfp4=True,
        attn_res_block_size=2, bos_token_id=3840, eos_token_id=3842, pad_token_id=4095,
        max_position_embeddings=8192)


def kimi_linear_48b() -> ModelConfig:
    full = {4, 8, 12, 16, 20, 24, 27}
    return ModelConfig(
        vocab_size=163840, hidden_size=2304, num_layers=27,
        layer_types=tuple("mla" if (i + 1) in full else "kda" for i in range(27)),  # type: ignore[arg-type]
        mlp_types=("dense",) + ("moe",) * 26,
        kda_num_heads=32, kda_num_v_heads=32, kda_head_dim=128, kda_v_head_dim=128,
        mla_num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, hidden_act="silu", intermediate_size=9216,
        num_experts=256, num_experts_per_token=8, moe_intermediate_size=1024, num_shared_experts=1,
        routed_scaling_factor=2.446, **_K3_SPECIAL)


def k3() -> ModelConfig:
    return _k3_common(num_layers=93, num_experts=896, attn_res_block=12, last_is_mla=True)


def k3_slice() -> ModelConfig:
    return _k3_common(num_layers=4, num_experts=896, attn_res_block=2, last_is_mla=True)


PRESETS = {"tiny": tiny, "tiny-code": tiny, "kimi-linear-48b": kimi_linear_48b, "k3": k3, "k3-slice": k3_slice}


def get_preset(name: str) -> ModelConfig:
    """Return the named preset's config; ValueError lists the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]()
