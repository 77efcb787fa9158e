"""Meshes, partition rules, placement and the memory planner.

The sharded forward runs in a subprocess: fake CPU devices must be configured before JAX starts, and this test
process has already started JAX with one device.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from kimi_jax import PRESETS, get_preset
from kimi_jax.model import KimiModel
from kimi_jax.weights.loader import param_leaves
from sharding import H200_HBM_BYTES, MeshShape, fit_spec, make_mesh, param_spec, param_specs, plan_memory
from sharding.rules import TP, shard_factor

ROOT = Path(__file__).resolve().parents[1]
UNSTACKED = {"embed", "lm_head", "norm", "attn_res.out_query", "attn_res.out_norm"}


def abstract(name: str) -> KimiModel:
    return nnx.eval_shape(lambda: KimiModel(get_preset(name), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_rules_cover_every_parameter_and_never_split_the_layer_axis(name):
    for path, var in param_leaves(abstract(name)).items():
        spec = param_spec(path)
        assert len(spec) <= var.ndim, (path, spec, var.shape)
        if path not in UNSTACKED:
            assert len(spec) == 0 or spec[0] is None, f"{path}: layer axis split by {spec}"


@pytest.mark.parametrize("suffix", ["pairs", "words", "mgpu"])
def test_rules_cover_the_kernel_layouts_of_mxfp4_experts(suffix, monkeypatch):
    """After the load-time re-layouts of K3's MXFP4 experts every parameter still has a rule of its rank, and
    tensor parallelism splits the output width F of w1 / w3 and the input width F of w2."""
    from kimi_jax.layers import ffn

    monkeypatch.setattr(ffn.gemm_kernel, "scales_are_narrow", lambda *scales: True)  # abstract under eval_shape

    def build():
        model = KimiModel(get_preset("k3-slice"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        if suffix == "mgpu":
            ffn.use_mgpu_layout(model.moe)
        else:
            ffn.use_byte_order(model.moe, suffix)
        return model

    leaves = param_leaves(nnx.eval_shape(build))
    assert f"moe.w1_{suffix}" in leaves and "moe.w1_packed" not in leaves
    for path, var in leaves.items():
        assert len(param_spec(path)) <= var.ndim, (path, param_spec(path), var.shape)
    if suffix == "mgpu":
        assert param_spec("moe.w1_mgpu")[3] == TP and param_spec("moe.w2_mgpu")[2] == TP


def test_unknown_parameter_path_raises():
    with pytest.raises(ValueError, match="no partition rule for parameter 'kda.new_thing'"):
        param_spec("kda.new_thing")


def test_fit_spec_drops_axes_that_do_not_divide():
    sizes = dict(data=1, tensor=4, expert=3, dcp=2)
    tp = ("tensor", "dcp")
    assert fit_spec(P(None, tp), (5, 16), sizes) == P(None, tp)
    assert fit_spec(P(None, tp), (5, 12), sizes) == P(None, "tensor")  # 12 % 8 != 0, 12 % 4 == 0
    assert fit_spec(P(None, tp), (5, 6), sizes) == P()
    assert fit_spec(P(None, "expert", tp), (2, 16, 8), sizes) == P(None, None, tp)
    assert shard_factor(P(None, "expert", tp), sizes) == 24


def test_make_mesh_axes_and_device_check():
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "tensor", "expert", "dcp")
    assert set(mesh.axis_types) == {AxisType.Auto}
    assert MeshShape.of(mesh) == MeshShape()
    with pytest.raises(ValueError, match="needs 2 devices"):
        make_mesh(tensor=2)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        make_mesh(model=1)


def test_planner_k3_on_16_h200_matches_hand_count():
    cfg = get_preset("k3")
    ctx = 131072
    plan = plan_memory(cfg, MeshShape(tensor=16), context_len=ctx, batch=4)
    n_kda, n_mla, n_moe = len(cfg.kda_layers), len(cfg.mla_layers), len(cfg.moe_layers)
    assert (n_kda, n_mla, n_moe) == (69, 24, 92)
    state = n_kda * (96 * 128 * 128 * 4 + 3 * (3 * 96 * 128) * 4) // 16  # fp32 recurrent + conv, heads over 16
    assert plan.kda_state_per_request == state
    assert plan.mla_per_token == 24 * 576 * 2  # bf16 latent + rope key, replicated over tensor
    experts = n_moe * 896 * 3 * 3072 * 3584 * (1 / 2 + 1 / 32) / 16  # MXFP4 bytes + E8M0 scales
    assert plan.weights["MoE routed experts"] == experts
    assert plan.replicated == ()
    assert 1.5e12 < plan.model_bytes < 1.7e12  # the 1.56 TB checkpoint
    assert plan.cache_budget == plan.usable_bytes - plan.weights_per_device
    assert plan.max_requests == plan.cache_budget // (state + ctx * plan.mla_per_token)
    assert plan.max_context_at_batch == (plan.cache_budget - 4 * state) // plan.mla_per_token // 4

    dcp = plan_memory(cfg, MeshShape(tensor=2, dcp=8), context_len=ctx, batch=4)
    assert dcp.weights == plan.weights and dcp.kda_state_per_request == state
    assert dcp.mla_per_token == plan.mla_per_token // 8
    ep = plan_memory(cfg, MeshShape(tensor=8, expert=2), context_len=ctx, batch=4)
    assert ep.weights["MoE routed experts"] == experts and ep.kda_state_per_request == 2 * state
    assert "MoE routed experts" in plan.table()


def test_planner_counts_what_the_rules_could_not_split():
    cfg = get_preset("tiny")
    plan = plan_memory(cfg, MeshShape(tensor=8), context_len=64, batch=2, weight_dtype="float32")
    assert {"kda.b_proj", "kda.A_log"} <= set(plan.replicated)  # 4 value heads on 8 ranks
    model = nnx.eval_shape(lambda: KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    specs = param_specs(model, MeshShape(tensor=8))
    assert specs["kda.b_proj"] == P() and specs["kda.q_proj"] == P(None, None, ("tensor", "dcp"))
    want = sum(math.prod(v.shape) * v.dtype.itemsize // shard_factor(specs[p], MeshShape(tensor=8).sizes())
               for p, v in param_leaves(model).items())
    assert plan.weights_per_device == want
    whole = plan_memory(cfg, MeshShape(), context_len=64, batch=2, weight_dtype="float32")
    assert whole.weights_per_device == whole.model_bytes == plan.model_bytes


SHARDED_FORWARD = r"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
import kimi_jax
from kimi_jax.api import KimiLM
from kimi_jax.step import StepInputs, dense_step, init_cache
from sharding import make_mesh, shard_cache, shard_params

def two_chunks(lm, place):
    # two prefill chunks of 13 tokens for 2 sequences: the second reads the placed cache the first wrote;
    # both steps pad to the same shapes, so each model compiles one program
    ids = np.random.default_rng(0).integers(0, 3840, (2, 26)).astype(np.int32)
    cache = place(init_cache(lm.config, num_blocks=8, block_size=16, num_slots=4, dtype=lm.dtype))
    logits = []
    for start in (0, 13):
        fields = dense_step(2, 13, block_size=16, context=np.array([start, start]), max_len=26)
        fields["logits_indices"] = np.arange(26, dtype=np.int32)
        out, cache = lm.step(place(cache), StepInputs(token_ids=ids[:, start:start + 13].reshape(-1), **fields))
        logits.append(np.asarray(out))
    return logits

want = two_chunks(kimi_jax.load("tiny", dtype="float32", impl="reference"), lambda c: c)
mesh = make_mesh(tensor=2, expert=2, dcp=2)
model = shard_params(kimi_jax.load("tiny", dtype="float32").model, mesh, for_parallel=False)  # GSPMD only
placed = lambda c: shard_cache(c, mesh)
got = two_chunks(KimiLM(model, impl="reference"), placed)
cache = placed(init_cache(model.config, num_blocks=8, block_size=16, num_slots=4))
print(json.dumps(dict(
    errors=[float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, want)],
    q_proj_shard=list(model.kda.q_proj.get_value().addressable_shards[0].data.shape),
    w1_shard=list(model.moe.w1_packed.get_value().addressable_shards[0].data.shape),
    embed_shard=list(model.embed.get_value().addressable_shards[0].data.shape),
    mla_shard=list(cache.mla.addressable_shards[0].data.shape),
    state_shard=list(cache.kda_state.addressable_shards[0].data.shape))))
"""


