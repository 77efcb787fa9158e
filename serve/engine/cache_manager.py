"""CacheManager: the hybrid cache for the scheduler: MLA pages (``MLAPages``), KDA state slots (``KDASlots``)
and, beside them, the prefix index (``PrefixCache``) with the checkpoint policy that ties the two together.

A running request holds a block table of MLA pages and one live KDA slot. The scheduler grows running requests
through ``pages`` (``can_allocate`` / ``allocate``); admission and release touch both pools and the index, so they
are verbs of the manager (``can_admit`` / ``admit`` / ``free_request``).

Prefix caching (``enable_prefix_caching``, on by default) shares full pages through chained hashes and
restores KDA state from checkpoints (see ``prefix_cache.py``). Checkpoints are exported by the prefill pass
itself at positions chosen here:
* prompt end: position ``num_prompt_tokens - 1`` (always). One token must always be recomputed to produce
  the first logits, so this is the position a later identical prompt resumes from; a longer prompt that
  extends it resumes there too;
* every ``retention_interval`` tokens when > 0 (prefill and decode);
* Marconi admission: when a request's prompt walks ``M`` full pages of the index (a prefix seen before) but
  the best checkpoint is at least a page short of ``M * block_size`` and none exists there, the request
  exports one at that junction, so the third request sharing the prefix hits all of it;
* at the end of a finished (or preempted) request, its live slot itself becomes a checkpoint at
  ``num_computed_tokens`` (no copy): multi-turn chats resume from the previous turn's last state.
Restoring copies the checkpoint's slot into the request's live slot and the checkpoint's partially filled
tail page into a fresh page (copy-on-write); both copies are queued for the runner (``take_copies``).

With a ``connector`` (``kv_connector.KVConnector``: the CPU offload tier, or entries pulled from a prefill
engine) a lookup falls through to host memory: the device's page match is extended by the host's, and a host
checkpoint later than the device's best wins; its pages and state are loaded into fresh pages and the live slot.

Images (``media_rows`` > 0): page hashes and checkpoint tails are taken over ``request.cache_token_ids``, in
which an image's placeholders are a key of its content, so two different images never share a page or a
checkpoint. Admission also needs media-pool rows for every image the hit does not cover (``media.py``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from serve.engine.block_pool import RefCountedPool
from serve.engine.kda_slots import KDASlots
from serve.engine.media import MediaLease, MediaRows, pending_spans
from serve.engine.mla_pages import MLAPages
from serve.engine.prefix_cache import Checkpoint, PrefixCache, hash_page
from serve.engine.request import Request

if TYPE_CHECKING:
    from serve.engine.kv_connector import RemoteHit


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Pool sizes (including the reserved entry 0; take them from ``memory_plan.plan_pools``) and policy.

    ``max_checkpoints_per_seq`` is P, the static width of the step's checkpoint arrays: a prefill chunk that
    would contain more checkpoint positions is cut at the P-th. ``bytes_per_block`` / ``bytes_per_slot``
    only weigh checkpoint eviction (saved tokens per byte).
    """

    block_size: int
    num_blocks: int
    num_slots: int
    enable_prefix_caching: bool = True
    retention_interval: int = 0
    max_checkpoints_per_seq: int = 4
    bytes_per_block: int = 1
    bytes_per_slot: int = 1
    eviction_alpha: float = 1.0
    page_group_size: int | None = None  # pages per DCP rank: pages are striped over those groups
    media_rows: int = 0  # rows of the media pool (row 0 reserved); 0: requests cannot carry images

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"CacheConfig.block_size must be >= 1, got {self.block_size}")
        if self.retention_interval < 0:
            raise ValueError(f"CacheConfig.retention_interval must be >= 0, got {self.retention_interval}")
        if self.max_checkpoints_per_seq < 1:
            raise ValueError(f"CacheConfig.max_checkpoints_per_seq must be >= 1, got {self.max_checkpoints_per_seq}")
        if self.eviction_alpha < 0:
            raise ValueError(f"CacheConfig.eviction_alpha must be >= 0, got {self.eviction_alpha}")


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """Result of a lookup: resume after ``num_tokens`` tokens (0 = miss).

    ``blocks``: the shared full pages (``num_tokens // block_size`` of them); ``checkpoint``: the state to
    restore; ``num_matched_pages``: full pages of the request found in the index (>= len(blocks));
    ``junction``: the Marconi checkpoint position to export for this request, or None; ``remote``: a hit
    restored from the connector's host tier (then ``checkpoint`` is None and ``blocks`` are its device pages).
    """

    num_tokens: int
    blocks: list[int]
    checkpoint: Checkpoint | None
    num_matched_pages: int
    junction: int | None
    remote: RemoteHit | None = None


