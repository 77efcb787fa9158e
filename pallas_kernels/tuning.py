"""Kernel configs with tuned defaults stored as data, and tilings that fit the device's shared memory.

Configs: every kernel takes one frozen dataclass, ``config=`` (None: the tuned default). A field left None takes
the value tuned for the device, read from ``pallas_kernels/tuned/<device>.json`` (e.g. ``nvidia-h200.json`` for
``"NVIDIA H200"``), else from ``generic.json`` (CPU runs and untuned GPUs); a tuned value of ``null`` means the
kernel picks per call shape, as the field's doc says. :func:`overriding` swaps in other defaults for a block of
code (tests, experiments) and :func:`override` for the rest of the process (a bench's flags).

Shared memory: :func:`smem_limit` is the device's opt-in per-block limit, queried from the CUDA driver
(``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)`` through ``libcuda.so.1``), else
looked up by device kind in ``generic.json``; off the GPU it is the H200's (interpret mode has no limit, and the
CUDA lowering tests target the H200). Each Triton kernel estimates what a config needs, conservatively:

    bytes = num_stages x (tiles one loop step loads) + (dot operands built in registers, each staged once)

Triton's software pipeliner keeps up to ``num_stages`` copies of the tiles a loop step loads (the rule Triton's
own matmul autotuner prunes with; loads gathered through an index loaded in the same step hold one fewer); a
``tl.dot`` operand computed in registers goes through shared memory on its way into the MMA. Kernels without a
loop count each loaded dot operand once. :func:`fit` then takes the config if its estimate fits, else the first
smaller one (fewer stages, then smaller blocks) that does, and raises ValueError naming the shape when none does.
Mosaic-GPU kernels count their shared-memory buffers exactly and check them with :func:`check_smem`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import math
import os
import re
from typing import Callable, Iterable, TypeVar

import jax
import numpy as np

from pallas_kernels.impl import on_gpu

TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
GENERIC = "generic"
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
OFF_GPU_SMEM_BYTES = 232448
"""Off the GPU: the H200's opt-in limit (227 KB), what the CUDA lowering tests and interpret mode tile for."""
C = TypeVar("C")
_log = logging.getLogger(__name__)
_OVERRIDES: dict[type, object] = {}


def device_kind() -> str:
    """``jax.devices()[0].device_kind`` on a GPU (e.g. ``"NVIDIA H200"``), else ``"cpu"``."""
    return str(jax.devices()[0].device_kind) if on_gpu() else "cpu"


def tuned_file(kind: str) -> str:
    """The data file of a device kind: lower case, runs of other characters as ``-`` (``nvidia-h200.json``)."""
    return os.path.join(TUNED_DIR, re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") + ".json")


@functools.cache
def _load(kind: str) -> dict:
    path = tuned_file(kind)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _entry(cls: type, kind: str) -> dict:
    """The tuned fields of ``cls`` for ``kind``: the generic entry updated by the device's own."""
    name = cls.__name__
    generic = _load(GENERIC).get("configs", {}).get(name)
    if generic is None:
        raise KeyError(f"{name} has no entry in {tuned_file(GENERIC)}")
    return {**generic, **_load(kind).get("configs", {}).get(name, {})}


def tuned(cls: type[C], kind: str | None = None) -> C:
    """The tuned default of config class ``cls`` for ``kind`` (default: this process's device), or the
    override in force (:func:`overriding`)."""
    if kind is None and cls in _OVERRIDES:
        return _OVERRIDES[cls]
    entry = _entry(cls, device_kind() if kind is None else kind)
    names = {f.name for f in dataclasses.fields(cls)}
    if set(entry) != names:
        raise ValueError(f"tuned {cls.__name__} for {kind or device_kind()!r}: fields {sorted(names)} expected, "
                         f"data has {sorted(entry)}")
    return cls(**{n: tuple(v) if isinstance(v, list) else v for n, v in entry.items()})


def resolve(cls: type[C], config: C | None) -> C:
    """``config`` with its None fields taken from :func:`tuned` (``config=None``: the tuned default)."""
    default = tuned(cls)
    if config is None:
        return default
    if not isinstance(config, cls):
        raise ValueError(f"config must be a {cls.__name__}, got {type(config).__name__}")
    return dataclasses.replace(default, **{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)
                                           if getattr(config, f.name) is not None})


