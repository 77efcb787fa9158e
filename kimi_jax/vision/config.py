"""Vision tower + projector dimensions, read from a checkpoint's ``config.json`` (``vision_config`` and the
projector fields of the Kimi-K2.5 / K3 schema) or built for tests."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """MoonViT: conv patch embedding, learned 2D position table (bicubically resampled to each image's grid),
    ``num_layers`` pre-LayerNorm blocks with axial 2D RoPE, final LayerNorm, 2x2 merge; projector LayerNorm ->
    Linear(4*hidden, 4*hidden) -> GELU -> Linear(4*hidden, text_hidden_size).

    ``head_dim``: 0 for ``hidden_size / num_heads`` (Kimi-K2.5); K3's tower attends with 12 heads of 128 over a
    1024-wide stream. ``max_patches``: the largest patch grid (h * w) an image is resized to (serving buckets
    are built from it).
    """

    text_hidden_size: int
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    head_dim: int = 0
    intermediate_size: int = 4304
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    merge: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    projector_eps: float = 1e-5
    max_patches: int = 16384
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if (not self.head_dim and self.hidden_size % self.num_heads) or self.attn_head_dim % 4:
            raise ValueError(f"VisionConfig: the head dim ({self.hidden_size}/{self.num_heads} or head_dim) must be a "
                             "whole multiple of 4 (axial RoPE splits it over rows and columns)")
        if self.merge != (2, 2):
            raise ValueError(f"VisionConfig.merge: only 2x2 merging is supported, got {self.merge}")
        if self.max_patches < self.merge_size:
            raise ValueError(f"VisionConfig.max_patches must be >= {self.merge_size}")

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def attn_width(self) -> int:
        """Width of q, k and v: heads x head dim."""
        return self.num_heads * self.attn_head_dim

    @property
    def merge_size(self) -> int:
        """Patches per merged (text-stream) token."""
        return self.merge[0] * self.merge[1]

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size

    @classmethod
    def from_hf(cls, config: dict[str, Any], **overrides) -> "VisionConfig":
        """From a hub ``config.json`` dict that has a ``vision_config`` (K2.5 / K3 schema)."""
        vc = config.get("vision_config")
        if not isinstance(vc, dict):
            raise ValueError("config.json has no vision_config")
        text = config.get("text_config") or {}
        rope = vc.get("rope_parameters") or {}
        hidden = vc.get("hidden_size", vc.get("vt_hidden_size", 1152))
        if config.get("projection_hidden_size", hidden) != hidden:
            raise ValueError("config.json: projection_hidden_size must equal vision_config.hidden_size")
        fields = dict(
            text_hidden_size=text.get("hidden_size", config.get("hidden_size")),
            hidden_size=hidden,
            num_layers=vc.get("num_hidden_layers", vc.get("vt_num_hidden_layers", 27)),
            num_heads=vc.get("num_attention_heads", vc.get("vt_num_attention_heads", 16)),
            head_dim=int(vc.get("head_dim") or 0),
            intermediate_size=vc.get("intermediate_size", vc.get("vt_intermediate_size", 4304)),
            patch_size=vc.get("patch_size", 14),
            pos_emb_height=vc.get("pos_emb_height", vc.get("init_pos_emb_height", 64)),
            pos_emb_width=vc.get("pos_emb_width", vc.get("init_pos_emb_width", 64)),
            merge=tuple(vc.get("merge_kernel_size", (2, 2))),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            projector_eps=float(config.get("projection_layer_norm_eps", 1e-5)),
            max_patches=int(vc.get("max_patches", 16384)),
        )
        if fields["text_hidden_size"] is None:
            raise ValueError("config.json: the text hidden size (text_config.hidden_size or hidden_size) is missing")
        return cls(**{**fields, **overrides})

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` / projector fields of a checkpoint's ``config.json``."""
        return {"vision_config": {
            "patch_size": self.patch_size, "pos_emb_height": self.pos_emb_height, "pos_emb_width": self.pos_emb_width,
            "num_attention_heads": self.num_heads, "num_hidden_layers": self.num_layers,
            **({"head_dim": self.head_dim} if self.head_dim else {}),
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": list(self.merge),
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
            "max_patches": self.max_patches},
            "projection_hidden_size": self.hidden_size, "projection_layer_norm_eps": self.projector_eps}
