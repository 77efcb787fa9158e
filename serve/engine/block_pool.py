"""RefCountedPool: ids of one cache pool (MLA pages or KDA slots) with reference counts and a free list."""

from __future__ import annotations

from collections import deque


class RefCountedPool:
    """Ids ``1 .. size-1`` of a pool whose id 0 is reserved scratch (padded sequences point at it).

    ``group_size``: ids form groups of that many consecutive ids (an MLA page pool split over DCP ranks: rank g
    holds ids ``[g * group_size, (g + 1) * group_size)``); ``allocate(group)`` prefers a group.

    An id has two kinds of owners:
    * ``refs``: holders that must keep it now (a request's block table or live slot, a step that copies from
      it). Referenced ids are never reclaimed.
    * ``holds``: prefix-cache entries (an indexed page, a checkpoint). Held but unreferenced ids are
      reclaimable: the cache evicts the entries to free them.
    An id is free (on the free list) iff it has neither. ``num_available`` = free + reclaimable ids, which is
    exactly what an allocation may use after evictions.
    """

    def __init__(self, size: int, name: str, *, group_size: int | None = None):
        if size < 2:
            raise ValueError(f"{name} pool needs at least 2 entries (entry 0 is reserved), got {size}")
        if group_size is not None and group_size < 1:
            raise ValueError(f"{name} pool group_size must be >= 1, got {group_size}")
        self.name = name
        self.size = size
        self._group_size = group_size or size
        self.groups = groups = -(-size // self._group_size)
        self._refs = [0] * size
        self._holds = [0] * size
        # one free list per group of consecutive ids (the DCP rank holding those pages; one group otherwise)
        self._free: list[deque[int]] = [
            deque(i for i in range(g * self._group_size, min(size, (g + 1) * self._group_size)) if i)
            for g in range(groups)]
        self._num_free = size - 1
        self._num_referenced = 0
        self._freed: list[int] = []

    @property
    def num_usable(self) -> int:
        return self.size - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def group_of(self, idx: int) -> int:
        return idx // self._group_size

    @property
    def num_referenced(self) -> int:
        return self._num_referenced

    @property
    def num_available(self) -> int:
        return self.num_usable - self._num_referenced

    def refs(self, idx: int) -> int:
        return self._refs[idx]

    def holds(self, idx: int) -> int:
        return self._holds[idx]

    def is_free(self, idx: int) -> bool:
        return self._refs[idx] == 0 and self._holds[idx] == 0

    def allocate(self, group: int | None = None) -> int:
        """Take a free id with one reference, from ``group``'s range when it has one free (else from the group with
        the most free ids). The caller evicts cache entries first when none is free."""
        if not self._num_free:
            raise RuntimeError(f"{self.name} pool has no free entry")
        if group is None or not self._free[group % self.groups]:
            group = max(range(self.groups), key=lambda g: len(self._free[g]))
        idx = self._free[group % self.groups].popleft()
        self._num_free -= 1
        self._refs[idx] = 1
        self._num_referenced += 1
        return idx

    def ref(self, idx: int) -> None:
        self._check(idx)
        if self._refs[idx] == 0:
            self._num_referenced += 1
        self._refs[idx] += 1

    def unref(self, idx: int) -> bool:
        """Drop a reference; True when it was the last one."""
        self._check(idx)
        if self._refs[idx] <= 0:
            raise RuntimeError(f"{self.name} {idx}: unref without a reference")
        self._refs[idx] -= 1
        if self._refs[idx]:
            return False
        self._num_referenced -= 1
        self._release_if_free(idx)
        return True

    def hold(self, idx: int) -> None:
        self._check(idx)
        self._holds[idx] += 1

    def unhold(self, idx: int) -> None:
        self._check(idx)
        if self._holds[idx] <= 0:
            raise RuntimeError(f"{self.name} {idx}: unhold without a hold")
        self._holds[idx] -= 1
        self._release_if_free(idx)

    def drain_freed(self) -> list[int]:
        """Ids that went back to the free list since the last drain (for poisoning them in a test mode)."""
        freed, self._freed = self._freed, []
        return freed

    def _release_if_free(self, idx: int) -> None:
        if self._refs[idx] == 0 and self._holds[idx] == 0:
            self._free[self.group_of(idx)].append(idx)
            self._num_free += 1
            self._freed.append(idx)

    def _check(self, idx: int) -> None:
        if not 0 < idx < self.size:
            raise ValueError(f"{self.name} {idx} is out of range 1..{self.size - 1}")
