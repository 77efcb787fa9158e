"""N-gram prompt lookup (vLLM's ``ngram`` method): drafts are the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n in [lo, hi] that occurred before."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose(tokens: Sequence[int], k: int, lo: int, hi: int, data: bytes | bytearray | None = None) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (prompt + output so far); [] when no n-gram of length
    ``lo .. hi`` at its end occurred earlier. Matching runs in C over the int32 bytes (``rfind``); ``data`` is
    ``tokens`` already in that form (``Request.token_bytes``), else they are converted here."""
    n_tokens = len(tokens)
    if n_tokens <= lo or k <= 0:
        return []
    buf = np.asarray(tokens, np.int32).tobytes() if data is None else data
    if len(buf) != 4 * n_tokens:
        raise ValueError(f"propose: data holds {len(buf) // 4} tokens, tokens {n_tokens}")
    for n in range(min(hi, n_tokens - 1), lo - 1, -1):
        pattern = buf[-4 * n:]
        end = len(buf) - 4  # the match must end before the last token, so at least one token follows it
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return list(tokens[start:start + k])
            end = at + len(pattern) - 1
    return []
