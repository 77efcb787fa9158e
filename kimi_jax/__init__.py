"""kimi-jax: Kimi K3-class hybrid models (KDA + Gated MLA + AttnRes + LatentMoE + MXFP4) in JAX.

Dimension glossary (docstrings, einsum strings, shape comments): B batch, T tokens, N sequences in a packed
batch, H heads, HV KDA value heads, K key/head dim, V value dim, D model width, R low-rank/latent width,
F FFN width, E experts, S state slots, P pages or checkpoint positions, L stacked layers or depth sources,
C chunk size or conv channels. Details: docs/design.md.
"""

from kimi_jax.api import KimiLM, load
from kimi_jax.config import ModelConfig
from kimi_jax.presets import PRESETS, get_preset

__all__ = ["LLM", "KimiLM", "ModelConfig", "PRESETS", "SamplingParams", "get_preset", "load"]


def __getattr__(name: str):
    """``kimi_jax.LLM`` / ``kimi_jax.SamplingParams``: the serving engine's offline API, imported on first use
    (the engine lives in ``serve/``, above this package, so the import is lazy)."""
    if name == "LLM":
        from serve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from serve.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'kimi_jax' has no attribute {name!r}")
