"""Launch config of the greedy-sampling kernel. A field left None takes the device's tuned value
(:mod:`pallas_kernels.tuning`, ``pallas_kernels/tuned/*.json``; BENCHMARKS.md, greedy)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GreedyConfig:
    """:func:`pallas_kernels.greedy.kernel.greedy_pallas`: ``chunk`` vocabulary entries per program (a power of
    two; at most the vocabulary's next power of two), ``num_warps``. No dot and no loop: the kernel's shared
    memory is its cross-warp reductions."""

    chunk: int | None = None
    num_warps: int | None = None
