"""Parsed model output (reasoning / content / tool calls) and the streaming base shared by K3 and K2 parsers.

Reasoning split: a parser made with `split_reasoning=True` (the server's `--reasoning-parser`) returns the
thinking channel's text as `reasoning` and only the response text as `content`; text arrives as content
whenever the model is not inside a thinking section (it never opened one, or has closed it). With
`split_reasoning=False` there is no `reasoning` at all: the thinking text is content too, in generation
order (channel markers are structure and are dropped either way), so a model that never leaves its think
channel still answers in `content`.
"""

import abc
import dataclasses
import json
from typing import Any

from kimi_jax.chat.json_schema import schema_error
from kimi_jax.chat.marker_scanner import Event, MarkerScanner
from kimi_jax.chat.messages import tool_schemas


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """One complete tool call, emitted once in the delta where it was accepted.

    index: position among this message's tool calls (OpenAI streaming `tool_calls[].index`).
    arguments: a JSON object as text (OpenAI `function.arguments`).
    """
    index: int
    id: str
    name: str
    arguments: str


@dataclasses.dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ParsedMessage:
    reasoning_content: str
    content: str
    tool_calls: list[ToolCallDelta]


class StreamingOutputParser(abc.ABC):
    """feed(text) per detokenised chunk -> ParsedDelta; flush() at the end of the stream -> the last
    ParsedDelta (held-back text, unfinished calls as content); finish() -> the whole ParsedMessage.

    Subclasses turn scanner events into delta text via `_on_event` and `_on_end`.
    """

    def __init__(self, scanner: MarkerScanner, tools: Any, split_reasoning: bool = True, constrained: bool = False):
        """tools: the request's OpenAI tools; calls are checked against them (unknown name or schema
        violation -> the call's raw text becomes content). None: calls are accepted without checks.
        split_reasoning: thinking text goes to `reasoning` (True) or into `content` (False; see the module).
        constrained: the completion was generated under a grammar of this chat format (serve.openai.grammars),
          so its markers are structure, not text: when the stream ends cut off (max_tokens), a partial marker and
          an unfinished call are dropped, leaving content a prefix of the constrained value. Otherwise they are
          kept as text, like everything that does not parse."""
        self._scanner = scanner
        self._split_reasoning = split_reasoning
        self._constrained = constrained
        self._schemas = None if tools is None else tool_schemas(tools)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tool_calls: list[ToolCallDelta] = []
        self._is_flushed = False

    def feed(self, delta_text: str) -> ParsedDelta:
        if self._is_flushed:
            raise ValueError("feed() after flush(): the stream has ended")
        delta = ParsedDelta()
        for event in self._scanner.feed(delta_text):
            self._on_event(event, delta)
        return self._record(delta)

    def flush(self) -> ParsedDelta:
        delta = ParsedDelta()
        if not self._is_flushed:
            if self._constrained:
                self._scanner.discard()
            for event in self._scanner.flush():
                self._on_event(event, delta)
            self._on_end(delta)
            self._is_flushed = True
        return self._record(delta)

    def finish(self) -> ParsedMessage:
        self.flush()
        return ParsedMessage("".join(self._reasoning), "".join(self._content), list(self._tool_calls))

    def _record(self, delta: ParsedDelta) -> ParsedDelta:
        self._reasoning.append(delta.reasoning)
        self._content.append(delta.content)
        self._tool_calls.extend(delta.tool_calls)
        return delta

    def _add_reasoning(self, delta: ParsedDelta, text: str) -> None:
        """Thinking-channel text: `reasoning`, or content when reasoning is not split off."""
        if self._split_reasoning:
            delta.reasoning += text
        else:
            delta.content += text

    def _unfinished_call(self, delta: ParsedDelta, raw: str) -> None:
        """A call the stream ended inside: its raw text as content, or nothing when constrained."""
        if not self._constrained:
            delta.content += raw

    def _accept_call(self, delta: ParsedDelta, name: str | None, arguments: dict | None, raw: str,
                     call_id: str) -> None:
        """Emit a tool call, or its raw text as content when it cannot be a valid call."""
        num_calls = len(self._tool_calls) + len(delta.tool_calls)
        valid = name is not None and arguments is not None and (
            self._schemas is None or (name in self._schemas and schema_error(arguments, self._schemas[name]) is None))
        text = _json_text(arguments) if valid else None
        if text is not None:
            delta.tool_calls.append(ToolCallDelta(num_calls, call_id, name, text))
        else:
            delta.content += raw

    @abc.abstractmethod
    def _on_event(self, event: Event, delta: ParsedDelta) -> None:
        """Apply one scanned text/marker event to the parser state, adding output to ``delta``."""

    @abc.abstractmethod
    def _on_end(self, delta: ParsedDelta) -> None:
        """End of stream: flush held-back text into ``delta``."""


def _json_text(value: Any) -> str | None:
    """`value` as JSON text; None when it holds a number JSON cannot spell (`1e999` parsed to infinity, NaN)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None


def raw_text(events: list[Event]) -> str:
    return "".join(e if isinstance(e, str) else e.raw for e in events)
