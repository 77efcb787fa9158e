"""Streaming detokenisation that never emits half of a multi-byte UTF-8 character."""

from kimi_jax.tokenizer.tokenizer import Tokenizer


def _incomplete_tail_length(data: bytes) -> int:
    """Number of trailing bytes that start a UTF-8 character whose continuation bytes have not arrived."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return back if needed > back else 0
    return 0


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces.

    `add(id)` returns the newly completed text; bytes of a character that is not complete yet are held back
    until the next token completes it (or `flush()` gives them up as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._pending = b""
        self.text = ""

    def add(self, token_id: int) -> str:
        if self._tokenizer.is_special(token_id):
            if self._skip_special_tokens:
                return ""
            piece = self.flush() + self._tokenizer.token_bytes(token_id).decode("utf-8")
            self.text += piece
            return piece
        data = self._pending + self._tokenizer.token_bytes(token_id)
        cut = len(data) - _incomplete_tail_length(data)
        self._pending = data[cut:]
        piece = data[:cut].decode("utf-8", errors="replace")
        self.text += piece
        return piece

    def flush(self) -> str:
        """Text of the held-back bytes (invalid, so U+FFFD); call at the end of the stream."""
        piece = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        self.text += piece
        return piece
