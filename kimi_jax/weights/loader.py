"""Safetensors loader for hub-layout Kimi-Linear / Kimi K3 checkpoints.

One device: reads tensor by tensor (memory-mapped), fills one stacked parameter at a time on the host, moves it
to the device and drops the host copy, so host memory peaks at the largest stacked parameter, never at a second
copy of the model.

On a mesh (``layout=(mesh, expert_parallel)``): every parameter is created with ``jax.make_array_from_callback``
and its target ``NamedSharding`` (``sharding.rules``), and the callback builds one device's shard from the hub
tensors that overlap it, reading only the overlapping rows and columns (``safe_open(...).get_slice(name)[...]``):
no host ever holds a whole stacked parameter, and on several hosts each reads only its own devices' shards. The
torch ``[out, in]`` -> ``[in, out]`` transpose happens on the slice; MXFP4 packed bytes and their scales are split
along the same expert / row axes by the rules, so each shard holds whole bytes with their scales. Small tensors
with other layouts (norm vectors, A_log, conv taps, gpt-oss block pairs of one expert) are read whole and cut.
Missing, extra and mis-shaped tensors raise ``ValueError`` naming them.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
from typing import Callable

import jax
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


def load_into(model: KimiModel, folder: str, *, progress: Callable[[int, int], None] | None = None,
              layout=None) -> KimiModel:
    """Fill ``model``'s parameters from the hub-layout checkpoint in ``folder``; returns the model.

    ``layout``: None (one device), or ``(mesh, expert_parallel)``: read each parameter shard by shard straight onto
    the mesh's devices (see the module docstring; ``kda.conv`` comes out in the tensor-parallel channel order)."""
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
    shardings = None if layout is None else _shardings(model, *layout)
    for done, (path, entries) in enumerate(groups.items(), start=1):
        var = params[path]
        shape = tuple(var.shape)
        _check_coverage(path, shape, entries)
        if shardings is None:
            host = np.zeros(shape, dtype=np.dtype(var.dtype))
            for name, slot, read in entries:
                _place(host, name, slot, read())
            var.set_value(jnp.asarray(host))
            del host
        else:
            order = shardings["conv_order"] if path == "kda.conv" else None
            reader = functools.partial(_read_shard, shape=shape, dtype=np.dtype(var.dtype), entries=entries,
                                       where=where, channel_order=order)
            var.set_value(jax.make_array_from_callback(shape, shardings[path], reader))
        if progress:
            progress(done, len(groups))
    if shardings is not None and getattr(model, "kda", None) is not None:
        model.kda.conv_tp = shardings["tp"]
    return model


def _check_coverage(path: str, shape: tuple[int, ...], entries) -> None:
    """Every stacked index (and conv row part) filled exactly once, without reading anything."""
    depth = len(entries[0][1].index)
    conv_rows = entries[0][1].rows is not None
    seen: set[tuple] = set()
    for name, slot, _ in entries:
        key = slot.index + (None if slot.rows is None else _row_part(slot.rows, shape[depth]),)
        if key in seen:
            raise ValueError(f"checkpoint tensor {name!r} fills {path}{list(slot.index)} a second time")
        seen.add(key)
    holes = sorted(_expected_keys(shape, depth, conv_rows) - seen)
    if holes:
        raise ValueError(f"checkpoint is missing tensors for {path} at stacked indices {holes[:5]}")


def _shardings(model: KimiModel, mesh, expert_parallel: bool) -> dict:
    """Parameter path -> NamedSharding on ``mesh`` (``sharding.rules``), plus the conv channel order."""
    from jax.sharding import NamedSharding

    from sharding.mesh import MeshShape
    from sharding.rules import conv_channel_order, fit_spec, param_spec

    shape = MeshShape.of(mesh, expert_parallel=expert_parallel)
    out: dict = {path: NamedSharding(mesh, fit_spec(param_spec(path, expert_parallel), tuple(var.shape),
                                                    shape.sizes()))
                 for path, var in param_leaves(model).items()}
    tp = shape.tensor_parallel if mesh.size > 1 else 1
    out["tp"] = tp
    out["conv_order"] = conv_channel_order(model.config, tp) if getattr(model, "kda", None) is not None else None
    return out


WHOLE_READS: list[str] = []
"""Hub tensors the sharded path read whole (small layouts only); tests check the large ones never are."""


def _read_shard(index: tuple[slice, ...], *, shape, dtype, entries, where: dict[str, str],
                channel_order: np.ndarray | None) -> np.ndarray:
    """One device's shard ``param[index]`` built from the hub tensors that overlap it."""
    index = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, shape))
    if channel_order is not None:  # kda.conv [L, C, W]: the shard's channels are order[c0:c1] of [q | k | v]
        full = (index[0], slice(0, shape[1]), index[2])
        natural = _read_shard(full, shape=shape, dtype=dtype, entries=entries, where=where, channel_order=None)
        return natural[:, channel_order[index[1]]]
    out = np.zeros(tuple(sl.stop - sl.start for sl in index), dtype)
    for name, slot, read in entries:
        depth = len(slot.index)
        if not all(sl.start <= i < sl.stop for i, sl in zip(slot.index, index)):
            continue
        at = tuple(i - sl.start for i, sl in zip(slot.index, index))
        trailing = index[depth:]
        full_shape = shape[depth:]
        if slot.rows is not None:  # a row range of the slice (the packed q/k/v conv)
            lo, hi = max(slot.rows.start, trailing[0].start), min(slot.rows.stop, trailing[0].stop)
            if lo >= hi:
                continue
            part_shape = (slot.rows.stop - slot.rows.start,) + full_shape[1:]
            block = _whole(name, slot, read, part_shape)
            rows = slice(lo - trailing[0].start, hi - trailing[0].start)
            out[at + (rows,)] = block[(slice(lo - slot.rows.start, hi - slot.rows.start),) + trailing[1:]]
            continue
        out[at] = _part(name, slot, read, where.get(name), full_shape, trailing)
    return out


def _part(name: str, slot: Slot, read: Reader, file: str | None, full_shape, trailing) -> np.ndarray:
    """``to_param(hub tensor)[trailing]``, reading only that part for the plain and transposed layouts."""
    if file is not None and slot.layout.name in ("same", "linear"):
        with safe_open(file, framework="numpy") as f:
            view = f.get_slice(name)
            hub_shape = tuple(view.get_shape())
            if slot.layout.name == "same" and hub_shape == tuple(full_shape):
                return view[trailing]
            if slot.layout.name == "linear" and len(full_shape) == 2 and hub_shape == tuple(full_shape)[::-1]:
                return view[trailing[1], trailing[0]].T
    return _whole(name, slot, read, full_shape)[trailing]


def _whole(name: str, slot: Slot, read: Reader, target_shape) -> np.ndarray:
    WHOLE_READS.append(name)
    array = np.asarray(read())
    value = slot.layout.to_param(array, tuple(target_shape))
    if value.shape != tuple(target_shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(array.shape)}; expected "
                         f"{tuple(target_shape)} after the {slot.layout.name} layout for {slot.path}")
    return value


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
