"""Explicit memory accounting for the two cache pools: MLA pages and KDA state slots.

Every byte is counted once per layer that stores it, including the reserved block 0 and slot 0, so the
reported capacity is what the pools really hold (vLLM's hybrid capacity logs are famously wrong:
../shared/spec/SERVING.md section 3.3).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class CacheDims:
    """Model dimensions that size the caches (glossary letters in brackets).

    mla: ``num_mla_layers`` x [num_blocks, block_size, R + K_rope] at ``mla_dtype_bytes`` plus ``mla_scale_bytes``
    per token (an fp8 cache's f32 scale, else 0);
    kda: ``num_kda_layers`` x recurrent state [S, HV, K, V] at ``state_dtype_bytes`` plus conv state
    [S, W-1, 2*H*K + HV*V] at ``conv_dtype_bytes``. ``draft``: a draft model's pools, which share the block and
    slot ids (their bytes are added to each page and slot).
    """

    num_mla_layers: int
    kv_lora_rank: int            # R
    qk_rope_head_dim: int        # K_rope
    num_kda_layers: int
    kda_num_heads: int           # H
    kda_num_v_heads: int         # HV
    kda_head_dim: int            # K
    kda_v_head_dim: int          # V
    conv_kernel: int             # W
    mla_dtype_bytes: int = 2
    mla_scale_bytes: int = 0
    state_dtype_bytes: int = 4
    conv_dtype_bytes: int = 4
    kda_shards: int = 1  # a slot's state is split over this many devices (KDA heads over tensor x dcp)
    mla_shards: int = 1  # a page's id range is split over this many devices (blocks over dcp)
    draft: "CacheDims | None" = None

    @classmethod
    def from_model_config(cls, cfg, *, mla_dtype_bytes: int = 2, mla_scale_bytes: int = 0,
                          state_dtype_bytes: int = 4, conv_dtype_bytes: int = 4, kda_shards: int = 1,
                          mla_shards: int = 1, extra_mla_layers: int = 0) -> "CacheDims":
        """From a ``kimi_jax.config.ModelConfig`` (the defaults match ``kimi_jax.step.init_cache``).

        ``kda_shards`` / ``mla_shards``: the devices a slot's state / the page pool are split over; the byte counts
        are then per device, so a per-device budget plans pools whose ids span the whole mesh.
        ``extra_mla_layers``: a drafter's page layers."""
        return cls(num_mla_layers=len(cfg.mla_layers) + extra_mla_layers, kv_lora_rank=cfg.kv_lora_rank,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, num_kda_layers=len(cfg.kda_layers),
                   kda_num_heads=cfg.kda_num_heads, kda_num_v_heads=cfg.kda_num_v_heads,
                   kda_head_dim=cfg.kda_head_dim, kda_v_head_dim=cfg.kda_v_head_dim,
                   conv_kernel=cfg.kda_conv_kernel, mla_dtype_bytes=mla_dtype_bytes, mla_scale_bytes=mla_scale_bytes,
                   state_dtype_bytes=state_dtype_bytes, conv_dtype_bytes=conv_dtype_bytes, kda_shards=kda_shards,
                   mla_shards=mla_shards)

    @property
    def conv_channels(self) -> int:
        return 2 * self.kda_num_heads * self.kda_head_dim + self.kda_num_v_heads * self.kda_v_head_dim

    def bytes_per_block(self, block_size: int) -> int:
        """One MLA page in every MLA layer: num_mla_layers * block_size * ((R + K_rope) * dtype bytes + scale bytes),
        per device (divided by ``mla_shards``)."""
        row = (self.kv_lora_rank + self.qk_rope_head_dim) * self.mla_dtype_bytes + self.mla_scale_bytes
        own = -(-self.num_mla_layers * block_size * row // self.mla_shards)
        return own + (self.draft.bytes_per_block(block_size) if self.draft is not None else 0)

    @property
    def bytes_per_slot(self) -> int:
        """One KDA slot in every KDA layer: recurrent state HV*K*V plus conv state (W-1)*channels, per device
        (divided by ``kda_shards``)."""
        state = self.kda_num_v_heads * self.kda_head_dim * self.kda_v_head_dim * self.state_dtype_bytes
        conv = (self.conv_kernel - 1) * self.conv_channels * self.conv_dtype_bytes
        own = -(-self.num_kda_layers * (state + conv) // self.kda_shards)
        return own + (self.draft.bytes_per_slot if self.draft is not None else 0)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """Sizes of both pools and what they can hold.

    ``num_blocks`` / ``num_slots`` include the reserved block 0 / slot 0 (pass them as the pool shapes).
    ``token_capacity`` = (num_blocks - 1) * block_size tokens of MLA cache.
    ``max_concurrent_requests`` = requests that can run at once (one live slot each, <= max_num_seqs).
    ``max_concurrent_full_length_requests`` = requests of ``max_model_len`` tokens that fit at once.
    ``num_checkpoint_slots`` = slots beyond the live ones, usable only for prefix-cache checkpoints.
    """

    block_size: int
    num_blocks: int
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    total_bytes: int
    token_capacity: int
    max_concurrent_requests: int
    max_concurrent_full_length_requests: int
    num_checkpoint_slots: int

    def describe(self) -> str:
        gib = 1 << 30
        return (f"KV cache: {self.num_blocks - 1} MLA pages x {self.block_size} tokens = {self.token_capacity} "
                f"tokens ({(self.num_blocks * self.bytes_per_block) / gib:.2f} GiB); {self.num_slots - 1} KDA "
                f"slots x {self.bytes_per_slot / (1 << 20):.1f} MiB ({self.num_slots * self.bytes_per_slot / gib:.2f}"
                f" GiB, {self.num_checkpoint_slots} for checkpoints); up to {self.max_concurrent_requests} "
                f"concurrent requests, {self.max_concurrent_full_length_requests} at full length")


def plan_pools(memory_budget_bytes: int, dims: CacheDims, *, block_size: int, max_num_seqs: int,
               max_model_len: int, num_checkpoint_slots: int = 0) -> PoolPlan:
    """Split a memory budget between the slot pool and the page pool.

    Slots are sized first: 1 reserved + up to ``max_num_seqs`` live + ``num_checkpoint_slots`` spare. The
    pages must hold at least one full-length request (ceil((max_model_len - 1) / block_size) pages + the
    reserved one); when the budget cannot also hold every slot, checkpoint slots are dropped first, then live
    slots, and ``max_concurrent_requests`` says so. The rest of the budget becomes pages (a model without MLA
    layers, whose pages hold nothing, gets enough page ids for every live sequence at full length).
    Raises ValueError when not even one full-length request fits.
    """
    if block_size < 1 or max_num_seqs < 1 or max_model_len < 2 or num_checkpoint_slots < 0:
        raise ValueError("plan_pools: block_size, max_num_seqs >= 1, max_model_len >= 2, "
                         "num_checkpoint_slots >= 0 required")
    per_block = dims.bytes_per_block(block_size)
    per_slot = dims.bytes_per_slot
    min_blocks = 1 + math.ceil((max_model_len - 1) / block_size)
    spare = memory_budget_bytes - min_blocks * per_block
    slots_affordable = spare // per_slot if per_slot else 1 + max_num_seqs + num_checkpoint_slots
    if spare < 0 or slots_affordable < 2:
        need = min_blocks * per_block + 2 * per_slot
        raise ValueError(f"memory budget {memory_budget_bytes} B cannot hold one request of max_model_len="
                         f"{max_model_len}: needs {need} B ({min_blocks} pages of {per_block} B + 2 slots of "
                         f"{per_slot} B)")
    num_slots = min(1 + max_num_seqs + num_checkpoint_slots, slots_affordable)
    live_slots = min(max_num_seqs, num_slots - 1)
    pages_per_full_request = math.ceil((max_model_len - 1) / block_size)
    if per_block:
        num_blocks = (memory_budget_bytes - num_slots * per_slot) // per_block
    else:  # no MLA layer: pages hold no bytes, so every live sequence gets a full-length block table
        num_blocks = 1 + max_num_seqs * pages_per_full_request
    return PoolPlan(
        block_size=block_size, num_blocks=num_blocks, num_slots=num_slots, bytes_per_block=per_block,
        bytes_per_slot=per_slot, total_bytes=num_blocks * per_block + num_slots * per_slot,
        token_capacity=(num_blocks - 1) * block_size, max_concurrent_requests=live_slots,
        max_concurrent_full_length_requests=min(live_slots, (num_blocks - 1) // pages_per_full_request),
        num_checkpoint_slots=num_slots - 1 - live_slots)
