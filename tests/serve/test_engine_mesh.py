"""The engine on 8 fake CPU devices, built from the parallelism flags (``kimi_jax.LLM(..., tensor_parallel_size=...)``)
over a checkpoint folder, so the sharded loader, the flag -> mesh mapping, the shard_map step, DCP page striping and
the data-parallel front are all in the loop. Greedy outputs must equal the one-device engine token for token (fp32;
split contractions change the summation order by ~1e-6 relative, far below these prompts' top-2 logit gaps), over
two ``generate`` calls whose second one continues the first one's prompt and hits its prefix cache (shared MLA
pages, a copy-on-write partial page, a restored KDA checkpoint: slot copies of a state split over heads). Test mode poisons freed pages and slots with NaN, so a stale
read on any rank shows. Runs in a subprocess (the fake device count must be set before JAX starts)."""

from __future__ import annotations

from tests.sharding_cases import run_script

SCRIPT = r"""
import json, tempfile
from pathlib import Path
import jax, numpy as np
from serve.engine import SamplingParams
from serve.engine.llm import LLM
from tests.sharding_cases import K3_TINY, write_checkpoint

folder = write_checkpoint(K3_TINY, Path(tempfile.mkdtemp()), with_tokenizer=False)
ENGINE = dict(dtype="float32", impl="reference", tokenizer=None, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, block_size=4, token_buckets=(8, 32), seq_buckets=(4,),
              memory_budget_bytes=1 << 20, compile_threads=1, test_mode=True)
rng = np.random.default_rng(0)
system = rng.integers(0, 3800, 10).tolist()
first = [system + rng.integers(0, 3800, 3).tolist()]
second = [first[0] + rng.integers(0, 3800, 5).tolist(), rng.integers(0, 3800, 13).tolist(),
          rng.integers(0, 3800, 2).tolist()]
params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)

def run(**flags):
    llm = LLM(str(folder), **ENGINE, **flags)
    outs = [[o.outputs[0].token_ids for o in llm.generate(batch, params)] for batch in (first, second)]
    engine = llm.engine
    jax.block_until_ready(getattr(engine, "engines", [engine])[0].runner.cache)
    engine.stats()  # starts the router-load copy ...
    stats = engine.stats()  # ... which has landed by now (the runner is idle)
    return outs, engine, stats

want, _, one = run()
result = {"one device": dict(router_tokens=sum(one.router_expert_tokens), prefix_hits=one.prefix_cache_hits)}
for name, flags in {"TP2": dict(tensor_parallel_size=2),
                    "TP2 DCP2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
                    "DP2": dict(data_parallel_size=2)}.items():
    got, engine, stats = run(**flags)
    runners = [e.runner for e in getattr(engine, "engines", [engine])]
    r = runners[0]
    entry = dict(equal=got == want, label=r.shape.label(), devices=[sorted(d.id for d in x.mesh.devices.flat)
                                                                  for x in runners],
                 prefix_hits=stats.prefix_cache_hits, router_tokens=sum(stats.router_expert_tokens),
                 generated=stats.generation_tokens, prompt=stats.prompt_tokens, replicas=stats.num_replicas,
                 num_blocks=r.num_blocks, num_slots=r.num_slots)
    if "DCP2" in name:
        pool = engine.scheduler.cache.pages.pool
        entry.update(group_size=r.page_group_size, groups=pool.groups,
                     mla_shard=list(r.cache.mla.addressable_shards[0].data.shape), mla=list(r.cache.mla.shape))
    if name == "TP2":
        names = dict(zip(r.param_names, r.params))
        entry.update(q_proj=list(names["kda.q_proj"].shape),
                     q_proj_shard=list(names["kda.q_proj"].addressable_shards[0].data.shape),
                     state_shard=list(r.cache.kda_state.addressable_shards[0].data.shape),
                     state=list(r.cache.kda_state.shape))
    if name == "DP2":
        entry.update(assignments=dict(engine.assignments))
    result[name] = entry
print(json.dumps(result))
"""


