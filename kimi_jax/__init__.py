"""kimi-jax: Kimi K3-class hybrid models (KDA + Gated MLA + AttnRes + LatentMoE + MXFP4) in JAX.

Dimension glossary (docstrings, einsum strings, shape comments): B batch, T tokens, N sequences in a packed
batch, H heads, HV KDA value heads, K key/head dim, V value dim, D model width, R low-rank/latent width,
F FFN width, E experts, S state slots, P pages or checkpoint positions, L stacked layers or depth sources,
C chunk size or conv channels. Details: docs/design.md.
"""

from kimi_jax.api import KimiLM, load
from kimi_jax.config import ModelConfig
from kimi_jax.presets import PRESETS, get_preset

__all__ = ["KimiLM", "ModelConfig", "PRESETS", "get_preset", "load"]