def test_sharded_tiny_forward_equals_unsharded_on_8_fake_devices():
    """GSPMD alone (no ``Parallel``): TP4 (tensor 2 x dcp 2) x EP2 on 8 fake CPU devices, fp32, two prefill chunks
    over placed caches; XLA partitions the pure-XLA forward from the placements. (The shard_map path of every
    layout: tests/test_sharding_layouts.py.)
    fp32 tolerance 1e-5 of the largest logit: only the summation order of split contractions differs
    (observed ~1e-6); a wrong placement or a dropped shard is an O(1) error."""
    cache = os.environ.get("KIMI_JAX_TEST_JIT_CACHE", os.path.expanduser("~/.cache/kimi_jax/jit"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    run = subprocess.run([sys.executable, "-c", SHARDED_FORWARD], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(e <= 1e-5 for e in result["errors"]), result["errors"]
    assert result["q_proj_shard"] == [6, 256, 64]  # [L, D, H*K/4]
    assert result["w1_shard"] == [7, 8, 32, 64]  # [L, E/2, F/4, Din/2]
    assert result["embed_shard"] == [1024, 256]  # vocabulary over 4 ranks
    assert result["mla_shard"] == [2, 4, 16, 96]  # blocks over dcp=2, replicated over tensor
    assert result["state_shard"] == [6, 4, 1, 64, 64]  # 4 heads over 4 ranks


def test_expert_parallel_rules_split_experts_over_the_whole_replica():
    from sharding.rules import EP_ALL

    assert param_spec("moe.w1_packed") == P(None, "expert", TP, None)
    assert param_spec("moe.w1_packed", expert_parallel=True) == P(None, EP_ALL, None, None)
    assert param_spec("moe.w2_scale", expert_parallel=True) == P(None, EP_ALL, None, None)
    assert param_spec("moe.shared_up", expert_parallel=True) == param_spec("moe.shared_up")  # dense: still TP
    shape = MeshShape(tensor=4, dcp=2, expert_parallel=True)
    assert shape.expert_shards == 8 and shape.label() == "TEP8 x DCP2"
    assert MeshShape(tensor=2, expert=2).expert_shards == 2


def test_conv_channel_order_gives_each_rank_its_heads_q_k_v():
    from kimi_jax.config import ModelConfig
    from sharding.rules import conv_channel_order

    cfg = ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, layer_types=("kda",), mlp_types=("dense",),
                      kda_num_heads=2, kda_num_v_heads=2, kda_head_dim=2, kda_v_head_dim=2)
    order = conv_channel_order(cfg, 2)  # channels q0 q1 q2 q3 | k0..k3 | v0..v3 (two heads of 2)
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert conv_channel_order(cfg, 1).tolist() == list(range(12))
    with pytest.raises(ValueError, match="cannot be split over 8"):
        conv_channel_order(cfg, 8)


def test_layout_flags_map_to_replica_meshes_as_vllm_does():
    from sharding.layout import ParallelConfig

    assert ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8).replica_shape() == MeshShape(dcp=8)
    pc = ParallelConfig(tensor_parallel_size=4, data_parallel_size=2)
    assert pc.num_replicas == 2 and pc.replica_shape() == MeshShape(tensor=4) and pc.label() == "2 x TP4"
    joined = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, enable_expert_parallel=True)
    assert joined.num_replicas == 1
    assert joined.replica_shape() == MeshShape(tensor=2, expert=4, expert_parallel=True)
    with pytest.raises(ValueError, match="--decode-context-parallel-size 3 must divide --tensor-parallel-size 4"):
        ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=3)


