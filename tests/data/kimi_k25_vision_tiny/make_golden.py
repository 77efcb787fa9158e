"""Golden data for the vision tower: a tiny random Kimi-K2.5 vision tower + projector run by transformers.

Made with Hugging Face transformers 5.24.0 (`transformers.models.kimi_k25`: `Kimi_K25ForConditionalGeneration`,
whose `model.vision_tower` is `Kimi_K25VisionModel` and `model.mm_projector` is `Kimi_K25MultimodalProjection`)
on CPU torch 2.13.0, float32. Not run by CI; it needs torch and transformers:

    python -m venv /tmp/vref && /tmp/vref/bin/pip install torch==2.13.0 transformers pillow safetensors numpy
    /tmp/vref/bin/python tests/data/kimi_k25_vision_tiny/make_golden.py

Writes beside itself:
  config.json        the model's config (`vision_config`, `projection_hidden_size`, text hidden size 32)
  model.safetensors  vision tensors in the hub layout of moonshotai/Kimi-K2.5 (`vision_tower.patch_embed.*`,
                     `vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}`,
                     `vision_tower.encoder.final_layernorm`, `mm_projector.{pre_norm,proj.0,proj.2}`): wqkv holds
                     q and k in the interleaved (complex-pair) rotary order; transformers' loader un-fuses it and
                     permutes it to its rotate-half order. The script checks that transformers loads this file
                     back to exactly the tensors it ran.
  expected.npz       per image i: pixel_values_i [L_i, 3, 14, 14] (raster patch order), grid_i [3] (t, h, w),
                     hidden_i [L_i, 64] (final_layernorm output, raster order), pooled_i [L_i/4, 4, 64] (2x2 merge),
                     embeds_i [L_i/4, 32] (projector output); and the image processor's resize rule
                     (`navit_resize`, read from its source: the processor class itself needs torchvision) on
                     sizes [K, 3] (height, width, max_patches) -> resized [K, 4] (height, width, padded height,
                     padded width), with 512 patches per side at most.
"""

import ast
import json
import pathlib

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

HERE = pathlib.Path(__file__).parent
GRIDS = [(4, 6), (8, 8), (10, 4)]  # patch grids (h, w); the learned position table is 8 x 8, so it is resampled

VISION = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=4,
              num_hidden_layers=2, hidden_size=64, intermediate_size=128, hidden_act="gelu_pytorch_tanh",
              merge_kernel_size=[2, 2], rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
TEXT = dict(model_type="deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2,
            num_experts_per_tok=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8)


def to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' rotate-half row order -> the checkpoint's interleaved pairs (inverse of PermuteForRope)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hub_state(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    heads = VISION["num_attention_heads"]
    out = {
        "vision_tower.patch_embed.proj.weight": sd["model.vision_tower.patch_embed.proj.weight"],
        "vision_tower.patch_embed.proj.bias": sd["model.vision_tower.patch_embed.proj.bias"],
        "vision_tower.patch_embed.pos_emb.weight":
            sd["model.vision_tower.patch_embed.pos_emb.position_embeddings"],
        "vision_tower.encoder.final_layernorm.weight": sd["model.vision_tower.final_layernorm.weight"],
        "vision_tower.encoder.final_layernorm.bias": sd["model.vision_tower.final_layernorm.bias"],
    }
    for name, src in (("pre_norm", "pre_norm"), ("proj.0", "in_proj"), ("proj.2", "out_proj")):
        for p in ("weight", "bias"):
            out[f"mm_projector.{name}.{p}"] = sd[f"model.mm_projector.{src}.{p}"]
    for i in range(VISION["num_hidden_layers"]):
        src, dst = f"model.vision_tower.layers.{i}.", f"vision_tower.encoder.blocks.{i}."
        for p in ("weight", "bias"):
            q, k, v = (sd[f"{src}attn.{n}_proj.{p}"] for n in "qkv")
            out[f"{dst}wqkv.{p}"] = torch.cat([to_interleaved(q, heads), to_interleaved(k, heads), v])
            for a, b in (("norm0", "norm1"), ("norm1", "norm2"), ("wo", "attn.proj"), ("mlp.fc0", "mlp.fc1"),
                         ("mlp.fc1", "mlp.fc2")):
                out[f"{dst}{a}.{p}"] = sd[f"{src}{b}.{p}"]
    return {k: v.contiguous() for k, v in out.items()}


RESIZE_CASES = [(97, 150, 64), (1000, 30, 256), (13, 13, 64), (448, 448, 256), (500, 300, 16384), (3000, 2000, 1024)]


def navit_resize():
    """The processor's resize rule, taken from its source (importing the module needs torchvision)."""
    path = pathlib.Path(transformers.__file__).parent / "models/kimi_k25/image_processing_kimi_k25.py"
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    scope = {"math": __import__("math")}
    exec(compile(ast.Module([node], []), str(path), "exec"), scope)
    return scope["navit_resize"]


def main() -> None:
    torch.manual_seed(0)
    cfg = Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=VISION["hidden_size"])
    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases (the init leaves LayerNorms at 1 / 0)
        for name, p in model.named_parameters():
            if "vision_tower" in name or "mm_projector" in name:
                p.add_(0.05 * torch.randn_like(p)) if ("norm" in name or "bias" in name) else None
    state = hub_state(model)
    save_file(state, str(HERE / "model.safetensors"))
    config = {"model_type": "kimi_k25", "vision_config": VISION, "projection_hidden_size": VISION["hidden_size"],
              "projection_layer_norm_eps": 1e-5, "text_config": {"hidden_size": TEXT["hidden_size"]}}
    (HERE / "config.json").write_text(json.dumps(config, indent=1) + "\n")

    # the file loads back through transformers' own conversion to the tensors that ran
    reloaded = Kimi_K25ForConditionalGeneration.from_pretrained(str(HERE), config=cfg).eval()
    ours, theirs = model.state_dict(), reloaded.state_dict()
    for key in ours:
        if "vision_tower" in key or "mm_projector" in key:
            assert torch.equal(ours[key], theirs[key]), key

    expected = {}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, (h, w) in enumerate(GRIDS):
            pixels = torch.randn(h * w, 3, 14, 14, generator=gen)
            grid = torch.tensor([[1, h, w]])
            out = model.model.vision_tower(pixels, grid_thw=grid)
            embeds = model.model.mm_projector(out.pooler_output).squeeze(1)
            expected.update({f"pixel_values_{i}": pixels.numpy(), f"grid_{i}": grid[0].numpy(),
                             f"hidden_{i}": out.last_hidden_state.numpy(), f"pooled_{i}": out.pooler_output.numpy(),
                             f"embeds_{i}": embeds.numpy()})
    resize = navit_resize()
    expected["sizes"] = np.array(RESIZE_CASES, np.int64)
    expected["resized"] = np.array([[*sum(resize(h, w, 14, 2, m, 512), ())] for h, w, m in RESIZE_CASES], np.int64)
    np.savez_compressed(HERE / "expected.npz", **expected)
    print(f"transformers {transformers.__version__}: wrote {len(state)} tensors, {len(GRIDS)} images")


if __name__ == "__main__":
    main()
