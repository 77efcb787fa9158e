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
    """``kimi_jax.LLM`` / ``kimi_jax.SamplingParams``: documented re-exports of the serving engine's offline API
    (``serve.engine``, the layer above this package). The import runs when the attribute is first read, after
    ``kimi_jax`` has finished importing, so it cannot form a cycle (``tests/test_import_layers.py`` allows exactly
    these two)."""
    if name == "LLM":
        from serve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from serve.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'kimi_jax' has no attribute {name!r}")
