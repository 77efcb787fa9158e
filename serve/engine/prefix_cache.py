"""The prefix index for a hybrid cache: a radix tree of full MLA pages with KDA checkpoints hanging on it.

A page is identified by the chained hash of every token up to its end (``hash_page(parent_hash, tokens)``),
so a node's hash names its whole path from the root. KDA state can only be reused at an exact token count,
so a *checkpoint* (a state copy in a spare slot) at position p hangs on the node of its last full page
(depth p // block_size) together with its *tail*: the p % block_size tokens after that page, and the page
block holding their latents (shared copy-on-write). A prefix hit is the largest checkpoint position whose
pages and tail all match.

Eviction: pages leaf-first in LRU order (a page with children or checkpoints is never evicted, so every
indexed node's ancestors are indexed); checkpoints by the lowest Marconi-style score
``recency + alpha * efficiency`` (recency min-max normalised over the candidates, efficiency = saved tokens
per byte normalised by the largest), i.e. LRU that prefers keeping checkpoints saving the most compute per
byte. Only unreferenced entries are candidates. An ``evictions`` listener (the CPU offload tier,
``kv_connector.KVConnector``) is told of each evicted entry before its block and slot are released.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from typing import Sequence

import numpy as np

from serve.engine.block_pool import RefCountedPool

ROOT_HASH = b""


def hash_page(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
    """Chained 128-bit hash of one full page given the hash of everything before it."""
    return hashlib.blake2b(parent_hash + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class PageNode:
    """One full page in the index (the root is a sentinel with block 0 and depth 0)."""

    __slots__ = ("hash", "block", "parent", "depth", "children", "checkpoints", "last_access")

    def __init__(self, page_hash: bytes, block: int, parent: "PageNode | None", last_access: int):
        self.hash = page_hash
        self.block = block
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.children: dict[bytes, PageNode] = {}
        self.checkpoints: dict[tuple[int, ...], Checkpoint] = {}
        self.last_access = last_access


class Checkpoint:
    """KDA state after ``position`` tokens: ``node`` (its last full page), ``tail`` tokens and their block."""

    __slots__ = ("node", "tail", "tail_block", "slot", "position", "last_access")

    def __init__(self, node: PageNode, tail: tuple[int, ...], tail_block: int | None, slot: int, position: int,
                 last_access: int):
        self.node = node
        self.tail = tail
        self.tail_block = tail_block
        self.slot = slot
        self.position = position
        self.last_access = last_access


class PrefixCache:
    """Index of cached pages and checkpoints; it holds (``RefCountedPool.hold``) every block and slot it names."""

    def __init__(self, block_size: int, blocks: RefCountedPool, slots: RefCountedPool, *, bytes_per_block: int,
                 bytes_per_slot: int, eviction_alpha: float):
        self.block_size = block_size
        self.blocks = blocks
        self.slots = slots
        self.bytes_per_block = bytes_per_block
        self.bytes_per_slot = bytes_per_slot
        self.eviction_alpha = eviction_alpha
        self.root = PageNode(ROOT_HASH, 0, None, 0)
        self.nodes: dict[bytes, PageNode] = {}
        self.checkpoints: dict[int, Checkpoint] = {}  # by slot
        self._node_of_block: dict[int, PageNode] = {}
        self._leaf_heap: list[tuple[int, int, PageNode]] = []
        self._tiebreak = itertools.count()
        self._clock = 0
        self.evictions = None  # has page_evicted(hash, block), checkpoint_evicted(node hash, tail, pos, slot, block)

    # ---- lookup ----
    def match_pages(self, page_hashes: Sequence[bytes]) -> list[PageNode]:
        """Indexed nodes of the longest matching run of full pages."""
        path = []
        for h in page_hashes:
            node = self.nodes.get(h)
            if node is None:
                break
            path.append(node)
        return path

    def node_at(self, page_hashes: Sequence[bytes], depth: int) -> PageNode | None:
        """The indexed node of full page ``depth`` (the root for 0); None past the pages hashed so far."""
        if depth > len(page_hashes):
            return None
        return self.root if depth == 0 else self.nodes.get(page_hashes[depth - 1])

    def find_checkpoint(self, tokens: Sequence[int], path: Sequence[PageNode], limit: int) -> Checkpoint | None:
        """The checkpoint at the largest position <= ``limit`` whose pages lie on ``path`` and tail matches."""
        bs = self.block_size
        for depth in range(len(path), -1, -1):
            node = path[depth - 1] if depth else self.root
            best = None
            for tail, ckpt in node.checkpoints.items():
                pos = depth * bs + len(tail)
                if 0 < pos <= limit and (best is None or pos > best.position) \
                        and tuple(tokens[depth * bs:pos]) == tail:
                    best = ckpt
            if best is not None:
                return best
        return None

    # ---- insertion ----
    def insert_page(self, parent: PageNode, page_hash: bytes, block: int) -> PageNode:
        node = PageNode(page_hash, block, parent, self._tick())
        parent.children[page_hash] = node
        self.nodes[page_hash] = node
        self._node_of_block[block] = node
        self.blocks.hold(block)
        self._push_leaf(node)
        return node

    def add_checkpoint(self, node: PageNode, tail: tuple[int, ...], tail_block: int | None, slot: int,
                       position: int) -> Checkpoint:
        ckpt = Checkpoint(node, tail, tail_block, slot, position, self._tick())
        node.checkpoints[tail] = ckpt
        self.checkpoints[slot] = ckpt
        self.slots.hold(slot)
        if tail_block is not None:
            self.blocks.hold(tail_block)
        return ckpt

    def touch(self, entry: PageNode | Checkpoint) -> None:
        entry.last_access = self._tick()
        if isinstance(entry, PageNode):
            self._push_leaf(entry)

    def block_unreferenced(self, block: int) -> None:
        """Tell the index a block lost its last reference (its page may now be evictable)."""
        node = self._node_of_block.get(block)
        if node is not None:
            self._push_leaf(node)

    # ---- eviction ----
    def evict_page(self) -> bool:
        """Drop the least recently used evictable leaf page; False when there is none."""
        while self._leaf_heap:
            last_access, _, node = heapq.heappop(self._leaf_heap)
            if last_access == node.last_access and self._is_evictable(node):
                if self.evictions is not None:
                    self.evictions.page_evicted(node.hash, node.block)
                self._remove_page(node)
                return True
        return False

    def evict_checkpoint(self) -> bool:
        """Drop the unreferenced checkpoint with the lowest score; False when there is none."""
        candidates = [c for c in self.checkpoints.values() if self.slots.refs(c.slot) == 0]
        if not candidates:
            return False
        ckpt = min(candidates, key=self._scorer(candidates))
        if self.evictions is not None:
            self.evictions.checkpoint_evicted(ckpt.node.hash, ckpt.tail, ckpt.position, ckpt.slot, ckpt.tail_block)
        self.remove_checkpoint(ckpt)
        return True

    def remove_checkpoint(self, ckpt: Checkpoint) -> None:
        del ckpt.node.checkpoints[ckpt.tail]
        del self.checkpoints[ckpt.slot]
        self.slots.unhold(ckpt.slot)
        if ckpt.tail_block is not None:
            self.blocks.unhold(ckpt.tail_block)
        if ckpt.node is not self.root:
            self._push_leaf(ckpt.node)

    def efficiency(self, ckpt: Checkpoint) -> float:
        """Saved prefill tokens per byte the checkpoint keeps alive (its slot and its tail page)."""
        size = self.bytes_per_slot + (self.bytes_per_block if ckpt.tail_block is not None else 0)
        return ckpt.position / max(size, 1)

    def _scorer(self, candidates: list[Checkpoint]):
        oldest = min(c.last_access for c in candidates)
        span = max(c.last_access for c in candidates) - oldest
        best_eff = max(self.efficiency(c) for c in candidates)

        def score(c: Checkpoint) -> tuple[float, int]:
            recency = (c.last_access - oldest) / span if span else 1.0
            return recency + self.eviction_alpha * self.efficiency(c) / best_eff, c.last_access

        return score

    def _is_evictable(self, node: PageNode) -> bool:
        return (self.nodes.get(node.hash) is node and not node.children and not node.checkpoints
                and self.blocks.refs(node.block) == 0)

    def _remove_page(self, node: PageNode) -> None:
        parent = node.parent
        del parent.children[node.hash]
        del self.nodes[node.hash]
        del self._node_of_block[node.block]
        self.blocks.unhold(node.block)
        if parent is not self.root:
            self._push_leaf(parent)

    def _push_leaf(self, node: PageNode) -> None:
        if len(self._leaf_heap) > 4 * len(self.nodes) + 64:
            self._leaf_heap = [(n.last_access, next(self._tiebreak), n) for n in self.nodes.values()
                               if self._is_evictable(n)]
            heapq.heapify(self._leaf_heap)
        if self._is_evictable(node):
            heapq.heappush(self._leaf_heap, (node.last_access, next(self._tiebreak), node))

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
