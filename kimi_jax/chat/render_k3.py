"""Kimi K3 "XTML" chat rendering as a Python program (spec KIMI_K3.md 8.2; no Jinja).

Follows the checkpoint's `encoding_k3.py::build_chat_segments` as described by the spec and public ports
(sgl-project/smg's Rust port, modelscope/ms-swift `KimiK3AgentTemplate`): structural markers are control
segments; tag names, each attribute piece (` key`, `="`, value, `"`), and every message/reasoning/argument
text are plain-text segments, so a marker spelled inside user text never becomes a control id.
"""

import json
from typing import Any

from kimi_jax.chat.messages import Message, Part, ToolCall, parse_messages, parse_tools
from kimi_jax.chat.segments import Segment, control, text

OPEN, CLOSE, SEP, END_OF_MSG, MEDIA_PAD = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|media_pad|>"
REASONING_EFFORTS = ("low", "high", "max")
DEFAULT_REASONING_EFFORT = "max"

TOOL_DECLARE_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
THINKING_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`.")
TOOL_CHOICE_BODIES = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
JSON_OUTPUT_RULE = ("Your response must be raw JSON data without markdown code blocks (```json) or any "
                    "additional formatting.")


def deep_sorted(value: Any) -> Any:
    """Recursively sort object keys (lists keep their order)."""
    if isinstance(value, dict):
        return {k: deep_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [deep_sorted(v) for v in value]
    return value


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def xtml_type(value: Any) -> str:
    """The `type` attribute of an argument element for a JSON value."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object"}.get(type(value), "array")


def xtml_value(value: Any) -> str:
    """Strings raw (no escaping); other values as JSON (Python's default separators, like the reference)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class _Writer:
    def __init__(self):
        self.segments: list[Segment] = []

    def control(self, value: str) -> None:
        self.segments.append(control(value))

    def text(self, value: str) -> None:
        if value:
            self.segments.append(text(value))

    def open(self, tag: str, **attrs: str) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs.items():
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def parts(self, parts: list[Part]) -> None:
        for part in parts:
            if part.is_image:
                self.segments.append(Segment(MEDIA_PAD, True, media=part.image))
            else:
                self.text(part.text)

    def message(self, body: list[Part], **attrs: str) -> None:
        self.open("message", **attrs)
        self.parts(body)
        self.close("message")
        self.control(END_OF_MSG)

    def system_option(self, kind: str, body: str) -> None:
        self.message([Part(body.strip())], role="system", type=kind)

    def tool_call(self, call: ToolCall, index: int) -> None:
        self.open("call", tool=call.name, index=str(index))
        if call.arguments is None:  # not a JSON object: the raw text goes in a json block
            self.open("json", type="object")
            self.text(call.raw_arguments)
            self.close("json")
        else:
            for key, value in call.arguments.items():
                self.open("argument", key=str(key), type=xtml_type(value))
                self.text(xtml_value(value))
                self.close("argument")
        self.close("call")

    def assistant(self, message: Message, thinking: bool) -> None:
        attrs = {"role": "assistant", **({"name": message.name} if message.name else {})}
        self.open("message", **attrs)
        if thinking:  # preserved thinking: the think channel is always present, possibly empty
            self.open("think")
            if message.reasoning and message.reasoning.strip():
                self.text(message.reasoning)
            self.close("think")
        self.open("response")
        self.parts(message.parts)
        self.close("response")
        if message.tool_calls:
            self.open("tools")
            for index, call in enumerate(message.tool_calls, start=1):
                self.tool_call(call, index)
            self.close("tools")
        self.close("message")
        self.control(END_OF_MSG)


def _order_tool_results(messages: list[Message]) -> list[tuple[Message, str | None, int]]:
    """(message, resolved tool name, 1-based index) per message; runs of tool results that all match the
    preceding assistant's call ids are put in call order and named after the calls (like the reference)."""
    out: list[tuple[Message, str | None, int]] = []
    calls: list[ToolCall] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.role != "tool":
            calls = message.tool_calls if message.role == "assistant" else calls
            out.append((message, None, 0))
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i].role == "tool":
            run.append(messages[i])
            i += 1
        positions = {c.id: k for k, c in reversed(list(enumerate(calls))) if c.id is not None}
        if all(m.tool_call_id in positions for m in run):
            run.sort(key=lambda m: positions[m.tool_call_id])
            out.extend((m, calls[positions[m.tool_call_id]].name, k) for k, m in enumerate(run, start=1))
        else:
            out.extend((m, m.name or (calls[k - 1].name if k <= len(calls) else None), k)
                       for k, m in enumerate(run, start=1))
    return out


def _response_format_body(response_format: Any) -> str | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                    "json_schema"):
        raise ValueError("response_format: must be an object with type 'text', 'json_object' or 'json_schema'")
    kind = response_format["type"]
    if kind == "text":
        return None
    body = f"The system is invoked with `response_format={kind}`.\n{JSON_OUTPUT_RULE}"
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema: must be an object with a 'schema' object")
        schema = compact_json(deep_sorted(spec["schema"])) if "schema" in spec else "null"
        body += f"\nThe JSON data must match the following schema:\n```json\n{schema}\n```"
    return body


