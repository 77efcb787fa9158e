"""llguidance grammars for structured output: plain JSON, and JSON or tool calls inside K3 XTML / K2 chat turns.

A chat turn is constrained as a whole, from where the generation prompt ends to the end-of-turn token, channel
markers included, so whatever the model's quality the parsed reply is the constrained value: a constrained
completion that stops (rather than running out of max_tokens) always parses, and one that runs out is a prefix
of a valid turn. Nothing in it may grow without a bound that the grammar sets, except the constrained value
itself:

* the think channel holds at most `think_tokens` tokens (0: it is closed at once); the caller picks the
  budget (serve.openai.chat: 0 unless reasoning is split off, else half of max_tokens);
* the response channel of a tool-call turn is empty: free text first would let a model talk until max_tokens
  and never call;
* a K3 argument element ends only at `<|close|>`, a token a weak model may never pick: the raw text of a string
  argument is bounded by its enum or maxLength, else by its share of the tokens left for the calls
  (`call_tokens`, less the call's markup, shared between the arguments); a plain number argument (no
  bounds, enum, ... in its schema) to as many characters as its share; the call index is spelled out
  (1, 2, ...; at most MAX_CALLS calls);
* JSON values (the response_format body, non-string arguments) end at their own closing quote, bracket or
  brace, as the schema (with compact separators) allows.

Layouts:

* K3 (spec KIMI_K3.md 8.2): `[THINK <|close|>think<|sep|><|open|>response<|sep|>] BODY <|close|>response<|sep|>
  [<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>] <|close|>message<|sep|><|end_of_msg|>`; the bracketed think
  part is there only when the prompt ends inside the think channel (thinking on). A call is
  `<|open|>call tool="NAME" index="N"<|sep|>` + one `argument` element per parameter + `<|close|>call<|sep|>`;
  string arguments are raw text, others JSON (their type attribute says which).
* K2 (spec 8.3): `[<think>TEXT</think>] BODY [<|tool_calls_section_begin|> CALL+ <|tool_calls_section_end|>]
  <|im_end|>` with `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`;
  the think block is allowed only with a non-zero `think_tokens`.

Special tokens are referenced by id (`<[163587]>`), so free text can never produce them.
"""

from __future__ import annotations

import json

import llguidance

_TEXT_TERMINAL = "TEXT: /(.|\\n)*/"
MAX_CALLS = 16  # the most tool calls one constrained turn may hold (their indices are spelled out)
_JSON_TYPES = ("number", "boolean", "null", "object", "array")
_ALL_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
_XTML_TYPE_OF = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
                 "null": "null", "object": "object", "array": "array"}
_ANNOTATIONS = {"type", "title", "description", "default", "examples", "$comment"}
_MAX_DIGITS = 18  # a plain number's digits before and after the point: more than a double holds


