"""One replica over several hosts: process 0 schedules and serves HTTP, the others replay its device launches.

JAX's multi-controller model (``jax.distributed``) needs every process to call the same executables in the same
order with the same inputs. All processes build the same ``ModelRunner`` (each loads only its own devices'
parameter shards) and compile and warm up the same executables in the same order. Afterwards only process 0 runs
the scheduler; before each launch it broadcasts what it is about to run (``multihost_utils.broadcast_one_to_all``,
itself a collective over every process): a fixed header naming the executable, then that launch's host inputs
(the step's packed int32 word buffer, and the penalty / grammar arrays when the step carries them; the pairs of a
copy; the ids of a poison). The other processes loop in :func:`follow`, receive, and make the same call. STOP ends
their loop. The executables' outputs are replicated, so every process holds the sampled tokens; only process 0
reads them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

STOP, COPY, POISON, STEP = range(4)
HEADER_WORDS = 8


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def host_view(array) -> np.ndarray:
    """A replicated array's value on this host (its first local shard when other hosts hold the rest)."""
    if isinstance(array, np.ndarray):
        return array
    return np.asarray(array if array.is_fully_addressable else array.addressable_data(0))


def broadcast(tree):
    """Process 0's ``tree`` (numpy arrays) on every process; the others pass arrays of the same shapes."""
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def announce(kind: int, fields: tuple[int, ...] = (), payload=None) -> None:
    """Process 0: tell the followers what it launches next (a header, then the launch's host inputs)."""
    header = np.zeros(HEADER_WORDS, np.int32)
    header[0] = kind
    header[1:1 + len(fields)] = fields
    broadcast(header)
    if payload is not None:
        broadcast(payload)


def follow(runner) -> None:
    """A follower process: replay process 0's launches on ``runner`` until it broadcasts STOP."""
    while True:
        header = broadcast(np.zeros(HEADER_WORDS, np.int32))
        kind = int(header[0])
        if kind == STOP:
            return
        if kind == COPY:
            blocks, slots = broadcast(runner.copy_payload_like())
            runner.launch_copy(blocks, slots)
        elif kind == POISON:
            blocks, slots = broadcast(runner.poison_payload_like())
            runner.launch_poison(blocks, slots)
        elif kind == STEP:
            key = tuple(int(v) for v in header[1:6])
            key = key[:3] + (bool(key[3]), bool(key[4]))
            host_mask = int(header[6])
            words, host_optional = broadcast(runner.step_payload_like(key, host_mask))
            runner.follower_step(key, words, host_optional, host_mask)
        else:
            raise RuntimeError(f"unknown multi-host command {kind}")
