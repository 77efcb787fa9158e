"""Chat formats: K3 XTML and K2 (Kimi-Linear) rendering, and streaming output parsers."""

from serve.chat.json_schema import schema_error
from serve.chat.messages import parse_messages, parse_tools, tool_schemas
from serve.chat.parse_k2 import K2OutputParser
from serve.chat.parse_k3 import K3OutputParser
from serve.chat.parsed import ParsedDelta, ParsedMessage, ToolCallDelta
from serve.chat.render_k2 import render_k2
from serve.chat.render_k3 import render_k3
from serve.chat.segments import Segment, encode_chat, prompt_text

__all__ = ["K2OutputParser", "K3OutputParser", "ParsedDelta", "ParsedMessage", "Segment", "ToolCallDelta",
           "encode_chat", "parse_messages", "parse_tools", "prompt_text", "render_k2", "render_k3", "schema_error",
           "tool_schemas"]
