"""Chat-formatted training rows for the vision-language fine-tune, rendered exactly as the server renders
requests (``render_k3`` -> ``expand_media`` -> ``encode_chat``), so training and serving see the same ids.

A row is the conversation [user: image + question, assistant: answer] with thinking on or off; the loss covers
the assistant's turn after the generation prompt (its empty think channel, the response, the closing markers).
Rehearsal rows (``text_pool``) are text-only chat conversations of the base's own training data with their
assistant-token mask, in rows of their own length (tool conversations run to ~700 tokens, a scene row to ~190), so
the fine-tuned language model keeps chatting.
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


@partial(jax.tree_util.register_dataclass, data_fields=["tokens", "targets", "mask", "images", "text_tokens",
                                                        "text_targets", "text_mask"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class VisionBatch:
    """tokens [B, T] int32 (placeholders as ``vocab + j``, j the image token), targets [B, T], mask [B, T] f32
    (1 on assistant-turn targets), images (ImageBatch of B images, L = max_patches); the rehearsal rows
    text_tokens / text_targets / text_mask [Bt, Tt] (Bt may be 0)."""

    tokens: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    images: ImageBatch
    text_tokens: np.ndarray
    text_targets: np.ndarray
    text_mask: np.ndarray


def text_pool(tokenizer: Tokenizer, conversations, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids [N], learned mask [N]) of the conversations that fit a row of ``length`` tokens (N <= length + 1)."""
    from kimi_jax.training.chat_batches import ConversationEncoder

    encode = ConversationEncoder(tokenizer)
    return [(ids, learned) for ids, learned in map(encode, conversations) if len(ids) <= length + 1]


def make_batch(rng: random.Random, tokenizer: Tokenizer, cfg: VisionConfig, vocab: int, batch: int, length: int,
               *, thinking_share: float = 0.75, text_rows: int = 0, text_length: int = 0,
               text: list[tuple[np.ndarray, np.ndarray]] = ()) -> VisionBatch:
    """``batch`` fresh scene rows padded / cut to ``length`` tokens, and ``text_rows`` conversations drawn from
    ``text`` (a :func:`text_pool` of ``text_length``)."""
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
    text_tokens = np.zeros((text_rows, text_length + 1), np.int32)
    text_mask = np.zeros((text_rows, text_length), np.float32)
    for b in range(text_rows):
        ids, learned = text[rng.randrange(len(text))]
        text_tokens[b, :len(ids)] = ids
        text_mask[b, :len(ids) - 1] = learned[1:]
    return VisionBatch(tokens[:, :-1], np.where(tokens[:, 1:] >= vocab, 0, tokens[:, 1:]), mask,
                       pack_images(images, batch, cfg.max_patches, cfg), text_tokens[:, :-1], text_tokens[:, 1:],
                       text_mask)
