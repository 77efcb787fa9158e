"""Speculative decoding end to end in the engine: per-user tok/s with and without it, in one process (benchmark).

Cases (``--cases``):

* ``dspark``: the shipped ``tiny`` with a DSpark drafter (``--drafter DIR``; default: the drafter shipped beside
  ``tiny``, else the case is skipped) on code prompts: windows of the held-out standard-library files that
  training never sees (``kimi_jax.training.corpus.token_stream``).
* ``ngram``: n-gram prompt lookup on a preset's shape with random weights (``--preset``, ``--layers``,
  ``--experts-mxfp4``) on a repetition workload: every prompt repeats a random span. Lookup drafts from the prompt's
  end, but a random model does not continue the span, so after the first token it mostly finds nothing: on random
  weights the row measures what speculation costs a step that drafts nothing (acceptance needs trained weights).
  ``--ngram-on-target``: the ngram case on ``--target``'s trained weights and the code prompts instead.
  ``--oracle-correct N ...``: more speculating arms on the same runner whose host drafts are the next k tokens of a
  known greedy output for the same prompt with only the first N kept (the rest shifted, so rejected): the engine's
  verification path at a set acceptance, which random weights cannot give; reported under the row's ``oracle``.
  The known output starts as the plain arm's. A random bf16 model's near-ties flip between verification and decode
  reductions, after which such drafts would all be rejected, so an oracle arm reruns with its own last output as
  the known one until a run reproduces the tokens it drafted from (a fixed point, reached in a few runs; only that
  run is timed): its acceptance is then exactly N per verification step. An arm whose 1 + N is under the config's
  ``min_acceptance_length`` (n-gram default 1.5, so N = 0) pauses drafting as serving would: its row then measures
  the pause (``paused_steps``, fewer verification steps); ``--min-acceptance-length 0`` verifies every draft.
* ``draft_model``: ``tiny`` drafted by a model of the same vocabulary (``--draft-model``, a preset or folder;
  skipped without it) on the code prompts.

Each case builds two runners of the same engine config over the same weights (the parameter buffers are shared):
one without speculation, one with it. For each batch size B the repeats are interleaved (plain, speculative,
plain, ...): B requests decode ``--new-tokens`` greedy tokens (``ignore_eos``); repeat r takes the B prompts from
prompt r x B on (so batch-1 repeats decode different prompts, both arms the same ones). Per-user tok/s is the tokens a
request emits while every request decodes (from the step where all have their first token to the step where
the first one finishes) over that time, averaged over requests. A row reports the median and spread (min, max)
of both arms, the speedup of the medians, the speculative runs' acceptance (mean acceptance length, acceptance
rate per draft position, verification steps, request steps whose drafting was paused) and the greedy check:
every request's output ids compared token for token between the arms of each repeat, and per arm the wall ms of
one engine step with its serial host ms (the device idles for it unless the step was launched ahead) and the
fraction launched ahead. Speculation turns itself off at ``disable_by_batch_size`` running requests, as when
serving, so the rows at and past it measure that rule.

The JSON (``--out``/bench_spec.json) is rewritten after every row; no run starts after ``--deadline-s``. The exit
status is 1 when a greedy output of a case on trained weights differs (on random weights mismatches
are reported only: near-ties of a random model may flip between the verification and decode steps' reductions).

    python -m serve.bench.spec --drafter DIR --preset kimi-linear-48b --layers 4 --batches 1 16 64

Each runner's pools must hold the largest batch at full length at once (a speculating runner also keeps 1 + k KDA
states per request), else the bench stops before compiling and names ``--memory-gib``. ``--executable-cache DIR``
keeps each runner's compiled steps as they finish (``serve.engine.executable_cache``): a run cut short by a time
limit leaves them for the next, which loads them without tracing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

_OUT_NAME = "bench_spec.json"


@dataclasses.dataclass
class Arm:
    """One engine of a case: its runner and the speculative config its engines take (None: no speculation)."""

    name: str
    runner: object
    spec: dict | None
    oracle: int | None = None  # oracle arms: how many of the k drafts are a known output's tokens


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", choices=("dspark", "ngram", "draft_model"), default=["dspark", "ngram"])
    p.add_argument("--drafter", default=None, help="DSpark drafter folder for tiny (default: the shipped one)")
    p.add_argument("--draft-model", default=None, help="the draft_model case's draft model (a preset or folder)")
    p.add_argument("--target", default="tiny",
                   help="the dspark and draft_model cases' target: a preset with weights or a folder")
    p.add_argument("--target-dtype", default="float32",
                   help="their parameter dtype (float32: their greedy check must be exact)")
    p.add_argument("--preset", default="kimi-linear-48b", help="the ngram case's shape (random weights)")
    p.add_argument("--layers", type=int, default=4, help="keep the preset's first N layers")
    p.add_argument("--dtype", default="bfloat16", help="the ngram case's parameter dtype")
    p.add_argument("--ngram-on-target", action="store_true",
                   help="run the ngram case on --target's trained weights and the code prompts instead of a preset")
    p.add_argument("--experts-mxfp4", action="store_true",
                   help="the ngram case's routed experts in MXFP4 (K3's format; the 27-layer 48B shape then fits 80 GB)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k (default: the drafter's block for dspark, 4 for ngram and draft_model)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative_config.disable_by_batch_size (default: the config's own)")
    p.add_argument("--min-acceptance-length", type=float, default=None,
                   help="speculative_config.min_acceptance_length (default: the method's own; 0: never pause "
                        "drafting; an oracle arm whose 1 + N is below it pauses too)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=3, help="runs per arm and batch, interleaved")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--span", type=int, default=24, help="ngram workload: tokens of the span each prompt repeats")
    p.add_argument("--oracle-correct", type=int, nargs="+", default=[], metavar="N",
                   help="ngram case: one more speculating arm per N whose drafts are the next k tokens of a known "
                        "greedy output with the first N kept and the rest made wrong (verification at a set "
                        "acceptance; the known output is the plain arm's, then the arm's own until it repeats)")
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=None, help="tokens per page (default: 64 on GPU, 16 on CPU)")
    p.add_argument("--memory-gib", type=float, default=4.0, help="cache pools of each runner")
    p.add_argument("--impl", default=None)
    p.add_argument("--matmul-precision", default="highest",
                   help="jax_default_matmul_precision (highest: fp32 matmuls stay fp32 on a GPU, not TF32, so the "
                        "dspark case's greedy check compares exact arithmetic; bf16 matmuls are unaffected)")
    p.add_argument("--prompts", default=None, metavar="JSON",
                   help="the dspark and draft_model cases' prompts: a JSON list of token-id lists (default: windows "
                        "of the held-out code stream, which depends on this Python's standard library)")
    p.add_argument("--write-prompts", default=None, metavar="JSON",
                   help="write the code prompts used to this file (for --prompts on another machine)")
    p.add_argument("--executable-cache", default=None, metavar="DIR",
                   help="keep the runners' compiled steps in DIR and load them on the next run (no tracing, no "
                        "compiling: a rerun after a set-up cut short only compiles what is missing)")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="add an XLA compile option to the engine's GPU executables, e.g. xla_gpu_autotune_level=0")
    p.add_argument("--step-timing", action="store_true",
                   help="also time one steady-state step of each arm per batch (device ms, relaunched back to back)")
    p.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.repeats < 1 or args.new_tokens < 2 or args.prompt_len < 2:
        p.error("--batches, --repeats must be >= 1 and --new-tokens, --prompt-len >= 2")
    if args.ngram_on_target and args.experts_mxfp4:
        p.error("--experts-mxfp4 shapes the random preset; --ngram-on-target takes the target's own weights")
    if args.oracle_correct and ("ngram" not in args.cases or min(args.oracle_correct) < 0
                                or max(args.oracle_correct) > (args.num_speculative_tokens or 4)):
        p.error("--oracle-correct needs the ngram case and values in [0, --num-speculative-tokens (default 4)]")
    if not 1 <= args.span <= (args.prompt_len - 1) // 2:
        p.error("--span must be in [1, (--prompt-len - 1) / 2]: a prompt holds its span at least twice")
    return args


def code_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens spread over the held-out code stream (files never trained on)."""
    from kimi_jax.training.corpus import token_stream

    stream = token_stream(tokenizer, heldout=True, max_tokens=max(4 * count * length, 1 << 16))
    if len(stream) < count * length:
        raise ValueError(f"the held-out stream has {len(stream)} tokens, fewer than {count} prompts of {length}")
    starts = np.linspace(0, len(stream) - length, count).astype(int)
    return [stream[s:s + length].astype(int).tolist() for s in starts]


