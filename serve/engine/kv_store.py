"""HostKVStore: the host tier of the hybrid cache (plain Python; the arrays it holds are opaque to it).

It keys entries the way the device prefix index does (``prefix_cache.py``): a *page* by the chained hash of
every token up to its end, a *checkpoint* (KDA recurrent + conv state after ``position`` tokens) by the hash of
its last full page (``ROOT_HASH`` at depth 0) and its tail tokens, together with the latents of those tail
tokens (the partially filled page). A lookup walks the page hashes of a request; since a hash names its whole
prefix, a run of hits is a valid prefix without a tree.

Entries are evicted least recently used first once their bytes pass ``capacity_bytes``; entries pinned by an
owner (a transferred request that has not finished) are never evicted, so pins may exceed the capacity. An
entry's arrays (``data``, ``state``, ``tail_page``) are None while its device->host copy is still queued.
The store is shared by the engine thread and the HTTP threads, so every method takes its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Sequence

from serve.engine.prefix_cache import ROOT_HASH

ORIGINS = ("cpu", "remote")
"""Where an entry came from: spilled from this engine's device cache, or transferred from a prefill replica."""


class HostPage:
    """One full page of MLA latents: ``data`` holds one array ``[L_mla, block_size, ...]`` per page pool."""

    __slots__ = ("hash", "data", "nbytes", "origin", "pins")

    def __init__(self, page_hash: bytes, nbytes: int, origin: str, data: tuple | None = None):
        self.hash = page_hash
        self.data = data
        self.nbytes = nbytes
        self.origin = origin
        self.pins = 0

    @property
    def key(self) -> tuple:
        return ("page", self.hash)


class HostCheckpoint:
    """KDA state after ``position`` tokens: ``state`` holds one array ``[L_kda, ...]`` per slot pool;
    ``tail_page`` the page of the ``tail`` tokens (None when the position ends a page)."""

    __slots__ = ("node_hash", "tail", "position", "state", "tail_page", "nbytes", "origin", "pins")

    def __init__(self, node_hash: bytes, tail: tuple[int, ...], position: int, nbytes: int, origin: str,
                 state: tuple | None = None, tail_page: tuple | None = None):
        self.node_hash = node_hash
        self.tail = tail
        self.position = position
        self.state = state
        self.tail_page = tail_page
        self.nbytes = nbytes
        self.origin = origin
        self.pins = 0

    @property
    def key(self) -> tuple:
        return ("ckpt", self.node_hash, self.tail)


@dataclasses.dataclass(frozen=True)
class StoreStats:
    num_pages: int
    num_checkpoints: int
    num_bytes: int
    num_pinned: int


class HostKVStore:
    """Pages and checkpoints in host memory, LRU within ``capacity_bytes`` (see the module docstring)."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"HostKVStore capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.RLock()
        self._lru: collections.OrderedDict[tuple, HostPage | HostCheckpoint] = collections.OrderedDict()
        self._by_node: dict[bytes, dict[tuple[int, ...], HostCheckpoint]] = {}
        self._pins: dict[str, list[HostPage | HostCheckpoint]] = {}
        self._bytes = 0

    # ---- insertion ----
    def put_page(self, page: HostPage, *, owner: str | None = None) -> HostPage | None:
        """Insert ``page``, or refresh the entry already held under its hash; returns the stored entry (None
        when ``page`` is larger than the whole capacity and unpinned). ``owner`` pins the stored entry."""
        return self._put(page, owner)

    def put_checkpoint(self, ckpt: HostCheckpoint, *, owner: str | None = None) -> HostCheckpoint | None:
        """Insert ``ckpt`` (see ``put_page``)."""
        return self._put(ckpt, owner)

    def has(self, key: tuple) -> bool:
        with self._lock:
            return key in self._lru

    # ---- lookup ----
    def match_pages(self, page_hashes: Sequence[bytes], start: int) -> list[HostPage]:
        """The stored pages of ``page_hashes[start:]`` up to the first one missing."""
        with self._lock:
            run = []
            for h in page_hashes[start:]:
                page = self._lru.get(("page", h))
                if page is None:
                    break
                run.append(page)
            return run

    def find_checkpoint(self, page_hashes: Sequence[bytes], tokens: Sequence[int], max_depth: int, block_size: int,
                        *, above: int, limit: int) -> HostCheckpoint | None:
        """The checkpoint at the largest position in (above, limit] hanging on full page ``depth <= max_depth``
        of ``page_hashes`` (the root for depth 0) whose tail matches ``tokens``."""
        with self._lock:
            for depth in range(max_depth, -1, -1):
                if depth * block_size + block_size - 1 <= above:  # no position at this depth or below is larger
                    break
                node = ROOT_HASH if depth == 0 else page_hashes[depth - 1]
                best = None
                for tail, ckpt in self._by_node.get(node, {}).items():
                    pos = depth * block_size + len(tail)
                    if above < pos <= limit and (best is None or pos > best.position) \
                            and tuple(tokens[depth * block_size:pos]) == tail:
                        best = ckpt
                if best is not None:
                    return best
            return None

    def touch(self, entries: Sequence[HostPage | HostCheckpoint]) -> None:
        """Mark entries as just used (a hit)."""
        with self._lock:
            for entry in entries:
                if self._lru.get(entry.key) is entry:
                    self._lru.move_to_end(entry.key)

    # ---- pins ----
    def release(self, owner: str) -> None:
        """Drop ``owner``'s pins (its entries become evictable, and are evicted if over capacity)."""
        with self._lock:
            for entry in self._pins.pop(owner, []):
                entry.pins -= 1
            self._evict()

    def stats(self) -> StoreStats:
        with self._lock:
            pages = sum(1 for key in self._lru if key[0] == "page")
            return StoreStats(pages, len(self._lru) - pages, self._bytes,
                              sum(1 for e in self._lru.values() if e.pins))

    def arrays(self) -> list:
        """Every array held (copies still queued count as none), e.g. to wait until the queued saves land."""
        with self._lock:
            return [a for e in self._lru.values() for field in ((e.data,) if isinstance(e, HostPage)
                                                                 else (e.state, e.tail_page))
                    if field is not None for a in field]

    def clear(self) -> None:
        """Drop every unpinned entry."""
        with self._lock:
            capacity, self.capacity_bytes = self.capacity_bytes, 0
            self._evict()
            self.capacity_bytes = capacity

    # ---- internals ----
    def _put(self, entry, owner: str | None):
        with self._lock:
            stored = self._lru.get(entry.key)
            if stored is None:
                if owner is None and entry.nbytes > self.capacity_bytes:
                    return None
                stored = entry
                self._lru[entry.key] = entry
                self._bytes += entry.nbytes
                if isinstance(entry, HostCheckpoint):
                    self._by_node.setdefault(entry.node_hash, {})[entry.tail] = entry
            self._lru.move_to_end(entry.key)
            if owner is not None:
                stored.pins += 1
                self._pins.setdefault(owner, []).append(stored)
            self._evict()
            return stored if self._lru.get(stored.key) is stored else None

    def _evict(self) -> None:
        if self._bytes <= self.capacity_bytes:
            return
        for key in [k for k, e in self._lru.items() if not e.pins]:
            if self._bytes <= self.capacity_bytes:
                break
            entry = self._lru.pop(key)
            self._bytes -= entry.nbytes
            if isinstance(entry, HostCheckpoint):
                tails = self._by_node[entry.node_hash]
                del tails[entry.tail]
                if not tails:
                    del self._by_node[entry.node_hash]
