"""Training the shipped ``tiny`` model: stdlib corpus, packed batches, loss through the serving forward,
AdamW trainer, MXFP4 export and evaluation (``python -m kimi_jax.training.train_tiny``)."""
