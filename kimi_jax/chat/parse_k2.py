"""Streaming parser for K2-style (Kimi-Linear) completions: optional leading `<think>...</think>`, content,
and a `<|tool_calls_section_begin|>` section of `<|tool_call_begin|>ID<|tool_call_argument_begin|>{json}
<|tool_call_end|>` calls. Same tolerance rules as the K3 parser: nothing is dropped, a call that does not
parse or validate becomes content with its raw text, a call counts only once `<|tool_call_end|>` arrives.
"""

import json
from typing import Any

from kimi_jax.chat.marker_scanner import Event, Marker, MarkerScanner, fixed_token_matcher
from kimi_jax.chat.parsed import ParsedDelta, StreamingOutputParser, raw_text

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")  # K2 ships both spellings
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, IM_END = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                                "<|tool_call_end|>", "<|im_end|>")
START, THINK, CONTENT, SECTION, CALL, DONE = "start", "think", "content", "section", "call", "done"


def parse_call(body: list[Event]) -> tuple[str, str | None, dict | None]:
    """(call id, function name, arguments) of the events between CALL_BEGIN and CALL_END.

    The id is `functions.NAME:IDX`; the name is the part before ':' after the last '.', as vLLM reads it.
    """
    split = next((k for k, e in enumerate(body) if isinstance(e, Marker) and e.name == ARGUMENT_BEGIN), None)
    if split is None:
        return raw_text(body).strip(), None, None
    call_id = raw_text(body[:split]).strip()
    name = call_id.split(":")[0].split(".")[-1] or None
    try:
        arguments = json.loads(raw_text(body[split + 1:]))
    except json.JSONDecodeError:
        return call_id, name, None
    return call_id, name, arguments if isinstance(arguments, dict) else None


class K2OutputParser(StreamingOutputParser):
    """Parse a K2-format completion as it streams (the prompt ends with `<|im_assistant|>assistant<|im_middle|>`;
    a leading `<think>` opens reasoning). tools, split_reasoning, constrained: as for K3OutputParser."""

    def __init__(self, *, tools: Any = None, split_reasoning: bool = True, constrained: bool = False):
        tokens = (THINK_OPEN, THINK_CLOSE, *SECTION_BEGIN, *SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, IM_END)
        super().__init__(MarkerScanner(fixed_token_matcher(tokens)), tools, split_reasoning, constrained)
        self._state = START
        self._space = ""  # whitespace outside think/content, kept only if text follows before a marker
        self._call: list[Event] = []

    def _emit(self, text: str, delta: ParsedDelta) -> None:
        if self._state == THINK:
            self._add_reasoning(delta, text)
        elif self._state == CONTENT:
            delta.content += text
        elif not text.strip():
            self._space += text  # dropped if a marker comes next (e.g. before `<think>`)
        else:
            delta.content += self._space + text
            self._space = ""
            self._state = CONTENT if self._state == START else self._state

    def _on_event(self, event: Event, delta: ParsedDelta) -> None:
        if self._state == CALL:
            self._on_call_event(event, delta)
        elif isinstance(event, str):
            self._emit(event, delta)
        elif not self._on_marker(event.name):
            self._emit(event.raw, delta)

    def _on_marker(self, name: str) -> bool:
        state = self._state
        if name == THINK_OPEN and state == START:
            self._state = THINK
        elif name == THINK_CLOSE and state == THINK:
            self._state = CONTENT
        elif name in SECTION_BEGIN and state in (START, THINK, CONTENT):
            self._state = SECTION
        elif name in SECTION_END and state == SECTION:
            self._state = CONTENT
        elif name == CALL_BEGIN and state in (START, THINK, CONTENT, SECTION):
            self._state, self._call = CALL, []
        elif name == IM_END:
            self._state = DONE
        else:
            return False
        self._space = ""
        return True

    def _on_call_event(self, event: Event, delta: ParsedDelta) -> None:
        name = event.name if isinstance(event, Marker) else None
        if name == CALL_END:
            call_id, function, arguments = parse_call(self._call)
            self._accept_call(delta, function, arguments, CALL_BEGIN + raw_text(self._call) + CALL_END, call_id)
            self._state, self._call = SECTION, []
        elif name in (CALL_BEGIN, IM_END, *SECTION_END):
            self._abandon_call(delta)
            self._on_event(event, delta)
        else:
            self._call.append(event)

    def _abandon_call(self, delta: ParsedDelta) -> None:
        delta.content += CALL_BEGIN + raw_text(self._call)
        self._state, self._call = SECTION, []

    def _on_end(self, delta: ParsedDelta) -> None:
        if self._state == CALL:
            self._unfinished_call(delta, CALL_BEGIN + raw_text(self._call))
            self._state, self._call = SECTION, []
