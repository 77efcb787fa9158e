"""Shipped checkpoints' training reports: ``training.json`` -> ``TRAINING.md`` (the code-only ``tiny-code`` of
``train_tiny``; the chat-tuned ``tiny`` of ``train_chat``, marked ``"recipe": "chat"``)."""

from __future__ import annotations

import json
import math
import os


def training_markdown(r: dict) -> str:
    c = r["corpus"]
    lines = [
        "# The shipped `tiny-code` checkpoint (code only; the chat-tuned `tiny` starts from it)",
        "",
        "Kimi K3 architecture at toy size (KDA with the lower-bound gate, gated NoPE MLA, Block AttnRes, Stable "
        "LatentMoE with SiTU, MXFP4 routed experts), trained by `kimi_jax/training/train_tiny.py`.",
        "",
        f"* Command run: `{r['command']}`",
        f"* Reproduce (same schedule and data order): `{r['reproduce']}`",
        f"* Device: {r['device']}; layout `{r['layout']}`, compute {r['compute_dtype']}, fp32 master weights, "
        f"AdamW (lr {r['lr']}, warmup {r['warmup']}, cosine to {r['min_lr_ratio']}x, wd {r['weight_decay']}, "
        f"clip {r['clip']}), seed {r['seed']}",
        f"* Steps {r['steps']} x {r['batch']} x {r['seq_len']} tokens = {r['tokens_trained']:,} tokens trained; "
        f"training {r['train_seconds']:.0f} s ({r['median_step_ms']:.0f} ms/step), whole run {r['wall_seconds']:.0f} s",
        f"* Parameters: {r['params']['routed_experts']:,} in routed experts (MXFP4 in the checkpoint), "
        f"{r['params']['other']:,} others ({r['export_dtype']})",
        f"* Corpus: the Python {c['python']} standard library (`*.py` sources + their docstrings as prose), "
        f"licence {c['license']}; {c['train_files']} train / {c['heldout_files']} held-out files (split by file), "
        f"{c['train_tokens']:,} / {c['heldout_tokens']:,} tokens, fingerprint `{c['fingerprint']}`",
        "",
        f"Held-out loss in nats/token (uniform guessing: {math.log(r['vocab_size']):.2f}). \"First N\" = the first "
        "windows of the held-out stream, whose files follow in sorted path order; \"spread\" = windows evenly "
        "spaced over all held-out files:",
        "",
        "| model | loss |",
        "|---|---|",
        f"| trained, training forward ({r['compute_dtype']} compute, fp32 master weights), first "
        f"{r['heldout_eval_tokens']:,} | {r['heldout_loss']:.4f} |",
        f"| same with the routed experts MXFP4 round-tripped, first {r['heldout_eval_tokens']:,} "
        f"| {r['heldout_loss_mxfp4']:.4f} |",
    ]
    for suffix, where in (("", "first"), ("_spread", "spread")):
        if f"heldout_loss_serving{suffix}" in r:
            lines.append(f"| shipped checkpoint through `kimi_jax.load` ({r['serving_dtype']} + MXFP4 experts, "
                         f"serving forward on {r['serving_device']}), {where} "
                         f"{r[f'heldout_serving_tokens{suffix}']:,} | {r[f'heldout_loss_serving{suffix}']:.4f} |")
    if "samples" in r:
        lines += ["", "Greedy samples (prompt, then the model's continuation):", ""]
        for prompt, text in r["samples"].items():
            lines += ["```", prompt + text, "```"]
    return "\n".join(lines) + "\n"


APPENDED_SECTIONS = ("\n## Vision\n",)
"""Sections other scripts append to a TRAINING.md (``train_vision``); a rewrite keeps them."""


def update_report(folder: str, found: dict) -> None:
    """Merge ``found`` into ``folder/training.json`` and rewrite ``folder/TRAINING.md`` (keeping its appended
    sections)."""
    path = os.path.join(folder, "training.json")
    with open(path) as f:
        result = json.load(f)
    result.update(found)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    md_path = os.path.join(folder, "TRAINING.md")
    old = open(md_path).read() if os.path.exists(md_path) else ""
    starts = [old.find(s) for s in APPENDED_SECTIONS if s in old]
    kept = old[min(starts):] if starts else ""
    with open(md_path, "w") as f:
        f.write(markdown(result) + kept)


def markdown(r: dict) -> str:
    """The report of either recipe."""
    if r.get("recipe") == "chat":
        from kimi_jax.training.chat_report import chat_markdown

        return chat_markdown(r)
    return training_markdown(r)
