"""Launch configs of the grouped GEMMs. A field left None takes the device's tuned value (:mod:`pallas_kernels.tuning`,
``pallas_kernels/tuned/*.json``); the figures are the H200 sweeps that chose them (BENCHMARKS.md, MXFP4 grouped
GEMM; K3 shapes: 56 local experts, gate + up N = 2 x 3072, K = 3584)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """One launch of :func:`pallas_kernels.mxfp4.kernel.grouped_gemm_concat_pallas`: ``block_m`` rows x
    ``block_n`` columns per program, ``block_k`` K columns per loop step over ``num_stages`` stages, ``num_warps``;
    ``weights_lhs`` computes ``W @ x.T`` per tile (the decoded weights as the MMA's register operand, small M);
    ``split_k`` cuts every tile's K loop over that many programs. The public ops pick one per call shape
    (:func:`pallas_kernels.mxfp4.ops.tile_config`, from :class:`GroupedGemmTiling`); the tuned value is the
    kernel's own default for direct calls."""

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    weights_lhs: bool | None = None
    split_k: int | None = None


@dataclasses.dataclass(frozen=True)
class GroupedGemmTiling:
    """:func:`pallas_kernels.mxfp4.ops.tile_config`'s table: the first of ``rules`` whose ``formats`` (all when
    absent) hold the weight format and whose ``[min_rows_per_expert, max_rows_per_expert]`` hold the mean rows
    per expert gives the tiles (:class:`GroupedGemmConfig` fields). H200 sweeps behind the rules, in order:

    * word order up to 16 rows per expert (decode; x as the MMA's A operand): 8 / 64 / 256 tokens over 56
      experts and 256 over 112: 50.5 / 247.7 / 313.2 / 601.6 us against 51.9 / 258.8 / 330.3 / 642.6 for the
      pair-halves tiling; 2 warps from 2 rows per expert (each 32 of the 64 columns): 256 tokens over 56 / 112
      experts 305.3-307.0 / 572.8-573.4 us against 317.2-318.8 / 606.6-606.9 with 4 warps; at 4 / 8 tokens 4 warps
      are ahead (34.1 / 75.1 against 35.8 / 78.2 us); no size between 1.2 and 4.3 rows per expert was timed.
    * pair halves up to 16 rows: 256-column K steps, 66.3 / 324.8 / 413.4 us at 8 / 64 / 256 tokens against 88.0 /
      469.8 / 605.4 for the checkpoint order's tiling.
    * other formats up to 16 rows: one row tile per expert, the weight tile as the MMA's register operand.
    * word order up to 32 rows: 1024 tokens over 56 experts 429.6 us against 518.1 with 64-row tiles.
    * up to 64 rows: 64 x 128 tiles (the word order reads its scales 128 columns at a time).
    * prefill: word order 1412 us at 8192 tokens (36% of the bf16 matmul rate), pair halves 1845 us (28%)
      against 2390 for the 128 x 256 tiles that the checkpoint order and bf16 keep.

    ``split_k_below_programs``: with fewer (expert, column tile) programs K is split over the smallest divisor of
    its steps that reaches this many (one row of N=4096, 64 programs: 8.5 us whole, 7.9 split in 2; N=2304,
    K=4096, 36 programs: 11.7 / 9.1 / 8.4 us in 1 / 2 / 4; 8 experts of N=1024, 128 programs: 11.2 whole, 12.5 in
    2). ``short_k_steps`` / ``short_k_stages``: register-operand tiles with at most that many K steps take that
    many stages (one MoE down projection at decode, K=1024: 14.1 -> 11.5 us with 3 stages; 2 stages 13.4)."""

    rules: tuple[dict, ...] | None = None
    split_k_below_programs: int | None = None
    short_k_steps: int | None = None
    short_k_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class MXFP4MGPUConfig:
    """:func:`pallas_kernels.mxfp4.decode_mgpu.mxfp4_grouped_matmul_mgpu`: ``block_k`` K columns per pipeline step
    (tuned null: the largest of 256, 128, 64 dividing K), ``block_m`` rows per tile (the wgmma N), ``stages``
    shared-memory stages, ``wgs`` compute warpgroups per CTA. :func:`~pallas_kernels.mxfp4.ops.mgpu_tile_config`
    picks ``decode_block_m`` rows and one warpgroup up to ``decode_rows_per_expert`` rows per expert, else
    ``prefill_block_m`` rows and ``prefill_wgs`` warpgroups where every width allows (a first guess: the H200
    sweep, ``BENCH_SUITE=mgpu``, has not run). Stages shrink to fit the device's shared memory."""

    block_k: int | None = None
    block_m: int | None = None
    stages: int | None = None
    wgs: int | None = None
    decode_rows_per_expert: int | None = None
    decode_block_m: int | None = None
    prefill_block_m: int | None = None
    prefill_wgs: int | None = None
