"""Rendered prompt pieces and their encoding: only structural segments may produce control ids."""

import dataclasses

from kimi_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Segment:
    """One piece of a rendered prompt.

    allow_special True: structural markers emitted by the renderer (special-token names map to their ids).
    False: user/tool/argument/tag text, encoded as plain BPE so it can never produce a control id.
    media: for an image's placeholder (a single ``<|media_pad|>`` control), the image as the request gave it
    (its URL); ``kimi_jax.chat.media.expand_media`` replaces it once the image is decoded.
    """
    text: str
    allow_special: bool
    media: object = None


def control(text: str) -> Segment:
    return Segment(text, True)


def text(value: str) -> Segment:
    return Segment(value, False)


def prompt_text(segments: list[Segment]) -> str:
    """The flat prompt string (segments joined), for logging and tests."""
    return "".join(s.text for s in segments)


def encode_chat(tokenizer: Tokenizer, segments: list[Segment]) -> list[int]:
    """Token ids of a rendered prompt, segment by segment (BPE never merges across segments)."""
    ids: list[int] = []
    for segment in segments:
        ids.extend(tokenizer.encode(segment.text, allow_special=segment.allow_special))
    return ids
