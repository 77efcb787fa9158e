"""Evaluate a checkpoint through the serving path: held-out loss via ``KimiLM.logits`` and greedy samples.

``python -m kimi_jax.training.evaluate CHECKPOINT [--corpus corpus.npz] [--eval-tokens N] [--update-report]``
loads the folder with :func:`kimi_jax.load` (the same loader, paged packed-step forward and ops as
``kimi-jax serve``) and prints the held-out loss in nats/token and greedy continuations of a few Python-ish
prompts. ``--update-report`` adds both to the folder's ``training.json`` and rewrites its ``TRAINING.md``
(for a run trained with ``train_tiny --no-serving-eval``, e.g. on a GPU host without the serving stack).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from kimi_jax.training.report import update_report

SAMPLE_PROMPTS = ("def ", "import ", '"""Return the', "class ", "    def __init__(self", "for i in range(")


def serving_heldout_loss(lm, batches: list[np.ndarray]) -> float:
    """Mean nats/token of ``batches`` (each ``[B, T + 1]``) through ``lm.logits``."""
    total, count = 0.0, 0
    for batch in batches:
        logits = np.asarray(lm.logits(batch[:, :-1]), np.float64)
        targets = batch[:, 1:]
        top = logits.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
        picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        total += float((lse - picked).sum())
        count += targets.size
    return total / count


def greedy_samples(lm, tokenizer, prompts=SAMPLE_PROMPTS, *, max_new_tokens: int = 48) -> dict[str, str]:
    """prompt -> greedy continuation text (stops at the tokenizer's eos ids)."""
    ids = [tokenizer.encode(p) for p in prompts]
    outs = lm.generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=list(tokenizer.eos_token_ids))
    return {p: tokenizer.decode(o[len(i):]) for p, i, o in zip(prompts, ids, outs)}


def serving_results(folder: str, batches: list[np.ndarray], tokenizer, *, dtype: str = "bfloat16",
                    max_new_tokens: int = 48, spread: bool = False) -> dict:
    """Held-out loss over ``batches`` and greedy samples of the checkpoint ``folder`` through ``kimi_jax.load``.

    Keys ``heldout_loss_serving``, ``heldout_serving_tokens`` (suffixed ``_spread`` for evenly spread windows),
    ``serving_dtype``, ``serving_device``, ``samples``."""
    import jax

    from kimi_jax import load

    lm = load(folder, dtype=dtype)
    suffix = "_spread" if spread else ""
    return {f"heldout_loss_serving{suffix}": serving_heldout_loss(lm, batches),
            f"heldout_serving_tokens{suffix}": int(sum(b[:, 1:].size for b in batches)), "serving_dtype": dtype,
            "serving_device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
            "samples": greedy_samples(lm, tokenizer, max_new_tokens=max_new_tokens)}


def main(argv=None) -> None:
    from kimi_jax.tokenizer import load_tokenizer
    from kimi_jax.training.batches import eval_batches
    from kimi_jax.training.corpus import load_or_build

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--corpus", help="saved corpus .npz (built from this interpreter's stdlib when missing)")
    ap.add_argument("--heldout-percent", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=65536, help="0 = the whole held-out stream")
    ap.add_argument("--spread", action="store_true",
                    help="evaluate windows evenly spaced over the held-out stream instead of the first ones")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--update-report", action="store_true",
                    help="merge the results into CHECKPOINT/training.json and rewrite CHECKPOINT/TRAINING.md")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer("tiny")
    corpus = load_or_build(args.corpus, tokenizer, heldout_percent=args.heldout_percent)
    batches = eval_batches(corpus.heldout, batch=args.batch, seq_len=args.seq_len,
                           max_tokens=args.eval_tokens or None, spread=args.spread)
    found = serving_results(args.checkpoint, batches, tokenizer, dtype=args.dtype,
                            max_new_tokens=args.max_new_tokens, spread=args.spread)
    print(json.dumps(found, indent=1))
    if args.update_report:
        update_report(args.checkpoint, found)


if __name__ == "__main__":
    main()
