"""KVConnector: the engine's side of a second cache tier in host memory (``HostKVStore``), and of exports.

It saves and loads a request's MLA pages and its KDA checkpoint (recurrent + conv state) by block hash:
* spill (CPU offload, ``spill=True``): a page or checkpoint the device prefix index evicts is copied to the store
  (device -> host, queued at the eviction and dispatched before anything can overwrite it);
* lookup: ``CacheManager.find_prefix`` extends the device's longest match with the store's pages and takes the
  store's checkpoint when it resumes later than the device's (so lookups fall through device -> host);
* restore: a host hit gets fresh device pages for its host pages and its tail page, and its live slot gets the
  checkpoint's state (host -> device loads queued for the runner, applied before the step that reads them); the
  request then runs exactly as after a device hit;
* export (the prefill side of disaggregation): when a request named by ``expect_export`` finishes, its prompt-end
  entries (the pages before position ``num_prompt_tokens - 1`` and the checkpoint there, which the prefill pass
  exports anyway) are copied to host and handed to ``on_export`` for a decode engine to pull; its device pages
  and slot are freed at once, as for any finished request;
* insert (the decode side): entries pulled from a prefill engine go into the store pinned by the request that
  brought them, so its admission finds them as a host hit.

Ordering: the runner calls ``flush_saves`` first in every ``execute`` (before test-mode poisoning, copies and
the step: a spilled page may be reallocated in the same schedule) and ``flush_loads`` after the copies. Every
copy is a fixed-shape executable (``host_copy.HostCopier``), compiled by ``attach_connector`` at start-up.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable, Sequence

from serve.engine.host_copy import HostCopier
from serve.engine.kv_store import HostCheckpoint, HostKVStore, HostPage
from serve.engine.prefix_cache import ROOT_HASH
from serve.engine.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class RemoteHit:
    """A prefix hit resumed from a host checkpoint: full pages [0, num_device_pages) shared from the device
    index, pages [num_device_pages, position // block_size) loaded from ``pages``; ``num_matched_pages`` pages of
    the request are held by either tier."""

    position: int
    num_device_pages: int
    pages: list[HostPage]
    checkpoint: HostCheckpoint
    num_matched_pages: int


@dataclasses.dataclass
class TransferItem:
    """One request's exported prompt: full pages [0, position // block_size) and the checkpoint at position."""

    pages: list[HostPage]
    checkpoint: HostCheckpoint

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pages) + self.checkpoint.nbytes


@dataclasses.dataclass
class ConnectorStats:
    """Totals since start: prefix-hit tokens restored per tier of origin, bytes copied each way, exports."""

    hit_tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    saved_bytes: int = 0
    loaded_bytes: int = 0
    exports: int = 0


