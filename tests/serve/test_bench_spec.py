"""`python -m serve.bench.spec` at toy size on the CPU: every case (a random DSpark drafter, n-gram on a
repetition workload, a draft model with the target's weights) on a 2-layer hybrid model, one repeat, a batch of
two: rows with both arms' figures, the greedy check (and a corrupted output that makes it fail with exit status
1), pools free, nothing compiled while running, the JSON rewritten per row, skipped cases and the deadline."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kimi_jax.drafter import DSparkConfig, DSparkDrafter
from kimi_jax.model import KimiModel
from kimi_jax.tokenizer import load_tokenizer
from serve.bench import spec as bench
from tests.serve.test_engine_runner import SMALL

TOY = SMALL.replace(num_layers=2, layer_types=("kda", "mla"), mlp_types=("dense", "dense"))
ARGV = ["--batches", "2", "--repeats", "1", "--prompt-len", "12", "--new-tokens", "6", "--span", "3",
        "--prefill-chunk", "32", "--memory-gib", "0.01"]
_models: dict = {}
_runners: dict = {}


def toy_model() -> KimiModel:
    if "model" not in _models:
        _models["model"] = KimiModel(TOY, dtype=jnp.float32, rngs=nnx.Rngs(0))
        _models["drafter"] = DSparkDrafter(DSparkConfig(target_layer_ids=(0, 1), num_layers=1, block_size=3,
                                                        markov_rank=2), TOY, dtype=jnp.float32, rngs=nnx.Rngs(1))
    return _models["model"]


def toy_dspark(args):
    model = toy_model()
    prompts = bench.code_prompts(load_tokenizer("tiny"), max(args.batches), args.prompt_len)
    return model, {"method": "dspark", "model": "toy", "num_speculative_tokens": 2}, _models["drafter"], prompts


def toy_ngram(args):
    model = toy_model()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return model, spec, None, bench.repetition_prompts(TOY.vocab_size, max(args.batches), args.prompt_len, args.span)


def toy_draft_model(args):
    model = toy_model()
    graphdef, state = nnx.split(model)
    twin = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    prompts = bench.code_prompts(load_tokenizer("tiny"), max(args.batches), args.prompt_len)
    return model, {"method": "draft_model", "model": "twin", "num_speculative_tokens": 2}, twin, prompts


@pytest.fixture
def toy(monkeypatch):
    """The toy setups, with runners reused across this module's runs (one compile per arm and case)."""
    build = bench.build_runner

    def cached(model, args, spec, drafter, max_len):
        key = json.dumps(spec, sort_keys=True)
        if key not in _runners:
            _runners[key] = build(model, args, spec, drafter, max_len)
        return _runners[key]

    monkeypatch.setattr(bench, "build_runner", cached)
    monkeypatch.setitem(bench.SETUPS, "dspark", toy_dspark)
    monkeypatch.setitem(bench.SETUPS, "ngram", toy_ngram)
    monkeypatch.setitem(bench.SETUPS, "draft_model", toy_draft_model)


