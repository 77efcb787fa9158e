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
                    "TEP2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
                    "DP2": dict(data_parallel_size=2)}.items():
    got, engine, stats = run(**flags)
    runners = [e.runner for e in getattr(engine, "engines", [engine])]
    r = runners[0]
    entry = dict(equal=got == want, label=r.shape.label(), devices=[sorted(d.id for d in x.mesh.devices.flat)
                                                                  for x in runners],
                 prefix_hits=stats.prefix_cache_hits, router_tokens=sum(stats.router_expert_tokens),
                 generated=stats.generation_tokens, prompt=stats.prompt_tokens, replicas=stats.num_replicas)
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
    assert result["TEP2"]["label"] == "TEP2"
    dp = result["DP2"]
    assert dp["replicas"] == 2 and dp["devices"] == [[0], [1]]
    assert sorted(dp["assignments"].values()) == [2, 2]  # four requests balanced over two replicas
