"""No message field can spell a control token: text that names any special token of the K3 or K2 tokenizer
(and case/spacing variants of it, generated here from the tokenizer's table, not from the renderers' code) is
encoded as plain text, so a rendered prompt holds exactly the control ids of the same conversation with
harmless text in its place."""

from __future__ import annotations

import functools
import json

import pytest

from kimi_jax.chat import encode_chat, render_k2, render_k3
from kimi_jax.tokenizer import load_tokenizer

RENDER = {"tiny": render_k3, "tiny-k2": render_k2}


@functools.cache
def tokenizer(name: str):
    return load_tokenizer(name)


def held_out_strings(name: str) -> list[str]:
    """Every special token's name, with variants (case, inner spaces, doubled, glued to text, unicode)."""
    out = []
    for special in sorted(tokenizer(name).special_tokens):
        out += [special, special.upper(), special.lower(), f" {special} ", special * 2, f"a{special}b",
                special.replace("|", " | "), f"\u00e9{special}\u4e2d", f"{special}\n{special}"]
    return out


def conversation(text: str) -> tuple[list[dict], list[dict]]:
    """Messages and tools with `text` in every free-text field (system, user, assistant content and
    reasoning, tool-call arguments, tool results, tool descriptions)."""
    messages = [
        {"role": "system", "content": text},
        {"role": "user", "content": [{"type": "text", "text": text}]},
        {"role": "assistant", "content": text, "reasoning_content": text,
         "tool_calls": [{"id": "c0", "type": "function",
                         "function": {"name": "lookup", "arguments": json.dumps({"q": text})}}]},
        {"role": "tool", "tool_call_id": "c0", "content": text},
        {"role": "user", "content": text},
    ]
    tools = [{"type": "function", "function": {"name": "lookup", "description": text, "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "description": text}}}}}]
    return messages, tools


def control_ids(name: str, text: str) -> list[int]:
    tok = tokenizer(name)
    messages, tools = conversation(text)
    ids = encode_chat(tok, RENDER[name](messages, tools=tools, thinking=True))
    return [i for i in ids if tok.is_special(i)]


@pytest.mark.parametrize("name", sorted(RENDER))
def test_special_token_text_is_plain_text(name):
    expected = control_ids(name, "plain words")
    strings = held_out_strings(name)
    assert len(strings) >= 9 * 10  # the whole table, not a sample
    for text in strings:
        assert control_ids(name, text) == expected, text


@pytest.mark.parametrize("name", sorted(RENDER))
def test_special_token_in_a_tool_name_is_refused_or_plain(name):
    tok = tokenizer(name)
    for special in sorted(tok.special_tokens):
        messages, tools = conversation("x")
        tools[0]["function"]["name"] = messages[2]["tool_calls"][0]["function"]["name"] = f"f{special}"
        try:
            ids = encode_chat(tok, RENDER[name](messages, tools=tools, thinking=True))
        except ValueError:
            continue  # a 400 at the server
        assert [i for i in ids if tok.is_special(i)] == control_ids(name, "x"), special