def case_prompts(args) -> list[list[int]]:
    """The code prompts of the dspark and draft_model cases: ``--prompts`` or held-out windows (one per request
    of the largest batch and per repeat, so that batch-1 repeats decode different prompts)."""
    from kimi_jax.tokenizer import load_tokenizer

    count = max(max(args.batches), args.repeats)
    if args.prompts:
        with open(args.prompts) as f:
            prompts = [[int(t) for t in p] for p in json.load(f)]
        if len(prompts) < count:
            raise ValueError(f"--prompts holds {len(prompts)} prompts; the runs need {count}")
        return prompts
    prompts = code_prompts(load_tokenizer(args.target if os.path.isdir(args.target) else "tiny"), count,
                           args.prompt_len)
    if args.write_prompts:
        with open(args.write_prompts, "w") as f:
            json.dump(prompts, f)
    return prompts


def repetition_prompts(vocab: int, count: int, length: int, span: int, seed: int = 0) -> list[list[int]]:
    """Prompts of a distinct first token and then one random ``span``-token span repeated up to ``length``."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        piece = rng.integers(0, vocab, span).tolist()
        body = (piece * (-(-length // span)))[:length - 1]
        prompts.append([i % vocab] + body)
    return prompts


def oracle_drafter(futures: dict[str, list[int]], k: int, correct: int, vocab: int):
    """The host drafter of an oracle arm: request -> the next ``k`` tokens of a known greedy output for the same
    prompt (``futures[request_id]``), the first ``correct`` as they are, the rest shifted by one (so a
    verification accepts exactly ``correct`` while the outputs agree)."""
    def propose(request) -> list[int]:
        done = request.num_output_tokens
        ahead = futures[request.request_id][done:done + k]
        return ahead[:correct] + [(t + 1) % vocab for t in ahead[correct:]]

    return propose


def run_oracle(arm: Arm, prompts: list[list[int]], new_tokens: int, tag: str, futures: list[list[int]],
               max_runs: int = 16) -> dict:
    """``run_batch`` of an oracle arm, drafting first from ``futures`` (the plain arm's outputs) and then from its
    own previous output until its outputs equal the ones it drafted from -> the last run, with ``oracle_runs``
    and ``fixed_point`` (False when ``max_runs`` ran out first)."""
    for done in range(1, max_runs + 1):
        result = run_batch(arm, prompts, new_tokens, f"{tag}-{done}", futures)
        settled = result["outputs"] == futures
        if settled:
            break
        futures = result["outputs"]
    return dict(result, oracle_runs=done, fixed_point=settled)


def run_batch(arm: Arm, prompts: list[list[int]], new_tokens: int, tag: str,
              futures: list[list[int]] | None = None) -> dict:
    """Decode ``prompts`` to ``new_tokens`` greedy tokens each on a fresh engine of ``arm`` -> timing, outputs,
    the run's acceptance and whether the pools ended free. An oracle arm drafts from ``futures`` (known greedy
    outputs for the same prompts)."""
    from serve.engine.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.sampling_params import SamplingParams

    runner = arm.runner
    config = EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=runner.config.max_num_batched_tokens,
                          enable_prefix_caching=False, speculative_config=arm.spec)
    engine = LLMEngine(runner, config=config)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    _install_oracle(engine, arm, ids, futures)
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    requests = [engine.scheduler.requests[i] for i in ids]
    outputs, timings = {}, []

    def step() -> None:
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        timings.append(engine.last_timing)

    while not all(r.num_output_tokens >= 1 for r in requests):
        step()
    before, verify_before = [r.num_output_tokens for r in requests], _verify_launches(runner)
    spec_before = _spec_counts(engine)
    start, first = time.perf_counter(), len(timings)
    while not any(r.is_finished for r in requests):
        step()
    seconds = time.perf_counter() - start
    window = timings[first:]
    emitted = [r.num_output_tokens - b for r, b in zip(requests, before)]
    spec_after, verify_steps = _spec_counts(engine), _verify_launches(runner) - verify_before
    while engine.has_unfinished_requests():
        step()
    rows, accepted = spec_after[0] - spec_before[0], spec_after[1] - spec_before[1]
    return dict(per_user_tokens_per_s=float(np.mean(emitted)) / seconds, tokens_per_s=sum(emitted) / seconds,
                window_s=seconds, outputs=[outputs[i] for i in ids], verification_steps=verify_steps,
                draft_rows=rows, accepted=accepted, steps=len(window), paused_steps=spec_after[3] - spec_before[3],
                host_serial_ms=1e3 * float(np.mean([t.update + t.schedule + t.launch for t in window])),
                phase_ms={phase: 1e3 * float(np.mean([getattr(t, phase) for t in window]))
                          for phase in ("wait", "update", "schedule", "launch", "process")},
                ahead_fraction=float(np.mean([t.ahead for t in window])),
                accepted_per_pos=[b - a for a, b in zip(spec_before[2], spec_after[2])], pools_free=engine.is_idle())


def _install_oracle(engine, arm: Arm, ids: list[str], futures: list[list[int]] | None) -> None:
    if arm.oracle is not None:
        engine.scheduler.host_drafter = oracle_drafter(dict(zip(ids, futures)), arm.spec["num_speculative_tokens"],
                                                       arm.oracle, arm.runner.model_config.vocab_size)


def step_device_ms(arm: Arm, prompts: list[list[int]], futures: list[list[int]] | None = None,
                   repeats: int = 30) -> dict:
    """Device time of one steady-state step of ``arm`` at this batch: a fresh engine decodes until every request
    has 8 tokens, then the last launched step (a verification step when the arm speculates) is relaunched
    ``repeats`` times back to back (``ModelRunner.time_step``); the requests are then aborted."""
    from serve.engine.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.sampling_params import SamplingParams

    runner = arm.runner
    engine = LLMEngine(runner, config=EngineConfig(max_num_seqs=len(prompts), enable_prefix_caching=False,
                                                   max_num_batched_tokens=runner.config.max_num_batched_tokens,
                                                   speculative_config=arm.spec))
    ids = [f"time-{i}" for i in range(len(prompts))]
    _install_oracle(engine, arm, ids, futures)
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    requests = [engine.scheduler.requests[i] for i in ids]
    while not all(r.num_output_tokens >= 8 for r in requests):
        engine.step()
    key = runner.last_key
    seconds = runner.time_step(repeats)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return dict(ms=seconds * 1e3, step=str(key))


def _spec_counts(engine) -> tuple[int, int, list[int], int]:
    """(verification rows with drafts, accepted drafts, accepted per position, request steps paused)."""
    s = engine.stats().spec_decode
    return (0, 0, [], 0) if s is None else (s.num_drafts, s.num_accepted_tokens, list(s.accepted_per_pos),
                                            s.num_paused_steps)


def _verify_launches(runner) -> int:
    return sum(n for key, n in runner.launch_counts.items() if len(key) == 6)  # verification launch keys


def compare(plain: list[list[int]], spec: list[list[int]]) -> list[dict]:
    """Requests whose greedy outputs differ: index and first differing position."""
    out = []
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(dict(request=i, position=at, plain=a[at:at + 4], speculative=b[at:at + 4]))
    return out


def summarize(batch: int, plain: list[dict], spec: list[dict], mismatches: list[dict]) -> dict:
    """One row: medians and spread of both arms, their ratio, the speculative runs' acceptance."""
    def spread(runs: list[dict]) -> dict:
        values = [r["per_user_tokens_per_s"] for r in runs]
        return dict(median=statistics.median(values), min=min(values), max=max(values), runs=values)

    rows = sum(r["draft_rows"] for r in spec)
    accepted = sum(r["accepted"] for r in spec)
    per_pos = np.sum([r["accepted_per_pos"] for r in spec], axis=0) if spec[0]["accepted_per_pos"] else []
    p, s = spread(plain), spread(spec)

    def per_step(runs: list[dict]) -> dict:
        """Wall ms per engine step, its serial host ms (update + schedule + launch: the device idles unless the
        step was launched ahead), the mean ms of each phase of ``engine.StepTiming`` and the fraction of steps
        launched ahead, medians over the runs."""
        return dict(wall_ms=statistics.median(1e3 * r["window_s"] / max(r["steps"], 1) for r in runs),
                    host_serial_ms=statistics.median(r["host_serial_ms"] for r in runs),
                    phase_ms={phase: statistics.median(r["phase_ms"][phase] for r in runs)
                              for phase in runs[0]["phase_ms"]},
                    ahead_fraction=statistics.median(r["ahead_fraction"] for r in runs))

    return dict(batch=batch, repeats=len(spec), plain_per_user_tokens_per_s=p, spec_per_user_tokens_per_s=s,
                speedup=s["median"] / p["median"],
                plain_tokens_per_s=statistics.median(r["tokens_per_s"] for r in plain),
                spec_tokens_per_s=statistics.median(r["tokens_per_s"] for r in spec),
                mean_acceptance_length=1.0 + accepted / rows if rows else 1.0,
                acceptance_rate_per_position=[float(a) / rows if rows else 0.0 for a in per_pos],
                draft_rows=rows, verification_steps=sum(r["verification_steps"] for r in spec),
                paused_steps=sum(r["paused_steps"] for r in spec),
                plain_step=per_step(plain), spec_step=per_step(spec),
                greedy_mismatches=len(mismatches), mismatch_examples=mismatches[:4],
                pools_free=all(r["pools_free"] for r in plain + spec))