def test_impossible_layouts_are_refused_with_the_reason_and_suggested_layouts():
    from sharding.layout import ParallelConfig
    from sharding.planner import validate_layout

    tiny = get_preset("tiny")  # 4 KDA / MLA heads, 16 experts
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 8: kda_num_heads=4 is not divisible by "
                                         r"--tensor-parallel-size 8.*Layouts that fit 8 devices.*TP4"):
        validate_layout(tiny, ParallelConfig(tensor_parallel_size=8), num_devices=8)
    with pytest.raises(ValueError, match="needs 4 devices .* only 2 are visible"):
        validate_layout(tiny, ParallelConfig(tensor_parallel_size=4), num_devices=2)
    with pytest.raises(ValueError, match="num_experts=16 is not divisible by --enable-expert-parallel over 32"):
        validate_layout(tiny, ParallelConfig(tensor_parallel_size=4, data_parallel_size=8,
                                             enable_expert_parallel=True), num_devices=32)
    k3 = get_preset("k3")
    with pytest.raises(ValueError, match=r"does not fit TP8 on devices of 140 GiB: weights 182.5 GiB per device.*"
                                         r"No layout of 8 devices fits"):
        validate_layout(k3, ParallelConfig(tensor_parallel_size=8), num_devices=8, hbm_bytes=H200_HBM_BYTES,
                        context_len=131072)
    with pytest.raises(ValueError, match=r"does not fit 2 x TP8.*Layouts that fit 16 devices .*: TP16 "
                                         r"\(--tensor-parallel-size 16\)"):
        validate_layout(k3, ParallelConfig(tensor_parallel_size=8, data_parallel_size=2), num_devices=16,
                        hbm_bytes=H200_HBM_BYTES, context_len=131072)
    assert validate_layout(k3, ParallelConfig(tensor_parallel_size=16), num_devices=16, hbm_bytes=H200_HBM_BYTES,
                           context_len=131072) == MeshShape(tensor=16)


