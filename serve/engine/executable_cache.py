"""Compiled step executables kept on disk across restarts, so a warm start skips tracing, lowering and compiling.

JAX's persistent compilation cache skips only the XLA compile: it keys an executable by its lowered program, so a
restart still traces and lowers every bucket to find that key (over a second per step of the shipped ``tiny`` on
an H100 host; ``kimi-jax serve tiny`` has 96 of them). This cache keys each executable by a fingerprint of what
shapes it instead, computed without tracing:

* the runner's part (``ModelRunner._executable_fingerprint``): the model's graph, the names, shapes, dtypes and
  shardings of the parameters, pools and step inputs, the engine config, the op implementation and the mesh;
* the environment: jax / jaxlib versions, the devices' kind, the XLA options and flags, ``KIMI_JAX_*`` /
  ``PALLAS_*`` / ``JAX_*`` variables (cache locations aside), and a digest of this package's source files (any
  code change starts a new folder);
* the executable's own key (its bucket) and step input layout.

Files live in ``<folder>/<fingerprint>/<key digest>.exec``, written atomically. A file that cannot be read back
(truncated, another jaxlib) is a miss and is compiled again; if a loaded executable fails when warm-up runs it
(seen with XLA's CPU client: an executable stored by a process that had compiled many others before, such as a
test worker, can name functions the loading process lacks), the runner discards the folder and compiles
everything. Backends that cannot serialise an executable (the CPU client refuses sort comparators) keep working:
the store is skipped. Delete the folder to reclaim the space of fingerprints that no longer occur.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
import threading
from pathlib import Path

import jax

_PACKAGES = ("kimi_jax", "pallas_kernels", "serve", "sharding")
_SOURCE_SUFFIXES = (".py", ".json")
_ENV_PREFIXES = ("KIMI_JAX_", "PALLAS_", "XLA_FLAGS", "JAX_")
_SUFFIX = ".exec"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over this project's Python and JSON sources (paths and bytes), computed once per process."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def environment_parts(devices, compiler_options: dict) -> dict:
    """What outside the runner changes a compiled program: versions, device kind, XLA options, env, sources."""
    import jaxlib

    return dict(jax=jax.__version__, jaxlib=jaxlib.__version__,
                devices=sorted({(d.platform, d.device_kind) for d in devices}),
                compiler_options=sorted(compiler_options.items()),
                env=sorted((k, v) for k, v in os.environ.items()
                           if k.startswith(_ENV_PREFIXES) and "CACHE" not in k),
                sources=source_digest())


def fingerprint(parts: dict) -> str:
    """sha256 of the ``repr`` of ``parts`` (sorted by name)."""
    return hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()


class ExecutableCache:
    """Compiled executables of one fingerprint in ``folder``; counts hits, misses and stores."""

    def __init__(self, folder: str | os.PathLike, fingerprint_hex: str):
        self.folder = Path(folder) / fingerprint_hex[:40]
        self.hits = self.misses = self.stored = self.unserializable = 0
        self._lock = threading.Lock()

    def _path(self, key) -> Path:
        return self.folder / (hashlib.sha256(repr(key).encode()).hexdigest()[:40] + _SUFFIX)

    def load(self, key) -> jax.stages.Compiled | None:
        """The executable stored under ``key``, or None (absent, or unreadable by this process)."""
        from jax.experimental import serialize_executable

        try:
            payload, in_tree, out_tree = pickle.loads(self._path(key).read_bytes())
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception:  # noqa: BLE001 - absent, damaged or foreign: a miss, rewritten after the compile
            compiled = None
        with self._lock:  # load() and store() run on the warm-up threads
            if compiled is None:
                self.misses += 1
            else:
                self.hits += 1
        return compiled

    def store(self, key, compiled: jax.stages.Compiled) -> bool:
        """Write ``compiled`` under ``key`` (atomically); False when the backend cannot serialise it."""
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception:  # noqa: BLE001 - e.g. the CPU client's "`LessThan` is not serializable"
            with self._lock:
                self.unserializable += 1
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            return False
        with self._lock:
            self.stored += 1
        return True

    def discard(self) -> None:
        """Delete this fingerprint's files (their executables loaded but could not run)."""
        for path in self.folder.glob("*" + _SUFFIX):
            path.unlink(missing_ok=True)

    def summary(self) -> str:
        return (f"executable cache {self.folder}: {self.hits} loaded, {self.misses} not found (compiled here), "
                f"{self.stored} stored so far"
                + (f", {self.unserializable} not serialisable on this backend" if self.unserializable else ""))
