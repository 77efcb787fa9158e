"""Kimi K2-style chat rendering (Kimi-Linear), as a Python program (spec KIMI_K3.md 8.3; no Jinja).

Every turn is `<|im_{user|assistant|system}|>NAME<|im_middle|>BODY<|im_end|>`; tools are declared in a
leading `tool_declare` system turn as compact JSON; assistant tool calls are
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
<|tool_call_end|>...<|tool_calls_section_end|>`; a tool result is a system turn named after the tool whose
body starts `## Return of CALL_ID\n`. Markers are control segments, all other text plain.
"""

import json
from typing import Any

from kimi_jax.chat.messages import Message, parse_messages, parse_tools
from kimi_jax.chat.segments import Segment, control, text

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
IM_START = {"user": "<|im_user|>", "assistant": "<|im_assistant|>", "system": "<|im_system|>",
            "tool": "<|im_system|>"}


def _turn(out: list[Segment], role: str, name: str, body: list[Segment]) -> None:
    out += [control(IM_START[role]), text(name), control("<|im_middle|>"), *body, control("<|im_end|>")]


def _content(message: Message, where: str) -> list[Segment]:
    if any(part.is_image for part in message.parts):
        raise ValueError(f"{where}.content: image parts are not supported by the K2 (Kimi-Linear) format")
    return [text(part.text) for part in message.parts if part.text]


def _call_id(call_id: str | None, name: str, index: int) -> str:
    return call_id if call_id else f"functions.{name}:{index}"


def _assistant_body(message: Message, where: str, thinking: bool) -> list[Segment]:
    body = []
    if thinking:
        body += [control("<think>"), *([text(message.reasoning)] if message.reasoning else []), control("</think>")]
    body += _content(message, where)
    if message.tool_calls:
        body.append(control("<|tool_calls_section_begin|>"))
        for index, call in enumerate(message.tool_calls):
            arguments = call.raw_arguments if call.arguments is None else json.dumps(call.arguments,
                                                                                    ensure_ascii=False)
            body += [control("<|tool_call_begin|>"), text(_call_id(call.id, call.name, index)),
                     control("<|tool_call_argument_begin|>"), text(arguments), control("<|tool_call_end|>")]
        body.append(control("<|tool_calls_section_end|>"))
    return body


def render_k2(messages: Any, *, tools: Any = None, thinking: bool = False, add_generation_prompt: bool = True,
              default_system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[Segment]:
    """Render an OpenAI-style conversation in the K2 / Kimi-Linear format.

    Args:
      tools: OpenAI function tools, declared as compact JSON in their given key order.
      thinking: render history reasoning as `<think>R</think>` before the content (K2-thinking style). The
        generation prompt is `<|im_assistant|>assistant<|im_middle|>` either way; a thinking model opens
        `<think>` itself and K2OutputParser recognises it.
      default_system_prompt: inserted as the first system turn when the first message is not a system one
        (None: no insertion).
    Raises:
      ValueError naming the field for malformed input (image parts are rejected: the format is text-only).
    """
    parsed = parse_messages(messages)
    tools = parse_tools(tools)
    out: list[Segment] = []
    if tools:
        _turn(out, "system", "tool_declare", [text(json.dumps(tools, ensure_ascii=False, separators=(",", ":")))])
    if parsed[0].role != "system" and default_system_prompt is not None:
        _turn(out, "system", "system", [text(default_system_prompt)])
    calls = []
    tool_position = 0
    for i, message in enumerate(parsed):
        where = f"messages[{i}]"
        if message.role == "assistant":
            calls, tool_position = message.tool_calls, 0
            _turn(out, "assistant", message.name or "assistant", _assistant_body(message, where, thinking))
        elif message.role == "tool":
            known = calls[tool_position] if tool_position < len(calls) else None
            call_id = message.tool_call_id or (_call_id(known.id, known.name, tool_position) if known else None)
            if call_id is None:
                raise ValueError(f"{where}.tool_call_id: required (no preceding assistant tool call to match)")
            tool_position += 1
            _turn(out, "tool", message.name or "tool",
                  [text(f"## Return of {call_id}\n"), *_content(message, where)])
        else:
            _turn(out, message.role, message.name or message.role, _content(message, where))
    if add_generation_prompt:
        out += [control("<|im_assistant|>"), text("assistant"), control("<|im_middle|>")]
    return out
