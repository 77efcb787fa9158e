"""Launch config of the residual add + RMSNorm kernel. A field left None takes the device's tuned value
(:mod:`pallas_kernels.tuning`, ``pallas_kernels/tuned/*.json``; BENCHMARKS.md, RMSNorm)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AddRMSNormConfig:
    """:func:`pallas_kernels.rmsnorm.kernel.add_rms_norm_pallas`, one program per row. ``num_warps`` (tuned null:
    by shape) is ``few_rows_warps`` up to ``few_rows`` rows, so that one SM pulls all of a row's addends (H200,
    D=2304, one row, plain / 4 split-K parts / 8 expert rows + 4 parts: 2.52 / 3.03 / 3.72 us with 4 warps, 2.18
    / 1.83 / 2.89 with 16), else ``narrow_warps`` up to ``wide_width`` columns and ``wide_warps`` above. No dot
    and no loop: the kernel's shared memory is its cross-warp reductions."""

    num_warps: int | None = None
    few_rows: int | None = None
    few_rows_warps: int | None = None
    narrow_warps: int | None = None
    wide_width: int | None = None
    wide_warps: int | None = None
