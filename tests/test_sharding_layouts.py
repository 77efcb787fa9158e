"""Tiny K3 and tiny Kimi-Linear on 8 fake CPU devices: every layout gives the logits and greedy tokens of one device.

Each layout places the same random fp32 model with the partition rules and runs ``forward(..., parallel=
Parallel(mesh))``: every sublayer inside ``jax.shard_map`` with per-shard shapes (KDA / MLA heads over TP, MLA
pages over DCP with LSE-merged partials, experts by all-to-all). Steps: a 9-token prefill chunk for two
sequences, a second chunk that reads the cache the first wrote (KDA state and conv carried, MLA pages of the
earlier positions), then two decode steps fed with the greedy tokens.

Tolerance: fp32 logits within 2e-5 of the largest logit. Only the summation order of split contractions differs
between layouts (the row-parallel psums, the DCP merge); observed differences are ~1e-6. A missing psum, a wrong
LSE merge or a wrong expert permutation is an O(0.1-1) error: the negative controls below break each one on purpose
and check that the comparison fails. Greedy tokens must be equal.
"""

from __future__ import annotations

from tests.sharding_cases import run_script

TOLERANCE = 2e-5

SCRIPT = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from kimi_jax.model import KimiModel, compute_logits, forward
from kimi_jax.step import StepInputs, dense_step, init_cache
from sharding import make_mesh
from sharding.parallel import Parallel
from sharding.place import shard_params, zero_cache
from tests.sharding_cases import MODELS

which = sys.argv[1]
B, T, BS = 2, 9, 4
MAX = 2 * T + 3

def steps(cfg):
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, 2 * T)).astype(np.int32)
    out = []
    for start in (0, T):
        f = dense_step(B, T, block_size=BS, context=np.full(B, start), max_len=MAX)
        f["logits_indices"] = np.arange(B * T, dtype=np.int32)
        out.append(StepInputs(token_ids=ids[:, start:start + T].reshape(-1), **f))
    return out

def decode(cfg, n, tokens):
    f = dense_step(B, 1, block_size=BS, context=np.full(B, 2 * T + n), max_len=MAX)
    return StepInputs(token_ids=np.asarray(tokens, np.int32), decode_only=True, **f)

def run(cfg, impl, layout=None, ep=False, decodes=2, prefill=True):
    model = KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    parallel, mesh = None, None
    if layout is not None:
        mesh = make_mesh(**layout)
        shard_params(model, mesh, expert_parallel=ep)
        parallel = Parallel(mesh, expert_parallel=ep)
    graphdef, state = nnx.split(model)
    def f(state, cache, step):
        m = nnx.merge(graphdef, state)
        h, cache = forward(m, cache, step, impl=impl, parallel=parallel, mla_form="auto")
        return compute_logits(m, h), cache
    f = jax.jit(f, donate_argnums=1)
    pools = dict(num_blocks=24, block_size=BS, num_slots=4, dtype=jnp.float32)
    cache = init_cache(cfg, **pools) if mesh is None else zero_cache(cfg, mesh, **pools)
    logits, tokens = [], []
    for step in steps(cfg) if prefill else steps(cfg)[:1]:
        lg, cache = f(state, cache, step)
        logits.append(np.asarray(lg))
    last = logits[-1].reshape(B, T, -1)[:, -1].argmax(-1)
    for n in range(decodes):
        lg, cache = f(state, cache, decode(cfg, n, last))
        logits.append(np.asarray(lg))
        last = logits[-1].argmax(-1)
        tokens.append(last.tolist())
    return logits, tokens

def compare(got, want):
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got[0], want[0])), got[1] == want[1]

LAYOUTS = {"TP2": dict(tensor=2), "TP4": dict(tensor=4), "EP4": dict(expert=4), "TP2xEP2": dict(tensor=2, expert=2),
           "DCP2": dict(dcp=2), "DCP4": dict(dcp=4), "TEP2xDCP2": (dict(tensor=1, dcp=2, expert=2), True)}
result = {}
if which == "reference":
    for name, cfg in MODELS.items():
        want = run(cfg, "reference")
        for label, layout in LAYOUTS.items():
            layout, ep = layout if isinstance(layout, tuple) else (layout, False)
            t0 = time.time()
            err, same = compare(run(cfg, "reference", layout, ep), want)
            result[f"{name} {label}"] = dict(error=err, tokens_equal=same, seconds=round(time.time() - t0, 1))
