"""Held-out accuracy of a vision-language checkpoint on freshly drawn scenes: greedy answers through
``kimi_jax.load`` of the written folder (the serving forward, MXFP4 experts, bf16 tower) with the server's
default chat settings (thinking on), parsed as the server parses them (K3 output parser, no reasoning split)."""

from __future__ import annotations

import collections
import random

import jax.numpy as jnp
import numpy as np

import kimi_jax
from kimi_jax.chat import K3OutputParser, encode_chat, render_k3
from kimi_jax.chat.media import MEDIA_PAD
from kimi_jax.tokenizer import load_tokenizer
from kimi_jax.training.shapes import TASKS, make_example
from kimi_jax.training.vision_data import prompt_ids
from kimi_jax.vision.preprocess import prepare_pil
from kimi_jax.vision.tower import image_rows

# Text-only chat prompts (no image) whose greedy replies are compared before and after vision training.
TEXT_PROMPTS = ("What does os.path.join do?", "Write a function that returns the sum of a list.", "Hello!",
                "What does json.dumps do?", "Explain what a Python generator is.", "What is 12 + 30?",
                "What does re.compile return?", "Write a class with an __init__ method.")
TEXT_NEW_TOKENS = 48
CHUNK = 64  # prompts decoded together
MAX_NEW_TOKENS = 24  # thinking on: the empty think channel, a one-word response and the closing markers take ~17


def answer_text(tokenizer, new_ids: list[int]) -> str:
    """The reply as a client reads `content`: parsed like the server (no reasoning parser), trimmed."""
    parser = K3OutputParser(thinking=True, split_reasoning=False)
    parser.feed(tokenizer.decode(new_ids))
    return (parser.finish().content or "").strip().rstrip(".").lower()


def evaluate(folder: str, *, seed: int, per_task: int, dtype: str | None = None
             ) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """-> (accuracy per question kind, share of the most common answer per kind, a few example lines)."""
    import jax

    lm = kimi_jax.load(folder, dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
    tokenizer = load_tokenizer(folder)
    pad, vocab = tokenizer.special_tokens[MEDIA_PAD], lm.config.vocab_size
    stop = tokenizer.special_tokens["<|end_of_msg|>"]
    rng = random.Random(seed)
    cases = [make_example(rng, task) for task in TASKS for _ in range(per_task)]
    correct, examples = collections.Counter(), []
    for i in range(0, len(cases), CHUNK):
        group = cases[i:i + CHUNK]
        images = [prepare_pil(c.image, lm.vision.config, b"") for c in group]
        rows = image_rows(lm.vision, images)
        prompts, offset = [], 0
        for case, image in zip(group, images):
            ids = np.asarray(prompt_ids(tokenizer, case.question, image, thinking=True))
            where = np.flatnonzero(ids == pad)
            ids[where] = vocab + offset + np.arange(len(where))
            offset += len(where)
            prompts.append(ids.tolist())
        outs = lm.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[stop], media=jnp.asarray(rows))
        for case, prompt, out in zip(group, prompts, outs):
            got = answer_text(tokenizer, out[len(prompt):])
            correct[case.task] += got == case.answer
            if sum(e.startswith(repr(case.question)) for e in examples) < 1 and len(examples) < 8:
                examples.append(f"{case.question!r} -> {got!r} (truth {case.answer!r})")
    accuracy = {task: correct[task] / per_task for task in TASKS}
    chance = {task: collections.Counter(c.answer for c in cases if c.task == task).most_common(1)[0][1] / per_task
              for task in TASKS}
    return accuracy, chance, examples


def text_replies(folder: str, prompts=TEXT_PROMPTS, dtype: str | None = None) -> list[str]:
    """Greedy replies (``content``, thinking on) of the folder's model to text-only chat prompts."""
    import jax

    lm = kimi_jax.load(folder, dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
    tokenizer = load_tokenizer(folder)
    ids = [encode_chat(tokenizer, render_k3([{"role": "user", "content": p}], thinking=True)) for p in prompts]
    outs = lm.generate(ids, max_new_tokens=TEXT_NEW_TOKENS, stop_token_ids=[tokenizer.special_tokens["<|end_of_msg|>"]])
    return [answer_text(tokenizer, out[len(i):]) for i, out in zip(ids, outs)]


def text_check(base_replies: list[str], new_replies: list[str], prompts=TEXT_PROMPTS) -> dict:
    """How far vision training moved text chat: share of prompts answered exactly as the base did, non-empty
    replies before / after, and each prompt's pair of replies."""
    return dict(same_reply=sum(a == b for a, b in zip(base_replies, new_replies)) / len(prompts),
                nonempty_base=sum(bool(a) for a in base_replies) / len(prompts),
                nonempty_new=sum(bool(b) for b in new_replies) / len(prompts),
                pairs=[dict(prompt=p, base=a, new=b) for p, a, b in zip(prompts, base_replies, new_replies)])