def build_runner(model, args, spec: dict | None, drafter, max_len: int):
    """A warm runner of the case's engine config (speculating when ``spec``); ValueError naming --memory-gib,
    before compiling, when its pools cannot hold the largest batch at full length."""
    from serve.engine.config import EngineConfig
    from serve.engine.runner import ModelRunner

    bs = args.block_size
    config = EngineConfig(
        max_model_len=max_len, max_num_seqs=max(args.batches), max_num_batched_tokens=args.prefill_chunk,
        block_size=bs, enable_prefix_caching=False, token_buckets=(args.prefill_chunk,),
        seq_buckets=tuple(sorted(set(args.batches))), page_buckets=(-(-max_len // bs),),
        memory_budget_bytes=int(args.memory_gib * (1 << 30)), speculative_config=spec,
        executable_cache_dir=args.executable_cache)
    runner = ModelRunner(model, config, impl=args.impl, drafter=drafter, warm_up=False)
    held, need = runner.plan.max_concurrent_full_length_requests, max(args.batches)
    if held < need:  # the runs would queue requests, and per-user tok/s would mean nothing
        raise ValueError(f"--memory-gib {args.memory_gib}: the {'speculating' if spec else 'plain'} runner's pools "
                         f"hold {held} requests of {max_len} tokens at once, the largest batch is {need} (speculation "
                         f"also keeps 1 + k KDA states per request); raise --memory-gib")
    runner.warm_up()  # one runner at a time: running each step once at the end needs its largest step's memory
    return runner


def setup_dspark(args):
    """(model, speculative config, drafter, prompts) of the dspark case, or None when there is no drafter."""
    import kimi_jax
    from kimi_jax.api import shipped_checkpoint
    from kimi_jax.weights.drafter_io import load_drafter

    folder = args.drafter or shipped_checkpoint(f"{args.target}-dspark")
    if folder is None:
        return None
    lm = kimi_jax.load(args.target, args.target_dtype)
    drafter = load_drafter(folder, lm.model)
    k = args.num_speculative_tokens or drafter.config.num_drafts
    spec = {"method": "dspark", "model": folder, "num_speculative_tokens": k, **scheduling_fields(args)}
    return lm.model, spec, drafter, case_prompts(args)


def scheduling_fields(args) -> dict:
    """The speculative config's scheduling fields given on the command line (the others keep their defaults)."""
    given = {"disable_by_batch_size": args.disable_by_batch_size, "min_acceptance_length": args.min_acceptance_length}
    return {name: value for name, value in given.items() if value is not None}


def setup_draft_model(args):
    """(target, speculative config, draft model, prompts) of the draft_model case, or None without a draft model."""
    import kimi_jax

    if args.draft_model is None:
        return None
    lm = kimi_jax.load(args.target, args.target_dtype)
    draft = kimi_jax.load(args.draft_model, args.target_dtype).model
    spec = {"method": "draft_model", "model": args.draft_model,
            "num_speculative_tokens": args.num_speculative_tokens or 4, **scheduling_fields(args)}
    return lm.model, spec, draft, case_prompts(args)


def ngram_config(args):
    """The ngram case's model config: the preset's first ``--layers`` layers, MXFP4 experts if asked."""
    from kimi_jax.presets import get_preset

    full = get_preset(args.preset)
    n = args.layers
    return full.replace(num_layers=n, layer_types=full.layer_types[:n], mlp_types=full.mlp_types[:n],
                        experts_mxfp4=full.experts_mxfp4 or args.experts_mxfp4)


def setup_ngram(args):
    """(model, speculative config, None, prompts) of the ngram case: a preset's shape with random weights on the
    repetition prompts, or (``--ngram-on-target``) the trained target on the code prompts."""
    import jax.numpy as jnp
    from flax import nnx

    import kimi_jax
    from kimi_jax.model import KimiModel

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens or 4,
            "prompt_lookup_min": 2, "prompt_lookup_max": 5, **scheduling_fields(args)}
    if args.ngram_on_target:
        return kimi_jax.load(args.target, args.target_dtype).model, spec, None, case_prompts(args)
    cfg = ngram_config(args)
    model = KimiModel(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    prompts = repetition_prompts(cfg.vocab_size, max(max(args.batches), args.repeats), args.prompt_len, args.span)
    return model, spec, None, prompts


SETUPS = {"dspark": setup_dspark, "ngram": setup_ngram, "draft_model": setup_draft_model}
_SKIPPED = {"dspark": "no drafter: pass --drafter (none is shipped beside the target)",
            "draft_model": "no draft model: pass --draft-model"}


class Report:
    """The JSON document, rewritten whole after every row."""

    def __init__(self, args, device: str):
        self.path = os.path.join(args.out, _OUT_NAME)
        os.makedirs(args.out, exist_ok=True)
        self.doc = dict(args={k: v for k, v in vars(args).items()}, device=device, cases=[],
                        stopped_by_deadline=False)
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(tmp, self.path)


def run_case(name: str, setup, args, report: Report, start: float) -> int:
    """Measure one case into ``report``; ``setup(args)`` -> (model, speculative config, drafter or None,
    prompts) or None (nothing to run). -> its greedy mismatches."""
    import jax

    from serve.engine.runner import backend_compile_count

    t0 = time.perf_counter()
    setup = setup(args)
    case = dict(case=name, rows=[])
    report.doc["cases"].append(case)
    if setup is None:
        case["skipped"] = _SKIPPED[name]
        report.write()
        print(f"[spec bench] {name}: {case['skipped']}", flush=True)
        return 0
    model, spec, drafter, prompts = setup
    max_len = args.prompt_len + args.new_tokens + 2 * args.block_size
    arms = [Arm("plain", build_runner(model, args, None, None, max_len), None),
            Arm("spec", build_runner(model, args, spec, drafter, max_len), spec)]
    if name == "ngram":  # the oracle arms share the speculating runner
        arms += [Arm(f"oracle{n}", arms[1].runner, spec, oracle=n) for n in args.oracle_correct]
    case.update(spec_config=spec, layers=model.config.num_layers, vocab=model.config.vocab_size,
                setup_s=time.perf_counter() - t0, executables=[a.runner.num_executables for a in arms[:2]],
                warm_up_s=[a.runner.warm_up_seconds for a in arms[:2]])
    print(f"[spec bench] {name}: {jax.devices()[0].device_kind}, {spec}; setup {case['setup_s']:.1f}s", flush=True)
    compiles = backend_compile_count()
    mismatches = 0
    for batch in args.batches:
        runs = {arm.name: [] for arm in arms}
        found: dict[str, list[dict]] = {arm.name: [] for arm in arms[1:]}
        for repeat in range(args.repeats):
            if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
                report.doc["stopped_by_deadline"] = True
                break
            first = repeat * batch % len(prompts)
            chosen = (prompts[first:] + prompts[:first])[:batch]  # batch-1 repeats: different prompts
            for arm in arms:
                tag = f"{arm.name}-{repeat}"
                runs[arm.name].append(run_batch(arm, chosen, args.new_tokens, tag) if arm.oracle is None else
                                      run_oracle(arm, chosen, args.new_tokens, tag, runs["plain"][-1]["outputs"]))
            for arm in arms[1:]:
                found[arm.name] += compare(runs["plain"][-1]["outputs"], runs[arm.name][-1]["outputs"])
        if not runs["spec"]:
            break
        row = summarize(batch, runs["plain"], runs["spec"], found["spec"])
        oracles = [arm for arm in arms if arm.oracle is not None]
        if oracles:
            row["oracle"] = {str(arm.oracle): dict(
                {k: v for k, v in summarize(batch, runs["plain"], runs[arm.name], found[arm.name]).items()
                 if not k.startswith("plain")},
                runs_to_fixed_point=[r["oracle_runs"] for r in runs[arm.name]],
                fixed_point=all(r["fixed_point"] for r in runs[arm.name])) for arm in oracles}
        if args.step_timing:  # repeat 0 decoded prompts[:batch]; an oracle arm drafts its own output there
            row["step_device_ms"] = {arm.name: step_device_ms(arm, prompts[:batch], runs[arm.name][0]["outputs"])
                                     for arm in arms}
        mismatches += row["greedy_mismatches"]
        case["rows"].append(row)
        case["compiles_while_running"] = backend_compile_count() - compiles
        report.write()
        print(json.dumps({k: v for k, v in row.items() if k not in ("mismatch_examples", "oracle")}), flush=True)
        for n, sub in row.get("oracle", {}).items():
            print(f"[spec bench] oracle {n} correct: {sub['speedup']:.2f}x, acceptance length "
                  f"{sub['mean_acceptance_length']:.2f}, {sub['verification_steps']} verification steps, "
                  f"{sub['paused_steps']} request steps paused, runs to a fixed point {sub['runs_to_fixed_point']} "
                  f"(reached: {sub['fixed_point']}), {sub['greedy_mismatches']} outputs differ from the plain arm's",
                  flush=True)
        if report.doc["stopped_by_deadline"]:
            break
    return mismatches


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    with jax.default_matmul_precision(args.matmul_precision):  # lowering happens inside, so it sticks
        return _run(args)


def _run(args) -> int:
    import jax

    from serve.engine import runner as runner_module

    runner_module.add_gpu_compiler_options(args.xla_option)

    on_gpu = jax.devices()[0].platform == "gpu"
    args.block_size = args.block_size or (64 if on_gpu else 16)
    start = time.perf_counter()
    report = Report(args, jax.devices()[0].device_kind)
    failed = 0
    for name in args.cases:
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            report.doc["stopped_by_deadline"] = True
            report.write()
        if report.doc["stopped_by_deadline"]:
            break
        mismatches = run_case(name, SETUPS[name], args, report, start)
        if name != "ngram" or args.ngram_on_target:  # trained weights: every greedy output must match
            failed += mismatches
    print(f"[spec bench] wrote {report.path}", flush=True)
    if failed:
        print(f"[spec bench] {failed} greedy outputs of a trained model differ with speculation", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
