"""Train the ``tiny`` K3-architecture model on the Python standard library and export it with MXFP4 experts.

    python -m kimi_jax.training.train_tiny --out DIR --steps N [--time-budget SECONDS] [...]

Trains every K3 part (KDA with the lower-bound gate, gated NoPE MLA, Block AttnRes, Stable LatentMoE with
SiTU) with bf16/fp32 routed experts through ``kimi_jax.model.forward``, reports the held-out loss, quantises
the routed experts to MXFP4, reports the held-out loss again (training forward with the MXFP4 round trip of
the experts, and through the serving loader ``kimi_jax.load`` unless ``--no-serving-eval``), prints greedy
samples and writes ``config.json`` + ``model.safetensors`` + ``training.json`` + ``TRAINING.md`` into DIR.
Seeded: the same arguments on the same corpus and backend give the same data order, initialisation and schedule
(bit-identical on CPU; on a GPU, XLA's atomic scatter-adds in the backward pass make the sums run-dependent in
the last bits).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.model import KimiModel
from kimi_jax.presets import tiny
from kimi_jax.training import export, loop
from kimi_jax.training.batches import PackedBatches, eval_batches
from kimi_jax.training.corpus import LICENSE, load_or_build
from kimi_jax.training.objective import split_params
from kimi_jax.training.report import training_markdown
from kimi_jax.training.loop import PROBE_STEPS
from kimi_jax.training.trainer import Trainer, init_for_training


def parse_args(argv=None) -> argparse.Namespace:
    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--steps", type=int, default=None, help="total optimizer steps (upper bound with --time-budget)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds of training: the total step count is fixed after the first steps from their time")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=("packed", "vmap"), default="vmap" if gpu else "packed")
    ap.add_argument("--compute-dtype", default="bfloat16" if gpu else "float32")
    ap.add_argument("--export-dtype", default="bfloat16")
    ap.add_argument("--corpus", default=None, help="saved corpus .npz (built from this interpreter's stdlib and "
                                                  "saved there when missing)")
    ap.add_argument("--heldout-percent", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=65536,
                    help="held-out targets evaluated: the first windows of the held-out stream (0 = all)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                    help="override a field of the tiny preset, e.g. --set hidden_size=192")
    ap.add_argument("--no-serving-eval", action="store_true",
                    help="skip the kimi_jax.load held-out loss and greedy samples (run training.evaluate later)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.steps is None and args.time_budget is None:
        ap.error("give --steps, --time-budget or both")
    if args.time_budget is not None and args.warmup < PROBE_STEPS:
        ap.error(f"--time-budget needs --warmup >= {PROBE_STEPS}")
    return args


def model_config(overrides: list[str]):
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        changes[key] = json.loads(value)
    return tiny().replace(experts_mxfp4=False, **changes)


def _log(msg: str) -> None:
    print(msg, flush=True)


def count_params(model: KimiModel) -> dict[str, int]:
    _, (experts, rest) = split_params(model)
    size = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))  # noqa: E731
    return {"routed_experts": size(experts), "other": size(rest)}


def train(args: argparse.Namespace) -> dict:
    from kimi_jax.tokenizer import load_tokenizer

    t_start = time.time()
    cfg = model_config(args.set)
    tokenizer = load_tokenizer("tiny")
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, model vocab is {cfg.vocab_size}")
    corpus = load_or_build(args.corpus, tokenizer, heldout_percent=args.heldout_percent)
    _log(f"corpus: python {corpus.python} stdlib, {corpus.train_files}+{corpus.heldout_files} files, "
         f"{corpus.source_bytes / 1e6:.1f} MB text, {len(corpus.train)} train / {len(corpus.heldout)} held-out "
         f"tokens, fingerprint {corpus.fingerprint()} ({time.time() - t_start:.0f}s)")

    model = KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    init_for_training(model)
    params = count_params(model)
    trainer = Trainer(model, layout=args.layout, compute_dtype=jnp.dtype(args.compute_dtype),
                      weight_decay=args.weight_decay, clip=args.clip)
    del model
    data = PackedBatches(corpus.train, batch=args.batch, seq_len=args.seq_len, seed=args.seed)
    held = eval_batches(corpus.heldout, batch=args.batch, seq_len=args.seq_len, max_tokens=args.eval_tokens or None)
    tokens_per_step = args.batch * args.seq_len
    _log(f"device {jax.devices()[0].device_kind} ({jax.default_backend()}), layout {args.layout}, compute "
         f"{args.compute_dtype}, params {params}, {tokens_per_step} tokens/step, "
         f"{data.steps_per_epoch} steps/epoch")

    ran = loop.run(trainer, lambda step: (data(step), None), lr=args.lr, warmup=args.warmup,
                   min_lr_ratio=args.min_lr_ratio, steps=args.steps, time_budget=args.time_budget,
                   tokens_per_step=tokens_per_step, log_every=args.log_every, log=_log)
    step, history, train_seconds = ran.steps, ran.history, ran.train_seconds

    trained = trainer.model()
    heldout_loss = trainer.evaluate(held)
    _log(f"held-out loss (training forward, {args.compute_dtype} compute): {heldout_loss:.4f} nats/token")
    fake_q = split_params(export.fake_quantized_experts(trained))[1]
    heldout_mxfp4 = trainer.evaluate(held, params=fake_q)
    _log(f"held-out loss (training forward, MXFP4 routed experts): {heldout_mxfp4:.4f} nats/token")
    export.export_checkpoint(trained, args.out, dtype=jnp.dtype(args.export_dtype))
    _log(f"wrote {args.out} ({folder_mb(args.out):.1f} MB)")

    result = {
        "command": "python -m kimi_jax.training.train_tiny " + shlex.join(args.argv),
        "reproduce": "python -m kimi_jax.training.train_tiny " + shlex.join(reproduce_argv(args.argv, step)),
        "steps": step, "tokens_trained": step * tokens_per_step, "train_seconds": train_seconds,
        "wall_seconds": time.time() - t_start,
        "median_step_ms": ran.median_step_ms,
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "layout": args.layout, "compute_dtype": args.compute_dtype, "export_dtype": args.export_dtype,
        "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup,
        "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay, "clip": args.clip, "seed": args.seed,
        "overrides": args.set, "params": params, "vocab_size": cfg.vocab_size,
        "corpus": {"python": corpus.python, "train_files": corpus.train_files,
                   "heldout_files": corpus.heldout_files, "source_bytes": corpus.source_bytes,
                   "train_tokens": int(len(corpus.train)), "heldout_tokens": int(len(corpus.heldout)),
                   "fingerprint": corpus.fingerprint(), "license": LICENSE},
        "heldout_eval_tokens": int(sum(b[:, 1:].size for b in held)),
        "heldout_loss": heldout_loss, "heldout_loss_mxfp4": heldout_mxfp4,
        "history": history,
    }
    if not args.no_serving_eval:
        result.update(serving_report(args.out, held, tokenizer))
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "TRAINING.md"), "w") as f:
        f.write(training_markdown(result))
    return result


def reproduce_argv(argv: list[str], steps: int) -> list[str]:
    """``argv`` with ``--time-budget`` replaced by the ``--steps`` it chose (the same schedule: the total is fixed
    before the warmup ends) and the output-only flags dropped."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--time-budget", "--steps", "--out", "--log-every"):
            skip = "=" not in a
            continue
        if name == "--no-serving-eval":
            continue
        out.append(a)
    return ["--out", "DIR", "--steps", str(steps)] + out


def serving_report(folder: str, held: list[np.ndarray], tokenizer) -> dict:
    """Held-out loss and greedy samples of the written checkpoint through ``kimi_jax.load``."""
    from kimi_jax.training.evaluate import serving_results

    found = serving_results(folder, held, tokenizer)
    _log(f"held-out loss (kimi_jax.load, bf16 + MXFP4 experts): {found['heldout_loss_serving']:.4f} nats/token")
    for prompt, text in found["samples"].items():
        _log(f"--- {prompt!r}\n{prompt}{text}")
    return found


def folder_mb(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 1e6


def main(argv=None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