def test_engine_on_parallel_layouts_equals_one_device():
    result = run_script(SCRIPT, timeout=1800)
    one = result.pop("one device")
    assert one["prefix_hits"] > 0 and one["router_tokens"] > 0, one
    for name, r in result.items():
        assert r["equal"], (name, r)
        assert r["prefix_hits"] > 0, (name, r)  # the second generate call reused the first one's prefix
        if name != "DP2":  # the same schedule routes the same (token, choice) pairs (real rows only)
            assert r["router_tokens"] == one["router_tokens"], (name, r, one)
        else:
            assert r["router_tokens"] > 0
    tp = result["TP2"]
    assert tp["label"] == "TP2" and tp["devices"] == [[0, 1]]
    assert tp["q_proj_shard"] == tp["q_proj"][:-1] + [tp["q_proj"][-1] // 2]  # KDA heads over the TP group
    assert tp["state_shard"] == tp["state"][:2] + [tp["state"][2] // 2] + tp["state"][3:]  # the state pool too
    dcp = result["TP2 DCP2"]
    assert dcp["label"] == "TP2 x DCP2" and dcp["groups"] == 2  # --tensor-parallel-size 2 = tensor 1 x dcp 2
    assert dcp["mla_shard"] == [dcp["mla"][0], dcp["mla"][1] // 2] + dcp["mla"][2:]  # pages split over dcp
    assert dcp["group_size"] == dcp["mla"][1] // 2
    # the same per-device budget holds twice the pages when each device keeps half of every page's id range
    assert dcp["num_slots"] == tp["num_slots"] and abs(dcp["num_blocks"] / tp["num_blocks"] - 2) < 0.01
    dp = result["DP2"]
    assert dp["replicas"] == 2 and dp["devices"] == [[0], [1]]
    assert sorted(dp["assignments"].values()) == [2, 2]  # four requests balanced over two replicas


def test_pages_of_a_request_are_striped_over_the_dcp_ranks():
    from serve.engine.block_pool import RefCountedPool
    from serve.engine.mla_pages import MLAPages
    from serve.engine.prefix_cache import PrefixCache
    from serve.engine.request import Request
    from serve.engine.sampling_params import SamplingParams

    blocks = RefCountedPool(16, "block", group_size=4)  # 4 DCP ranks of 4 pages; page 0 (rank 0) is reserved
    prefix = PrefixCache(4, blocks, RefCountedPool(4, "slot"), bytes_per_block=1, bytes_per_slot=1, eviction_alpha=1.0)
    pages = MLAPages(blocks, 4, prefix)
    request = Request("r", list(range(40)), SamplingParams(max_tokens=1), eos_token_ids=(), arrival_time=0.0)
    pages.allocate(request, 40)  # 10 pages
    assert [blocks.group_of(b) for b in request.block_table] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # page j: rank j % 4
    assert blocks.num_free == 5 and len(set(request.block_table)) == 10
    pages.allocate(request, 52)  # 3 more pages; rank 2 is asked for page 10 and has one left, then ranks run out
    assert [blocks.group_of(b) for b in request.block_table[10:]] == [2, 3, 1]


class _StubEngine:
    """The LLMEngine surface the data-parallel front uses, with requests finishing when told."""

    def __init__(self):
        self.running, self.finished, self.config = {}, [], type("C", (), {"block_size": 4})()
        self.tokenizer = self.model_config = self.runner = None
        self.max_model_len = 64

    def add_request(self, request_id, prompt, params=None, *, arrival_time=None):
        self.running[request_id] = prompt

    def has_unfinished_requests(self):
        return bool(self.running) or bool(self.finished)

    def step(self):
        from serve.engine.outputs import RequestMetrics, RequestOutput

        done, self.finished = self.finished, []
        return [RequestOutput(r, [], [], True, RequestMetrics(0.0)) for r in done]

    def finish(self, request_id):
        del self.running[request_id]
        self.finished.append(request_id)


def test_data_parallel_front_balances_by_load_and_keeps_prefixes_together():
    from serve.engine.data_parallel import DataParallelEngine

    a, b = _StubEngine(), _StubEngine()
    front = DataParallelEngine([a, b])
    system = [7] * 8  # two pages shared by a conversation's turns
    front.add_request("c1", system + [1, 2, 3, 4])
    front.add_request("x", [9] * 12)
    assert set(a.running) == {"c1"} and set(b.running) == {"x"}  # least loaded
    front.add_request("c2", system + [5, 6, 7, 8, 9])
    assert "c2" in a.running  # same leading pages: the replica whose prefix cache holds them
    front.add_request("c3", system + [1])
    front.add_request("c4", system + [2])
    front.add_request("c5", system + [3])
    assert "c5" in b.running  # replica a is AFFINITY_SLACK + 1 requests ahead: balance wins
    for request_id in list(a.running):
        a.finish(request_id)
    assert {o.request_id for o in front.step()} == {"c1", "c2", "c3", "c4"}
    front.add_request("y", [4] * 12)
    assert "y" in a.running  # a is idle again
