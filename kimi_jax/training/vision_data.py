"""Chat-formatted training rows for the vision-language fine-tune, rendered exactly as the server renders
requests (``render_k3`` -> ``expand_media`` -> ``encode_chat``), so training and serving see the same ids.

A row is the conversation [user: image + question, assistant: answer] with thinking on or off; the loss covers
the assistant's turn after the generation prompt (its empty think channel, the response, the closing markers).
"""

from __future__ import annotations

import dataclasses
import random
from functools import partial

import jax
import numpy as np

from kimi_jax.chat import encode_chat, render_k3
from kimi_jax.chat.media import MEDIA_PAD, expand_media
from kimi_jax.tokenizer import Tokenizer
from kimi_jax.training.shapes import Example, make_example
from kimi_jax.vision.config import VisionConfig
from kimi_jax.vision.preprocess import PreparedImage, prepare_pil
from kimi_jax.vision.tower import ImageBatch, pack_images


def question_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "image"}},
                                         {"type": "text", "text": question}]}]


def prompt_ids(tokenizer: Tokenizer, question: str, image: PreparedImage, thinking: bool) -> list[int]:
    """The generation prompt of a question about ``image`` (what the server feeds the engine)."""
    return encode_chat(tokenizer, expand_media(render_k3(question_messages(question), thinking=thinking), [image]))


def row_ids(tokenizer: Tokenizer, example: Example, image: PreparedImage, thinking: bool) -> tuple[list[int], int]:
    """(ids of the whole conversation, length of its generation prompt)."""
    messages = question_messages(example.question) + [{"role": "assistant", "content": example.answer}]
    ids = encode_chat(tokenizer, expand_media(render_k3(messages, thinking=thinking, add_generation_prompt=False),
                                              [image]))
    prompt = prompt_ids(tokenizer, example.question, image, thinking)
    assert ids[:len(prompt)] == prompt, "the generation prompt must prefix the rendered turn"
    return ids, len(prompt)


@partial(jax.tree_util.register_dataclass, data_fields=["tokens", "targets", "mask", "images"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class VisionBatch:
    """tokens [B, T] int32 (placeholders as ``vocab + j``, j the image token), targets [B, T], mask [B, T] f32
    (1 on assistant-turn targets), images (ImageBatch of B images, L = max_patches)."""

    tokens: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    images: ImageBatch


def make_batch(rng: random.Random, tokenizer: Tokenizer, cfg: VisionConfig, vocab: int, batch: int, length: int,
               *, thinking_share: float = 0.75) -> VisionBatch:
    """``batch`` fresh examples padded / cut to ``length`` tokens."""
    pad_id = tokenizer.special_tokens[MEDIA_PAD]
    tokens = np.zeros((batch, length + 1), np.int32)
    mask = np.zeros((batch, length), np.float32)
    images = []
    for b in range(batch):
        example = make_example(rng)
        image = prepare_pil(example.image, cfg, b"")
        ids, start = row_ids(tokenizer, example, image, rng.random() < thinking_share)
        ids = np.asarray(ids[:length + 1], np.int32)
        pads = np.flatnonzero(ids == pad_id)
        ids[pads] = vocab + np.arange(len(pads))
        tokens[b, :len(ids)] = ids
        mask[b, start - 1:len(ids) - 1] = 1.0
        images.append(image)
    return VisionBatch(tokens[:, :-1], np.where(tokens[:, 1:] >= vocab, 0, tokens[:, 1:]), mask,
                       pack_images(images, batch, cfg.max_patches, cfg))
