"""Train a DSpark block drafter for a target checkpoint and write it beside the target.

    python -m kimi_jax.training.train_drafter --out kimi_jax/assets/tiny-dspark --steps N [--time-budget S]

The engine's default drafter for a target ``T`` (``--speculative-config '{"method": "dspark", ...}'`` without
``model``) is the folder ``T-dspark`` beside it: ``kimi_jax/assets/tiny-dspark`` for the preset ``tiny``,
``DIR-dspark`` for a checkpoint folder ``DIR``.

The target (default: the shipped ``tiny``) stays frozen. Every step runs it over packed windows of the training
corpus with its residual stream tapped at ``--taps`` (``forward(..., taps=...)``, the serving forward), then trains
the drafter through the serving drafter functions (``kimi_jax.drafter``): the fused taps are cached as context
latents in paged draft layers, and blocks anchored at page boundaries (their first row the true token at the
anchor, the rest mask rows) run over that context. Mask row ``i`` at position ``P + i`` learns the target's
distribution for that position (KL to the target's logits at ``P + i - 1``), its Markov head sees the true token
before it, and the confidence head learns (binary cross-entropy) whether the row's argmax is the target's.

Evaluation (held-out files, never trained on): the target's own greedy continuation of held-out prompts is the
sequence a greedy speculative engine would produce; at each block anchor the drafter drafts with its Markov head
chained on its own drafts, and the acceptance length is 1 + the drafts that match that continuation before the
first miss, exactly what verification at temperature 0 accepts. Writes ``config.json`` + ``model.safetensors`` +
``training.json`` + ``TRAINING.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kimi_jax.drafter import (DSparkConfig, DSparkDrafter, block_hidden, block_step, confidence, fuse_taps,
                              markov_bias, write_context)
from kimi_jax.layers.common import rms_norm
from kimi_jax.model import KimiModel, compute_logits, forward
from kimi_jax.step import StepInputs, dense_step, init_cache, token_layout
from kimi_jax.training.batches import PackedBatches, eval_batches
from kimi_jax.training.corpus import load_or_build
from kimi_jax.training.trainer import Schedule

PAGE = 16  # the training pages: one private page per block (block_size <= PAGE)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="tiny", help="a preset with a shipped checkpoint, or a checkpoint folder")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds of training (caps --steps)")
    ap.add_argument("--taps", default="1,4,7", help="0-indexed target layers to tap, comma-separated")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=8, help="blocks per window")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-new", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=20)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.steps is None and args.time_budget is None:
        ap.error("give --steps, --time-budget or both")
    if args.block_size > PAGE:
        ap.error(f"--block-size must be <= {PAGE}")
    if args.eval_new <= args.block_size:
        ap.error(f"--eval-new must exceed --block-size ({args.block_size}): held-out blocks need a full "
                 "continuation after the prompt")
    return args


def target_pass(model: KimiModel, tokens: jax.Array, taps: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """tokens [B, T] as fresh sequences -> (logits [B*T, V] f32, taps [n_taps, B*T, D] f32), no gradient."""
    b, t = tokens.shape
    fields = dense_step(b, t, block_size=PAGE)
    fields["logits_indices"] = np.arange(b * t, dtype=np.int32)
    step = StepInputs(token_ids=tokens.reshape(-1), **{k: jnp.asarray(v) for k, v in fields.items()})
    cache = init_cache(model.config, num_blocks=1 + b * (-(-t // PAGE)), block_size=PAGE, num_slots=1 + b,
                       dtype=model.dtype)
    aux = {}
    hidden, _ = forward(model, cache, step, taps=taps, aux=aux)
    return jax.lax.stop_gradient(compute_logits(model, hidden)), jax.lax.stop_gradient(aux["taps"])


def context_and_blocks(drafter: DSparkDrafter, embed: jax.Array, taps: jax.Array, tokens: jax.Array,
                       anchors: jax.Array):
    """The drafter's training forward: context latents of every row, then one block per anchor.

    embed: the target's embedding; tokens [B, T]; anchors [B, A] page-aligned positions with
    ``anchor + block_size <= T``.
    -> (hidden [B*A, block_size, D], first tokens [B*A], the anchors flattened)."""
    b, t = tokens.shape
    a = anchors.shape[1]
    bs = drafter.config.block_size
    pages_per_seq = -(-t // PAGE)
    cfg = drafter.target_config
    fields = dense_step(b, t, block_size=PAGE)
    step = StepInputs(token_ids=tokens.reshape(-1), **{k: jnp.asarray(v) for k, v in fields.items()})
    num_blocks = 1 + b * pages_per_seq + b * a
    pages = jnp.zeros((drafter.config.num_layers, num_blocks, PAGE, cfg.mla_cache_width), drafter.fc.dtype)
    fused = fuse_taps(drafter, taps, impl="reference")
    pages, _ = write_context(drafter, pages, None, fused, step, token_layout(step), 0, impl="reference")
    seq = jnp.repeat(jnp.arange(b), a)
    pos = anchors.reshape(-1)
    width = pages_per_seq + 1
    j = jnp.arange(width)[None, :]
    context_pages = 1 + seq[:, None] * pages_per_seq + j
    private = 1 + b * pages_per_seq + jnp.arange(b * a)
    tables = jnp.where(j < (pos // PAGE)[:, None], context_pages,
                       jnp.where(j == (pos // PAGE)[:, None], private[:, None], 0)).astype(jnp.int32)
    first = tokens[seq, pos]
    bstep = block_step(first, pos, tables, bs)
    hidden, _, _ = block_hidden(drafter, embed, pages, None, bstep, 0, impl="reference")
    return hidden.reshape(b * a, bs, -1), first, pos


def block_logits(drafter: DSparkDrafter, target: KimiModel, hidden: jax.Array, previous: jax.Array) -> jax.Array:
    """hidden [N, B, D] -> the drafter's logits [N, B-1, V] for mask rows 1..B-1, given ``previous [N, B-1]``
    (the token before each row, for the Markov head)."""
    normed = rms_norm(hidden[:, 1:], drafter.norm[...], target.config.rms_norm_eps)
    return compute_logits(target, normed) + markov_bias(drafter, previous)


def make_loss(graphdef, target: KimiModel):
    def loss(params, taps, teacher_logits, tokens, anchors):
        drafter = nnx.merge(graphdef, params)
        hidden, _, pos = context_and_blocks(drafter, target.embed[...], taps, tokens, anchors)
        n, bs, _ = hidden.shape
        b, t = tokens.shape
        seq = jnp.repeat(jnp.arange(b), anchors.shape[1])
        offs = jnp.arange(1, bs)
        previous = tokens[seq[:, None], pos[:, None] + offs - 1]  # true token before each mask row
        logits = block_logits(drafter, target, hidden, previous)  # [N, B-1, V]
        teacher = teacher_logits.reshape(b, t, -1)[seq[:, None], pos[:, None] + offs - 1]  # predicts P + i
        p = jax.nn.softmax(teacher, -1)
        kl = jnp.sum(p * (jax.nn.log_softmax(teacher, -1) - jax.nn.log_softmax(logits, -1)), -1)
        hit = (jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32)
        c = jnp.clip(confidence(drafter, hidden[:, 1:]), 1e-6, 1 - 1e-6)
        bce = -(hit * jnp.log(c) + (1 - hit) * jnp.log(1 - c))
        return jnp.mean(kl) + 0.1 * jnp.mean(bce), (jnp.mean(kl), jnp.mean(hit))

    return loss


def random_anchors(rng: np.random.Generator, batch: int, seq_len: int, count: int, block_size: int) -> np.ndarray:
    """Page-aligned anchors (each block fits its window, and at least one page of context precedes it)."""
    choices = np.arange(PAGE, seq_len - block_size + 1, PAGE)
    return np.stack([rng.choice(choices, size=count, replace=len(choices) < count) for _ in range(batch)]
                    ).astype(np.int32)


def acceptance(drafter: DSparkDrafter, target: KimiModel, sequences: np.ndarray, prompt_len: int) -> dict:
    """Greedy acceptance on target-generated continuations ``sequences [B, T]`` (prompt then the target's greedy
    tokens): mean tokens per verification step and the per-position acceptance rate of the drafts."""
    k = drafter.config.num_drafts
    b, t = sequences.shape
    anchors = np.arange(-(-prompt_len // PAGE) * PAGE, t - k - 1, PAGE, dtype=np.int32)
    if not len(anchors):
        raise ValueError(f"sequences of {t} tokens after a {prompt_len}-token prompt hold no block of {k} drafts")
    anchors = np.broadcast_to(anchors, (b, len(anchors)))
    tokens = jnp.asarray(sequences)
    _, taps = target_pass(target, tokens, drafter.config.target_layer_ids)
    hidden, first, pos = context_and_blocks(drafter, target.embed[...], taps, tokens, jnp.asarray(anchors))
    normed = rms_norm(hidden, drafter.norm[...], target.config.rms_norm_eps)
    base = compute_logits(target, normed)
    previous, drafts = first, []
    for i in range(1, k + 1):  # the drafter's own chain, as at serving time
        x = jnp.argmax(base[:, i] + markov_bias(drafter, previous), -1).astype(jnp.int32)
        drafts.append(x)
        previous = x
    drafts = np.asarray(jnp.stack(drafts, 1))
    seq = np.repeat(np.arange(b), anchors.shape[1])
    truth = np.asarray(sequences)[seq[:, None], np.asarray(pos)[:, None] + np.arange(1, k + 1)]
    matches = np.cumprod(drafts == truth, axis=1)
    return {"mean_acceptance_length": float(1 + matches.sum(1).mean()),
            "acceptance_per_position": [float(x) for x in matches.mean(0)], "blocks": int(len(seq))}


def train(args: argparse.Namespace) -> dict:
    import kimi_jax
    from kimi_jax.tokenizer import load_tokenizer
    from kimi_jax.weights.drafter_io import save_drafter

    t0 = time.time()
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    lm = kimi_jax.load(args.target, dtype)
    target = lm.model
    tokenizer = load_tokenizer(args.target if os.path.isdir(args.target) else "tiny")
    corpus = load_or_build(args.corpus, tokenizer)
    cfg = DSparkConfig(target_layer_ids=tuple(int(x) for x in args.taps.split(",")), num_layers=args.layers,
                       block_size=args.block_size, markov_rank=args.markov_rank)
    drafter = DSparkDrafter(cfg, target.config, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(drafter, nnx.Param)
    total = args.steps or 10**9
    schedule = Schedule(args.lr, args.warmup, total)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.inject_hyperparams(optax.adamw)(learning_rate=args.lr, weight_decay=0.01))
    opt_state = opt.init(params)
    loss_fn = make_loss(graphdef, target)

    @jax.jit
    def update(params, opt_state, tokens, anchors, lr):
        logits, taps = target_pass(target, tokens, cfg.target_layer_ids)
        (value, (kl, hit)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, taps, logits, tokens, anchors)
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, kl, hit

    data = PackedBatches(corpus.train, batch=args.batch, seq_len=args.seq_len, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    log, step, start = [], 0, time.time()
    while step < total:
        batch = data(step)[:, :-1]
        anchors = random_anchors(rng, args.batch, args.seq_len, args.anchors, cfg.block_size)
        params, opt_state, value, kl, hit = update(params, opt_state, jnp.asarray(batch), jnp.asarray(anchors),
                                                   jnp.float32(schedule(step)))
        step += 1
        if step % args.log_every == 0 or step == 1:
            row = {"step": step, "loss": float(value), "kl": float(kl), "top1_agreement": float(hit),
                   "seconds": round(time.time() - start, 1)}
            log.append(row)
            print(json.dumps(row), flush=True)
        if args.time_budget and time.time() - start > args.time_budget:
            break
    train_seconds = time.time() - start
    drafter = nnx.merge(graphdef, params)

    held = eval_batches(corpus.heldout, batch=args.eval_prompts, seq_len=64, max_tokens=None, spread=True)[0]
    prompts = [list(map(int, row[:32])) for row in held]
    outs = lm.generate(prompts, max_new_tokens=args.eval_new, stop_token_ids=[])
    sequences = np.asarray([o[:32 + args.eval_new] for o in outs], np.int32)
    evaluation = acceptance(drafter, target, sequences, 32)
    print(json.dumps({"heldout": evaluation}), flush=True)
    save_drafter(drafter, args.out)
    result = {"command": "python -m kimi_jax.training.train_drafter " + " ".join(args.argv),
              "device": jax.devices()[0].device_kind, "target": args.target, "config": cfg.to_dict(),
              "steps": step, "batch": args.batch, "seq_len": args.seq_len, "anchors": args.anchors,
              "train_seconds": round(train_seconds, 1), "wall_seconds": round(time.time() - t0, 1),
              "log": log, "heldout": evaluation}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "TRAINING.md"), "w") as f:
        f.write(report(result))
    return result


def report(r: dict) -> str:
    e = r["heldout"]
    per_pos = ", ".join(f"{x:.2f}" for x in e["acceptance_per_position"])
    return "\n".join([
        f"# The DSpark drafter of `{os.path.basename(os.path.normpath(r['target']))}`", "",
        f"Trained by `{r['command']}` on {r['device']}: {r['steps']} steps x {r['batch']} windows x "
        f"{r['seq_len']} tokens ({r['anchors']} blocks per window), {r['train_seconds']:.0f} s.",
        f"Architecture: {json.dumps(r['config'])}.", "",
        "Held-out greedy acceptance (the target's own greedy continuations of prompts from files never trained on; "
        "what verification at temperature 0 accepts):", "",
        f"* mean tokens per verification step: **{e['mean_acceptance_length']:.2f}** over {e['blocks']} blocks",
        f"* acceptance by draft position: {per_pos}", "",
    ])


if __name__ == "__main__":
    train(parse_args())
