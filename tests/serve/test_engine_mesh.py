"""The engine on a mesh of 8 fake CPU devices (tensor 2 x expert 2 x dcp 2): parameters and cache pools are
placed by the sharding rules, GSPMD partitions the step, and greedy outputs equal the single-device
reference token for token (fp32; split contractions change the summation order by ~1e-6 relative, far below
these prompts' top-2 logit gaps). The Pallas kernels are not partitioned: asking for them on a multi-device
mesh is a clear error. Runs in a subprocess (the fake device count must be set before JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import dataclasses
from serve.engine import EngineConfig, SamplingParams
from serve.engine.engine import LLMEngine
from serve.engine.runner import ModelRunner
from sharding import make_mesh
from tests.serve.test_engine_runner import MAX_NEW, PROMPTS, RUNNER_CONFIG, shared_lm

names = ["a", "b", "d", "h", "i"]
lm = shared_lm()
want = lm.generate([PROMPTS[n] for n in names], max_new_tokens=MAX_NEW, stop_token_ids=[])
mesh = make_mesh(tensor=2, expert=2, dcp=2)
config = dataclasses.replace(RUNNER_CONFIG, token_buckets=(64,), test_mode=False)
runner = ModelRunner(lm, config, mesh=mesh)
engine = LLMEngine(runner)
params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
for n in names:
    engine.add_request(n, PROMPTS[n], params)
done = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out.outputs[0].token_ids
try:
    ModelRunner(lm, config, mesh=mesh, impl="pallas", warm_up=False)
    error = None
except ValueError as e:
    error = str(e)
names_params = dict(zip(runner.param_names, runner.params))
print(json.dumps(dict(
    equal=[done[n] == w[len(PROMPTS[n]):] for n, w in zip(names, want)],
    q_proj_shard=list(names_params["kda.q_proj"].addressable_shards[0].data.shape),
    q_proj=list(names_params["kda.q_proj"].shape),
    mla_shard=list(runner.cache.mla.addressable_shards[0].data.shape), mla=list(runner.cache.mla.shape),
    error=error)))
"""


def test_engine_on_a_sharded_mesh_equals_single_device():
    cache = os.environ.get("KIMI_JAX_TEST_JIT_CACHE", os.path.expanduser("~/.cache/kimi_jax/jit"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(result["equal"]), result
    q, q_shard = result["q_proj"], result["q_proj_shard"]
    assert q_shard == q[:-1] + [q[-1] // 4]  # q heads over the TP group (tensor x dcp)
    mla, mla_shard = result["mla"], result["mla_shard"]
    assert mla_shard == [mla[0], mla[1] // 2] + mla[2:]  # MLA pages over dcp
    assert "impl='reference'" in result["error"]
