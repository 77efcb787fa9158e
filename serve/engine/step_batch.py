"""StepBatch: everything a step reads besides parameters and cache, and its one-buffer transfer format.

A padded step has about twenty small int32 / float32 arrays (StepInputs, per-row sampling parameters, stage
flags). Sending each as its own array costs a host-to-device transfer and a dispatch argument apiece, so the
runner packs them into one int32 word buffer (``pack``) that the jitted step slices and bitcasts back
(``unpack``) with a static ``PackedLayout``. The large optional sampling arrays (penalty lists, grammar
bitmask) travel separately: they are device-resident neutral arrays unless a row uses them.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.step import StepInputs
from serve.engine.sampler import SamplingTensors

OPTIONAL_SAMPLING = ("penalty_token_ids", "penalty_output_counts", "penalty_in_prompt", "allowed_bitmask")


@partial(jax.tree_util.register_dataclass,
         data_fields=["step", "sampling", "use_sampling", "use_bitmask", "use_penalties", "want_top_logprobs",
                      "draft_rows", "draft_limits"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Everything one step reads besides parameters and cache (numpy on the host, jax arrays inside).

    step        StepInputs padded to the bucket (padded sequences: length 0, block 0, slot 0, no checkpoints)
    sampling    SamplingTensors with all optional arrays present (neutral when unused)
    use_sampling, use_bitmask, use_penalties, want_top_logprobs   [] bool: whether any row needs that stage
                (use_sampling: a row with temperature > 0; otherwise the step skips the sampler's sort)
    draft_rows  [N] int32: each sequence's row in the step before (speculative decoding with sampled drafts
                reads the drafter's distributions there; a chained verification row reads its inputs there)
    draft_limits [N] int32: chained verification rows (``speculation.chain_verification``): the request's length
                cap, min(max_model_len, prompt + max_tokens); no draft is verified at or past cap - 1 (0: none)
    """

    step: StepInputs
    sampling: SamplingTensors
    use_sampling: np.ndarray
    use_bitmask: np.ndarray
    use_penalties: np.ndarray
    want_top_logprobs: np.ndarray
    draft_rows: np.ndarray
    draft_limits: np.ndarray


def split(batch: StepBatch) -> tuple[StepBatch, tuple]:
    """(the batch without the optional sampling arrays, those arrays in OPTIONAL_SAMPLING order)."""
    optional = tuple(getattr(batch.sampling, name) for name in OPTIONAL_SAMPLING)
    small = dataclasses.replace(batch, sampling=dataclasses.replace(
        batch.sampling, **{name: None for name in OPTIONAL_SAMPLING}))
    return small, optional


def join(small: StepBatch, optional: tuple) -> StepBatch:
    return dataclasses.replace(small, sampling=dataclasses.replace(small.sampling,
                                                                   **dict(zip(OPTIONAL_SAMPLING, optional))))


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each leaf of a (small) StepBatch sits in the word buffer: static, one per bucket."""

    treedef: jax.tree_util.PyTreeDef
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) in tree order

    @classmethod
    def of(cls, small: StepBatch) -> "PackedLayout":
        leaves, treedef = jax.tree.flatten(small)
        return cls(treedef, tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves))

    @functools.cached_property
    def num_words(self) -> int:
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)

    def segments(self):
        """Yield ``(words slice, shape, dtype name)`` of each leaf, in tree order."""
        offset = 0
        for shape, dtype in self.leaves:
            size = int(np.prod(shape))
            yield slice(offset, offset + size), shape, dtype
            offset += size


def pack(small: StepBatch) -> np.ndarray:
    """All leaves as one int32 [W] buffer (4-byte dtypes bit-for-bit, bools as 0 / 1)."""
    words = []
    for leaf in jax.tree.leaves(small):
        leaf = np.asarray(leaf)
        words.append((leaf.astype(np.int32) if leaf.dtype == np.bool_ else leaf.view(np.int32)).ravel())
    return np.concatenate(words)


class WordBuffer:
    """A bucket's reusable word buffer with a StepBatch of numpy views into it, so the runner writes a step's
    values straight into their packed places (bool leaves are int32 0 / 1 views): no per-step array allocation,
    tree flattening or concatenation on the host's critical path.

    ``reset()`` restores the neutral (all-padding) batch and returns the views; ``take()`` a copy of the words
    for the executable (the buffer is refilled while that step is still in flight)."""

    def __init__(self, neutral: StepBatch):
        self.layout = PackedLayout.of(neutral)
        self._template = pack(neutral)
        self._words = self._template.copy()
        leaves = [(self._words[where] if dtype in ("int32", "bool") else self._words[where].view(np.dtype(dtype)))
                  .reshape(shape) for where, shape, dtype in self.layout.segments()]
        self._views: StepBatch = jax.tree.unflatten(self.layout.treedef, leaves)

    def reset(self) -> StepBatch:
        np.copyto(self._words, self._template)
        return self._views

    def take(self) -> np.ndarray:
        return self._words.copy()


def unpack(words: jax.Array, layout: PackedLayout) -> StepBatch:
    """Inverse of ``pack`` inside the jitted step: words [W] int32 -> the small StepBatch."""
    leaves = []
    for where, shape, dtype in layout.segments():
        seg = words[where]
        if dtype == "bool":
            seg = seg != 0
        elif dtype != "int32":
            seg = jax.lax.bitcast_convert_type(seg, jnp.dtype(dtype))
        leaves.append(seg.reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)
