"""Launch configs of the KDA kernels. A field left None takes the device's tuned value (:mod:`pallas_kernels.tuning`,
``pallas_kernels/tuned/*.json``); the figures below are the H200 measurements that chose them (BENCHMARKS.md, KDA
prefill / KDA decode; H32 T8K: 32 heads, K = V = 128, 8192 tokens)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChunkKDAConfig:
    """:func:`pallas_kernels.kda.chunk.chunk_kda_pallas`'s three launches (diagonal blocks, intra chunk, scan).

    * ``block_v``: V columns per scan program (32: 214.3 us against 257.0 with 64).
    * ``scan_warps`` / ``scan_stages``: 4 warps (214.3 us against 304.5 with 8) and 3 stages, which prefetch two
      chunks' ``w, u, qg, kg, A_qk`` ahead of the sequential state update (233.5 us against 315.5 with 2); 4 stages
      at ``block_v`` 64 exceed the shared memory. Fewer are taken where the inputs need more room (fp32: 1).
    * ``intra_warps`` / ``intra_stages``: 4 warps (473.1 us against 632.3 with 8; the lower-bound prefill 892.4
      us against 1307.2 with 2), 2 stages (1 and 3 within 0.5%: the kernel has no loop to pipeline).
    * ``diagonal_warps_dyadic`` / ``diagonal_warps_midpoint``: warps of the diagonal launch per form of its blocks
      (dyadic, any gate: 447.3 us with 2 against 552.8 with 4 and 1324.5 with 1; midpoint, the lower-bound gate:
      the whole prefill 987.2 us with 1 against 1007.8 with 2 and 1015.9 with 4).
    * ``fast_math``: PTX ``ex2`` / ``lg2`` / ``rcp`` approximations in place of libdevice's exact ``expf`` /
      ``log1pf`` / divide (998.6 us against 1076.8 at H32 T8K; fp32 results within 1e-4); tuned null: on the GPU.
    * ``adaptive_diagonal``: gates without a lower bound take the midpoint form per block where its span allows
      (``chunk._diagonal_block_any_gate``): tuned on (H100, softplus H32 T8K: diagonal launch 287.2 against 392.5
      us, the prefill 0.982 against 1.076 ms; about 2400 SASS instructions per program against 4200 for the
      dyadic form, so the gain does not depend on the device's bandwidth).
    """

    block_v: int | None = None
    intra_warps: int | None = None
    scan_warps: int | None = None
    intra_stages: int | None = None
    scan_stages: int | None = None
    diagonal_warps_dyadic: int | None = None
    diagonal_warps_midpoint: int | None = None
    fast_math: bool | None = None
    adaptive_diagonal: bool | None = None


@dataclasses.dataclass(frozen=True)
class KDADecodeConfig:
    """The decode / verify step (:func:`pallas_kernels.kda.fused_recurrent_kda`): which kernel, and its launch.

    * ``fused_max_rows``: decode steps with at most this many (sequence, value head) rows take the fused kernel,
      one launch with one program per (sequence, head) owning its whole state and conv channels; past it the
      split-V kernel. Profiler us per step at H=32, fused (4 warps) against split-V 64 + its epilogue, fp32 pool:
      batch 1 5.3 / 7.3, 16 24.6 / 29.9, 64 89.6 / 97.9, 256 348.8 / 360.4; bf16 pool: batch 64 60.7 / 70.1, 256
      220.4 / 247.2. Past 8192 rows (not timed) split-V stays.
    * ``split_v``: the split-V kernel's ``[K, split_v]`` state slice per program (above V: V); 0: never split.
    * ``block_v``: the fused kernel's state slice walked per loop step (tuned null: V, the whole state; 32 and 64
      were 2-10% slower at batch 1-256), pipelined over ``sliced_stages`` stages.
    * ``fused_warps`` (one token: 1.4-1.8x faster than 8 at batch 1-16) and ``verify_warps`` (several tokens; not
      swept).
    * ``split_v_warps`` from :data:`WIDE_SPLIT_V` columns, ``narrow_split_v_warps`` below; ``epilogue_warps``:
      the split-V epilogue (gated RMSNorm and conv-state write).
    * ``mgpu_min_rows`` / ``mgpu_min_rows_bf16``: decode steps over an fp32 / bf16 state pool with at least this
      many rows take the Mosaic-GPU state update (:mod:`pallas_kernels.kda.decode_mgpu`, K = V = 128) instead; 0:
      never. H100 (device us of the whole step, Mosaic-GPU against the tuned Triton kernel): fp32 H96 B64 (6144
      rows) 310.6 / 320.9, H32 B256 407.9 / 429.1, H96 B256 1192.0 / 1322.9, but H32 B64 (2048) 115.6 / 107.4;
      bf16 H96 B256 (24576) 751.8 / 825.6, but H32 B256 (8192) 266.2 / 254.1 and H96 B64 199.5 / 193.4; every
      B16 case slower. Tuned 6144 / 24576 on the H100 (the ``k3-slice`` engine at batch 64 runs with them, device
      7.51 -> 7.49 ms per step), 0 elsewhere until timed (BENCHMARKS.md, KDA decode).
    * ``mgpu_one_launch``: where each value head has its own q / k head (H = HV), the Mosaic-GPU path in one
      launch (conv, norms, gate and gated RMSNorm inside the state update's kernel) instead of three (a Triton
      inputs kernel, the update, an XLA RMSNorm: 9-80 us and 4 us on top of the update on the H100). Tuned false
      until it has run on a GPU.
    * ``mgpu_bf16_sums``: a bf16 pool's two column sums in the Mosaic-GPU update, ``"wgmma"`` (timed above) or
      ``"reduce"`` (the fp32 pool's cross-warp reductions: half the shared memory, room for six CTAs per SM
      against three, if registers allow; not yet timed).
    """

    fused_max_rows: int | None = None
    split_v: int | None = None
    block_v: int | None = None
    sliced_stages: int | None = None
    fused_warps: int | None = None
    verify_warps: int | None = None
    split_v_warps: int | None = None
    narrow_split_v_warps: int | None = None
    epilogue_warps: int | None = None
    mgpu_min_rows: int | None = None
    mgpu_min_rows_bf16: int | None = None
    mgpu_one_launch: bool | None = None
    mgpu_bf16_sums: str | None = None


WIDE_SPLIT_V = 64
"""Split-V slices at least this wide take ``split_v_warps`` warps, narrower ones ``narrow_split_v_warps``."""
