"""Chat-tune the code-only tiny model into the shipped ``tiny``: K3 XTML conversations about the standard library.

    python -m kimi_jax.training.train_chat --out DIR --time-budget SECONDS [--steps N] [...]

Starts from ``--init`` (default: the shipped ``tiny-code`` checkpoint), builds conversations from the docstrings and
signatures of the standard library's train-split files (:mod:`kimi_jax.training.transcripts`: questions, tool calls
with ``lookup_doc`` and ``calculator``, code, follow-ups, system prompts, short reasoning), renders and encodes them
as the server does (:mod:`kimi_jax.training.chat_batches`), mixes in windows of standard-library code, and trains
on assistant tokens (and the code) with the router bias balancing expert load (:mod:`kimi_jax.training.balance`).
Reports held-out losses (conversations about modules never trained on, held-out code) and expert load before and
after, quantises the routed experts to MXFP4 and writes a servable folder: ``config.json``, ``model.safetensors``,
the tokenizer, ``training.json`` and ``TRAINING.md``. ``python -m serve.bench.chat_eval DIR`` then serves it and
adds the chat figures (tool-call parse rate, empty answers, summary matches).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.training import export, loop
from kimi_jax.training.balance import load_summary
from kimi_jax.training.batches import eval_batches
from kimi_jax.training.chat_batches import ChatBatches, ConversationEncoder, PackedRows, pack_rows
from kimi_jax.training.corpus import LICENSE, token_stream
from kimi_jax.training.objective import split_params
from kimi_jax.training.report import markdown
from kimi_jax.training.stdlib_docs import stdlib_entries
from kimi_jax.training.train_tiny import count_params, folder_mb, reproduce_argv
from kimi_jax.training.transcripts import build_conversations
from kimi_jax.training.trainer import Trainer

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


def default_init() -> str:
    from kimi_jax.api import shipped_checkpoint

    return shipped_checkpoint("tiny-code")


def parse_args(argv=None) -> argparse.Namespace:
    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--init", default=None, help="checkpoint folder to start from (default: the shipped tiny-code)")
    ap.add_argument("--steps", type=int, default=None, help="total optimizer steps (upper bound with --time-budget)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds of training: the total step count is fixed after the first steps from their time")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--code-rows", type=int, default=3, help="rows of each batch that are standard-library code")
    ap.add_argument("--code-tokens", type=int, default=3_000_000, help="code tokens read for the code rows")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--balance-rate", type=float, default=1e-3,
                    help="router bias step per training step towards even expert load (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=("packed", "vmap"), default="vmap" if gpu else "packed")
    ap.add_argument("--compute-dtype", default="bfloat16" if gpu else "float32")
    ap.add_argument("--export-dtype", default="bfloat16")
    ap.add_argument("--heldout-percent", type=int, default=3)
    ap.add_argument("--stdlib-root", default=None, help="standard-library folder to read (default: this "
                                                        "interpreter's)")
    ap.add_argument("--eval-rows", type=int, default=64, help="held-out conversation rows evaluated")
    ap.add_argument("--eval-code-tokens", type=int, default=65536, help="held-out code targets evaluated")
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.init = args.init or default_init()
    if args.steps is None and args.time_budget is None:
        ap.error("give --steps, --time-budget or both")
    return args


def _log(msg: str) -> None:
    print(msg, flush=True)


@dataclasses.dataclass(frozen=True)
class ChatData:
    """Packed training rows, held-out rows and streams, and what they were made of."""

    rows: PackedRows
    heldout_rows: PackedRows
    code: np.ndarray
    heldout_code: np.ndarray
    summary: dict


def build_data(tokenizer, *, seq_len: int, seed: int, code_tokens: int, eval_code_tokens: int,
               heldout_percent: int = 3, root: str | None = None) -> ChatData:
    """Conversations of the train-split entries (packed, code in the gaps) and of the held-out ones (padded), the
    code stream for the code rows and the first held-out code."""
    train_entries, heldout_entries = stdlib_entries(heldout_percent=heldout_percent, root=root)
    encode = ConversationEncoder(tokenizer)
    code = token_stream(tokenizer, heldout=False, heldout_percent=heldout_percent, max_tokens=code_tokens,
                        root=root, seed=seed)
    heldout_code = token_stream(tokenizer, heldout=True, heldout_percent=heldout_percent,
                                max_tokens=eval_code_tokens + 1, root=root)
    packed = {}
    for name, entries, offset in (("train", train_entries, 0), ("heldout", heldout_entries, 1)):
        conversations = build_conversations(entries, seed=seed + offset)
        encoded = [encode(c) for c in conversations]
        rows = pack_rows(encoded, [c.kind for c in conversations], seq_len=seq_len, seed=seed + offset,
                         filler=code if name == "train" else None, pad_id=tokenizer.pad_token_id)
        packed[name] = (rows, len(entries), sum(len(t) for t, _ in encoded), sum(int(m.sum()) for _, m in encoded))
    summary = {"license": LICENSE, "code_tokens": int(len(code)), "seq_len": seq_len}
    for name, (rows, entries, tokens, learned) in packed.items():
        summary[name] = {"entries": entries, "conversations": rows.kinds, "tokens": tokens,
                         "assistant_tokens": learned, "rows": int(len(rows.tokens)), "dropped": rows.dropped}
    return ChatData(packed["train"][0], packed["heldout"][0], code, heldout_code, summary)


def _measure(trainer: Trainer, chat: list[tuple[np.ndarray, np.ndarray]], code: list[np.ndarray],
             params=None) -> dict:
    chat_loss, chat_load = trainer.measure([t for t, _ in chat], [w for _, w in chat], params=params)
    code_loss, code_load = trainer.measure(code, params=params)
    return {"chat_loss": chat_loss, "code_loss": code_loss, "expert_load": load_summary(chat_load + code_load)}


def _heldout_chat_batches(rows: PackedRows, batch: int, max_rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    count = min(len(rows.tokens), max(batch, max_rows))
    count -= count % batch
    if count == 0:
        raise ValueError(f"{len(rows.tokens)} held-out conversation rows; need at least batch={batch}")
    return [(rows.tokens[i: i + batch].astype(np.int32), rows.targets_weights(np.arange(i, i + batch)))
            for i in range(0, count, batch)]


def copy_tokenizer(init: str, out: str) -> None:
    """The tokenizer files of ``init`` (else the embedded tiny tokenizer's) into ``out``."""
    from kimi_jax.tokenizer.loader import TINY_TOKENIZER_DIR

    for name in TOKENIZER_FILES:
        source = os.path.join(init, name)
        shutil.copy(source if os.path.exists(source) else TINY_TOKENIZER_DIR / name, os.path.join(out, name))


def _tokenizer(init: str):
    from kimi_jax.tokenizer import load_tokenizer

    return load_tokenizer(init if os.path.exists(os.path.join(init, "tiktoken.model")) else "tiny")


def train(args: argparse.Namespace) -> dict:
    t_start = time.time()
    tokenizer = _tokenizer(args.init)
    data = build_data(tokenizer, seq_len=args.seq_len, seed=args.seed, code_tokens=args.code_tokens,
                      eval_code_tokens=args.eval_code_tokens, heldout_percent=args.heldout_percent,
                      root=args.stdlib_root)
    s = data.summary
    _log(f"data: {s['train']['entries']} train / {s['heldout']['entries']} held-out names, conversations "
         f"{s['train']['conversations']}, {s['train']['tokens']:,} tokens ({s['train']['assistant_tokens']:,} "
         f"assistant) in {s['train']['rows']} rows of {args.seq_len + 1}, {s['train']['dropped']} too long; "
         f"{len(data.code):,} code tokens ({time.time() - t_start:.0f}s)")

    model = export.trainable_model(args.init)
    cfg = model.config
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, model vocab is {cfg.vocab_size}")
    params = count_params(model)
    trainer = Trainer(model, layout=args.layout, compute_dtype=jnp.dtype(args.compute_dtype),
                      weight_decay=args.weight_decay, clip=args.clip, balance_rate=args.balance_rate)
    del model
    batches = ChatBatches(data.rows, data.code, batch=args.batch, code_rows=args.code_rows, seed=args.seed)
    held_chat = _heldout_chat_batches(data.heldout_rows, args.batch, args.eval_rows)
    held_code = eval_batches(data.heldout_code, batch=args.batch, seq_len=args.seq_len,
                             max_tokens=args.eval_code_tokens)
    tokens_per_step = args.batch * args.seq_len
    _log(f"device {jax.devices()[0].device_kind} ({jax.default_backend()}), layout {args.layout}, compute "
         f"{args.compute_dtype}, params {params}, {tokens_per_step} tokens/step, "
         f"{batches.steps_per_epoch} steps/epoch")
    before = _measure(trainer, held_chat, held_code)
    _log(f"before: held-out chat {before['chat_loss']:.4f}, code {before['code_loss']:.4f} nats/token, experts "
         f"max/mean {before['expert_load']['worst_max_over_mean']:.2f}")

    ran = loop.run(trainer, batches, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                   steps=args.steps, time_budget=args.time_budget, tokens_per_step=tokens_per_step,
                   log_every=args.log_every, log=_log)

    trained = trainer.model()
    after = _measure(trainer, held_chat, held_code)
    fake_q = split_params(export.fake_quantized_experts(trained))[1]
    after["chat_loss_mxfp4"] = trainer.measure([t for t, _ in held_chat], [w for _, w in held_chat],
                                               params=fake_q)[0]
    _log(f"after: held-out chat {after['chat_loss']:.4f} ({after['chat_loss_mxfp4']:.4f} with MXFP4 experts), "
         f"code {after['code_loss']:.4f} nats/token, experts max/mean "
         f"{after['expert_load']['worst_max_over_mean']:.2f}")
    export.export_checkpoint(trained, args.out, dtype=jnp.dtype(args.export_dtype))
    copy_tokenizer(args.init, args.out)
    _log(f"wrote {args.out} ({folder_mb(args.out):.1f} MB)")

    result = {
        "recipe": "chat",
        "command": "python -m kimi_jax.training.train_chat " + shlex.join(args.argv),
        "reproduce": "python -m kimi_jax.training.train_chat " + shlex.join(reproduce_argv(args.argv, ran.steps)),
        "init": os.path.basename(os.path.normpath(args.init)),
        "steps": ran.steps, "tokens_trained": ran.steps * tokens_per_step, "train_seconds": ran.train_seconds,
        "wall_seconds": time.time() - t_start, "median_step_ms": ran.median_step_ms,
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "layout": args.layout, "compute_dtype": args.compute_dtype, "export_dtype": args.export_dtype,
        "batch": args.batch, "seq_len": args.seq_len, "code_rows": args.code_rows, "lr": args.lr,
        "warmup": args.warmup, "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay,
        "clip": args.clip, "balance_rate": args.balance_rate, "seed": args.seed, "params": params,
        "vocab_size": cfg.vocab_size, "data": data.summary,
        "heldout_chat_targets": int(sum(w.sum() for _, w in held_chat)),
        "heldout_code_targets": int(sum(b[:, 1:].size for b in held_code)),
        "before": before, "after": after, "history": ran.history,
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "TRAINING.md"), "w") as f:
        f.write(markdown(result))
    return result


def main(argv=None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
