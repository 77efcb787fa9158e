"""The peer a user would reach for: Hugging Face transformers' ``KimiLinearForCausalLM`` (its own PyTorch code,
with flash-linear-attention's Triton KDA kernels when the ``fla`` package is importable) on a random bf16 model
of one of our presets' shapes, first N layers, on the GPU. Benchmark only (needs torch, transformers >= 5.17).

Decode tokens/s at batch B = B * (new - 1) / (time of generate(new) - time of generate(1)), greedy, prompts of
``--prompt-len`` random tokens, so that prefill is subtracted out.

    PYTHONPATH=/tmp/site:. python3 -m serve.bench.peer --preset kimi-linear-48b --layers 4 --batches 1 16 64
"""

from __future__ import annotations

import argparse
import json
import os
import time


def hf_config_dict(cfg) -> dict:
    """transformers' native KimiLinearConfig fields for a kimi_jax ModelConfig (Kimi-Linear family only)."""
    if cfg.uses_attnres or cfg.latent_dim or cfg.experts_mxfp4:
        raise ValueError("transformers' KimiLinear has no AttnRes / LatentMoE / MXFP4: use a Kimi-Linear preset")
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        layer_types=["linear_attention" if t == "kda" else "full_attention" for t in cfg.layer_types],
        mlp_layer_types=["dense" if t == "dense" else "sparse" for t in cfg.mlp_types],
        linear_num_heads=cfg.kda_num_heads, linear_head_dim=cfg.kda_head_dim,
        linear_conv_kernel_dim=cfg.kda_conv_kernel, num_attention_heads=cfg.mla_num_heads,
        num_key_value_heads=cfg.mla_num_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
        num_experts_per_token=cfg.num_experts_per_token, moe_intermediate_size=cfg.moe_intermediate_size,
        num_shared_experts=cfg.num_shared_experts, moe_renormalize=cfg.moe_renormalize,
        routed_scaling_factor=cfg.routed_scaling_factor, num_expert_group=cfg.num_expert_group,
        topk_group=cfg.topk_group, rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id, use_cache=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="kimi-linear-48b")
    parser.add_argument("--layers", type=int, default=4, help="keep the preset's first N layers")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)

    import torch
    import transformers

    from kimi_jax.presets import get_preset

    full = get_preset(args.preset)
    n = args.layers
    cfg = full.replace(num_layers=n, layer_types=full.layer_types[:n], mlp_types=full.mlp_types[:n])
    hf_cfg = transformers.AutoConfig.for_model("kimi_linear", **hf_config_dict(cfg))
    try:
        import fla  # noqa: F401
        kernels = "flash-linear-attention " + getattr(fla, "__version__", "?")
    except ImportError:
        kernels = "none (torch fallback)"
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, kernels: {kernels}; "
          f"{args.preset} x {n} layers, {params / 1e9:.2f} GB; built in {time.perf_counter() - start:.1f}s",
          flush=True)

    def generate(batch: int, new: int) -> float:
        ids = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    rows = []
    for batch in args.batches:
        generate(batch, 2)  # warm-up (Triton autotuning, allocator)
        prefill = min(generate(batch, 1) for _ in range(2))
        total = generate(batch, args.new_tokens)
        decode = (total - prefill) / (args.new_tokens - 1)
        rows.append(dict(batch=batch, tokens_per_s=batch / decode, step_ms=decode * 1e3,
                         prefill_s=prefill, prompt_len=args.prompt_len))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "bench_peer.json"), "w") as f:
        json.dump(dict(args=vars(args), kernels=kernels, transformers=transformers.__version__, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
