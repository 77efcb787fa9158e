"""llguidance grammars for structured output: plain JSON, and JSON or tool calls inside K3 XTML / K2 chat turns.

A chat turn is constrained as a whole, starting where the generation prompt ends, so the model still thinks
freely and only the regions that must parse are constrained (like vLLM's structural tags for K3):

* K3 (spec KIMI_K3.md 8.2): `[THINK <|close|>think<|sep|><|open|>response<|sep|>] BODY <|close|>response<|sep|>
  [<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>] <|close|>message<|sep|><|end_of_msg|>`; the bracketed think
  part is there only when the prompt ends inside the think channel (thinking on). A call is
  `<|open|>call tool="NAME" index="N"<|sep|>` + one `argument` element per parameter + `<|close|>call<|sep|>`;
  string arguments are raw text, others JSON (their type attribute says which).
* K2 (spec 8.3): `[<think>TEXT</think>] BODY [<|tool_calls_section_begin|> CALL+ <|tool_calls_section_end|>]
  <|im_end|>` with `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`.

Special tokens are referenced by id (`<[163587]>`), so free text can never produce them.
"""

from __future__ import annotations

import json

import llguidance

_TEXT_TERMINAL = "TEXT: /(.|\\n)*/"
_INDEX_TERMINAL = "INDEX: /[0-9]+/"
_JSON_TYPES = ("number", "boolean", "null", "object", "array")
_XTML_TYPE_OF = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
                 "null": "null", "object": "object", "array": "array"}


def _compact(schema: dict) -> dict:
    """`schema` with fixed `json.dumps`-style separators: no free whitespace for a model to loop on."""
    options = {"item_separator": ", ", "key_separator": ": ", **schema.get("x-guidance", {}),
               "whitespace_flexible": False}
    return {**schema, "x-guidance": options}


def json_grammar(schema: dict) -> str:
    """The whole output is one compact JSON value matching `schema`, then end of sequence."""
    return llguidance.LLMatcher.grammar_from_json_schema(_compact(schema))


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_expr(schema: dict) -> str:
    return "%json " + json.dumps(_compact(schema), ensure_ascii=False)


def _attr(value: str) -> str:
    """XTML attribute escaping (spec 8.2): & first, then quotes."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _with_definitions(sub: dict, root: dict) -> dict:
    """`sub` carrying the root schema's `$defs`/`definitions` so its `$ref`s still resolve."""
    extra = {key: root[key] for key in ("$defs", "definitions") if key in root}
    return {**extra, **sub} if extra else sub


def _string_value(schema: dict) -> str:
    """Raw-text grammar of a string argument: its enum literals, else text bounded by maxLength, else any text."""
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(_literal(v) for v in schema["enum"]) + ")"
    if isinstance(schema.get("maxLength"), int):
        low = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
        return f"/(.|\\n){{{low},{schema['maxLength']}}}/"
    return "TEXT"


def _function(tool: dict) -> tuple[str, dict]:
    function = tool["function"]
    return function["name"], function.get("parameters") or {"type": "object", "properties": {}}


