"""Split streamed model text into plain-text pieces and format markers, across arbitrary chunk boundaries.

A tail that could still become a marker (`<|op`, or `<|open|>call tool="x` before its `<|sep|>`) is held
back until the next chunk decides it; at the end of the stream it is plain text.
"""

import dataclasses
import re
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Marker:
    raw: str  # the exact text consumed
    kind: str  # "open" | "close" | "token"
    name: str  # tag name for open/close, the token text for "token"
    attrs: dict[str, str] = dataclasses.field(default_factory=dict)


NEED_MORE = object()
Event = str | Marker
# match(buffer starting with "<", final) -> Marker | None (not a marker) | NEED_MORE (only when not final)
Matcher = Callable[[str, bool], object]


class MarkerScanner:
    def __init__(self, match: Matcher):
        self._match = match
        self._buffer = ""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._scan(final=False)

    def flush(self) -> list[Event]:
        """Everything still held back, a partial marker becoming plain text."""
        return self._scan(final=True)

    def discard(self) -> str:
        """Drop what is held back (a tail that could still become a marker); returns it."""
        held, self._buffer = self._buffer, ""
        return held

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        buffer = self._buffer
        while buffer:
            start = buffer.find("<")
            if start < 0:
                events.append(buffer)
                buffer = ""
                break
            if start:
                events.append(buffer[:start])
                buffer = buffer[start:]
            marker = self._match(buffer, final)
            if marker is NEED_MORE:
                break
            if marker is None:
                events.append("<")
                buffer = buffer[1:]
                continue
            events.append(marker)
            buffer = buffer[len(marker.raw):]
        self._buffer = buffer
        return _join_text(events)


def _join_text(events: list[Event]) -> list[Event]:
    joined: list[Event] = []
    for event in events:
        if isinstance(event, str) and joined and isinstance(joined[-1], str):
            joined[-1] += event
        else:
            joined.append(event)
    return joined


def fixed_token_matcher(tokens: tuple[str, ...]) -> Matcher:
    """Matcher for markers that are fixed strings (K2's `<|tool_call_begin|>`, `<think>`, ...)."""
    def match(buffer: str, final: bool):
        for token in tokens:
            if buffer.startswith(token):
                return Marker(token, "token", token)
        if not final and any(token.startswith(buffer) for token in tokens):
            return NEED_MORE
        return None
    return match


_TAG = re.compile(r'([A-Za-z_][\w\-]*)((?:\s+[\w\-]+="[^"]*")*)\s*')
_ATTR = re.compile(r'([\w\-]+)="([^"]*)"')


def _unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def xtml_matcher(open_token: str, close_token: str, sep_token: str, plain_tokens: tuple[str, ...],
                 max_header_length: int = 512) -> Matcher:
    """Matcher for XTML: `OPEN name key="v"... SEP`, `CLOSE name SEP`, and single tokens (`<|end_of_msg|>`)."""
    def match(buffer: str, final: bool):
        for token in plain_tokens:
            if buffer.startswith(token):
                return Marker(token, "token", token)
        for opener, kind in ((open_token, "open"), (close_token, "close")):
            if not buffer.startswith(opener):
                continue
            end = buffer.find(sep_token, len(opener))
            if end < 0:
                header = buffer[len(opener):]
                undecided = next((k for k in range(min(len(sep_token) - 1, len(header)), 0, -1)
                                  if sep_token.startswith(header[-k:])), 0)
                if final or len(header) > max_header_length or "<|" in header[:len(header) - undecided]:
                    return None
                return NEED_MORE
            tag = _TAG.fullmatch(buffer[len(opener):end])
            if tag is None or (kind == "close" and tag.group(2)):
                return None
            attrs = {k: _unescape_attr(v) for k, v in _ATTR.findall(tag.group(2))}
            return Marker(buffer[:end + len(sep_token)], kind, tag.group(1), attrs)
        if not final and any(t.startswith(buffer) for t in (open_token, close_token, *plain_tokens)):
            return NEED_MORE
        return None
    return match
