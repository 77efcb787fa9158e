"""Precompiled step shapes: every jitted step is padded to one (T, N, P, decode_only) bucket.

T = tokens of the packed step, N = sequences, P = block-table width (pages per sequence). Mixed steps
(prefill chunks, possibly with decode tokens) use every valid (T, N, P) combination (``N <= T``: each real
sequence feeds at least one token); decode-only steps (one token per sequence, all with cached context, no
checkpoint export) run the model's fused decode path with ``T == N``, so they have (N, N, P) buckets. The
engine compiles all of them at warm-up and never afterwards; a step takes the smallest bucket that holds it.
With a progressive warm-up (``EngineConfig.warm_up``) the engine serves once the largest buckets are ready, and a
step takes the smallest *ready* bucket that holds it (``smallest_ready``) while the others compile.
"""

from __future__ import annotations

import dataclasses
import itertools


def ladder(start: int, factor: int, top: int) -> tuple[int, ...]:
    """``start, start*factor, ...`` below ``top``, then ``top`` itself (``top`` always included)."""
    sizes, size = [], start
    while size < top:
        sizes.append(size)
        size *= factor
    return tuple(sizes) + (top,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Sorted bucket sizes for tokens (T), sequences (N) and block-table width (P)."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    pages: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("tokens", "seqs", "pages"):
            sizes = getattr(self, name)
            if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"Buckets.{name} must be a non-empty tuple of positive ints, got {sizes!r}")
            object.__setattr__(self, name, tuple(sorted(set(sizes))))

    def shapes(self) -> list[tuple[int, int, int, bool]]:
        """Every (T, N, P, decode_only) the engine compiles: mixed buckets, then decode buckets."""
        mixed = [(t, n, p, False) for t, n, p in itertools.product(self.tokens, self.seqs, self.pages) if n <= t]
        return mixed + [(n, n, p, True) for n, p in itertools.product(self.seqs, self.pages)]

    def pick(self, num_tokens: int, num_seqs: int, num_pages: int, *, decode_only: bool = False
             ) -> tuple[int, int, int, bool]:
        """The smallest bucket holding a step of ``num_tokens`` tokens of ``num_seqs`` sequences whose widest
        block table has ``num_pages`` pages. Raises ValueError when none does."""
        n = _smallest(self.seqs, num_seqs, "sequences")
        t = n if decode_only else _smallest(self.tokens, max(num_tokens, n), "tokens")
        p = _smallest(self.pages, num_pages, "pages")
        return t, n, p, decode_only

    def check_covers(self, *, max_num_batched_tokens: int, max_num_seqs: int, max_pages: int) -> None:
        """Raise ValueError unless the largest buckets hold the largest step the scheduler can make."""
        for name, top, need in (("token", self.tokens[-1], max_num_batched_tokens),
                                ("sequence", self.seqs[-1], max_num_seqs), ("page", self.pages[-1], max_pages)):
            if top < need:
                raise ValueError(f"largest {name} bucket {top} < {need} that a step may need")
        if self.seqs[-1] > self.tokens[-1]:
            raise ValueError(f"largest sequence bucket {self.seqs[-1]} exceeds the largest token bucket "
                             f"{self.tokens[-1]}")


def smallest_ready(shape: tuple[int, int, int, bool], ready, same_class=lambda a, b: True
                   ) -> tuple[int, int, int, bool]:
    """The cheapest ready bucket that can run a step picked for bucket ``shape`` (T, N, P, decode_only): ``shape``
    itself when ready, else one of ``ready`` (a collection of such shapes) with T, N and P at least as large, of
    the same kind, or a mixed bucket for a decode-only step (a mixed step feeds decode tokens too), and with
    ``same_class(shape, candidate)`` (the runner keeps drafting and non-drafting buckets apart). Cheapest: the
    fewest padded tokens, then sequences, then pages, a decode bucket before a mixed one. ValueError when none
    qualifies."""
    t, n, p, decode_only = shape
    if shape in ready:
        return shape
    fits = [c for c in ready if c[0] >= t and c[1] >= n and c[2] >= p and (c[3] == decode_only or not c[3])
            and same_class(shape, c)]
    if not fits:
        raise ValueError(f"no ready bucket holds a step of bucket {shape}")
    return min(fits, key=lambda c: (c[0], c[1], c[2], not c[3]))


def _smallest(sizes: tuple[int, ...], need: int, what: str) -> int:
    for size in sizes:
        if size >= need:
            return size
    raise ValueError(f"no bucket holds {need} {what} (largest {sizes[-1]})")


def default_buckets(*, max_num_batched_tokens: int, max_num_seqs: int, max_pages: int, gpu: bool) -> Buckets:
    """Few buckets on CPU (a compile takes tens of seconds there), a geometric ladder on GPU.

    CPU: T in (64, max), N = max, one P (3 executables); GPU: T and N in powers of 4 from 16 / 1, P in powers
    of 4 from 16 pages (attention over a padded table costs time proportional to P on the reference path).
    Every ladder ends at the configured maximum.
    """
    if gpu:
        tokens = ladder(16, 4, max_num_batched_tokens)
        seqs = ladder(1, 4, max_num_seqs)
        pages = ladder(16, 4, max_pages)
    else:
        tokens = tuple(sorted({min(64, max_num_batched_tokens), max_num_batched_tokens}))
        seqs = (max_num_seqs,)
        pages = (max_pages,)
    return Buckets(tokens, seqs, pages)
