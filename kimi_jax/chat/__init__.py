"""Chat formats: K3 XTML and K2 (Kimi-Linear) rendering, and streaming output parsers."""

from kimi_jax.chat.json_schema import schema_error
from kimi_jax.chat.messages import parse_messages, parse_tools, tool_schemas
from kimi_jax.chat.parse_k2 import K2OutputParser
from kimi_jax.chat.parse_k3 import K3OutputParser
from kimi_jax.chat.parsed import ParsedDelta, ParsedMessage, ToolCallDelta
from kimi_jax.chat.render_k2 import render_k2
from kimi_jax.chat.render_k3 import render_k3
from kimi_jax.chat.segments import Segment, encode_chat, prompt_text

__all__ = ["K2OutputParser", "K3OutputParser", "ParsedDelta", "ParsedMessage", "Segment", "ToolCallDelta",
           "encode_chat", "parse_messages", "parse_tools", "prompt_text", "render_k2", "render_k3", "schema_error",
           "tool_schemas"]