SEED_HBM = 288 * 10 ** 9
"""HBM of one B300 GPU, the seed's hardware (288 GB HBM3e): the DCP8 figures are from 8-GPU B300 nodes."""


def test_planner_reproduces_the_seeds_dcp8_capacity_on_8_b300():
    """Seed 003: K3 on TP8, a 120K-token workload; DCP8 raised the KV cache capacity from 1.93M to 19.75M tokens.

    Assumptions: 8 x B300 of 288 GB, bf16 MLA latents (24 layers x 576 values = 27,648 B per token on every TP rank,
    1/8 of that per rank under DCP8), fp32 KDA state reserved for one request, 4 GiB workspace per GPU. At equal
    settings the planner's capacity grows exactly 8x (DCP ranks are TP ranks: weights and KDA state per GPU are
    unchanged, each GPU holds 1/8 of every token), and its TP8 figure is within 15% of the seed's. The seed's 10.2x
    is 8x times a 28% larger cache budget per GPU in the DCP8 run (the blog gives neither run's memory settings):
    the planner reproduces both figures within 2% with the TP8 run at 0.88 of HBM and the DCP8 run at 0.932."""
    k3 = get_preset("k3")

    def tokens(mesh, utilization=0.9):
        return plan_memory(k3, mesh, context_len=120000, batch=1, hbm_bytes=SEED_HBM,
                           memory_utilization=utilization).kv_tokens_at_batch

    tp8, dcp8 = tokens(MeshShape(tensor=8)), tokens(MeshShape(dcp=8))
    assert abs(tp8 / 1.93e6 - 1) < 0.15
    assert abs(dcp8 / tp8 - 8) < 1e-5
    tp8_seed, dcp8_seed = tokens(MeshShape(tensor=8), 0.88), tokens(MeshShape(dcp=8), 0.932)
    assert abs(tp8_seed / 1.93e6 - 1) < 0.02 and abs(dcp8_seed / 19.75e6 - 1) < 0.02
    assert abs(dcp8_seed / tp8_seed - 19.75 / 1.93) < 0.3  # the seed's 10.2x


def test_recipe_profiles_tp8_and_tep16_fit():
    """Seed 002 (vLLM recipe): TP8 on 8 x GB300 (288 GB) and TEP16 (TP16 + --enable-expert-parallel) on 16 x GB200
    (186 GB usable) serve K3 at the recipe's --max-model-len 1048576 with --gpu-memory-utilization 0.90."""
    k3 = get_preset("k3")
    tp8 = plan_memory(k3, MeshShape(tensor=8), context_len=1048576, batch=1, hbm_bytes=288 * 10 ** 9)
    tep16 = plan_memory(k3, MeshShape(tensor=16, expert_parallel=True), context_len=1048576, batch=1,
                        hbm_bytes=186 * 10 ** 9)
    assert tp8.fits and tep16.fits and tp8.replicated == () and tep16.replicated == ()
    assert tep16.weights["MoE routed experts"] == tp8.weights["MoE routed experts"] / 2  # 56 whole experts per GPU


def test_planner_cli_lists_the_layouts_of_the_gpus(capsys):
    import json

    from sharding.planner import main

    main(["--model", "k3", "--gpus", "8", "--gpu-memory-gib", "268.2", "--context", "120000", "--json"])
    rows = {r["layout"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["TP8"]["fits"] and rows["TP8 x DCP8"]["fits"]
    assert rows["TP8 x DCP8"]["cache_tokens"] // rows["TP8"]["cache_tokens"] == 8
    assert rows["TP8 x DCP8"]["kda_state_per_request"] == rows["TP8"]["kda_state_per_request"]
    assert not rows["8 x TP1"]["fits"]  # eight one-GPU replicas: no GPU holds K3
    main(["--model", "k3", "--gpus", "16", "--context", "131072", "--only-fitting"])
    table = capsys.readouterr().out
    assert "TP16 x DCP16" in table and "--tensor-parallel-size 16 --decode-context-parallel-size 16" in table
    assert "TP8 " not in table  # 8 H200s hold no K3 replica
