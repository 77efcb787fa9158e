"""Launch configs of the MLA kernels. A field left None takes the device's tuned value (:mod:`pallas_kernels.tuning`,
``pallas_kernels/tuned/*.json``); the figures are the H200 measurements that chose them (BENCHMARKS.md, MLA
decode / MLA prefill; K3 shapes: R = 512, K_rope = 64)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig:
    """The absorbed paged-attention Triton kernel (:func:`pallas_kernels.mla.attention.mla_paged_attention_pallas`).

    Tiling (tuned null: :func:`~pallas_kernels.mla.attention.choose_tiling` picks per call shape): ``block_q``
    query tokens x ``block_h`` heads per program (``block_q * block_h >= 16``, powers of 2), ``block_k`` keys per
    loop step, ``num_splits`` KV splits merged by LSE, ``num_warps``, ``num_stages``.

    The heuristic's constants: ``target_rows`` score rows per program (32 rows x 4 warps beat 64 x 8: at batch
    16, 32K context, H=32 341 us), ``target_programs`` (two waves of the H200's 132 SMs), tiles of at most
    ``small_rows`` rows stream ``small_block_k`` keys over ``small_stages`` stages (H=12: 209 us, 86% of copy
    bandwidth), larger ones ``large_block_k`` over ``large_stages`` (64 rows x 64 keys with an fp8 cache asked
    241920 B of shared memory). Short decode (one query per sequence, at most
    :data:`~pallas_kernels.mla.attention.SHORT_KV_TOKENS` cached tokens): ``short_block_h`` heads per program and
    splits of at least ``short_split_keys`` keys toward ``short_kv_programs`` programs and at most
    ``short_kv_max_splits`` splits (H=32, batch 1 over 560 tokens 20.0 -> 12.2 us, over 4K 22.4 -> 18.2, batch
    16 over 560 24.3 -> 19.7).
    """

    block_q: int | None = None
    block_h: int | None = None
    block_k: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    target_rows: int | None = None
    target_programs: int | None = None
    small_rows: int | None = None
    small_block_k: int | None = None
    small_stages: int | None = None
    large_block_k: int | None = None
    large_stages: int | None = None
    short_block_h: int | None = None
    short_split_keys: int | None = None
    short_kv_programs: int | None = None
    short_kv_max_splits: int | None = None


@dataclasses.dataclass(frozen=True)
class MLAPrefillConfig:
    """The un-absorbed prefill kernel (:func:`pallas_kernels.mla.prefill.mla_prefill_attention_pallas`): ``block_q``
    queries of one head per program, ``block_k`` keys per loop step over ``num_stages`` stages; ``num_warps``
    (tuned null: ``narrow_warps``, or ``wide_warps`` from ``wide_rows`` queries per program)."""

    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    narrow_warps: int | None = None
    wide_warps: int | None = None
    wide_rows: int | None = None


@dataclasses.dataclass(frozen=True)
class AbsorbQueriesConfig:
    """:func:`pallas_kernels.mla.absorb.absorb_queries_pallas`: ``block_r`` latent columns per program (shrunk to
    divide R), ``num_warps``, ``num_stages`` (the kernel has no loop)."""

    block_r: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class AbsorbOutputsConfig:
    """:func:`pallas_kernels.mla.absorb.absorb_outputs_pallas`: ``block_v`` output columns per program, ``block_k``
    latent columns per loop step over ``num_stages`` stages (both shrunk to divide V / R), ``num_warps``."""

    block_v: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class MLADecodeMGPUConfig:
    """The Mosaic-GPU decode kernel (:func:`pallas_kernels.mla.decode_mgpu.mla_decode_mgpu`).

    * ``splits``: KV splits per (sequence, head block); tuned null: one wave of ``num_sms`` CTAs
      (:func:`~pallas_kernels.mla.decode_mgpu.default_splits`).
    * ``stages``: 64-key shared-memory stages of the cache stream (Q 72 KB + two stages of 72 KB = 216 KB; three
      would need 297 KB, over the H200's 227 KB).
    * ``chunk``: accumulator columns per ``P V`` product, 64 or 128 (128 was 1-15% faster at all 8 shapes timed).
    * ``min_rows``: (token, head) rows per sequence from which decode routes here (at H=12 the Triton kernel was
      3-11% faster, at H=32 this one 1.5-1.6x).
    """

    splits: int | None = None
    stages: int | None = None
    chunk: int | None = None
    num_sms: int | None = None
    min_rows: int | None = None