class KVConnector:
    """See the module docstring. ``attach_connector`` binds it to an engine."""

    def __init__(self, store: HostKVStore, *, spill: bool,
                 on_export: Callable[[str, TransferItem], None] | None = None):
        self.store = store
        self.spill = spill
        self.on_export = on_export
        self.stats = ConnectorStats()
        self.copier: HostCopier | None = None
        self._runner = None
        self._block_size = 0
        self._page_saves: list[tuple[int, object, str]] = []  # (block, entry, attribute receiving the arrays)
        self._slot_saves: list[tuple[int, HostCheckpoint]] = []
        self._page_loads: list[tuple[object, str, int]] = []  # (entry, attribute holding the arrays, block)
        self._slot_loads: list[tuple[HostCheckpoint, int]] = []
        self._exports: dict[str, str] = {}  # request id -> transfer id
        self._lock = threading.Lock()

    def bind(self, runner, copier: HostCopier) -> None:
        self._runner = runner
        self.copier = copier
        self._block_size = copier.layout.block_size

    @property
    def num_executables(self) -> int:
        return self.copier.num_executables if self.copier is not None else 0

    # ---- evictions of the device prefix index (PrefixCache.evictions) ----
    def page_evicted(self, page_hash: bytes, block: int) -> None:
        page = HostPage(page_hash, self.copier.layout.page.nbytes, "cpu")
        if self.store.put_page(page) is page:
            self._page_saves.append((block, page, "data"))

    def checkpoint_evicted(self, node_hash: bytes, tail: tuple[int, ...], position: int, slot: int,
                           tail_block: int | None) -> None:
        layout = self.copier.layout
        ckpt = HostCheckpoint(node_hash, tail, position, layout.slot.nbytes + (layout.page.nbytes if tail else 0),
                              "cpu")
        if self.store.put_checkpoint(ckpt) is ckpt:
            self._queue_checkpoint_save(ckpt, slot, tail_block)

    # ---- lookup and restore (CacheManager) ----
    def find(self, page_hashes: Sequence[bytes], tokens: Sequence[int], num_device_pages: int, device_hit: int,
             limit: int) -> tuple[RemoteHit | None, int]:
        """(a host hit resuming after more than ``device_hit`` and at most ``limit`` tokens, or None; the pages
        of the request held by either tier)."""
        bs = self._block_size
        run = self.store.match_pages(page_hashes, num_device_pages)
        matched = num_device_pages + len(run)
        ckpt = self.store.find_checkpoint(page_hashes, tokens, matched, bs, above=device_hit, limit=limit)
        if ckpt is None:
            return None, matched
        depth = ckpt.position // bs
        shared = min(num_device_pages, depth)
        return RemoteHit(ckpt.position, shared, run[:depth - shared], ckpt, matched), matched

    def has_checkpoint(self, page_hashes: Sequence[bytes], tokens: Sequence[int], position: int) -> bool:
        depth = position // self._block_size
        if depth > len(page_hashes):
            return False
        node = ROOT_HASH if depth == 0 else page_hashes[depth - 1]
        return self.store.has(("ckpt", node, tuple(tokens[depth * self._block_size:position])))

    def restore(self, request: Request, hit: RemoteHit, pages) -> None:
        """After ``pages.share(request, <the hit's device pages>)`` and the live slot's allocation: append fresh
        pages for the host pages and the checkpoint's tail, and queue the loads (``pages``: ``MLAPages``)."""
        for page in hit.pages:
            self._page_loads.append((page, "data", pages.append_fresh(request)))
        ckpt = hit.checkpoint
        if ckpt.tail:
            self._page_loads.append((ckpt, "tail_page", pages.append_fresh(request)))
        self._slot_loads.append((ckpt, request.state_slot))
        self.store.touch([*hit.pages, ckpt])
        self.stats.hit_tokens[ckpt.origin] += hit.position - hit.num_device_pages * self._block_size

    # ---- exports (prefill side) ----
    def expect_export(self, request_id: str, transfer_id: str) -> None:
        """Export ``request_id``'s prompt under ``transfer_id`` when it finishes."""
        with self._lock:
            self._exports[request_id] = transfer_id

    def forget_export(self, request_id: str) -> None:
        with self._lock:
            self._exports.pop(request_id, None)

    def request_freed(self, request: Request, cache) -> None:
        """``CacheManager.free_request`` is about to release ``request`` (``cache``: that CacheManager)."""
        with self._lock:
            transfer_id = self._exports.pop(request.request_id, None)
        if (transfer_id is None or self.on_export is None or not request.is_finished
                or request.status == RequestStatus.FINISHED_ABORTED):
            return
        position = request.num_prompt_tokens - 1
        pages, ckpt, tail_block = cache.resumable_entries(request, position)
        if ckpt is None:
            return  # nothing to resume from (a one-token prompt): the decode engine computes it all
        layout = self.copier.layout
        item = TransferItem([HostPage(h, layout.page.nbytes, "remote") for h, _ in pages], HostCheckpoint(
            ckpt.node.hash, ckpt.tail, position, layout.slot.nbytes + (layout.page.nbytes if ckpt.tail else 0),
            "remote"))
        self._page_saves.extend((block, page, "data") for (_, block), page in zip(pages, item.pages))
        self._queue_checkpoint_save(item.checkpoint, ckpt.slot, tail_block)
        self.flush_saves()  # now: the request's pages may be reused by the next schedule
        self.stats.exports += 1
        self.on_export(transfer_id, item)

    # ---- inserts (decode side) ----
    def insert(self, items: Sequence[TransferItem], owner: str) -> None:
        """Store transferred entries (arrays already host-resident), pinned until ``store.release(owner)``."""
        for item in items:
            for page in item.pages:
                self.store.put_page(page, owner=owner)
            self.store.put_checkpoint(item.checkpoint, owner=owner)

    # ---- device side (ModelRunner.execute) ----
    def flush_saves(self) -> None:
        """Dispatch the queued device -> host copies (they read the current pools; nothing waits for them)."""
        runner, copier = self._runner, self.copier
        if self._page_saves:
            saves, self._page_saves = self._page_saves, []
            for (_, entry, attr), data in zip(saves, copier.save("page", runner.cache, [b for b, _, _ in saves])):
                setattr(entry, attr, data)
            self.stats.saved_bytes += len(saves) * copier.layout.page.nbytes
        if self._slot_saves:
            saves, self._slot_saves = self._slot_saves, []
            for (_, ckpt), data in zip(saves, copier.save("slot", runner.cache, [s for s, _ in saves])):
                ckpt.state = data
            self.stats.saved_bytes += len(saves) * copier.layout.slot.nbytes

    def flush_loads(self) -> None:
        """Dispatch the queued host -> device copies into the pools."""
        runner, copier = self._runner, self.copier
        if self._page_loads:
            loads, self._page_loads = self._page_loads, []
            runner.cache = copier.load("page", runner.cache, [(getattr(e, attr), b) for e, attr, b in loads])
            self.stats.loaded_bytes += len(loads) * copier.layout.page.nbytes
        if self._slot_loads:
            loads, self._slot_loads = self._slot_loads, []
            runner.cache = copier.load("slot", runner.cache, [(c.state, s) for c, s in loads])
            self.stats.loaded_bytes += len(loads) * copier.layout.slot.nbytes

    def _queue_checkpoint_save(self, ckpt: HostCheckpoint, slot: int, tail_block: int | None) -> None:
        self._slot_saves.append((slot, ckpt))
        if ckpt.tail:
            self._page_saves.append((tail_block, ckpt, "tail_page"))


