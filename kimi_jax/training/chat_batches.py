"""Conversations -> token ids with a mask of what the model learns -> packed training rows.

:func:`encode_conversation` renders with :func:`kimi_jax.chat.render_k3` and encodes segment by segment with
:func:`kimi_jax.chat.encode_chat`, the server's path, so training and serving see the same ids. The mask is 1 on
each assistant turn after its generation prompt (``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>``,
which the server writes itself) up to and including its ``<|end_of_msg|>``: the loss covers assistant tokens only.

:func:`pack_rows` fills rows of ``T + 1`` tokens with whole conversations, each row starting with one (a
conversation never straddles two rows, so every one is seen from its first token, as served), and fills the rest of
a row with code from a token stream (learned, except its first token) or with padding (not learned).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kimi_jax.chat import Segment, encode_chat, render_k3
from kimi_jax.chat.render_k3 import END_OF_MSG
from kimi_jax.training.batches import PackedBatches
from kimi_jax.training.transcripts import Conversation

END_OF_TURN = Segment(END_OF_MSG, True)


def _render(conv: Conversation, messages: list[dict], prompt: bool):
    return render_k3(messages, tools=conv.tools, thinking=conv.thinking, reasoning_effort=conv.reasoning_effort,
                     add_generation_prompt=prompt)


class ConversationEncoder:
    """:func:`encode_conversation` with a cache of segment encodings (markers, tag names and system messages
    repeat across conversations; BPE never merges across segments, so caching per segment is exact)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[Segment, list[int]] = {}

    def _ids(self, segment: Segment) -> list[int]:
        ids = self._cache.get(segment)
        if ids is None:
            ids = self._cache[segment] = encode_chat(self.tokenizer, [segment])
        return ids

    def __call__(self, conv: Conversation) -> tuple[np.ndarray, np.ndarray]:
        """(ids uint16 [N], mask uint8 [N]) of a whole conversation; mask 1 on the assistant turns' own tokens.

        An assistant turn starts where the server's generation prompt for it ends (the rendering of the messages
        before it with ``add_generation_prompt``, checked to be a prefix of the whole) and ends with its
        ``<|end_of_msg|>``."""
        full = _render(conv, conv.messages, prompt=False)
        learned = np.zeros(len(full), bool)
        for i, message in enumerate(conv.messages):
            if message["role"] != "assistant":
                continue
            prompt = _render(conv, conv.messages[:i], prompt=True)
            if full[:len(prompt)] != prompt:
                raise ValueError(f"messages[{i}]: the conversation before this turn does not render as a prefix of "
                                 "the whole (options after the messages, e.g. tool_choice, are not supported)")
            end = full.index(END_OF_TURN, len(prompt)) + 1
            learned[len(prompt):end] = True
        ids, mask = [], []
        for segment, on in zip(full, learned):
            piece = self._ids(segment)
            ids += piece
            mask += [on] * len(piece)
        if not any(mask):
            raise ValueError(f"messages: a {conv.kind} conversation has no assistant turn to learn")
        return np.asarray(ids, np.uint16), np.asarray(mask, np.uint8)


def encode_conversation(tokenizer, conv: Conversation) -> tuple[np.ndarray, np.ndarray]:
    """One conversation through a fresh :class:`ConversationEncoder`."""
    return ConversationEncoder(tokenizer)(conv)


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """tokens uint16 [R, T + 1]; learn uint8 [R, T + 1] (1: the model learns to predict this token); kinds: the
    conversations packed per kind; dropped: conversations longer than a row."""

    tokens: np.ndarray
    learn: np.ndarray
    kinds: dict[str, int]
    dropped: int

    def targets_weights(self, rows: np.ndarray) -> np.ndarray:
        """Loss weights ``[len(rows), T]`` f32 of the targets ``tokens[rows, 1:]``."""
        return self.learn[rows, 1:].astype(np.float32)


def pack_rows(encoded: list[tuple[np.ndarray, np.ndarray]], kinds: list[str], *, seq_len: int, seed: int,
              filler: np.ndarray | None = None, pad_id: int = 0) -> PackedRows:
    """Greedy packing of ``encoded`` conversations (in a permutation drawn from ``seed``) into rows of
    ``seq_len + 1`` tokens; each row's tail is the next tokens of ``filler`` (cycled), or ``pad_id``."""
    width = seq_len + 1
    order = np.random.default_rng(seed).permutation(len(encoded))
    rows, learns, counts, dropped = [], [], {}, 0
    ids, learn = [], []
    cursor = used = 0

    def close_row():
        nonlocal ids, learn, cursor, used
        gap = width - used
        if filler is not None and len(filler) and gap:
            tail = np.take(filler, np.arange(cursor, cursor + gap), mode="wrap")
            cursor = (cursor + gap) % len(filler)
            rows.append(np.concatenate(ids + [tail.astype(np.uint16)]))
            learns.append(np.concatenate(learn + [np.r_[0, np.ones(gap - 1, np.uint8)].astype(np.uint8)]))
        else:
            rows.append(np.concatenate(ids + [np.full(gap, pad_id, np.uint16)]))
            learns.append(np.concatenate(learn + [np.zeros(gap, np.uint8)]))
        ids, learn, used = [], [], 0

    for i in order:
        tokens, mask = encoded[i]
        if len(tokens) > width:
            dropped += 1
            continue
        if used + len(tokens) > width:
            close_row()
        ids.append(tokens)
        learn.append(mask)
        used += len(tokens)
        counts[kinds[i]] = counts.get(kinds[i], 0) + 1
    if ids:
        close_row()
    if not rows:
        raise ValueError(f"no conversation fits a row of {width} tokens")
    return PackedRows(np.stack(rows), np.stack(learns), dict(sorted(counts.items())), dropped)


class ChatBatches:
    """Deterministic batches ``(tokens [B, T + 1] int32, weights [B, T] f32)``: ``batch - code_rows`` packed chat
    rows in a permutation per epoch drawn from ``(seed, epoch)``, then ``code_rows`` windows of ``code``
    (:class:`kimi_jax.training.batches.PackedBatches`, every target learned)."""

    def __init__(self, rows: PackedRows, code: np.ndarray | None, *, batch: int, code_rows: int, seed: int):
        if not 0 <= code_rows < batch:
            raise ValueError(f"code_rows: must be in [0, batch={batch}), got {code_rows}")
        self.rows, self.chat_rows, self.seed = rows, batch - code_rows, seed
        if len(rows.tokens) < self.chat_rows:
            raise ValueError(f"{len(rows.tokens)} packed chat rows; need at least {self.chat_rows} per batch")
        seq_len = rows.tokens.shape[1] - 1
        self.code = PackedBatches(code, batch=code_rows, seq_len=seq_len, seed=seed) if code_rows else None
        self.steps_per_epoch = len(rows.tokens) // self.chat_rows

    def __call__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows.tokens))
        picks = order[within * self.chat_rows: (within + 1) * self.chat_rows]
        tokens, weights = self.rows.tokens[picks].astype(np.int32), self.rows.targets_weights(picks)
        if self.code is not None:
            code = self.code(step)
            tokens = np.concatenate([tokens, code])
            weights = np.concatenate([weights, np.ones((len(code), code.shape[1] - 1), np.float32)])
        return tokens, weights
