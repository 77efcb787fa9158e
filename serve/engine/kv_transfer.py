"""Prefill -> decode transfers without the HTTP layer: the prefill side's table of staged exports, the wire
format, and the decode side's check that a transfer belongs to the prompt it arrives for.

Wire format: one safetensors blob (the checkpoint format we already read: a length-prefixed JSON header with
validated offsets, then raw little-endian arrays, bf16 and fp8 included). Tensors ``{i}.p{j}.{k}`` (page j of
item i, pool k of the page layout), ``{i}.s.{k}`` (checkpoint state) and ``{i}.t.{k}`` (its tail page); the
header's metadata holds the sender's ``CacheLayout`` and, per item, page hashes, checkpoint key and position. A
receiver refuses a blob whose layout differs from its own (another model, block size or cache dtype).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Sequence

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from serve.engine.host_copy import CacheLayout, EntryLayout
from serve.engine.kv_connector import TransferItem
from serve.engine.kv_store import HostCheckpoint, HostPage
from serve.engine.prefix_cache import ROOT_HASH, hash_page

_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F16": np.float16, "F32": np.float32}


# ---- the prefill side's staging table ----
@dataclasses.dataclass
class _Staged:
    deadline: float
    items: list[TransferItem]


@dataclasses.dataclass(frozen=True)
class TransferStats:
    num_pending: int
    pending_bytes: int
    results: dict[str, int]  # "pulled" / "released" / "expired" -> transfers


class TransferTable:
    """Exports waiting to be pulled, by transfer id. Each is dropped when pulled (once), released, or
    ``timeout_s`` after it was staged (swept on every call), so a decode engine that never comes frees them."""

    def __init__(self, timeout_s: float, clock=time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"TransferTable timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._staged: dict[str, _Staged] = {}
        self._results = {"pulled": 0, "released": 0, "expired": 0}
        self._lock = threading.Lock()

    def stage(self, transfer_id: str, item: TransferItem) -> None:
        with self._lock:
            self._sweep()
            staged = self._staged.setdefault(transfer_id, _Staged(self._clock() + self.timeout_s, []))
            staged.items.append(item)

    def take(self, transfer_id: str) -> list[TransferItem] | None:
        """The items staged under ``transfer_id``, removed from the table; None if there are none."""
        with self._lock:
            self._sweep()
            staged = self._staged.pop(transfer_id, None)
            if staged is not None:
                self._results["pulled"] += 1
            return None if staged is None else staged.items

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            self._sweep()
            found = self._staged.pop(transfer_id, None) is not None
            self._results["released"] += found
            return found

    def stats(self) -> TransferStats:
        with self._lock:
            self._sweep()
            return TransferStats(len(self._staged), sum(i.nbytes for s in self._staged.values() for i in s.items),
                                 dict(self._results))

    def _sweep(self) -> None:
        now = self._clock()
        for transfer_id in [t for t, s in self._staged.items() if s.deadline <= now]:
            del self._staged[transfer_id]
            self._results["expired"] += 1


# ---- wire format ----
def encode(items: Sequence[TransferItem], layout: CacheLayout) -> bytes:
    """One blob of ``items`` (their arrays are fetched to the host here: this waits for pending copies)."""
    tensors, described = {}, []
    for i, item in enumerate(items):
        ckpt = item.checkpoint
        for j, page in enumerate(item.pages):
            tensors.update(_arrays(f"{i}.p{j}", page.data))
        tensors.update(_arrays(f"{i}.s", ckpt.state))
        if ckpt.tail:
            tensors.update(_arrays(f"{i}.t", ckpt.tail_page))
        described.append({"pages": [p.hash.hex() for p in item.pages], "node": ckpt.node_hash.hex(),
                          "tail": list(ckpt.tail), "position": ckpt.position})
    metadata = {"layout": json.dumps(dataclasses.asdict(layout)), "items": json.dumps(described)}
    return safetensors.numpy.save(tensors, metadata=metadata)


def decode(blob: bytes, layout: CacheLayout) -> list[TransferItem]:
    """The items of a blob with numpy arrays. ValueError if it is malformed or its layout is not ``layout``."""
    try:
        header_len = int.from_bytes(blob[:8], "little")
        metadata = json.loads(blob[8:8 + header_len])["__metadata__"]
        sent = _layout(json.loads(metadata["layout"]))
        described = json.loads(metadata["items"])
        tensors = {name: np.frombuffer(t["data"], _DTYPES[t["dtype"]]).reshape(t["shape"])
                   for name, t in safetensors.deserialize(blob)}
    except (KeyError, TypeError, ValueError, safetensors.SafetensorError) as err:
        raise ValueError(f"malformed KV transfer: {err}") from None
    if sent != layout:
        raise ValueError(f"the KV transfer's cache layout {sent} differs from this engine's {layout}: both "
                         "replicas must serve the same model with the same --block-size and --kv-cache-dtype")
    items = []
    try:
        for i, d in enumerate(described):
            tail = tuple(int(t) for t in d["tail"])
            pages = [HostPage(bytes.fromhex(h), layout.page.nbytes, "remote",
                              _entry(tensors, f"{i}.p{j}", layout.page)) for j, h in enumerate(d["pages"])]
            ckpt = HostCheckpoint(bytes.fromhex(d["node"]), tail, int(d["position"]),
                                  layout.slot.nbytes + (layout.page.nbytes if tail else 0), "remote",
                                  state=_entry(tensors, f"{i}.s", layout.slot),
                                  tail_page=_entry(tensors, f"{i}.t", layout.page) if tail else None)
            items.append(TransferItem(pages, ckpt))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"malformed KV transfer item: {err}") from None
    return items


def items_for_prompt(items: Sequence[TransferItem], prompt: Sequence[int], block_size: int) -> list[TransferItem]:
    """The items that are entries of ``prompt`` itself: their page hashes are the prompt's chained page hashes
    and their checkpoint lies on the prompt before its last token (so a transfer can only ever populate the
    cache with the prompt's own prefix, under the hashes the prompt's tokens give)."""
    hashes, parent = [], b""
    for i in range(len(prompt) // block_size):
        parent = hash_page(parent, prompt[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    kept = []
    for item in items:
        ckpt = item.checkpoint
        depth = ckpt.position // block_size
        if not 0 < ckpt.position < len(prompt) or len(item.pages) != depth:
            continue
        if [p.hash for p in item.pages] != hashes[:depth]:
            continue
        node = ROOT_HASH if depth == 0 else hashes[depth - 1]
        if ckpt.node_hash == node and ckpt.tail == tuple(prompt[depth * block_size:ckpt.position]):
            kept.append(item)
    return kept


def _arrays(prefix: str, data: tuple) -> dict[str, np.ndarray]:
    return {f"{prefix}.{k}": np.ascontiguousarray(np.asarray(a)) for k, a in enumerate(data)}


def _entry(tensors: dict[str, np.ndarray], prefix: str, layout: EntryLayout) -> tuple[np.ndarray, ...]:
    arrays = tuple(tensors[f"{prefix}.{k}"] for k in range(len(layout.names)))
    for a, shape, dtype in zip(arrays, layout.shapes, layout.dtypes):
        if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
            raise ValueError(f"{prefix}: {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}")
    return arrays


def _layout(d: dict) -> CacheLayout:
    def entry(e):
        return EntryLayout(tuple(e["names"]), tuple(tuple(s) for s in e["shapes"]), tuple(e["dtypes"]))

    return CacheLayout(int(d["block_size"]), entry(d["page"]), entry(d["slot"]), str(d["model"]))