def attach_connector(engine, connector: KVConnector) -> None:
    """Bind ``connector`` to an ``LLMEngine``'s cache manager, prefix index and runner, compiling its copy
    executables now (start-up). Refused (ValueError) where the first version does not reach: data-parallel
    fronts, multi-device meshes or several hosts, speculative decoding, prefix caching off."""
    runner = getattr(engine, "runner", None)
    if not hasattr(engine, "scheduler"):
        raise ValueError("the KV connector (CPU offload, prefill/decode roles) serves one replica: drop "
                         "--data-parallel-size")
    if runner.mesh.size > 1 or runner.multihost:
        raise ValueError("the KV connector (CPU offload, prefill/decode roles) runs on one device for now: drop the "
                         "parallelism flags")
    if engine.config.speculative_config is not None:
        raise ValueError("the KV connector (CPU offload, prefill/decode roles) does not support speculative "
                         "decoding yet: drop speculative_config")
    if not engine.config.enable_prefix_caching:
        raise ValueError("the KV connector (CPU offload, prefill/decode roles) restores entries through the prefix "
                         "cache: enable prefix caching")
    copier = HostCopier(runner.cache, runner.cache_shardings, runner.replicated, runner.model_config)
    copier.compile(runner.cache)
    connector.bind(runner, copier)
    runner.connector = connector
    cache = engine.scheduler.cache
    cache.connector = connector
    cache.prefix.evictions = connector if connector.spill else None
