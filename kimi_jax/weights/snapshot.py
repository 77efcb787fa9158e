"""Orbax snapshots of converted parameters, for fast restarts (no safetensors re-layout on the next start)."""

from __future__ import annotations

import os

import orbax.checkpoint as ocp
from flax import nnx

from kimi_jax.model import KimiModel


def save_snapshot(model: KimiModel, path: str) -> None:
    """Save the model's parameter state (an nnx State pytree) to ``path`` (a new directory)."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(path), nnx.state(model, nnx.Param))
    checkpointer.wait_until_finished()


def restore_snapshot(model: KimiModel, path: str) -> KimiModel:
    """Fill ``model`` (built from the same config and dtype) from a snapshot written by :func:`save_snapshot`."""
    abstract = nnx.state(model, nnx.Param)
    restored = ocp.StandardCheckpointer().restore(os.path.abspath(path), abstract)
    nnx.update(model, restored)
    return model
