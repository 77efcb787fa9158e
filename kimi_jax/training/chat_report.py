"""``TRAINING.md`` of a ``train_chat`` checkpoint, with the served-chat figures of ``serve.bench.chat_eval`` when
they are in its ``training.json`` (key ``chat_eval``: ``rows`` of (figure, value) and ``samples`` of text)."""

from __future__ import annotations

import math


def _kinds(counts: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in counts.items())


def _load_rows(before: dict, after: dict) -> list[str]:
    rows = ["| MoE layer | busiest / mean, before | after | idlest / mean, before | after | CV before | after |",
            "|---|---|---|---|---|---|---|"]
    b, a = before["per_layer"], after["per_layer"]
    for i in range(len(b["cv"])):
        rows.append(f"| {i} | {b['max_over_mean'][i]:.2f} | {a['max_over_mean'][i]:.2f} | {b['min_over_mean'][i]:.2f} "
                    f"| {a['min_over_mean'][i]:.2f} | {b['cv'][i]:.3f} | {a['cv'][i]:.3f} |")
    return rows


def chat_markdown(r: dict) -> str:
    d, before, after = r["data"], r["before"], r["after"]
    train, held = d["train"], d["heldout"]
    lines = [
        "# The shipped `tiny` checkpoint: chat-tuned",
        "",
        f"`{r['init']}` (the code-only model) fine-tuned on K3 XTML conversations by "
        "`kimi_jax/training/train_chat.py`: questions about standard-library names answered with their summary "
        "line, `lookup_doc` and `calculator` tool calls with their results and answers, code, follow-ups, system "
        "prompts and short reasoning, rendered and encoded by the server's own renderer and tokenizer, loss on "
        "assistant tokens only, plus standard-library code rows so completions keep working.",
        "",
        f"* Command run: `{r['command']}`",
        f"* Reproduce (same schedule and data order): `{r['reproduce']}`",
        f"* Device: {r['device']}; layout `{r['layout']}`, compute {r['compute_dtype']}, fp32 master weights, "
        f"AdamW (lr {r['lr']}, warmup {r['warmup']}, cosine to {r['min_lr_ratio']}x, wd {r['weight_decay']}, "
        f"clip {r['clip']}), router bias balancing rate {r['balance_rate']}, seed {r['seed']}",
        f"* Steps {r['steps']} x {r['batch']} x {r['seq_len']} tokens ({r['code_rows']} code rows per batch) = "
        f"{r['tokens_trained']:,} tokens; training {r['train_seconds']:.0f} s ({r['median_step_ms']:.0f} ms/step), "
        f"whole run {r['wall_seconds']:.0f} s",
        f"* Data (licence {d['license']}): {train['entries']:,} documented names of the train-split files; "
        f"conversations {_kinds(train['conversations'])}; {train['tokens']:,} tokens, of them "
        f"{train['assistant_tokens']:,} assistant tokens (the loss), in {train['rows']:,} rows "
        f"({train['dropped']} conversations longer than a row left out); {d['code_tokens']:,} code tokens",
        f"* Held out: {held['entries']:,} names of the files never trained on (split by file, as in pre-training), "
        f"{_kinds(held['conversations'])}",
        "",
        f"Held-out loss in nats/token (uniform guessing: {math.log(r['vocab_size']):.2f}); conversations: "
        f"{r['heldout_chat_targets']:,} assistant targets, code: the first {r['heldout_code_targets']:,} targets "
        "of the held-out stream (as in `tiny-code`'s report):",
        "",
        "| model | conversations | code |",
        "|---|---|---|",
        f"| `{r['init']}` (start) | {before['chat_loss']:.4f} | {before['code_loss']:.4f} |",
        f"| chat-tuned, training forward | {after['chat_loss']:.4f} | {after['code_loss']:.4f} |",
        f"| same with the routed experts MXFP4 round-tripped | {after['chat_loss_mxfp4']:.4f} | |",
        "",
        "Expert load over the held-out batches ((token, choice) pairs per routed expert, per MoE layer; even load "
        f"is 1.00 / 1.00 / 0): worst busiest/mean {before['expert_load']['worst_max_over_mean']:.2f} -> "
        f"{after['expert_load']['worst_max_over_mean']:.2f}, mean CV {before['expert_load']['mean_cv']:.3f} -> "
        f"{after['expert_load']['mean_cv']:.3f}.",
        "",
        *_load_rows(before["expert_load"], after["expert_load"]),
    ]
    served = r.get("chat_eval")
    if served:
        lines += ["", f"Served chat (`{served['command']}`, {served['device']}):", "", "| figure | value |",
                  "|---|---|", *(f"| {name} | {value} |" for name, value in served["rows"])]
        for sample in served["samples"]:
            lines += ["", "```", sample, "```"]
    return "\n".join(lines) + "\n"
