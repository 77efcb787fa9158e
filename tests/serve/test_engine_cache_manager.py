"""Cache pools, prefix hits (prompt end, Marconi junction, interval, finished state), copy-on-write, eviction."""

from __future__ import annotations

import pytest

from serve.engine import CacheConfig, CacheManager, Request, SamplingParams
from serve.engine.block_pool import RefCountedPool
from serve.engine.prefix_cache import PrefixCache

BS = 4


def manager(num_blocks=64, num_slots=16, **kw) -> CacheManager:
    return CacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks, num_slots=num_slots, **kw))


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=8))


def start(cm: CacheManager, r: Request, budget: int = 10**6):
    """Admit like the scheduler does; returns (hit, positions, n, slots) of the first chunk."""
    hit = cm.find_prefix(r)
    cm.plan_checkpoints(r, hit)
    positions, n = cm.checkpoint_positions(r, hit.num_tokens, min(r.num_tokens - hit.num_tokens, budget))
    assert cm.can_admit(r, hit, n)
    cm.admit(r, hit, n)
    return hit, positions, n, [cm.slots.allocate_checkpoint() for _ in positions]


def finish_step(cm: CacheManager, r: Request, n: int, positions, slots):
    r.num_computed_tokens += n
    cm.on_step_done(r, list(zip(positions, slots)))
    cm.release_step_pins()


