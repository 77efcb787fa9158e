"""Memory accounting of the two pools: per-entry bytes from the model dims, budget split, truthful capacity."""

from __future__ import annotations

import math

import pytest

from kimi_jax.presets import get_preset
from serve.engine import CacheDims, plan_pools

MIB = 1 << 20


def test_k3_bytes_per_block_and_slot_match_the_spec_arithmetic():
    dims = CacheDims.from_model_config(get_preset("k3"))
    assert (dims.num_mla_layers, dims.num_kda_layers) == (24, 69)
    # MLA: 24 layers x 576 values x 2 B = 27,648 B per token (SERVING.md: ~27.6 KB/token in bf16)
    assert dims.bytes_per_block(64) == 64 * 24 * 576 * 2
    # KDA: 6 MiB of fp32 state per layer (414 MiB per request) + conv state 3 x (2*96*128 + 96*128) fp32
    state = 69 * 96 * 128 * 128 * 4
    conv = 69 * 3 * (2 * 96 * 128 + 96 * 128) * 4
    assert state == 414 * MIB and dims.bytes_per_slot == state + conv
    bf16 = CacheDims.from_model_config(get_preset("k3"), state_dtype_bytes=2, conv_dtype_bytes=2)
    assert bf16.bytes_per_slot * 2 == dims.bytes_per_slot


def test_plan_fills_the_budget_and_reports_capacity():
    dims = CacheDims.from_model_config(get_preset("tiny"))
    per_block, per_slot = dims.bytes_per_block(16), dims.bytes_per_slot
    budget = 1000 * per_block + 40 * per_slot + per_block // 2
    plan = plan_pools(budget, dims, block_size=16, max_num_seqs=16, max_model_len=1024, num_checkpoint_slots=8)
    assert plan.num_slots == 1 + 16 + 8 and plan.num_checkpoint_slots == 8
    assert plan.total_bytes == plan.num_blocks * per_block + plan.num_slots * per_slot <= budget
    assert budget - plan.total_bytes < per_block                 # nothing left that would hold another page
    assert plan.token_capacity == (plan.num_blocks - 1) * 16
    assert plan.max_concurrent_requests == 16
    pages_per_request = math.ceil(1023 / 16)
    assert plan.max_concurrent_full_length_requests == min(16, (plan.num_blocks - 1) // pages_per_request)
    assert "concurrent requests" in plan.describe()


def test_tight_budget_drops_checkpoint_slots_then_live_slots_and_says_so():
    dims = CacheDims.from_model_config(get_preset("tiny"))
    per_block, per_slot = dims.bytes_per_block(16), dims.bytes_per_slot
    min_pages = 1 + math.ceil((512 - 1) / 16)
    budget = min_pages * per_block + 6 * per_slot
    plan = plan_pools(budget, dims, block_size=16, max_num_seqs=8, max_model_len=512, num_checkpoint_slots=4)
    assert plan.num_slots == 6 and plan.max_concurrent_requests == 5 and plan.num_checkpoint_slots == 0
    assert plan.num_blocks == min_pages and plan.max_concurrent_full_length_requests == 1
    with pytest.raises(ValueError, match="cannot hold one request"):
        plan_pools(min_pages * per_block + per_slot, dims, block_size=16, max_num_seqs=8, max_model_len=512)


def test_models_without_one_cache_kind_plan_without_dividing_by_zero():
    """A model with no MLA layer (pages of 0 bytes) or no KDA layer (slots of 0 bytes) still gets a plan: the
    budget goes to the other pool, and a page-less model gets a full-length block table per live sequence."""
    tiny = get_preset("tiny")
    kda_only = CacheDims.from_model_config(tiny.replace(num_layers=1, layer_types=("kda",), mlp_types=("dense",)))
    assert kda_only.bytes_per_block(16) == 0 and kda_only.bytes_per_slot > 0
    plan = plan_pools(10 * kda_only.bytes_per_slot, kda_only, block_size=16, max_num_seqs=4, max_model_len=100)
    assert plan.num_slots == 1 + 4 and plan.num_blocks == 1 + 4 * math.ceil(99 / 16)
    assert plan.max_concurrent_requests == plan.max_concurrent_full_length_requests == 4
    mla_only = CacheDims.from_model_config(tiny.replace(num_layers=1, layer_types=("mla",), mlp_types=("dense",)))
    assert mla_only.bytes_per_slot == 0
    plan = plan_pools(50 * mla_only.bytes_per_block(16), mla_only, block_size=16, max_num_seqs=4, max_model_len=100)
    assert plan.num_blocks == 50 and plan.max_concurrent_requests == 4
