"""Decode context parallelism for MLA: latent pages split over the ``dcp`` axis, partial attention merged by LSE.

Runs inside the MLA layer's ``jax.shard_map`` (``sharding.parallel.Parallel.mla``), per device.

Page layout. The pool's block axis is split into contiguous ranges: DCP rank ``d`` holds global blocks
``[d * B_local, (d + 1) * B_local)``; block tables keep global ids. Which rank holds which part of a sequence is the
allocator's choice: the engine stripes pages, page ``j`` of a request from rank ``j % dcp``'s range
(``serve.engine.block_pool.RefCountedPool`` groups), so every rank holds an equal share of every long context
and capacity grows with the group. Contiguous id ranges (rather than ``block % dcp``) keep a global id's local
index a subtraction and let the pool stay one array whose block axis ``NamedSharding`` splits evenly; the
striping lives in the allocator, where balance is decided. Correctness never depends on the placement: every rank
finds its own pages in a table by their ids.

Attention. Heads are split over ``tensor x dcp`` for the weights (DCP ranks are TP ranks, as in vLLM), but a DCP
rank holds keys of every head of its tensor group, so:
1. the absorbed queries of the rank's heads are all-gathered over ``dcp`` (all heads of the tensor group);
2. each rank attends over its own pages only. Each query row is given to the paged kernel as a sequence of its
   own (one row, ``cu_q_lens = 0, 1, 2, ...``) whose block table is the rank's pages of that row's sequence in
   position order and whose context is the number of those keys at or before the row's position. That is exact
   for decode and prefill rows alike: a rank's pages of a sequence are full except the sequence's last page, so
   its visible keys are a prefix of its compacted table. (Prefill rows each re-read the rank's pages: a chunk-
   aware split, context part per rank plus the chunk's own causal part, would read them once.)
3. the partial ``(o, lse)`` of every head go back to the head's owner with one all-to-all over ``dcp`` and are
   merged by log-sum-exp (``pallas_kernels.mla.reference.merge_partials``). Rows with no key on a rank get
   ``lse = NO_KEY_LSE`` and zero output before the exchange, whatever the kernel returns for an empty context.
The cache write of a token goes only to the rank that owns its page. ``form`` is always the absorbed one here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kimi_jax.config import ModelConfig
from kimi_jax.layers.mla import MLAStack, write_latent
from kimi_jax.step import StepInputs, TokenLayout
from pallas_kernels import mla as mla_ops
from pallas_kernels.mla.reference import NO_KEY_LSE, merge_partials

F32 = jnp.float32
AXIS = "dcp"


def local_slots(slots: jax.Array, pages: jax.Array, rank: jax.Array) -> jax.Array:
    """Global flat cache rows ``slots [T]`` (block * block_size + offset, -1 = none) -> rows of this rank's pages
    ``pages [L, B_local, block_size, W]``, -1 where another rank owns the page."""
    rows = pages.shape[1] * pages.shape[2]
    mine = (slots >= 0) & (slots // rows == rank)
    return jnp.where(mine, slots - rank * rows, -1)


def row_tables(block_tables: jax.Array, total: jax.Array, seq: jax.Array, positions: jax.Array,
               valid: jax.Array, blocks_per_rank: int, block_size: int, rank: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """This rank's keys for every query row: (tables [T, P] of local block ids, the row's sequence's pages held
    here first in position order; visible [T], the number of those keys at positions <= the row's position).

    block_tables [N, P] global ids; total [N] tokens of each sequence including this step's; seq, positions,
    valid [T] (padding rows see nothing)."""
    num_pages = block_tables.shape[1]
    page = jnp.arange(num_pages, dtype=jnp.int32)
    exists = page[None, :] * block_size < total[:, None]  # [N, P]
    mine = exists & (block_tables // blocks_per_rank == rank)
    order = jnp.argsort(jnp.logical_not(mine).astype(jnp.int32), axis=1, stable=True)
    local = jnp.where(mine, block_tables - rank * blocks_per_rank, 0)
    tables = jnp.take_along_axis(local, order, axis=1)  # [N, P]
    safe = jnp.clip(seq, 0, block_tables.shape[0] - 1)
    seen = jnp.clip(positions[:, None] + 1 - page[None, :] * block_size, 0, block_size)  # [T, P]
    visible = jnp.sum(jnp.where(mine[safe], seen, 0), axis=1)
    return tables[safe], jnp.where(valid, visible, 0).astype(jnp.int32)


def dcp_attention(p: MLAStack, j: int, q: jax.Array, latent: jax.Array, pages: jax.Array,
                  scales: jax.Array | None, slots: jax.Array, step: StepInputs, layout: TokenLayout,
                  cfg: ModelConfig, *, dcp: int, impl: str | None = None, finite_pages: bool = True
                  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Inside ``shard_map``: write this rank's share of the step's latents and attend over this rank's pages.

    q [T, H_local, Kn+Kr] (this rank's heads); latent [T, R+Kr]; pages [L, B_local, block_size, W] (this rank's
    blocks, scales alike); slots [T] global cache rows -> (attn f32 [T, H_local * V], pages, scales)."""
    rank = lax.axis_index(AXIS)
    pages, scales = write_latent(pages, scales, latent, local_slots(slots, pages, rank), j)
    t_rows, heads = q.shape[:2]
    kn, kr, vd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    total = step.context_lens + layout.q_lens
    tables, visible = row_tables(step.block_tables, total, layout.seq_ids, layout.positions, layout.valid,
                                 pages.shape[1], pages.shape[2], rank)
    q_abs = mla_ops.absorb_queries(q, p.kv_b[...], layer=j, k_nope=kn, impl=impl)  # [T, H_local, R+Kr]
    q_group = lax.all_gather(q_abs, AXIS, axis=1, tiled=True)  # [T, H_local * dcp, R+Kr]: the tensor group's heads
    each_row = jnp.arange(t_rows + 1, dtype=jnp.int32)
    o, lse = mla_ops.mla_paged_attention(q_group, pages, tables, visible, each_row, scale=(kn + kr) ** -0.5,
                                         kv_lora_rank=r, page_scales=scales, layer=j,
                                         decode_q_len=1 if finite_pages else None, impl=impl)
    has_keys = visible > 0
    o = jnp.where(has_keys[:, None, None], o, 0).astype(F32)
    lse = jnp.where(has_keys[:, None], lse.astype(F32), NO_KEY_LSE)
    # head chunk d' of every rank's partial goes to rank d' (the owner of those heads): [dcp * T, H_local, ...]
    o_parts = lax.all_to_all(o, AXIS, 1, 0, tiled=True).reshape(dcp, t_rows, heads, r)
    lse_parts = lax.all_to_all(lse, AXIS, 1, 0, tiled=True).reshape(dcp, t_rows, heads)
    o_lat, _ = merge_partials(o_parts, lse_parts)
    attn = mla_ops.absorb_outputs(o_lat.astype(q.dtype), p.kv_b[...], layer=j, v_dim=vd, impl=impl)
    return attn.astype(F32).reshape(t_rows, heads * vd), pages, scales