def _bounded_number(json_type: str, chars: int | None = None) -> str:
    """The regex of a plain JSON number of at most `chars` characters (so at most that many tokens; None: 18
    digits before the point, 18 after and a 2-digit exponent, finite as a double).

    A number element ends only at `<|close|>`, so an unbounded digit run would let a model write digits until
    max_tokens; the bound is split between the integer part and, for "number", the fraction and exponent.
    """
    if chars is None:
        whole, fraction, exponent = _MAX_DIGITS, _MAX_DIGITS, True
    else:
        room = max(1, chars - 1)  # less the sign
        whole = min(_MAX_DIGITS, room if json_type == "integer" or room < 3 else room // 2)
        fraction = min(_MAX_DIGITS, room - whole - 1)  # less the point
        exponent = room - whole - 1 - fraction >= 4
    number = ("-?" if chars is None or chars >= 2 else "") + f"(0|[1-9][0-9]{{0,{whole - 1}}})"
    if json_type == "number" and fraction >= 1:
        number += f"(\\.[0-9]{{1,{fraction}}})?" + ("([eE][+-]?[0-9]{1,2})?" if exponent else "")
    return f"/{number}/"


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


def _think_text(think_tokens: int) -> str:
    """The rule of think-channel text: any text of at most `think_tokens` tokens."""
    if think_tokens < 1:
        raise ValueError("think_tokens must be positive where a think channel is allowed")
    return f"think_text[max_tokens={int(think_tokens)}]: TEXT"


def _function(tool: dict) -> tuple[str, dict]:
    function = tool["function"]
    return function["name"], function.get("parameters") or {"type": "object", "properties": {}}


def _call_sequence(num_tools: int, multiple: bool, *, first_index: int) -> tuple[str, list[str], range]:
    """(expression, rules, call indices) of one call, or with `multiple` one to MAX_CALLS calls, at consecutive
    indices from `first_index`; the call of tool i at index k is the caller's rule `call_{i}_{k}`."""
    positions = range(first_index, first_index + (MAX_CALLS if multiple else 1))
    rules = [f"at_{k}: " + " | ".join(f"call_{i}_{k}" for i in range(num_tools)) for k in positions]
    if not multiple:
        return f"at_{first_index}", rules, positions
    rules += [f"more_{k}: at_{k} more_{k + 1}?" for k in positions[1:-1]]
    rules.append(f"more_{positions[-1]}: at_{positions[-1]}")
    return f"at_{first_index} more_{first_index + 1}?", rules, positions


def _json_type_of(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", dict: "object"}.get(type(value), "array")


def _satisfiable(schema: dict) -> bool:
    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_json_schema(_compact(schema)))
    return not is_error


def _typed_forms(schema: dict) -> list[tuple[str, dict]]:
    """(JSON type, the schema narrowed to it) for each type an argument of `schema` may have.

    A type list (`["string", "null"]`) or the types of `enum`/`const` values give the candidates, else every
    type; a narrowed schema that nothing satisfies (say `{"anyOf": [...]}` narrowed to boolean) is left out.
    """
    declared = schema.get("type")
    if isinstance(declared, str) and declared in _ALL_TYPES:
        return [(declared, schema)]
    if isinstance(declared, list):
        candidates = [t for t in _ALL_TYPES if t in declared]
        if not candidates:
            raise ValueError(f"no known JSON type in {declared!r}")
    elif isinstance(schema.get("enum"), list) or "const" in schema:
        values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]]
        found = {_json_type_of(v) for v in values}
        candidates = [t for t in _ALL_TYPES if t in found or (t == "number" and "integer" in found)]
    elif declared is None:
        candidates = list(_ALL_TYPES)
    else:
        raise ValueError(f"unknown JSON type {declared!r}")
    if "integer" in candidates and "number" in candidates:
        candidates.remove("integer")  # the number form covers integers (both are type="number" in XTML)
    forms = [(t, {**schema, "type": t}) for t in candidates]
    return [(t, s) for t, s in forms if _satisfiable(s)] or [("string", schema)]


