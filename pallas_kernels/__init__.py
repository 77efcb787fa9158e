"""Hot-path ops for kimi-jax, one folder per op: ``reference.py`` (pure jnp, fp32 math) + Pallas kernel(s).

Every public op takes ``impl=None | "reference" | "pallas"``; ``None`` resolves once per backend through
:func:`pallas_kernels.impl.resolve_impl` (GPU: pallas, CPU: reference). On CPU, ``impl="pallas"`` runs the
kernel with ``interpret=True``.
"""
