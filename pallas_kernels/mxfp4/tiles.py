"""Tile schedule for grouped GEMMs over rows sorted by expert (computed on device, shapes static).

Each expert's rows ``[start_e, start_e + size_e)`` are cut into ``block_m`` tiles that start at the group's
first row, so no tile straddles two experts and an expert's weights are streamed once per tile of its own rows.
Rows at or past ``sum(group_sizes)`` form one more pseudo-group (expert id ``E``) whose tiles write zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def max_num_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the tile count ``sum_e ceil(size_e / block_m)`` over the E + 1 groups, whose sizes
    add up to ``num_rows``: at most ``G = min(E + 1, num_rows)`` groups are non-empty, and each adds at most
    ``block_m - 1`` padding rows. At decode (M=8 rows over 256 experts) this is 8 tiles, not 241: the grid no
    longer launches hundreds of programs that only exit."""
    nonempty = min(num_experts + 1, max(num_rows, 1))
    return (num_rows + nonempty * (block_m - 1)) // block_m


def make_tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """``group_sizes [E]`` -> int32 ``[3, T]``: per tile (expert id, first row, end row); unused tiles have
    expert id ``-1``. ``T = max_num_tiles(num_rows, E, block_m)``."""
    sizes = group_sizes.astype(jnp.int32)
    sizes = jnp.concatenate([sizes, jnp.maximum(num_rows - jnp.sum(sizes), 0)[None]])
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles_per_group = (sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles_per_group)
    num_tiles = max_num_tiles(num_rows, group_sizes.shape[0], block_m)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(tile_ends, tile, side="right", method="scan_unrolled")  # no while loop: no host sync
    group = jnp.minimum(group, sizes.shape[0] - 1).astype(jnp.int32)
    first_row = starts[group] + (tile - (tile_ends[group] - tiles_per_group[group])) * block_m
    valid = tile < tile_ends[-1]
    return jnp.stack([jnp.where(valid, group, -1), first_row, ends[group]]).astype(jnp.int32)
