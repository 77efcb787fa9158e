"""Streaming parser for K3 XTML completions: reasoning (think), content (response), tool calls (tools).

The completion text must be detokenised with special tokens kept (skip_special_tokens=False). Tolerant of
what real models emit: a missing `<|close|>think<|sep|>` before the response or tools channel, calls
without the `<|open|>tools<|sep|>` wrapper, missing closing markers, markers split across chunks. Text
that does not fit the grammar is kept as content, never dropped; a call that does not parse or validate
becomes content with its raw text.
"""

import json
from typing import Any

from kimi_jax.chat.marker_scanner import Event, Marker, MarkerScanner, xtml_matcher
from kimi_jax.chat.parsed import ParsedDelta, StreamingOutputParser, raw_text
from kimi_jax.chat.render_k3 import CLOSE, END_OF_MSG, OPEN, SEP

THINK, BETWEEN, RESPONSE, TOOLS, CALL, DONE = "think", "between", "response", "tools", "call", "done"
_VALUE_TYPES = {"number": (int, float), "boolean": (bool,), "null": (type(None),), "object": (dict,),
                "array": (list,)}


def _decode_value(kind: str | None, value: str) -> tuple[bool, Any]:
    """(ok, value) of an argument element: string raw, other types JSON of that type."""
    if kind == "string":
        return True, value
    if kind not in _VALUE_TYPES:
        return False, None
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError:
        return False, None
    is_bool_as_number = kind == "number" and isinstance(decoded, bool)
    return isinstance(decoded, _VALUE_TYPES[kind]) and not is_bool_as_number, decoded


def _element_body(events: list[Event], start: int, tag: str) -> tuple[str | None, int]:
    """Raw text from events[start] up to the `CLOSE tag SEP` marker, and the index after it (None: unclosed)."""
    for end in range(start, len(events)):
        event = events[end]
        if isinstance(event, Marker) and event.kind == "close" and event.name == tag:
            return raw_text(events[start:end]), end + 1
    return None, len(events)


def parse_call_arguments(body: list[Event]) -> dict | None:
    """Arguments of a call body (events between the call's open and close markers); None if malformed."""
    arguments: dict = {}
    i = 0
    while i < len(body):
        event = body[i]
        if isinstance(event, str):
            if event.strip():
                return None
            i += 1
            continue
        if event.kind != "open" or event.name not in ("argument", "json"):
            return None
        value, i = _element_body(body, i + 1, event.name)
        if value is None:
            return None
        if event.name == "json":
            ok, decoded = _decode_value("object", value)
            if not ok:
                return None
            arguments.update(decoded)
            continue
        ok, decoded = _decode_value(event.attrs.get("type"), value)
        if not ok or "key" not in event.attrs:
            return None
        arguments[event.attrs["key"]] = decoded
    return arguments


class K3OutputParser(StreamingOutputParser):
    """Parse a K3 completion as it streams.

    thinking: True when the prompt ended with `<|open|>think<|sep|>` (render_k3(thinking=True)), so the
      completion starts inside the think channel; False when it ended with `<|open|>response<|sep|>`.
    tools: the request's tools for validation (see StreamingOutputParser); None accepts any call.
    split_reasoning: think-channel text as `reasoning` (True) or as content (False; see kimi_jax.chat.parsed).
    constrained: generated under a K3 grammar (see StreamingOutputParser).
    """

    def __init__(self, *, thinking: bool, tools: Any = None, split_reasoning: bool = True, constrained: bool = False):
        super().__init__(MarkerScanner(xtml_matcher(OPEN, CLOSE, SEP, (END_OF_MSG,))), tools, split_reasoning,
                         constrained)
        self._state = THINK if thinking else RESPONSE
        self._call: list[Event] = []
        self._has_output = False
        self._space = ""  # whitespace outside think/response, dropped unless text follows before a marker

    def _emit(self, text: str, delta: ParsedDelta) -> None:
        if self._state == THINK:
            self._add_reasoning(delta, text)
        elif self._state == RESPONSE:
            delta.content += text
        elif text.strip():
            delta.content += self._space + text
            self._space = ""
        else:
            self._space += text
        self._has_output = True

    def _on_event(self, event: Event, delta: ParsedDelta) -> None:
        if self._state == CALL:
            self._on_call_event(event, delta)
        elif isinstance(event, str):
            self._emit(event, delta)
        elif not self._on_marker(event):
            self._emit(event.raw, delta)

    def _on_marker(self, marker: Marker) -> bool:
        """Apply a structural marker; False if it does not fit here (its raw text is then kept as text)."""
        state, name = self._state, marker.name
        if marker.kind == "token":
            self._state = DONE
        elif marker.kind == "close":
            closes = {THINK: "think", RESPONSE: "response", TOOLS: "tools"}
            if closes.get(state) == name:
                self._state = BETWEEN
            elif name == "message" and state != DONE:
                self._state = DONE
            else:
                return False
        elif name == "think" and (state == BETWEEN or (state == THINK and not self._has_output)):
            self._state = THINK  # (in THINK before any output: the model repeated the opener the prompt holds)
        elif name == "response" and state in (THINK, BETWEEN):
            self._state = RESPONSE
        elif name == "tools" and state in (THINK, BETWEEN, RESPONSE):
            self._state = TOOLS
        elif name == "call" and state in (THINK, BETWEEN, RESPONSE, TOOLS):
            self._state, self._call = CALL, [marker]
        else:
            return False
        self._has_output = True
        self._space = ""
        return True

    def _on_call_event(self, event: Event, delta: ParsedDelta) -> None:
        if isinstance(event, Marker) and event.kind == "close" and event.name == "call":
            self._call.append(event)
            opener = self._call[0]
            index = opener.attrs.get("index", str(len(self._tool_calls) + len(delta.tool_calls) + 1))
            name = opener.attrs.get("tool")
            self._accept_call(delta, name, parse_call_arguments(self._call[1:-1]), raw_text(self._call),
                              f"functions.{name}:{index}")
            self._state, self._call = TOOLS, []
            return
        ends_unclosed_call = isinstance(event, Marker) and (
            event.kind == "token" or (event.kind == "open" and event.name == "call")
            or (event.kind == "close" and event.name in ("tools", "message")))
        if ends_unclosed_call:
            self._abandon_call(delta)
            self._on_event(event, delta)
        else:
            self._call.append(event)

    def _abandon_call(self, delta: ParsedDelta) -> None:
        delta.content += raw_text(self._call)
        self._state, self._call = TOOLS, []

    def _on_end(self, delta: ParsedDelta) -> None:
        if self._state == CALL:
            self._unfinished_call(delta, raw_text(self._call))
            self._state, self._call = TOOLS, []