def override(config) -> None:
    """From now on :func:`tuned` returns ``config`` (its None fields resolved first) for its class: a bench's
    command-line knobs. Kernels read their config when traced: jit caches made before are not retraced."""
    _OVERRIDES[type(config)] = resolve(type(config), config)


@contextlib.contextmanager
def overriding(*configs):
    """:func:`override` for the duration of a block."""
    saved = dict(_OVERRIDES)
    try:
        for config in configs:
            override(config)
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


# ----------------------------------------------------------------------------------------------------------------
# Shared memory


@functools.cache
def _query_smem(ordinal: int) -> int | None:
    """The CUDA driver's opt-in per-block shared memory of device ``ordinal`` (None if the driver is not there)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, value = ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal):
        return None
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device):
        return None
    return value.value


def smem_by_kind(kind: str) -> int:
    """The table's opt-in per-block shared memory of a device kind: the longest prefix listed in
    ``generic.json``, else its ``"default"`` (48 KB, what every CUDA device grants without opting in)."""
    table = _load(GENERIC)["shared_memory_per_block_optin"]
    prefixes = [p for p in table if p != "default" and kind.startswith(p)]
    return table[max(prefixes, key=len)] if prefixes else table["default"]


def smem_limit() -> int:
    """Bytes of shared memory one program (CTA) may use on this process's device: queried from the driver,
    else :func:`smem_by_kind`; :data:`OFF_GPU_SMEM_BYTES` off the GPU."""
    if not on_gpu():
        return OFF_GPU_SMEM_BYTES
    queried = _query_smem(int(getattr(jax.devices()[0], "local_hardware_id", None) or 0))
    return queried if queried else smem_by_kind(device_kind())


def nbytes(dtype, *shape: int) -> int:
    """Bytes of a ``shape`` tile of ``dtype``."""
    return math.prod(shape) * np.dtype(dtype).itemsize


def smaller(config: C, stages: str, blocks: Iterable[tuple[str, int]] = ()) -> list[C]:
    """Fallbacks of ``config`` in order: each count of field ``stages`` below its value, then, per halving of the
    ``blocks`` fields (``(name, smallest)``, in order, down to their smallest), every stage count again."""
    top = getattr(config, stages)
    out = [dataclasses.replace(config, **{stages: s}) for s in range(top - 1, 0, -1)]
    current = config
    for name, least in blocks:
        while getattr(current, name) // 2 >= least:
            current = dataclasses.replace(current, **{name: getattr(current, name) // 2})
            out += [dataclasses.replace(current, **{stages: s}) for s in range(top, 0, -1)]
    return out


def fit(kernel: str, config: C, estimate: Callable[[C], int], fallbacks: Iterable[C] = (), what: str = "") -> C:
    """``config`` if ``estimate(config)`` bytes fit :func:`smem_limit`, else the first of ``fallbacks`` that fits.
    None fits: ValueError naming ``kernel`` and the shape (``what``)."""
    limit = smem_limit()
    need = estimate(config)
    if need <= limit:
        return config
    for candidate in fallbacks:
        if estimate(candidate) <= limit:
            _log.info("%s: %s instead of %s: ~%d B of shared memory needed, %d available", kernel, candidate, config,
                      need, limit)
            return candidate
    raise ValueError(f"{kernel}: {what or 'this shape'} needs ~{need} B of shared memory per program at {config}, "
                     f"more than the device's {limit} B at every smaller tiling")


def check_smem(kernel: str, need: int, what: str) -> None:
    """ValueError unless ``need`` bytes (a Mosaic-GPU kernel's exact count) fit :func:`smem_limit`."""
    limit = smem_limit()
    if need > limit:
        raise ValueError(f"{kernel}: {what} needs {need} B of shared memory per CTA, more than the device's {limit} B")
