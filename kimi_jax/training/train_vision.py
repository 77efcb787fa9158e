"""Give a K3-architecture checkpoint eyes: train a small MoonViT tower + projector on drawn shapes, colours and
digits, fine-tuning the language model with it, and write a vision-language checkpoint.

    python -m kimi_jax.training.train_vision --base FOLDER --out FOLDER [--steps N] [--time-budget SECONDS] [...]

Data (``shapes.py``): scenes of 1-3 coloured squares / circles / triangles, or one digit, with one-word questions
("What colour is the square?" -> "red"), rendered as the server renders chat requests, thinking on or off. The
language model is trained too (a frozen code model cannot learn to answer), with a share of each batch rehearsing
text-only chat conversations (trained on scenes alone, the chat-tuned model answered every text prompt with a
colour or shape word). The result (MXFP4 experts as in the
base, the tower in bf16 as ``vision.safetensors``, the base's tokenizer) is evaluated on held-out scenes (another
seed) through the serving engine, greedy, with the server's default chat settings (thinking on); the accuracy per
question kind lands in ``vision_training.json`` and a section of ``TRAINING.md``, beside a text check: the
base's and the result's greedy replies to text-only chat prompts (vision training must not wreck chat).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shlex
import shutil
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kimi_jax
from kimi_jax.tokenizer import load_tokenizer
from kimi_jax.training import export
from kimi_jax.training.shapes import TASKS
from kimi_jax.training.trainer import Schedule
from kimi_jax.training.vision_data import make_batch, text_pool
from kimi_jax.training.vision_eval import evaluate, text_check, text_replies
from kimi_jax.training.vision_trainer import VisionTrainer
from kimi_jax.vision.config import VisionConfig
from kimi_jax.vision.tower import VisionModel
from kimi_jax.vision.weights import save_vision

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "generation_config.json")


def parse_args(argv=None) -> argparse.Namespace:
    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="K3-architecture checkpoint folder with a tokenizer")
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="train for about this many seconds: the step count is fitted to it (at most --steps)")
    ap.add_argument("--batch", type=int, default=64 if gpu else 4)
    ap.add_argument("--seq-len", type=int, default=192, help="tokens per row (the thinking-on prompt is ~170)")
    ap.add_argument("--thinking-share", type=float, default=0.75, help="rows rendered with thinking on")
    ap.add_argument("--text-rows", type=int, default=None,
                    help="rows per step rehearsing text-only chat conversations (train_chat's data of the train "
                         "split), so the fine-tuned language model keeps chatting (default: a quarter of --batch)")
    ap.add_argument("--text-seq-len", type=int, default=704, help="tokens per rehearsal row (conversations that fit)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the tower and projector")
    ap.add_argument("--lm-lr-scale", type=float, default=0.3, help="the language model's share of --lr")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compute-dtype", default="bfloat16" if gpu else "float32")
    ap.add_argument("--vision-hidden", type=int, default=128)
    ap.add_argument("--vision-layers", type=int, default=4)
    ap.add_argument("--vision-heads", type=int, default=4)
    ap.add_argument("--max-patches", type=int, default=64, help="largest patch grid (64: 16 tokens per image)")
    ap.add_argument("--eval-per-task", type=int, default=100, help="held-out questions of each kind")
    ap.add_argument("--log-every", type=int, default=50)
    return ap.parse_args(argv)


TIMING_STEPS = (10, 20)  # a time budget is fitted from the step time between these (past the compile)


def steps_within(seconds_left: float, seconds_per_step: float, done: int, cap: int) -> int:
    """Total steps that fit ``seconds_left`` after ``done`` steps, at most ``cap`` (the learning rate then decays
    to its floor by the end of the budget instead of being cut off at its peak)."""
    return max(done, min(cap, done + int(seconds_left / max(seconds_per_step, 1e-9))))


def rehearsal_pool(tokenizer, length: int, seed: int) -> list:
    """train_chat's conversations of the train-split standard-library names that fit a row of ``length``."""
    from kimi_jax.training.stdlib_docs import stdlib_entries
    from kimi_jax.training.transcripts import build_conversations

    train, _ = stdlib_entries()
    pool = text_pool(tokenizer, build_conversations(train, seed=seed), length)
    if not pool:
        raise ValueError(f"--text-seq-len {length}: no chat conversation fits a row; raise it or set --text-rows 0")
    return pool


def _prefetch(make, depth: int = 4):
    """Batches made on a background thread (drawing and rendering overlap the device steps)."""
    q: queue.Queue = queue.Queue(depth)

    def run():
        while True:
            q.put(make())

    threading.Thread(target=run, daemon=True).start()
    while True:
        yield q.get()


def write_checkpoint(args, lm, vision: VisionModel, out: str) -> None:
    exported = export.export_checkpoint(lm, out, dtype=jnp.bfloat16)
    del exported
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(args.base, name)) and not os.path.samefile(args.base, out):
            shutil.copy(os.path.join(args.base, name), os.path.join(out, name))
    save_vision(vision, out, dtype=jnp.bfloat16)