elif which == "pallas":  # interpret mode; the kernels under shard_map with per-shard shapes
    cfg = MODELS["k3"]
    want = run(cfg, "pallas", decodes=1)
    for label, layout in (("TP2", dict(tensor=2)), ("DCP2", dict(dcp=2))):
        err, same = compare(run(cfg, "pallas", layout, decodes=1), want)
        result[f"k3 {label}"] = dict(error=err, tokens_equal=same)
else:  # negative controls: each breaks one piece and must be caught
    import sharding.dcp, sharding.moe_ep, sharding.parallel
    cfg = MODELS["k3"]
    want = run(cfg, "reference", decodes=1)
    def broken(label, layout, patch, ep=False):
        undo = patch()
        try:
            result[label] = compare(run(cfg, "reference", layout, ep, decodes=1), want)[0]
        finally:
            undo()
    def swap(module, name, value):
        def apply():
            old = getattr(module, name)
            setattr(module, name, value)
            return lambda: setattr(module, name, old)
        return apply
    no_psum = lambda self, out, dtype: sharding.parallel.total(out, jnp.float32).astype(dtype)
    broken("no psum (TP2)", dict(tensor=2), swap(sharding.parallel.Parallel, "_tp_sum", no_psum))
    mean_merge = lambda o, lse: (o.mean(axis=0), lse.max(axis=0))
    broken("mean instead of LSE merge (DCP2)", dict(dcp=2), swap(sharding.dcp, "merge_partials", mean_merge))
    real = sharding.moe_ep._local_experts
    flipped = lambda p, j, rows, e, n, cfg, impl: real(p, j, rows, jnp.where(e < 0, e, n - 1 - e), n, cfg, impl)
    broken("experts permuted on their rank (EP4)", dict(expert=4), swap(sharding.moe_ep, "_local_experts", flipped))
print(json.dumps(result))
"""


def test_every_layout_gives_the_one_device_logits_and_tokens():
    result = run_script(SCRIPT, args=("reference",), timeout=1800)
    assert len(result) == 14
    for case, r in result.items():
        assert r["error"] <= TOLERANCE and r["tokens_equal"], (case, r)


def test_pallas_kernels_under_shard_map_give_the_one_device_logits():
    result = run_script(SCRIPT, args=("pallas",), timeout=1800)
    assert set(result) == {"k3 TP2", "k3 DCP2"}  # TP2: KDA chunk + decode, MLA, MXFP4 grouped kernels per shard
    for case, r in result.items():
        assert r["error"] <= TOLERANCE and r["tokens_equal"], (case, r)


def test_a_missing_psum_a_wrong_merge_or_a_wrong_expert_permutation_fails_the_comparison():
    result = run_script(SCRIPT, args=("broken",), timeout=1800)
    assert len(result) == 3
    for case, error in result.items():
        assert error > 100 * TOLERANCE, (case, error)


def test_decode_layouts_experiment_runs_on_simulated_devices(tmp_path):
    """The 2-GPU experiment's script end to end on 8 CPU devices (its timings mean nothing here)."""
    import json
    import subprocess
    import sys

    from tests.sharding_cases import K3_TINY, ROOT, subprocess_env

    (tmp_path / "config.json").write_text(json.dumps(K3_TINY.to_hub_dict()))
    out = tmp_path / "layouts.json"
    run = subprocess.run([sys.executable, "-m", "sharding.experiments.decode_layouts", "--model", str(tmp_path),
                          "--layouts", "TP2,EP2,DCP2", "--batch", "2", "--context", "12", "--steps", "2",
                          "--trace-steps", "1", "--check-tokens", "2", "--trace-dir", str(tmp_path / "trace"),
                          "--out", str(out)], cwd=ROOT, env=subprocess_env(8), capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["layout"] for r in results] == ["TP2", "EP2", "DCP2"]
    for r in results:
        assert r["tokens_equal_to_first"] and r["max_logit_diff"] < TOLERANCE and r["step_ms"] > 0
        assert r["collective_ms"] is not None and 0 < r["collective_share"] < 1
    assert results[0]["collectives_per_step"]["all-reduce"]["count"] > 0  # the row-parallel psums
    assert results[1]["collectives_per_step"]["all-to-all"]["count"] >= 3  # dispatch, expert ids, combine
