"""Launch config of the AttnRes mix kernel. A field left None takes the device's tuned value
(:mod:`pallas_kernels.tuning`, ``pallas_kernels/tuned/*.json``; BENCHMARKS.md, AttnRes mix)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """:func:`pallas_kernels.attnres.kernel.attnres_mix_pallas`: ``block_n`` tokens per program (a power of two),
    ``max_chunk`` the widest ``D`` chunk a loop step reads, ``num_warps``. No dot, one stage: the kernel's shared
    memory is its cross-warp reductions."""

    block_n: int | None = None
    max_chunk: int | None = None
    num_warps: int | None = None
