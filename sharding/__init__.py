"""Meshes, partition rules by parameter path, and sharded op wrappers (tensor / expert / decode-context parallel)."""
