"""Weight quantisation formats (MXFP4 for routed experts)."""

from kimi_jax.quant import mxfp4

__all__ = ["mxfp4"]
