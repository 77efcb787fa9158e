"""KDASlots: the KDA state side of the hybrid cache (live slots, checkpoint slots, restores, pins).

A slot holds one KDA recurrent + conv state in every KDA layer; slot 0 is reserved scratch. A running request
owns one live slot; checkpoints (state copies at chosen positions, indexed by the prefix cache) own the others.
Checkpoints nobody references are evicted on demand.
"""

from __future__ import annotations

from serve.engine.block_pool import RefCountedPool
from serve.engine.prefix_cache import Checkpoint, PrefixCache
from serve.engine.request import Request


class KDASlots:
    """Allocation of KDA state slots: ``can_allocate`` / ``allocate`` / ``free`` for live slots, and checkpoint
    slots for the prefill pass to export states into."""

    def __init__(self, pool: RefCountedPool, prefix: PrefixCache):
        self.pool = pool
        self._prefix = prefix
        self._copies: list[tuple[int, int]] = []
        self._pins: list[int] = []

    @property
    def usage(self) -> float:
        return self.pool.num_referenced / self.pool.num_usable

    def can_allocate(self, num_slots: int = 1) -> bool:
        return self.pool.num_available >= num_slots

    def pin(self, checkpoint: Checkpoint) -> None:
        """Keep a checkpoint's slot from eviction until the step that copies from it has run."""
        self.pool.ref(checkpoint.slot)
        self._pins.append(checkpoint.slot)

    def allocate(self, request: Request, restore: Checkpoint | None = None) -> None:
        """Give the request its live slot: the zero state, or a copy of ``restore``'s state (queued for the runner;
        ``restore`` must be pinned first, so that no allocation made for the request can evict it)."""
        assert request.state_slot == 0, request
        request.state_slot = self._take()
        if restore is not None:
            assert restore.slot in self._pins, restore.slot
            self._copies.append((restore.slot, request.state_slot))

    def free(self, request: Request) -> None:
        if request.state_slot:
            self.pool.unref(request.state_slot)
        request.state_slot = 0

    def allocate_checkpoint(self) -> int | None:
        """A slot to export a checkpoint into, evicting older checkpoints if needed; None when every slot is live."""
        if self.pool.num_available == 0:
            return None
        return self._take()

    def free_checkpoints(self, slots: list[int]) -> None:
        """Release checkpoint slots that were not indexed (their request ended while the step was in flight)."""
        for slot in slots:
            self.pool.unref(slot)

    def take_copies(self) -> list[tuple[int, int]]:
        """(src_slot, dst_slot) copies queued since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def release_pins(self) -> None:
        for slot in self._pins:
            self.pool.unref(slot)
        self._pins = []

    def _take(self) -> int:
        while self.pool.num_free == 0:
            if not self._prefix.evict_checkpoint():
                raise RuntimeError("no slot to allocate: check can_allocate first")
        return self.pool.allocate()