MISS = PrefixHit(0, [], None, 0, None)


@dataclasses.dataclass
class PrefixCacheStats:
    """Tokens looked up at admission and tokens served from the cache; checkpoints currently held."""

    queries: int = 0
    hits: int = 0
    num_checkpoints: int = 0


class CacheManager:
    """The two pools and the prefix index. ``pages`` and ``slots`` allocate; this class decides what is cached."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self.block_size = config.block_size
        blocks = RefCountedPool(config.num_blocks, "block", group_size=config.page_group_size)
        slots = RefCountedPool(config.num_slots, "slot")
        self.prefix = PrefixCache(config.block_size, blocks, slots, bytes_per_block=config.bytes_per_block,
                                  bytes_per_slot=config.bytes_per_slot, eviction_alpha=config.eviction_alpha)
        self.pages = MLAPages(blocks, config.block_size, self.prefix)
        self.slots = KDASlots(slots, self.prefix)
        self.enable_prefix_caching = config.enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._registered_pages: dict[str, int] = {}
        self.connector = None  # a KVConnector (kv_connector.attach_connector), else None
        self.media = MediaRows(config.media_rows)

    # ---- capacity ----
    def is_idle(self) -> bool:
        """No page or slot is referenced (every request has ended); the cache may still hold entries."""
        return self.pages.pool.num_referenced == 0 and self.slots.pool.num_referenced == 0

    def clear_prefix_cache(self, *, spill: bool = True) -> None:
        """Evict every unreferenced page and checkpoint, spilled to the host tier when there is one and ``spill``
        (False after the device pools were rebuilt: their contents are zeros, not the entries')."""
        listener = self.prefix.evictions
        if not spill:
            self.prefix.evictions = None
        try:
            while self.prefix.evict_checkpoint() or self.prefix.evict_page():
                pass
        finally:
            self.prefix.evictions = listener
        if self.connector is not None and spill:
            self.connector.flush_saves()

    def checkpoint_count(self) -> int:
        return len(self.prefix.checkpoints)

    # ---- lookup and admission ----
    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest resumable prefix of ``request.all_token_ids`` (at most all but one token) and its junction."""
        if not self.enable_prefix_caching:
            return MISS
        bs = self.block_size
        hashes = self._page_hashes(request)
        limit = request.num_tokens - 1
        path = self.prefix.match_pages(hashes)
        ckpt = self.prefix.find_checkpoint(request.cache_token_ids, path, limit)
        hit = ckpt.position if ckpt is not None else 0
        matched, remote = len(path), None
        if self.connector is not None:
            remote, matched = self.connector.find(hashes, request.all_token_ids, len(path), hit, limit)
        if remote is not None:
            hit, ckpt = remote.position, None
            blocks = [node.block for node in path[:remote.num_device_pages]]
        else:
            blocks = [node.block for node in path[:hit // bs]]
        junction = matched * bs
        has_junction = (0 < junction <= limit and junction - hit >= bs
                        and not self._has_checkpoint(request, hashes, junction)
                        and not (self.connector and self.connector.has_checkpoint(hashes, request.all_token_ids,
                                                                                  junction)))
        return PrefixHit(hit, blocks, ckpt, matched, junction if has_junction else None, remote)

    def plan_checkpoints(self, request: Request, hit: PrefixHit) -> None:
        """Choose the one-off checkpoint positions (prompt end, Marconi junction) for a request being admitted."""
        planned = []
        if self.enable_prefix_caching:
            prompt_end = request.num_prompt_tokens - 1
            if prompt_end > hit.num_tokens:
                planned.append(prompt_end)
            if hit.junction is not None:
                planned.append(hit.junction)
        request.planned_checkpoints = sorted(set(planned))

    def can_admit(self, request: Request, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Whether a live slot, the hit's entries and pages for ``num_new_tokens`` tokens fit (after evictions)."""
        pool = self.pages.pool
        shared = hit.blocks + ([hit.checkpoint.tail_block] if self._needs_cow(hit) else [])
        need_pages = self.pages.pages_for(hit.num_tokens + num_new_tokens) - len(hit.blocks)
        need_pages += sum(1 for b in shared if pool.refs(b) == 0)
        need_slots = 1 + (1 if hit.checkpoint is not None and self.slots.pool.refs(hit.checkpoint.slot) == 0 else 0)
        need_rows = sum(request.media[i].num_tokens for i in pending_spans(request, hit.num_tokens)
                        if i not in request.media_leases)
        return (self.pages.can_allocate(need_pages) and self.slots.can_allocate(need_slots)
                and self.media.can_allocate(need_rows))

    def admit(self, request: Request, hit: PrefixHit, num_new_tokens: int) -> None:
        """Give a waiting request its live slot and pages, restoring the hit (queues the copies)."""
        assert not request.block_table and request.state_slot == 0, request
        ckpt = hit.checkpoint
        if ckpt is not None:
            self.slots.pin(ckpt)  # before any allocation below, which may evict unreferenced checkpoints
            self.prefix.touch(ckpt)
        for node in self.prefix.match_pages(request.page_hashes[:len(hit.blocks)]):
            self.prefix.touch(node)
        self.pages.share(request, hit.blocks)
        if self._needs_cow(hit):
            self.pages.copy_on_write(request, ckpt.tail_block)
        self.slots.allocate(request, restore=ckpt)
        if hit.remote is not None:
            self.connector.restore(request, hit.remote, self.pages)
        request.num_computed_tokens = hit.num_tokens
        self._registered_pages[request.request_id] = len(hit.blocks)
        if self.enable_prefix_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += hit.num_tokens
        self.pages.allocate(request, num_new_tokens)
        for i in pending_spans(request, hit.num_tokens):
            if i not in request.media_leases:
                request.media_leases[i] = MediaLease(self.media.allocate(request.media[i].num_tokens))

    def release_media(self, request: Request, *, everything: bool = False) -> None:
        """Return the pool rows of the request's images that its prefill has passed (all of them with
        ``everything``)."""
        for i in list(request.media_leases):
            if everything or request.media[i].end <= request.num_computed_tokens:
                self.media.free(request.media_leases.pop(i).rows)

    # ---- checkpoints of running requests ----
    def checkpoint_positions(self, request: Request, start: int, num_new_tokens: int) -> tuple[list[int], int]:
        """Checkpoint positions in (start, start + n] that are not cached yet, and the possibly shortened n:
        a chunk holding more than ``max_checkpoints_per_seq`` positions stops at the last one kept."""
        if not self.enable_prefix_caching:
            return [], num_new_tokens
        end = start + num_new_tokens
        positions = {p for p in request.planned_checkpoints if start < p <= end}
        interval = self.config.retention_interval
        if interval:
            positions.update(range((start // interval + 1) * interval, end + 1, interval))
        if not positions:
            return [], num_new_tokens
        hashes = self._page_hashes(request)
        kept = [p for p in sorted(positions) if not self._has_checkpoint(request, hashes, p)]
        cap = self.config.max_checkpoints_per_seq
        if len(kept) > cap:
            kept = kept[:cap]
            num_new_tokens = kept[-1] - start
        return kept, num_new_tokens

    def on_step_done(self, request: Request, checkpoints: list[tuple[int, int]]) -> None:
        """After a step advanced ``request.num_computed_tokens``: index its new full pages and its exported
        checkpoints ``(position, slot)`` (a checkpoint that already exists releases its slot)."""
        if request.media_leases:
            self.release_media(request)
        if not self.enable_prefix_caching:
            return
        self._register_pages(request)
        for position, slot in checkpoints:
            self._register_checkpoint(request, position, slot)
            self.slots.pool.unref(slot)

    def free_request(self, request: Request, *, retain_state: bool) -> None:
        """Release everything the request holds. With ``retain_state`` (finished or preempted, never aborted
        mid-step) its live slot becomes a checkpoint at ``num_computed_tokens`` if none exists there."""
        if self.enable_prefix_caching and retain_state and request.state_slot and request.num_computed_tokens:
            self._register_pages(request)
            self._register_checkpoint(request, request.num_computed_tokens, request.state_slot)
        if self.connector is not None:
            self.connector.request_freed(request, self)
        self.pages.free(request)
        self.slots.free(request)
        self.release_media(request, everything=True)
        request.num_computed_tokens = 0
        self._registered_pages.pop(request.request_id, None)

    def resumable_entries(self, request: Request, position: int
                          ) -> tuple[list[tuple[bytes, int]], Checkpoint | None, int | None]:
        """What a request held by this manager resumes from at ``position``: (page hash, block) of its full pages
        before it, the indexed checkpoint there (None if there is none) and the block of its tail tokens."""
        bs = self.block_size
        hashes = self._page_hashes(request)
        depth = position // bs
        tail = tuple(request.all_token_ids[depth * bs:position])
        node = self.prefix.node_at(hashes, depth)
        ckpt = node.checkpoints.get(tail) if node is not None and position > 0 else None
        if ckpt is None or len(request.block_table) < depth + (1 if tail else 0):
            return [], None, None
        tail_block = request.block_table[depth] if tail else None
        return list(zip(hashes[:depth], request.block_table[:depth])), ckpt, tail_block

    # ---- per-step queues ----
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(src_block, dst_block) and (src_slot, dst_slot) copies queued since the last call."""
        return self.pages.take_copies(), self.slots.take_copies()

    def take_freed(self) -> tuple[list[int], list[int]]:
        """Blocks and slots that returned to the free lists since the last call."""
        return self.pages.pool.drain_freed(), self.slots.pool.drain_freed()

    def release_step_pins(self) -> None:
        """The step that copied from pinned sources has run: unpin them."""
        self.pages.release_pins()
        self.slots.release_pins()

    # ---- internals ----
    def _needs_cow(self, hit: PrefixHit) -> bool:
        return hit.checkpoint is not None and hit.checkpoint.tail_block is not None

    def _page_hashes(self, request: Request) -> list[bytes]:
        """Extend ``request.page_hashes`` to every full page of its known tokens."""
        hashes, bs, tokens = request.page_hashes, self.block_size, request.cache_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_page(hashes[-1] if i else b"", tokens[i * bs:(i + 1) * bs]))
        return hashes

    def _has_checkpoint(self, request: Request, hashes: list[bytes], position: int) -> bool:
        depth = position // self.block_size
        node = self.prefix.node_at(hashes, depth)
        tail = tuple(request.cache_token_ids[depth * self.block_size:position])
        return node is not None and tail in node.checkpoints

    def _register_pages(self, request: Request) -> None:
        """Index the request's computed full pages; a page already indexed with another block replaces the
        request's copy, so a request always references indexed pages (keeps the index downward closed)."""
        hashes = self._page_hashes(request)
        done = self._registered_pages.get(request.request_id, 0)
        full = request.num_computed_tokens // self.block_size
        for i in range(done, full):
            block = request.block_table[i]
            node = self.prefix.nodes.get(hashes[i])
            if node is None:
                parent = self.prefix.node_at(hashes, i)
                node = self.prefix.insert_page(parent, hashes[i], block)
            elif node.block != block:
                self.pages.pool.ref(node.block)
                request.block_table[i] = node.block
                self.pages.unref(block)
            self.prefix.touch(node)
        self._registered_pages[request.request_id] = max(done, full)

    def _register_checkpoint(self, request: Request, position: int, slot: int) -> None:
        depth = position // self.block_size
        node = self.prefix.node_at(request.page_hashes, depth)
        tail = tuple(request.cache_token_ids[depth * self.block_size:position])
        if tail in node.checkpoints:
            return
        tail_block = request.block_table[depth] if tail else None
        self.prefix.add_checkpoint(node, tail, tail_block, slot, position)