def _cell(text: str) -> str:
    """A reply as one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|") or "(empty)"


def report(args, out: str, result: dict) -> None:
    with open(os.path.join(out, "vision_training.json"), "w") as f:
        json.dump(result, f, indent=1)
    base_md = os.path.join(args.base, "TRAINING.md")
    text = open(base_md).read() if os.path.exists(base_md) and os.path.abspath(args.base) != os.path.abspath(out) \
        else (open(os.path.join(out, "TRAINING.md")).read() if os.path.exists(os.path.join(out, "TRAINING.md")) else "")
    text = text.split("\n## Vision\n")[0].rstrip() + "\n"
    acc, check = result["accuracy"], result["text_check"]
    rows = "\n".join(f"| {task} | {acc[task]:.1%} | {result['chance'][task]:.1%} |" for task in TASKS)
    text += (f"\n## Vision\n\nA MoonViT tower ({args.vision_layers} blocks, hidden {args.vision_hidden}, "
             f"{args.vision_heads} heads, patch 14, at most {args.max_patches} patches = "
             f"{args.max_patches // 4} tokens per image; {result['vision_parameters'] / 1e6:.2f}M parameters) and "
             f"projector trained with the language model by `{result['command']}`: {result['steps']} steps of "
             f"{args.batch} drawn scenes and {result['text_rows']} text-only chat conversations rehearsed ("
             f"{result['train_seconds']:.0f} s on {result['device']}), final loss "
             f"{result['final_loss']:.3f} nats per answer token.\n\nHeld-out accuracy ({args.eval_per_task} new "
             f"scenes per question, greedy through the serving engine, the server's default chat settings: "
             f"thinking on), against always giving the most common answer:\n\n"
             f"| question | accuracy | most common answer |\n|---|---|---|\n{rows}\n\n"
             f"Examples: {result['examples']}\n\n"
             f"Text chat after vision training (greedy, thinking on, {len(check['pairs'])} text-only prompts): "
             f"{check['same_reply']:.0%} answered exactly as the base checkpoint did; non-empty replies "
             f"{check['nonempty_base']:.0%} before, {check['nonempty_new']:.0%} after.\n\n"
             "| prompt | base | after vision training |\n|---|---|---|\n"
             + "".join(f"| {p['prompt']} | {_cell(p['base'])} | {_cell(p['new'])} |\n" for p in check['pairs']))
    with open(os.path.join(out, "TRAINING.md"), "w") as f:
        f.write(text)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.base)
    base_replies = text_replies(args.base)
    lm = export.dequantized_model(kimi_jax.load(args.base, "float32").model)
    vcfg = VisionConfig(text_hidden_size=lm.config.hidden_size, hidden_size=args.vision_hidden,
                        num_layers=args.vision_layers, num_heads=args.vision_heads,
                        intermediate_size=2 * args.vision_hidden, pos_emb_height=8, pos_emb_width=8,
                        max_patches=args.max_patches)
    vision = VisionModel(vcfg, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    trainer = VisionTrainer(lm, vision, compute_dtype=jnp.dtype(args.compute_dtype), lm_lr_scale=args.lm_lr_scale)
    rng = random.Random(args.seed)
    text_rows = args.batch // 4 if args.text_rows is None else args.text_rows
    text = rehearsal_pool(tokenizer, args.text_seq_len, args.seed) if text_rows else []
    batches = _prefetch(lambda: make_batch(rng, tokenizer, vcfg, lm.config.vocab_size, args.batch, args.seq_len,
                                           thinking_share=args.thinking_share, text_rows=text_rows,
                                           text_length=args.text_seq_len, text=text))
    schedule = Schedule(args.lr, args.warmup, args.steps)
    losses, step, marks = [], 0, {}
    train_start = time.perf_counter()
    while step < schedule.total:
        loss = trainer.step(next(batches), schedule(step))
        if args.time_budget is not None and step in TIMING_STEPS:
            marks[step] = (jax.block_until_ready(loss), time.perf_counter())[1]
            if len(marks) == 2:
                first, last = TIMING_STEPS
                total = steps_within(args.time_budget - (marks[last] - train_start),
                                     (marks[last] - marks[first]) / (last - first), last + 1, args.steps)
                schedule = Schedule(args.lr, args.warmup, total)
        if step % args.log_every == 0 or step + 1 == schedule.total:
            losses.append(float(loss))
            print(f"step {step:5d} loss {losses[-1]:.4f} {time.perf_counter() - train_start:6.1f}s", flush=True)
        step += 1
        if args.time_budget is not None and time.perf_counter() - train_start > args.time_budget:
            break
    step -= 1
    train_seconds = time.perf_counter() - train_start
    lm_trained, vision_trained = trainer.models()
    os.makedirs(args.out, exist_ok=True)
    write_checkpoint(args, lm_trained, vision_trained, args.out)
    accuracy, chance, examples = evaluate(args.out, seed=args.seed + 10_000, per_task=args.eval_per_task)
    text = text_check(base_replies, text_replies(args.out))
    result = dict(command="python -m kimi_jax.training.train_vision " + shlex.join(sys.argv[1:] if argv is None
                                                                                   else argv),
                  steps=step + 1, text_rows=text_rows, train_seconds=train_seconds, total_seconds=time.perf_counter() - start,
                  final_loss=float(trainer.grad_fn(trainer.params, jax.tree.map(jnp.asarray, next(batches)))[0]),
                  losses=losses, accuracy=accuracy, chance=chance, examples=examples, text_check=text,
                  vision_parameters=int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(vision_trained)))),
                  device=jax.devices()[0].device_kind)
    report(args, args.out, result)
    print(json.dumps({k: result[k] for k in ("steps", "final_loss", "accuracy", "chance", "total_seconds")}))
    print(json.dumps({k: v for k, v in text.items() if k != "pairs"}))
    return result


if __name__ == "__main__":
    main()