class K3Grammars:
    """Grammars for a K3 XTML assistant turn (tokens from a K3-layout tokenizer)."""

    def __init__(self, tokenizer):
        name = tokenizer.special_token_id
        self._open, self._close, self._sep, self._end = (
            f"<[{name(n)}]>" for n in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))

    def _start(self, tag: str) -> str:
        return f"{self._open} {_literal(tag)} {self._sep}"

    def _stop(self, tag: str) -> str:
        return f"{self._close} {_literal(tag)} {self._sep}"

    def _turn(self, body: str, *, thinking: bool, tools: str = "") -> list[str]:
        think = f"TEXT {self._stop('think')} {self._start('response')} " if thinking else ""
        return [f"start: {think}{body} {self._stop('response')} {tools}{self._stop('message')} {self._end}",
                _TEXT_TERMINAL]

    def response(self, schema: dict, *, thinking: bool) -> str:
        """The response channel holds exactly one JSON value matching `schema`; no tool calls."""
        rules = self._turn("body", thinking=thinking) + [f"body: {_json_expr(schema)}"]
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))

    def tool_calls(self, tools: list[dict], *, thinking: bool, multiple: bool) -> str:
        """An empty response channel, then a tools channel with one call (or one or more with `multiple`) of
        `tools` (used for tool_choice "required" / named: free text first would let a model talk until
        max_tokens and never call)."""
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        repeat = "+" if multiple else ""
        tools_part = f"{self._start('tools')} ({calls}){repeat} {self._stop('tools')} "
        rules = self._turn("", thinking=thinking, tools=tools_part) + [_INDEX_TERMINAL]
        for i, tool in enumerate(tools):
            rules += self._call_rules(i, *_function(tool))
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))

    def _call_rules(self, i: int, name: str, parameters: dict) -> list[str]:
        header = f'{self._open} {_literal(f"call tool=\"{_attr(name)}\" index=\"")} INDEX "\\"" {self._sep}'
        properties = parameters.get("properties")
        if parameters.get("type", "object") != "object" or not isinstance(properties, dict) or any(
                key in parameters for key in ("anyOf", "oneOf", "allOf", "$ref")):
            raw = f'{self._start("json type=\"object\"")} {_json_expr(parameters)} {self._stop("json")}'
            return [f"call_{i}: {header} {raw} {self._stop('call')}"]
        required = set(parameters.get("required", []))
        args, rules = [], []
        for j, (key, sub) in enumerate(properties.items()):
            rule = f"arg_{i}_{j}"
            args.append(rule if key in required else f"{rule}?")
            rules.append(f"{rule}: {self._argument(key, _with_definitions(sub, parameters))}")
        return [f"call_{i}: {header} {' '.join(args)} {self._stop('call')}", *rules]

    def _argument(self, key: str, schema: dict) -> str:
        xtml_type = _XTML_TYPE_OF.get(schema.get("type")) if isinstance(schema.get("type"), str) else None
        types = [xtml_type] if xtml_type else ["string", *_JSON_TYPES]
        forms = []
        for t in types:
            value = _string_value(schema) if t == "string" else _json_expr(schema)
            forms.append(f'{self._start(f"argument key=\"{_attr(key)}\" type=\"{t}\"")} {value} '
                         f'{self._stop("argument")}')
        return " | ".join(forms)


class K2Grammars:
    """Grammars for a Kimi K2 / Kimi-Linear assistant turn (tokens from a K2-layout tokenizer).

    `thinking` is taken for the same interface as K3Grammars and not needed: the K2 generation prompt is the
    same either way, and a leading think block is always allowed.
    """

    def __init__(self, tokenizer):
        name = tokenizer.special_token_id
        self._ids = {n: f"<[{name(n)}]>" for n in (
            "<|im_end|>", "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
            "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")}

    def _turn(self, body: str) -> list[str]:
        ids = self._ids
        return [f"start: think? {body} {ids['<|im_end|>']}", f"think: {ids['<think>']} TEXT {ids['</think>']}",
                _TEXT_TERMINAL]

    def response(self, schema: dict, *, thinking: bool) -> str:
        """Content is exactly one JSON value matching `schema` (an optional think block before it)."""
        rules = self._turn("body") + [f"body: {_json_expr(schema)}"]
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))

    def tool_calls(self, tools: list[dict], *, thinking: bool, multiple: bool) -> str:
        """Free content, then a tool-calls section with one call (one or more with `multiple`) of `tools`."""
        ids = self._ids
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        repeat = "+" if multiple else ""
        section = f"TEXT {ids['<|tool_calls_section_begin|>']} ({calls}){repeat} {ids['<|tool_calls_section_end|>']}"
        rules = self._turn(section) + [_INDEX_TERMINAL]
        for i, tool in enumerate(tools):
            name, parameters = _function(tool)
            rules.append(f"call_{i}: {ids['<|tool_call_begin|>']} {_literal(f'functions.{name}:')} INDEX "
                         f"{ids['<|tool_call_argument_begin|>']} {_json_expr(parameters)} {ids['<|tool_call_end|>']}")
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
