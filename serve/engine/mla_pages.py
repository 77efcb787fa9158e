"""MLAPages: the MLA page side of the hybrid cache (block tables of running requests, copy-on-write, pins).

A page holds ``block_size`` tokens of MLA latents in every MLA layer; block 0 is reserved scratch and never
handed out. Pages the prefix index holds but nobody references are reclaimed (evicted) on demand, cached pages
first, then checkpoints whose tail page is the only thing left to free.
"""

from __future__ import annotations

import math

from serve.engine.block_pool import RefCountedPool
from serve.engine.prefix_cache import PrefixCache
from serve.engine.request import Request


class MLAPages:
    """Allocation of MLA pages to requests: ``can_allocate`` / ``allocate`` / ``free``."""

    def __init__(self, pool: RefCountedPool, block_size: int, prefix: PrefixCache):
        self.pool = pool
        self.block_size = block_size
        self._prefix = prefix
        self._copies: list[tuple[int, int]] = []
        self._pins: list[int] = []

    @property
    def usage(self) -> float:
        return self.pool.num_referenced / self.pool.num_usable

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_new_pages(self, request: Request, num_new_tokens: int) -> int:
        """Pages the request's table lacks for positions up to ``num_computed_tokens + num_new_tokens``."""
        return self.pages_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether ``num_pages`` pages can be taken now (after evicting unreferenced cache entries)."""
        return self.pool.num_available >= num_pages

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Extend the request's block table to cover ``num_computed_tokens + num_new_tokens`` positions."""
        for _ in range(self.num_new_pages(request, num_new_tokens)):
            request.block_table.append(self._take(len(request.block_table)))

    def share(self, request: Request, blocks: list[int]) -> None:
        """Start the request's table with cached (shared, read-only) full pages."""
        for block in blocks:
            self.pool.ref(block)
        request.block_table = list(blocks)

    def append_fresh(self, request: Request) -> int:
        """Append one new page to the request's table (a host-tier load fills it before the step reads it)."""
        block = self._take(len(request.block_table))
        request.block_table.append(block)
        return block

    def copy_on_write(self, request: Request, source: int) -> None:
        """Append a private copy of the shared partial page ``source`` (the copy is queued for the runner; the
        source stays pinned until the step that copies it has run)."""
        self.pool.ref(source)
        self._pins.append(source)
        dst = self._take(len(request.block_table))
        self._copies.append((source, dst))
        request.block_table.append(dst)

    def free(self, request: Request) -> None:
        for block in request.block_table:
            self.unref(block)
        request.block_table = []

    def unref(self, block: int) -> None:
        if self.pool.unref(block):
            self._prefix.block_unreferenced(block)

    def take_copies(self) -> list[tuple[int, int]]:
        """(src_block, dst_block) copies queued since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def release_pins(self) -> None:
        """The step that copied from pinned sources has run: unpin them."""
        for block in self._pins:
            self.unref(block)
        self._pins = []

    def _take(self, page_index: int) -> int:
        """A page for position ``page_index`` of a block table: striped over the pool's groups (DCP ranks), page
        j from group ``j % groups``, so every rank holds an equal share of each long context."""
        while self.pool.num_free == 0:
            if not (self._prefix.evict_page() or self._prefix.evict_checkpoint()):
                raise RuntimeError("no page to allocate: check can_allocate first")
        return self.pool.allocate(page_index % self.pool.groups)