def prefill(cm: CacheManager, r: Request, budget: int = 10**6):
    hit, positions, n, slots = start(cm, r, budget)
    finish_step(cm, r, n, positions, slots)
    while r.num_computed_tokens < r.num_tokens:
        positions, n = cm.checkpoint_positions(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
        cm.pages.allocate(r, n)
        finish_step(cm, r, n, positions, [cm.slots.allocate_checkpoint() for _ in positions])
    return hit


def positions_cached(cm: CacheManager) -> list[int]:
    return sorted(c.position for c in cm.prefix.checkpoints.values())


def test_pool_refcounts_holds_and_reserved_entry():
    pool = RefCountedPool(5, "block")
    ids = [pool.allocate() for _ in range(4)]
    assert sorted(ids) == [1, 2, 3, 4] and pool.num_free == 0 and pool.num_available == 0
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.ref(ids[0])
    assert not pool.unref(ids[0]) and pool.unref(ids[0])      # two refs: the second unref is the last
    assert pool.drain_freed() == [ids[0]] and pool.num_free == 1
    pool.hold(ids[1])
    assert pool.unref(ids[1]) and not pool.is_free(ids[1])    # held by the cache: reclaimable, not free
    assert pool.num_available == 2 and pool.num_free == 1
    pool.unhold(ids[1])
    assert pool.is_free(ids[1]) and pool.drain_freed() == [ids[1]]
    with pytest.raises(RuntimeError):
        pool.unref(ids[1])
    with pytest.raises(ValueError):
        pool.ref(0)


def test_identical_prompt_hits_prompt_end_and_shorter_prompt_gets_junction():
    cm = manager()
    prompt = list(range(100, 111))                      # 11 tokens: prompt-end checkpoint at 10
    a = req("a", prompt)
    assert prefill(cm, a).num_tokens == 0
    assert a.planned_checkpoints == [10] and positions_cached(cm) == [10]
    cm.free_request(a, retain_state=False)

    b = req("b", prompt)
    hit = cm.find_prefix(b)
    assert hit.num_tokens == 10 and hit.junction is None and len(hit.blocks) == 2
    extended = cm.find_prefix(req("c", prompt + [7, 8]))
    assert extended.num_tokens == 10
    shorter = cm.find_prefix(req("d", prompt[:10]))     # at most 9 tokens may be reused: no checkpoint there
    assert shorter.num_tokens == 0 and shorter.num_matched_pages == 2 and shorter.junction == 8
    assert cm.find_prefix(req("e", [1] + prompt)).num_tokens == 0


def test_marconi_junction_checkpoint_on_second_sighting_hit_on_third():
    cm = manager()
    system = list(range(200, 209))                      # 9 shared tokens: junction at 2 full pages = 8
    a, b, c = (req(n, system + [n_] * 5) for n, n_ in (("a", 1), ("b", 2), ("c", 3)))
    prefill(cm, a)
    cm.free_request(a, retain_state=False)
    hit_b = prefill(cm, b)
    assert hit_b.num_tokens == 0 and hit_b.junction == 8 and b.planned_checkpoints == [8, 13]
    assert 8 in positions_cached(cm)
    cm.free_request(b, retain_state=False)
    hit_c = cm.find_prefix(c)
    assert hit_c.num_tokens == 8 and hit_c.junction is None
    prefill(cm, c)
    assert cm.stats.hits == 8 and cm.stats.queries == 3 * 14


def test_interval_checkpoints_cap_the_chunk_and_serve_a_divergent_prompt():
    cm = manager(retention_interval=4, max_checkpoints_per_seq=2)
    prompt = list(range(300, 314))                      # 14 tokens: 4, 8, 12 by interval, 13 prompt end
    a = req("a", prompt)
    _, positions, n, slots = start(cm, a)
    assert positions == [4, 8] and n == 8               # more than 2 positions: the chunk stops at the 2nd
    finish_step(cm, a, n, positions, slots)
    positions, n = cm.checkpoint_positions(a, 8, 6)
    assert positions == [12, 13] and n == 6
    cm.pages.allocate(a, n)
    finish_step(cm, a, n, positions, [cm.slots.allocate_checkpoint() for _ in positions])
    assert positions_cached(cm) == [4, 8, 12, 13]
    cm.free_request(a, retain_state=False)
    assert cm.find_prefix(req("b", prompt[:10] + [1, 2, 3])).num_tokens == 8
    assert cm.find_prefix(req("c", prompt[:6] + [9] * 8)).num_tokens == 4


def test_copy_on_write_of_a_shared_partial_page():
    cm = manager()
    prompt = list(range(400, 410))                      # checkpoint at 9: pages 0,1 full + 1-token tail page
    a = req("a", prompt)
    prefill(cm, a)                                      # "a" keeps running and owns its partial page 2
    b = req("b", prompt)
    hit, positions, n, slots = start(cm, b)
    assert hit.num_tokens == 9 and n == 1 and positions == []
    block_copies, slot_copies = cm.take_copies()
    assert block_copies == [(a.block_table[2], b.block_table[2])] and a.block_table[2] != b.block_table[2]
    assert b.block_table[:2] == a.block_table[:2]       # full pages are shared, not copied
    assert slot_copies == [(hit.checkpoint.slot, b.state_slot)]
    assert cm.pages.pool.refs(a.block_table[2]) == 2        # a's reference + the pin for this step's copy
    finish_step(cm, b, n, positions, slots)
    assert cm.pages.pool.refs(a.block_table[2]) == 1 and cm.pages.pool.refs(a.block_table[0]) == 2


def test_concurrent_duplicates_are_merged_onto_indexed_pages():
    cm = manager()
    prompt = list(range(500, 513))
    a, b = req("a", prompt), req("b", prompt)
    sa, sb = start(cm, a), start(cm, b)                 # both miss: they compute the same pages twice
    assert a.block_table[:3] != b.block_table[:3]
    finish_step(cm, a, sa[2], sa[1], sa[3])
    finish_step(cm, b, sb[2], sb[1], sb[3])
    assert a.block_table[:3] == b.block_table[:3] and a.block_table[3] != b.block_table[3]
    assert cm.pages.pool.num_referenced == 5                # 3 shared + 2 private partial pages
    for r in (a, b):
        cm.free_request(r, retain_state=False)
    assert cm.is_idle()


def test_finished_state_becomes_a_checkpoint_for_the_next_turn():
    cm = manager()
    a = req("a", list(range(600, 606)))
    prefill(cm, a)
    a.append_output_token(1)
    for t in (2, 3):                                    # decode: feed the last sampled token, sample the next
        cm.pages.allocate(a, 1)
        finish_step(cm, a, 1, [], [])
        a.append_output_token(t)
    assert a.num_computed_tokens == 8
    live = a.state_slot
    cm.free_request(a, retain_state=True)
    ckpt = cm.prefix.checkpoints[live]                  # the live slot itself, no copy
    assert ckpt.position == 8 and ckpt.tail_block is None
    turn2 = req("t2", a.all_token_ids[:8] + [9, 9, 9])
    assert cm.find_prefix(turn2).num_tokens == 8


def test_prefix_caching_disabled_never_shares():
    cm = manager(enable_prefix_caching=False)
    prompt = list(range(700, 712))
    a = req("a", prompt)
    assert prefill(cm, a).num_tokens == 0 and a.planned_checkpoints == []
    cm.free_request(a, retain_state=True)
    assert cm.find_prefix(req("b", prompt)).num_tokens == 0
    assert cm.checkpoint_count() == 0 and not cm.prefix.nodes
    pages, slots = cm.pages.pool, cm.slots.pool
    assert pages.num_free == pages.num_usable and slots.num_free == slots.num_usable


def test_page_eviction_is_lru_among_unreferenced_leaves():
    blocks, slots = RefCountedPool(8, "block"), RefCountedPool(4, "slot")
    cache = PrefixCache(BS, blocks, slots, bytes_per_block=1, bytes_per_slot=1, eviction_alpha=1.0)
    ids = {name: blocks.allocate() for name in ("a1", "a2", "b1", "c1")}
    a1 = cache.insert_page(cache.root, b"a1", ids["a1"])
    cache.insert_page(a1, b"a2", ids["a2"])
    b1 = cache.insert_page(cache.root, b"b1", ids["b1"])
    cache.insert_page(cache.root, b"c1", ids["c1"])
    cache.touch(b1)                                     # b1 becomes the most recent
    for name in ("a2", "b1", "a1"):
        blocks.unref(ids[name])
        cache.block_unreferenced(ids[name])
    evicted = []
    while cache.evict_page():
        evicted.append(sorted(set(ids) - {n.hash.decode() for n in cache.nodes.values()} - set(evicted))[0])
    assert evicted == ["a2", "a1", "b1"]                # c1 is still referenced; a1 only once a2 is gone
    assert blocks.num_free == 3 + 3


def test_checkpoint_eviction_score_prefers_lru_then_saved_compute_per_byte():
    def setup(alpha, positions):
        blocks, slots = RefCountedPool(4, "block"), RefCountedPool(8, "slot")
        cache = PrefixCache(BS, blocks, slots, bytes_per_block=1, bytes_per_slot=10, eviction_alpha=alpha)
        made = []
        for i, pos in enumerate(positions):             # oldest first
            slot = slots.allocate()
            made.append(cache.add_checkpoint(cache.root, (i,) * pos, None, slot, pos))
            slots.unref(slot)
        return cache, slots, made

    def order(cache):
        out = []
        while cache.checkpoints:
            before = set(cache.checkpoints)
            assert cache.evict_checkpoint()
            out.append((before - set(cache.checkpoints)).pop())
        return out

    cache, slots, made = setup(0.0, [3, 3, 3])
    assert order(cache) == [c.slot for c in made]       # equal efficiency: plain LRU
    cache, slots, made = setup(1.0, [3, 1, 1])
    assert order(cache)[0] == made[1].slot              # the old but 3x more efficient one outlives the middle
    cache, slots, made = setup(1.0, [1, 2])
    slots.ref(made[0].slot)                             # a referenced checkpoint is never a candidate
    assert cache.evict_checkpoint() and list(cache.checkpoints) == [made[0].slot]
    assert not cache.evict_checkpoint()


def test_admission_check_counts_unreferenced_hit_pages_and_slots():
    cm = manager(num_blocks=5, num_slots=3)             # 4 usable pages, 2 usable slots
    prompt = list(range(800, 812))                      # 3 pages; checkpoint at 11
    a = req("a", prompt)
    prefill(cm, a)
    cm.free_request(a, retain_state=False)
    assert cm.pages.pool.num_available == 4 and cm.slots.pool.num_available == 2
    b = req("b", prompt + [1, 2, 3, 4, 5])
    hit = cm.find_prefix(b)
    assert hit.num_tokens == 11
    # 2 shared pages + the pinned tail page + its copy = 4 pages; one more token would need a 5th
    assert cm.can_admit(b, hit, 1) and not cm.can_admit(b, hit, 2)
    cm.admit(b, hit, 1)
    assert cm.pages.pool.num_available == 0 and cm.slots.pool.num_available == 0


def test_emptying_after_the_pools_were_rebuilt_spills_nothing_to_the_host_tier():
    """``clear_prefix_cache(spill=False)`` (the device pools hold zeros after a rebuild) evicts every entry without
    telling the host tier, which would file zeroed pages under valid hashes; the default spills them."""
    class Spy:
        def __init__(self):
            self.pages, self.checkpoints = [], []

        def page_evicted(self, node_hash, block):
            self.pages.append(block)

        def checkpoint_evicted(self, node_hash, tail, position, slot, block):
            self.checkpoints.append(slot)

    for spill in (False, True):
        cm = manager()
        spy = cm.prefix.evictions = Spy()
        a = req("a", list(range(600, 611)))
        prefill(cm, a)
        cm.free_request(a, retain_state=True)
        assert cm.prefix.checkpoints and cm.pages.pool.num_free < cm.pages.pool.num_usable
        cm.clear_prefix_cache(spill=spill)
        assert not cm.prefix.checkpoints and cm.pages.pool.num_free == cm.pages.pool.num_usable
        assert bool(spy.pages) == bool(spy.checkpoints) == spill and cm.prefix.evictions is spy
