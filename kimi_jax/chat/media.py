"""Images in a rendered K3 prompt: find their placeholder segments and expand each, once its image is decoded,
to ``<|media_begin|>image WxH<|media_content|>`` + one ``<|media_pad|>`` per merged vision token +
``<|media_end|>`` (W x H: the decoded image's size in pixels, as plain text)."""

from __future__ import annotations

from typing import Sequence

from kimi_jax.chat.segments import Segment, control, text

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = "<|media_begin|>", "<|media_content|>", "<|media_end|>", \
    "<|media_pad|>"


def media_refs(segments: Sequence[Segment]) -> list[object]:
    """The images of a rendered prompt in prompt order (what each placeholder segment carries)."""
    return [s.media for s in segments if s.media is not None]


def expand_media(segments: Sequence[Segment], images: Sequence) -> list[Segment]:
    """Replace the i-th placeholder segment by the full image block of ``images[i]`` (anything with
    ``size`` (width, height) and ``num_tokens``). Raises ValueError when the counts differ."""
    refs = media_refs(segments)
    if len(refs) != len(images):
        raise ValueError(f"the prompt has {len(refs)} images but {len(images)} were given")
    out: list[Segment] = []
    pending = iter(images)
    for segment in segments:
        if segment.media is None:
            out.append(segment)
            continue
        image = next(pending)
        width, height = image.size
        out += [control(MEDIA_BEGIN), text(f"image {width}x{height}"), control(MEDIA_CONTENT),
                control(MEDIA_PAD * image.num_tokens), control(MEDIA_END)]
    return out
