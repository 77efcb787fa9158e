"""Images in the engine (host side): where a request's images sit in its prompt, the rows of the device's media
pool that hold their encoder outputs while the prompt is prefilled, and the cache keys that keep two different
images apart in the prefix cache.

An image of a prompt is a run of ``num_tokens`` placeholder ids (``<|media_pad|>``) starting at ``start``. While
any of its positions is still to be computed, the image holds a ``MediaLease``: ``num_tokens`` rows of the media
pool (``HybridCache.media``, row 0 is scratch), filled by the encoder before the first step that feeds them; the
step then reads row ``rows[j]`` for the image's j-th placeholder (fed as token id ``vocab_size + rows[j]``).
Leases are taken at admission (``CacheManager.admit``: only images the prefix hit does not cover), and returned
once the prefill has passed the image or the request leaves (finished, preempted, aborted).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from kimi_jax.vision.preprocess import PreparedImage


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """An image of a prompt: positions ``start .. start + image.num_tokens - 1`` are its placeholders."""

    start: int
    image: PreparedImage

    @property
    def num_tokens(self) -> int:
        return self.image.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclasses.dataclass
class MediaLease:
    """Pool rows of one image's merged tokens; ``encoded`` is set by the runner once the encoder wrote them."""

    rows: list[int]
    encoded: bool = False


def find_spans(prompt_token_ids: Sequence[int], pad_id: int, images: Sequence[PreparedImage]) -> list[ImageSpan]:
    """Pair each run of ``pad_id`` in the prompt with the next image (in order). Raises ValueError when the runs
    and the images do not match one to one in count and length."""
    ids = np.asarray(prompt_token_ids)
    pads = np.flatnonzero(ids == pad_id)
    runs = np.split(pads, np.flatnonzero(np.diff(pads) != 1) + 1) if len(pads) else []
    if len(runs) != len(images):
        raise ValueError(f"the prompt has {len(runs)} image placeholder runs for {len(images)} images")
    spans = []
    for run, image in zip(runs, images):
        if len(run) != image.num_tokens:
            raise ValueError(f"an image placeholder run at position {run[0]} has {len(run)} tokens; its image "
                             f"needs {image.num_tokens}")
        spans.append(ImageSpan(int(run[0]), image))
    return spans


def check_media(spans: Sequence[ImageSpan], prompt_token_ids: Sequence[int], media_rows: int) -> None:
    """Raise ValueError when a request's images cannot be served: no vision tower, a span outside the prompt,
    or more vision tokens than the media pool holds (``media_rows`` including the reserved row)."""
    if not spans:
        return
    if media_rows == 0:
        raise ValueError("this engine has no vision encoder (a text-only model, or one served across several "
                         "hosts): image inputs are not supported")
    if any(s.start < 0 or s.end > len(prompt_token_ids) for s in spans):
        raise ValueError("an image's placeholder positions lie outside the prompt")
    total = sum(s.num_tokens for s in spans)
    if total > media_rows - 1:
        raise ValueError(f"the images need {total} vision tokens; this server holds at most {media_rows - 1} "
                         "at once (fewer or smaller images, or a larger media pool)")


def cache_key_ids(prompt_token_ids: Sequence[int], spans: Sequence[ImageSpan]) -> list[int]:
    """The prompt as the prefix cache sees it: each image's placeholder ids replaced by a negative 62-bit key of
    its content, so pages and checkpoints are shared only between prompts with identical images there."""
    keys = list(prompt_token_ids)
    for span in spans:
        key = -1 - (int.from_bytes(hashlib.blake2b(span.image.digest, digest_size=8).digest(), "little") >> 2)
        keys[span.start:span.end] = [key] * span.num_tokens
    return keys


class MediaRows:
    """Free list of the media pool's rows 1 .. num_rows - 1 (row 0 is the encoder's scratch)."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"media pool: {n} rows asked, {len(self._free)} free")
        rows = [self._free.pop() for _ in range(n)]
        return rows

    def free(self, rows: Sequence[int]) -> None:
        self._free.extend(reversed(rows))


def pending_spans(request, start: int) -> list[int]:
    """Indices of the request's images with a position at or after ``start`` (still to be computed)."""
    return [i for i, span in enumerate(request.media) if span.end > start]
