"""Flax nnx layer stacks of the Kimi hybrid model (one stack per layer kind, leading layer axis)."""
