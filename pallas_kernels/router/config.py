"""Launch config of the routing kernels. A field left None takes the device's tuned value (:mod:`pallas_kernels.tuning`,
``pallas_kernels/tuned/*.json``; BENCHMARKS.md, router)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """:func:`pallas_kernels.router.kernel.route_pallas`: the logits kernel splits D until about
    ``target_programs`` programs run (about one per SM of the H200), each streaming ``block_d`` rows of the router
    by ``block_e`` experts (largest powers of two dividing D / E up to these) over ``logits_stages`` stages with
    ``logits_warps`` warps; the top-k kernel runs ``topk_warps``."""

    target_programs: int | None = None
    block_d: int | None = None
    block_e: int | None = None
    logits_warps: int | None = None
    logits_stages: int | None = None
    topk_warps: int | None = None
