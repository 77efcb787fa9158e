"""Safetensors loader for hub-layout Kimi-Linear / Kimi K3 checkpoints.

Reads tensor by tensor (memory-mapped), fills one stacked parameter at a time on the host, moves it to the
device and drops the host copy, so host memory peaks at the largest stacked parameter, never at a second
copy of the model. Missing, extra and mis-shaped tensors raise ``ValueError`` naming them.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from kimi_jax.model import KimiModel
from kimi_jax.weights.names import Slot, slot_for
from pallas_kernels.mxfp4 import quant as mxfp4

Reader = Callable[[], np.ndarray]


def checkpoint_files(folder: str) -> list[str]:
    """Safetensors files of a checkpoint folder (sharded via ``model.safetensors.index.json`` or single)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
        if missing:
            raise ValueError(f"checkpoint index names shards that are missing: {missing}")
        return [os.path.join(folder, f) for f in files]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {folder!r}")
    return [os.path.join(folder, f) for f in files]


def _tensor_index(files: list[str]) -> dict[str, str]:
    where: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                if name in where:
                    raise ValueError(f"tensor {name!r} appears in both {where[name]} and {path}")
                where[name] = path
    return where


def _reader(path: str, name: str) -> Reader:
    def read() -> np.ndarray:
        with safe_open(path, framework="numpy") as f:
            return f.get_tensor(name)
    return read


def _blocks_reader(where: dict[str, str], blocks_name: str, want_scales: bool) -> Reader:
    """gpt-oss style ``weight_blocks``/``weight_scales`` pair -> compressed-tensors packed bytes or scales."""
    scales_name = blocks_name[: -len("_blocks")] + "_scales"
    if scales_name not in where:
        raise ValueError(f"checkpoint tensor {blocks_name!r} has no matching {scales_name!r}")

    def read() -> np.ndarray:
        packed, scales = mxfp4.blocks_to_packed(_reader(where[blocks_name], blocks_name)(),
                                                _reader(where[scales_name], scales_name)())
        return np.asarray(scales if want_scales else packed)
    return read


def plan(where: dict[str, str], cfg) -> dict[str, list[tuple[str, Slot, Reader]]]:
    """Group the checkpoint's tensors by destination parameter path (ignored tensors dropped)."""
    groups: dict[str, list[tuple[str, Slot, Reader]]] = collections.defaultdict(list)
    for name in sorted(where):
        if name.endswith(".weight_scales"):
            continue  # read with its .weight_blocks partner
        if name.endswith(".weight_blocks"):
            base = name[: -len("_blocks")]
            packed_slot = slot_for(base + "_packed", cfg)
            scale_slot = slot_for(base + "_scale", cfg)
            groups[packed_slot.path].append((name, packed_slot, _blocks_reader(where, name, False)))
            groups[scale_slot.path].append((name, scale_slot, _blocks_reader(where, name, True)))
            continue
        slot = slot_for(name, cfg)
        if slot is not None:
            groups[slot.path].append((name, slot, _reader(where[name], name)))
    return groups


def param_leaves(model: KimiModel) -> dict[str, nnx.Param]:
    """Parameter path (``kda.q_proj``) -> its nnx.Param."""
    return {".".join(str(k) for k in path): var for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}


def _expected_keys(shape: tuple[int, ...], depth: int, conv_rows: bool) -> set[tuple]:
    keys = set(itertools.product(*(range(n) for n in shape[:depth])))
    return {k + (r,) for k in keys for r in range(3)} if conv_rows else {k + (None,) for k in keys}


def load_into(model: KimiModel, folder: str, *, progress: Callable[[int, int], None] | None = None) -> KimiModel:
    """Fill ``model``'s parameters from the hub-layout checkpoint in ``folder``; returns the model."""
    cfg = model.config
    where = _tensor_index(checkpoint_files(folder))
    params = param_leaves(model)
    groups = plan(where, cfg)
    unknown = sorted(set(groups) - set(params))
    if unknown:
        names = [n for p in unknown for n, _, _ in groups[p]][:8]
        raise ValueError(f"checkpoint has tensors this model config has no parameter for ({unknown}): {names}")
    missing = sorted(set(params) - set(groups))
    if missing:
        raise ValueError(f"checkpoint has no tensors for parameters {missing}")
    for done, (path, entries) in enumerate(groups.items(), start=1):
        var = params[path]
        host = np.zeros(var.shape, dtype=np.dtype(var.dtype))
        depth = len(entries[0][1].index)
        conv_rows = entries[0][1].rows is not None
        seen: set[tuple] = set()
        for name, slot, read in entries:
            key = slot.index + (None if slot.rows is None else _row_part(slot.rows, host.shape[depth]),)
            if key in seen:
                raise ValueError(f"checkpoint tensor {name!r} fills {path}{list(slot.index)} a second time")
            seen.add(key)
            _place(host, name, slot, read())
        holes = sorted(_expected_keys(host.shape, depth, conv_rows) - seen)
        if holes:
            raise ValueError(f"checkpoint is missing tensors for {path} at stacked indices {holes[:5]}")
        var.set_value(jnp.asarray(host))
        del host
        if progress:
            progress(done, len(groups))
    return model


def _row_part(rows: slice, total: int) -> int:
    return 0 if rows.start == 0 else (1 if rows.stop < total else 2)


def _place(host: np.ndarray, name: str, slot: Slot, array: np.ndarray) -> None:
    target = host[slot.index] if slot.index else host
    if slot.rows is not None:
        target = target[slot.rows]
    value = slot.layout.to_param(np.asarray(array), target.shape)
    if value.shape != target.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(array.shape)}; expected "
                         f"{tuple(target.shape)} after the {slot.layout.name} layout for {slot.path}")
    target[...] = value.astype(host.dtype)