class K3Grammars:
    """Grammars for a K3 XTML assistant turn (tokens from a K3-layout tokenizer)."""

    def __init__(self, tokenizer):
        name = tokenizer.special_token_id
        self._tokenizer = tokenizer
        self._open, self._close, self._sep, self._end = (
            f"<[{name(n)}]>" for n in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))

    def _markup_tokens(self, *, thinking: bool, name: str, arguments: list[tuple[str, str]]) -> int:
        """Tokens of the fixed markup of a turn holding one call of `name` with these (key, XTML type)
        arguments, from the end of the think text to `<|end_of_msg|>`."""
        def start(tag):
            return f"<|open|>{tag}<|sep|>"

        def stop(tag):
            return f"<|close|>{tag}<|sep|>"
        text = (stop("think") + start("response") if thinking else "") + stop("response") + start("tools")
        text += start(f'call tool="{_attr(name)}" index="1"')
        text += "".join(start(f'argument key="{_attr(key)}" type="{t}"') + stop("argument") for key, t in arguments)
        text += stop("call") + stop("tools") + stop("message") + "<|end_of_msg|>"
        return len(self._tokenizer.encode(text, allow_special=True))

    def _start(self, tag: str) -> str:
        return f"{self._open} {_literal(tag)} {self._sep}"

    def _stop(self, tag: str) -> str:
        return f"{self._close} {_literal(tag)} {self._sep}"

    def _turn(self, body: str, *, thinking: bool, think_tokens: int, tools: str = "") -> list[str]:
        rules = [_TEXT_TERMINAL]
        think = ""
        if thinking:
            think = f"{self._stop('think')} {self._start('response')} "
            if think_tokens:
                think = "think_text " + think
                rules.append(_think_text(think_tokens))
        return [f"start: {think}{body} {self._stop('response')} {tools}{self._stop('message')} {self._end}",
                *rules]

    def response(self, schema: dict, *, thinking: bool, think_tokens: int = 0) -> str:
        """The response channel holds exactly one JSON value matching `schema`; no tool calls.

        thinking: the prompt ends inside the think channel; think_tokens: its budget (module docstring).
        """
        rules = self._turn("body", thinking=thinking, think_tokens=think_tokens) + [f"body: {_json_expr(schema)}"]
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))

    def tool_calls(self, tools: list[dict], *, thinking: bool, multiple: bool, think_tokens: int = 0,
                   call_tokens: int | None = None) -> str:
        """An empty response channel, then a tools channel with one call of `tools` (or, with `multiple`, one to
        MAX_CALLS calls), indexed 1, 2, ... (for tool_choice "required" / named).

        thinking, think_tokens: as for `response`. call_tokens: the tokens left for the calls (max_tokens less the
        think budget). What a call's fixed markup (all its arguments present) leaves of them is shared evenly
        between its arguments, and the raw text of a string argument without enum or maxLength is held to its
        share, so a first call fits in call_tokens unless JSON-valued arguments overrun their own shares or the
        markup alone does not fit (None: the text is unbounded).
        """
        calls, rules, positions = _call_sequence(len(tools), multiple, first_index=1)
        tools_part = f"{self._start('tools')} {calls} {self._stop('tools')} "
        rules = self._turn("", thinking=thinking, think_tokens=think_tokens, tools=tools_part) + rules
        for i, tool in enumerate(tools):
            rules += self._call_rules(i, *_function(tool), positions, call_tokens, thinking)
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))

    def _call_rules(self, i: int, name: str, parameters: dict, positions: range, call_tokens: int | None,
                    thinking: bool) -> list[str]:
        body, rules = self._call_body(i, name, parameters, call_tokens, thinking)
        return rules + [f'call_{i}_{k}: {self._open} {_literal(f"call tool=\"{_attr(name)}\" index=\"{k}\"")} '
                        f'{self._sep} {body} {self._stop("call")}' for k in positions]

    def _call_body(self, i: int, name: str, parameters: dict, call_tokens: int | None,
                   thinking: bool) -> tuple[str, list[str]]:
        """(the expression of call i's arguments, the rules it uses)."""
        properties = parameters.get("properties")
        if parameters.get("type", "object") != "object" or not isinstance(properties, dict) or any(
                key in parameters for key in ("anyOf", "oneOf", "allOf", "$ref")):
            return f'{self._start("json type=\"object\"")} {_json_expr(parameters)} {self._stop("json")}', []
        rules = []
        required = set(parameters.get("required", []))
        forms = {key: _typed_forms(_with_definitions(sub, parameters) if isinstance(sub, dict) else {})
                 for key, sub in properties.items()}
        text_tokens = None
        if call_tokens is not None:
            markup = self._markup_tokens(thinking=thinking, name=name, arguments=[
                (key, max((_XTML_TYPE_OF[t] for t, _ in typed), key=len)) for key, typed in forms.items()])
            text_tokens = max(1, (call_tokens - markup) // max(1, len(forms)))
        args = []
        for j, (key, typed) in enumerate(forms.items()):
            rule = f"arg_{i}_{j}"
            args.append(rule if key in required else f"{rule}?")
            alternatives = []
            for t, sub in typed:
                if t == "string":
                    value = _string_value(sub, f"text_{i}_{j}")
                    if value == f"text_{i}_{j}":
                        bound = f"[max_tokens={text_tokens}]" if text_tokens else ""
                        rules.append(f"text_{i}_{j}{bound}: TEXT")
                else:
                    value = _number_value(t, sub, text_tokens) if t in ("integer", "number") else _json_expr(sub)
                alternatives.append(f'{self._start(f"argument key=\"{_attr(key)}\" type=\"{_XTML_TYPE_OF[t]}\"")} '
                                    f'{value} {self._stop("argument")}')
            rules.append(f"{rule}: " + " | ".join(alternatives))
        return " ".join(args), rules


def _string_value(schema: dict, free_text_rule: str) -> str:
    """Raw-text grammar of a string argument: its enum literals, else text bounded by maxLength, else
    `free_text_rule` (the caller's token-bounded text)."""
    strings = [v for v in schema["enum"] if isinstance(v, str)] if isinstance(schema.get("enum"), list) else []
    if strings:  # (the enum's other members are other forms of the argument)
        return "(" + " | ".join(_literal(v) for v in strings) + ")"
    if isinstance(schema.get("const"), str):
        return _literal(schema["const"])
    if isinstance(schema.get("maxLength"), int):
        low = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
        return f"/(.|\\n){{{low},{schema['maxLength']}}}/"
    return free_text_rule


def _number_value(json_type: str, schema: dict, tokens: int | None) -> str:
    """A number element's JSON: a plain number of at most `tokens` characters when the schema says no more than
    its type, else the schema's own grammar (its bounds, enum, multipleOf, ...)."""
    if set(schema) <= _ANNOTATIONS:
        return _bounded_number(json_type, tokens)
    return _json_expr(schema)


class K2Grammars:
    """Grammars for a Kimi K2 / Kimi-Linear assistant turn (tokens from a K2-layout tokenizer).

    `thinking` is taken for the same interface as K3Grammars and not needed: the K2 generation prompt is the
    same either way; a leading think block (the model opens it) is allowed when `think_tokens` is non-zero.
    """

    def __init__(self, tokenizer):
        name = tokenizer.special_token_id
        self._ids = {n: f"<[{name(n)}]>" for n in (
            "<|im_end|>", "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
            "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")}

    def _turn(self, body: str, think_tokens: int) -> list[str]:
        ids = self._ids
        if not think_tokens:
            return [f"start: {body} {ids['<|im_end|>']}", _TEXT_TERMINAL]
        return [f"start: think? {body} {ids['<|im_end|>']}", f"think: {ids['<think>']} think_text {ids['</think>']}",
                _think_text(think_tokens), _TEXT_TERMINAL]

    def response(self, schema: dict, *, thinking: bool, think_tokens: int = 0) -> str:
        """Content is exactly one JSON value matching `schema` (an optional think block of at most
        `think_tokens` tokens before it)."""
        rules = self._turn("body", think_tokens) + [f"body: {_json_expr(schema)}"]
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))

    def tool_calls(self, tools: list[dict], *, thinking: bool, multiple: bool, think_tokens: int = 0,
                   call_tokens: int | None = None) -> str:
        """No content, a tool-calls section with one call (one to MAX_CALLS with `multiple`) of `tools`, indexed
        0, 1, ... (an optional think block of at most `think_tokens` tokens before it). call_tokens is taken for
        K3Grammars' interface: K2 arguments are JSON objects, which end at their closing brace."""
        ids = self._ids
        calls, rules, positions = _call_sequence(len(tools), multiple, first_index=0)
        section = f"{ids['<|tool_calls_section_begin|>']} {calls} {ids['<|tool_calls_section_end|>']}"
        rules = self._turn(section, think_tokens) + rules
        for i, tool in enumerate(tools):
            name, parameters = _function(tool)
            rules += [f"call_{i}_{k}: {ids['<|tool_call_begin|>']} {_literal(f'functions.{name}:{k}')} "
                      f"{ids['<|tool_call_argument_begin|>']} {_json_expr(parameters)} {ids['<|tool_call_end|>']}"
                      for k in positions]
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
