"""Sequence packing: documents concatenated (eos-separated) into one stream, cut into fixed windows.

Window ``i`` of a stream is ``stream[i*T : i*T + T + 1]`` (T inputs and their T next-token targets; windows
overlap by the one target token). Training visits the windows of each epoch in a permutation drawn from
``(seed, epoch)``; batch ``s`` is therefore a pure function of ``(stream, B, T, seed, s)``.
"""

from __future__ import annotations

import numpy as np


def num_windows(stream: np.ndarray, seq_len: int) -> int:
    return max(0, (len(stream) - 1) // seq_len)


def window(stream: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    """Tokens ``[T + 1]`` of window ``index``."""
    return stream[index * seq_len: index * seq_len + seq_len + 1]


class PackedBatches:
    """Deterministic shuffled batches ``[B, T + 1]`` int32 of packed windows of a token stream."""

    def __init__(self, stream: np.ndarray, *, batch: int, seq_len: int, seed: int):
        self.stream, self.batch, self.seq_len, self.seed = stream, batch, seq_len, seed
        self.windows = num_windows(stream, seq_len)
        if self.windows < batch:
            raise ValueError(f"stream of {len(stream)} tokens has {self.windows} windows of {seq_len}; "
                             f"need at least batch={batch}")
        self.steps_per_epoch = self.windows // batch
        self._epoch, self._order = -1, np.zeros(0, np.int64)

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
        return self._order

    def __call__(self, step: int) -> np.ndarray:
        epoch, within = divmod(step, self.steps_per_epoch)
        picks = self._order_of(epoch)[within * self.batch: (within + 1) * self.batch]
        return np.stack([window(self.stream, int(i), self.seq_len) for i in picks]).astype(np.int32)


def eval_batches(stream: np.ndarray, *, batch: int, seq_len: int, max_tokens: int | None,
                 spread: bool = False) -> list[np.ndarray]:
    """Windows of a held-out stream as full batches ``[B, T + 1]`` covering at most ``max_tokens`` targets (all
    windows when None; at least one batch): the first windows in order, or with ``spread`` windows evenly
    spaced over the whole stream."""
    available = num_windows(stream, seq_len)
    count = available if max_tokens is None else min(available, max(batch, max_tokens // seq_len))
    count -= count % batch
    if count == 0:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one batch of {batch}x{seq_len}")
    picks = np.linspace(0, available - 1, count).astype(int) if spread else np.arange(count)
    rows = np.stack([window(stream, int(i), seq_len) for i in picks]).astype(np.int32)
    return [rows[i: i + batch] for i in range(0, count, batch)]