def render_k3(messages: Any, *, tools: Any = None, thinking: bool = True, reasoning_effort: str | None = None,
              tool_choice: Any = None, response_format: Any = None,
              add_generation_prompt: bool = True) -> list[Segment]:
    """Render an OpenAI-style conversation as K3 XTML segments.

    Order: tool declarations, thinking effort (thinking only), the messages, tool_choice ("required"/"none")
    and response_format (json_object/json_schema) options, then the generation prompt
    `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` (thinking: the completion starts inside
    think) or `...<|open|>response<|sep|>`. No BOS is added.

    Args:
      messages: OpenAI messages (system/developer/user/assistant/tool; content str or parts with text and
        image_url; image parts become one `<|media_pad|>` segment each, carrying the URL, for
        ``kimi_jax.chat.media.expand_media``).
      tools: OpenAI function tools, declared as deep-key-sorted compact JSON.
      reasoning_effort: "low" | "high" | "max" (None = "max"); ignored when thinking is off.
      tool_choice: "auto" | "none" | "required" | {"type": "function", ...} (the last is enforced by
        constrained decoding, not by a message).
    Raises:
      ValueError naming the field for malformed input.
    """
    parsed = parse_messages(messages)
    tools = parse_tools(tools)
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort: must be one of {', '.join(REASONING_EFFORTS)}; got {reasoning_effort!r}")
    if not (tool_choice is None or tool_choice in ("auto", "none", "required") or isinstance(tool_choice, dict)):
        raise ValueError(f"tool_choice: must be 'auto', 'none', 'required' or a function object; got {tool_choice!r}")
    format_body = _response_format_body(response_format)
    w = _Writer()
    if tools:
        w.system_option("tool-declare", f"{TOOL_DECLARE_HEADER}```json\n{compact_json(deep_sorted(tools))}\n```")
    if thinking:
        effort = reasoning_effort or DEFAULT_REASONING_EFFORT
        w.system_option("thinking-effort", THINKING_EFFORT_BODY.format(effort=effort))
    for position, (message, tool_name, index) in enumerate(_order_tool_results(parsed)):
        named = {"name": message.name} if message.name else {}
        if message.role == "assistant":
            w.assistant(message, thinking)
        elif message.role == "tool":
            if tool_name is None:
                raise ValueError(f"messages[{position}].name: a tool result needs the tool's name (or a "
                                 "tool_call_id / position matching the preceding assistant tool_calls)")
            w.message(message.parts, role="tool", tool=tool_name, index=str(index))
        else:
            w.message(message.parts, role=message.role, **named)
    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_BODIES:
        w.system_option("tool-choice", TOOL_CHOICE_BODIES[tool_choice])
    if format_body is not None:
        w.system_option("response-format", format_body)
    if add_generation_prompt:
        w.open("message", role="assistant")
        w.open("think" if thinking else "response")
    return w.segments
