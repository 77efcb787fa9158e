"""Validate OpenAI-style chat messages and tools, and normalise them for the renderers.

Every error is a ValueError whose message starts with the offending field, e.g. `messages[2].content: ...`.
"""

import dataclasses
import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Part:
    """A content part: text, or an image (is_image True, text empty, ``image`` its URL)."""
    text: str
    is_image: bool = False
    image: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """An assistant tool call from the history. `arguments` is the decoded JSON object; when the request's
    `arguments` string is not a JSON object, `arguments` is None and `raw_arguments` keeps the text."""
    id: str | None
    name: str
    arguments: dict | None
    raw_arguments: str | None


@dataclasses.dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool ("developer" is folded into system)
    parts: list[Part]
    name: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    tool_call_id: str | None = None


def _optional_str(message: dict, key: str, where: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}.{key}: must be a string, got {type(value).__name__}")
    return value


def _parts(content: Any, where: str, *, allow_none: bool) -> list[Part]:
    if content is None:
        if allow_none:
            return []
        raise ValueError(f"{where}: is required")
    if isinstance(content, str):
        return [Part(content)]
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of content parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at}: must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{at}.text: must be a string")
            parts.append(Part(part["text"]))
        elif kind == "image_url":
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                raise ValueError(f"{at}.image_url.url: must be a non-empty string")
            parts.append(Part("", is_image=True, image=url))
        elif kind == "image":
            if not isinstance(part.get("image"), str) or not part["image"]:
                raise ValueError(f"{at}.image: must be a non-empty string (a URL)")
            parts.append(Part("", is_image=True, image=part["image"]))
        else:
            raise ValueError(f"{at}.type: unsupported content part type {kind!r} (expected 'text' or 'image_url')")
    return parts


def _arguments(value: Any, where: str) -> tuple[dict | None, str | None]:
    if value is None:
        return {}, None
    if isinstance(value, dict):
        return value, None
    if not isinstance(value, str):
        raise ValueError(f"{where}: must be a JSON string or an object, got {type(value).__name__}")
    if not value.strip():
        return {}, None
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError:
        return None, value
    return (decoded, None) if isinstance(decoded, dict) else (None, value)


def _tool_calls(value: Any, where: str) -> list[ToolCall]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where}: must be a list, got {type(value).__name__}")
    calls = []
    for k, call in enumerate(value):
        at = f"{where}[{k}]"
        if not isinstance(call, dict):
            raise ValueError(f"{at}: must be an object, got {type(call).__name__}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{at}.function: must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at}.function.name: must be a non-empty string")
        arguments, raw = _arguments(function.get("arguments"), f"{at}.function.arguments")
        calls.append(ToolCall(_optional_str(call, "id", at), name, arguments, raw))
    return calls


def parse_messages(messages: Any) -> list[Message]:
    """Validate an OpenAI `messages` list and normalise it. Raises ValueError naming the bad field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: must be one of {', '.join(ROLES)}; got {role!r}")
        name = _optional_str(message, "name", where)
        if role == "assistant":
            reasoning = _optional_str(message, "reasoning_content", where) or _optional_str(message, "reasoning", where)
            parsed.append(Message("assistant", _parts(message.get("content"), f"{where}.content", allow_none=True),
                                  name, reasoning, _tool_calls(message.get("tool_calls"), f"{where}.tool_calls")))
        elif role == "tool":
            parsed.append(Message("tool", _parts(message.get("content"), f"{where}.content", allow_none=False),
                                  name, tool_call_id=_optional_str(message, "tool_call_id", where)))
        else:
            parsed.append(Message("system" if role == "developer" else role,
                                  _parts(message.get("content"), f"{where}.content", allow_none=False), name))
    return parsed


def parse_tools(tools: Any) -> list[dict]:
    """Validate OpenAI `tools` ([{"type": "function", "function": {"name", "description"?, "parameters"?}}])."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list, got {type(tools).__name__}")
    names = set()
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}: must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function: must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name: must be a non-empty string")
        if name in names:
            raise ValueError(f"{where}.function.name: duplicate tool name {name!r}")
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{where}.function.description: must be a string")
    return tools


def tool_schemas(tools: Any) -> dict[str, dict]:
    """Declared tool name -> its `parameters` JSON schema ({} when absent). Validates like parse_tools."""
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in parse_tools(tools)}
