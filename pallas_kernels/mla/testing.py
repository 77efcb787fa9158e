"""Random paged-cache batches and a per-sequence numpy oracle for the MLA tests and benchmark."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PagedBatch:
    """One packed step: q [T, H, W]; pages [num_blocks, block_size, W]; block_tables [N, P]; context_lens [N];
    cu_q_lens [N+1]; owned [num_blocks, block_size] bool marks rows that hold some request's cached token."""

    q: np.ndarray
    pages: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    cu_q_lens: np.ndarray
    owned: np.ndarray


def make_paged_batch(
    rng: np.random.Generator,
    context_lens,
    q_lens,
    *,
    num_heads: int,
    width: int,
    block_size: int,
    num_tokens: int | None = None,
    spare_blocks: int = 2,
    poison: bool = True,
) -> PagedBatch:
    """Requests with the given context lengths (new tokens included) and query counts, pages shuffled over a
    pool whose block 0 is scratch. Rows no request owns (and padding query rows) are NaN when ``poison``.
    ``num_tokens`` pads q beyond sum(q_lens)."""
    context_lens = np.asarray(context_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    pages_per_seq = -(-context_lens // block_size)
    max_pages = max(1, int(pages_per_seq.max()))
    num_blocks = 1 + int(pages_per_seq.sum()) + spare_blocks
    pool = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    block_tables = np.zeros((len(context_lens), max_pages), np.int32)
    owned = np.zeros((num_blocks, block_size), bool)
    start = 0
    for n, (length, count) in enumerate(zip(context_lens, pages_per_seq)):
        block_tables[n, :count] = pool[start : start + count]
        start += count
        for p in range(count):
            owned[block_tables[n, p], : min(block_size, length - p * block_size)] = True
    pages = rng.standard_normal((num_blocks, block_size, width)).astype(np.float32)
    if poison:
        pages[~owned] = np.nan
    total = int(q_lens.sum())
    num_tokens = total if num_tokens is None else num_tokens
    q = rng.standard_normal((num_tokens, num_heads, width)).astype(np.float32)
    if poison:
        q[total:] = np.nan
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return PagedBatch(q, pages, block_tables, context_lens, cu_q_lens, owned)


def naive_mla_attention(batch: PagedBatch, *, scale: float, kv_lora_rank: int, pages=None):
    """Per-sequence dense causal softmax in float64: returns (o_lat [T, H, R], lse [T, H]); padding rows are 0 / nan.

    ``pages`` overrides ``batch.pages`` (e.g. a dequantised fp8 cache)."""
    pages = batch.pages if pages is None else pages
    num_tokens, num_heads, _ = batch.q.shape
    o = np.zeros((num_tokens, num_heads, kv_lora_rank))
    lse = np.full((num_tokens, num_heads), np.nan)
    for n, length in enumerate(batch.context_lens):
        lo, hi = batch.cu_q_lens[n], batch.cu_q_lens[n + 1]
        rows = pages[batch.block_tables[n]].reshape(-1, pages.shape[-1])[:length].astype(np.float64)
        for i, t in enumerate(range(lo, hi)):
            pos = length - (hi - lo) + i
            keys = rows[: pos + 1]
            scores = scale * batch.q[t].astype(np.float64) @ keys.T  # [H, pos+1]
            row_max = scores.max(-1, keepdims=True)
            probs = np.exp(scores - row_max)
            denom = probs.sum(-1, keepdims=True)
            o[t] = probs @ keys[:, :kv_lora_rank] / denom
            lse[t] = (row_max + np.log(denom))[:, 0]
    return o, lse