def test_every_case_reports_both_arms_with_identical_greedy_outputs(toy, tmp_path):
    assert bench.main([*ARGV, "--cases", "dspark", "ngram", "draft_model", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_spec.json").read_text())
    assert [c["case"] for c in doc["cases"]] == ["dspark", "ngram", "draft_model"] and not doc["stopped_by_deadline"]
    for case in doc["cases"]:
        assert [r["batch"] for r in case["rows"]] == [2] and case["compiles_while_running"] == 0
        k = case["spec_config"]["num_speculative_tokens"]
        for row in case["rows"]:
            assert row["greedy_mismatches"] == 0 and row["pools_free"]
            assert row["plain_per_user_tokens_per_s"]["median"] > 0 and row["spec_per_user_tokens_per_s"]["runs"]
            for arm in (row["plain_step"], row["spec_step"]):
                assert 0 < arm["host_serial_ms"] < arm["wall_ms"] and 0.0 <= arm["ahead_fraction"] <= 1.0
            assert row["speedup"] == pytest.approx(row["spec_per_user_tokens_per_s"]["median"]
                                                   / row["plain_per_user_tokens_per_s"]["median"])
            per_pos = row["acceptance_rate_per_position"]
            assert len(per_pos) == k and row["mean_acceptance_length"] == pytest.approx(1 + sum(per_pos))
    dspark, twin = doc["cases"][0]["rows"], doc["cases"][2]["rows"]
    assert all(r["draft_rows"] > 0 and r["verification_steps"] > 0 for r in dspark)  # the drafter always drafts
    assert all(r["mean_acceptance_length"] > 2.0 for r in twin)  # the target's own drafts: nearly all accepted


def test_oracle_arms_verify_at_the_acceptance_they_set(toy, tmp_path):
    """``--oracle-correct 3 1`` (k = 3): drafts from the plain arm's own greedy outputs, all or only the first
    kept. Every verification accepts exactly that many while outputs agree (the last step of a request may
    have fewer tokens left to draft), and greedy outputs stay identical."""
    argv = [*ARGV, "--cases", "ngram", "--new-tokens", "13", "--oracle-correct", "3", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    row = json.loads((tmp_path / "bench_spec.json").read_text())["cases"][0]["rows"][0]
    full, first = row["oracle"]["3"], row["oracle"]["1"]
    assert full["greedy_mismatches"] == first["greedy_mismatches"] == 0 and full["pools_free"]
    assert full["runs_to_fixed_point"] == first["runs_to_fixed_point"] == [1] and full["fixed_point"]
    assert full["acceptance_rate_per_position"][0] == 1.0 and 3.0 < full["mean_acceptance_length"] <= 4.0
    assert first["acceptance_rate_per_position"] == [1.0, 0.0, 0.0] and first["mean_acceptance_length"] == 2.0
    assert full["verification_steps"] > 0 and full["verification_steps"] < first["verification_steps"]


def test_an_oracle_arm_reruns_until_it_reproduces_what_it_drafted(monkeypatch):
    """An oracle arm whose output left the known one (a near-tie flipped) drafts its own output next time, until a
    run's outputs equal the ones it drafted from; only that run is returned. One that never settles stops at
    ``max_runs`` and says so."""
    drafted_from = []

    def flips_once_per_run(arm, prompts, new_tokens, tag, futures):
        drafted_from.append(futures)
        out = [list(f) for f in futures]
        if len(drafted_from) <= 2:  # runs 1 and 2 flip a later token each; run 3 reproduces its drafts
            out[0][len(drafted_from)] += 1
        return dict(outputs=out, tag=tag)

    monkeypatch.setattr(bench, "run_batch", flips_once_per_run)
    arm = bench.Arm("oracle4", None, {"num_speculative_tokens": 4}, oracle=4)
    result = bench.run_oracle(arm, [[1, 2]], 4, "o-0", [[5, 6, 7, 8]])
    assert result["oracle_runs"] == 3 and result["fixed_point"] and result["tag"] == "o-0-3"
    assert drafted_from == [[[5, 6, 7, 8]], [[5, 7, 7, 8]], [[5, 7, 8, 8]]] and result["outputs"] == [[5, 7, 8, 8]]

    monkeypatch.setattr(bench, "run_batch", lambda arm, prompts, n, tag, futures: dict(
        outputs=[[t + 1 for t in futures[0]]]))
    result = bench.run_oracle(arm, [[1, 2]], 4, "o-1", [[5, 6, 7, 8]], max_runs=3)
    assert result["oracle_runs"] == 3 and not result["fixed_point"]


def test_a_differing_greedy_output_fails_the_dspark_case(toy, tmp_path, monkeypatch):
    run = bench.run_batch

    def corrupted(arm, prompts, new_tokens, tag, futures=None):
        result = run(arm, prompts, new_tokens, tag, futures)
        if arm.spec is not None:
            result["outputs"][0][2] += 1
        return result

    monkeypatch.setattr(bench, "run_batch", corrupted)
    assert bench.main([*ARGV, "--cases", "dspark", "--out", str(tmp_path)]) == 1
    row = json.loads((tmp_path / "bench_spec.json").read_text())["cases"][0]["rows"][0]
    assert row["greedy_mismatches"] == 1 and row["mismatch_examples"][0]["position"] == 2


def test_cases_without_a_drafter_are_skipped(tmp_path):
    assert bench.main([*ARGV, "--cases", "draft_model", "--out", str(tmp_path)]) == 0
    case = json.loads((tmp_path / "bench_spec.json").read_text())["cases"][0]
    assert case["rows"] == [] and "--draft-model" in case["skipped"]


@pytest.mark.parametrize("budget_bytes, arm", [(50_000, "plain"), (100_000, "speculating")])
def test_pools_that_cannot_hold_the_batch_are_refused(budget_bytes, arm):
    """A runner whose pools hold fewer full-length requests than the largest batch would queue some of them and
    leave an empty timing window: refused before compiling, naming the runner and --memory-gib. At 100 KB the
    8 requests fit alone (9 KDA slots of 3.2 KB and 33 pages of 1.5 KB), not with 3 drafts' 32 more slots."""
    args = bench.parse_args([*ARGV, "--batches", "8", "--memory-gib", str(budget_bytes / (1 << 30))])
    args.block_size = 16
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match=f"the {arm} runner's pools hold .* the largest batch is 8.*--memory-gib"):
        bench.build_runner(toy_model(), args, spec if arm == "speculating" else None, None, 50)


def test_the_executable_cache_reaches_the_runners(tmp_path, monkeypatch):
    """``--executable-cache DIR`` becomes the runners' ``executable_cache_dir`` (a rerun loads their steps instead of
    tracing them; the CPU client may refuse to store some, so only the plumbing is checked here)."""
    from serve.engine.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: None)
    args = bench.parse_args([*ARGV, "--executable-cache", str(tmp_path / "exec")])
    args.block_size = 16
    assert bench.build_runner(toy_model(), args, None, None, 50).config.executable_cache_dir == str(tmp_path / "exec")
    assert bench.parse_args(ARGV).executable_cache is None


def test_ngram_case_can_take_mxfp4_experts():
    """``--experts-mxfp4`` puts the 27-layer Kimi-Linear-48B shape (bf16 experts) in 80 GB: the preset's first layers
    with packed MXFP4 routed experts."""
    argv = [*ARGV, "--preset", "kimi-linear-48b", "--layers", "27"]
    plain, packed = bench.ngram_config(bench.parse_args(argv)), bench.ngram_config(bench.parse_args(
        [*argv, "--experts-mxfp4"]))
    assert plain.num_layers == packed.num_layers == 27 and not plain.experts_mxfp4 and packed.experts_mxfp4
    assert dataclasses.replace(packed, experts_mxfp4=False) == plain


def test_ngram_case_on_the_trained_target_takes_the_code_prompts():
    """``--ngram-on-target``: the shipped ``tiny`` (trained weights, so its greedy mismatches fail the run) on
    held-out code windows instead of a random preset on the repetition prompts."""
    args = bench.parse_args([*ARGV, "--ngram-on-target", "--batches", "3"])
    model, spec, drafter, prompts = bench.setup_ngram(args)
    assert model.config.vocab_size == load_tokenizer("tiny").vocab_size and drafter is None
    assert spec["method"] == "ngram" and len(prompts) == 3 and all(len(p) == 12 for p in prompts)
    assert prompts == bench.code_prompts(load_tokenizer("tiny"), 3, 12)


def test_deadline_and_bad_arguments(tmp_path):
    assert bench.main([*ARGV, "--deadline-s", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_spec.json").read_text())
    assert doc["stopped_by_deadline"] and doc["cases"] == []
    for bad in (["--span", "6"], ["--repeats", "0"], ["--ngram-on-target", "--experts-mxfp4"],
                ["--oracle-correct", "5"], ["--cases", "dspark", "--oracle-correct", "1"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*ARGV, *bad])


def test_workloads():
    prompts = bench.repetition_prompts(100, 3, 12, 3)
    assert all(len(p) == 12 and p[1:4] == p[4:7] == p[7:10] for p in prompts) and len({p[0] for p in prompts}) == 3
    code = bench.code_prompts(load_tokenizer("tiny"), 3, 20)
    assert len(code) == 3 and all(len(p) == 20 for p in code) and code[0] != code[1]
