"""Chat conversations about the standard library, built from :class:`~kimi_jax.training.stdlib_docs.DocEntry`s.

Every conversation is an OpenAI-style request (``messages`` with assistant turns, ``tools``, the thinking switch
and reasoning effort), so it renders through :func:`kimi_jax.chat.render_k3` exactly as the server renders a
client's request. Kinds (:data:`KINDS`):

* ``ask``: "What does `os.path.join` do?" -> "`os.path.join(a, *p)`: <summary line>".
* ``lookup``: the same question with ``lookup_doc`` declared: a call, the tool's result (signature + first docstring
  paragraph, :func:`run_tool`), then the same answer quoted from the result.
* ``write``: "Write a function ..." -> the function's standard-library source in a code block.
* ``follow_up``: an ``ask`` and then its signature, module, source or thanks.
* ``calculator``: arithmetic with ``calculator`` declared: a call, the result, "12 * 7 = 84."
* ``greeting``: hello / who are you, with or without tools (no call).

Assistant turns think in one short sentence (ending in a newline, so the text reads well when a server without
a reasoning parser returns thinking and answer together). Seeded: the same entries and seed give the same
conversations.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import random

from kimi_jax.training.stdlib_docs import DocEntry

KINDS = ("ask", "lookup", "write", "follow_up", "calculator", "greeting")
LOOKUP_DOC = {"type": "function", "function": {
    "name": "lookup_doc", "description": "Look up the documentation of a Python standard-library name.",
    "parameters": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "description": "dotted name, e.g. os.path.join"}}}}}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "e.g. (12 + 5) * 3"}}}}}

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are Kimi, an AI assistant.",
                  "You are a concise assistant for Python programmers.",
                  "Answer questions about the Python standard library.",
                  "You are a helpful coding assistant. Keep answers short.")
ASK = ("What does `{n}` do?", "What does {n} do?", "What is `{n}` for?", "Explain `{n}`.", "Tell me about `{n}`.",
       "what does {n} do", "Can you explain what `{n}` does?", "Describe {n}.", "What is {n}?")
ASK_MODULE = ("What is the `{n}` module for?", "What does the {n} module do?", "Tell me about the `{n}` module.",
              "What is {n}?", "Explain the `{n}` module.")
LOOKUP_ONLY = ("Look up `{n}`.", "Check the docs for `{n}`.", "Use the documentation to explain `{n}`.")
WRITE = ("Write a function `{d}`: {s}", "Write a Python function {short}: {s}", "Implement `{d}`. {s}",
         "Show me how `{n}` is implemented.", "Write the function {n}.")
SIGNATURE = ("What arguments does it take?", "What are its parameters?", "What is its signature?")
WHERE = ("Which module is it in?", "Where is it defined?", "How do I import it?")
SOURCE = ("Show me its source.", "How is it implemented?", "Show me the code.")
THANKS = ("Thanks!", "Thank you.", "Great, thanks.", "thanks")
WELCOME = ("You're welcome!", "Glad to help.", "You're welcome. Ask me about any other standard-library name.")
CALC = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "How much is {e}?", "{e} = ?")
IDENTITY = ("I am a small language model with the Kimi K3 architecture, trained on the Python standard library. "
            "Ask me what a module, class or function does, or ask me to write one.")
GREETINGS = {
    "The user greets me.\n": (("Hi", "Hello!", "Hey", "Good morning!", "hello", "Hi there!"),
                              ("Hello! Ask me about the Python standard library: what a function does, or how it "
                               "is implemented.", "Hi! What would you like to know about the Python standard "
                               "library?")),
    "The user asks who I am.\n": (("Who are you?", "What are you?", "What can you do?", "Hi, who are you?",
                                   "Introduce yourself."), (IDENTITY,)),
    "The user asks how I am.\n": (("How are you?", "How are you doing?"),
                                  ("I'm fine, thanks. What would you like to know about the Python standard "
                                   "library?",)),
}
EFFORTS = (None, "low", "high", "max")
THINKING_SHARE = 0.85  # of conversations rendered with thinking on (the server's default)
SYSTEM_SHARE = 0.4
HISTORY_REASONING_SHARE = 0.5  # earlier assistant turns that keep their reasoning (clients often drop it)


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A chat request with its assistant turns: ``messages`` (OpenAI dicts), ``tools`` (None: none declared),
    the render options, and its kind (one of :data:`KINDS`)."""

    kind: str
    messages: list[dict]
    tools: list[dict] | None = None
    thinking: bool = True
    reasoning_effort: str | None = None


def answer_text(entry: DocEntry) -> str:
    """The answer to "what does it do": the name and the summary line, verbatim."""
    if entry.kind == "module":
        return f"The `{entry.name}` module: {entry.summary}"
    return f"`{entry.display}`: {entry.summary}"


def doc_text(entry: DocEntry) -> str:
    """``lookup_doc``'s result: the signature line, then the docstring's first paragraph."""
    head = f"module {entry.name}" if entry.kind == "module" else f"{entry.name}{entry.signature}"
    return f"{head}\n\n{entry.paragraph}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT = 64


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"expression: exponent {right} is too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"expression: only numbers, + - * / // % ** and parentheses are allowed, "
                     f"got {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """The ``calculator`` tool: the value of an arithmetic expression as text (``"84"``, ``"2.5"``)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"expression: not an arithmetic expression: {expression!r}") from err
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError as err:
        raise ValueError("expression: division by zero") from err
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.10g}"
    return str(value)


def run_tool(name: str, arguments: dict, entries: dict[str, DocEntry]) -> str:
    """The result a tool returns for a call (``entries``: ``lookup_doc``'s names); errors as text, like a tool."""
    if name == "lookup_doc":
        entry = entries.get(str(arguments.get("name", "")).strip("` "))
        return doc_text(entry) if entry else f"No documentation found for {arguments.get('name')!r}."
    if name == "calculator":
        try:
            return calculate(str(arguments.get("expression", "")))
        except ValueError as err:
            return f"Error: {err}"
    return f"Error: unknown tool {name!r}."


def expression(rng: random.Random) -> str:
    """A random arithmetic expression of two or three integers."""
    a, b, c = rng.randint(2, 999), rng.randint(2, 999), rng.randint(2, 99)
    form = rng.randrange(5)
    if form == 0:
        return f"{a} {rng.choice('+-*')} {b}"
    if form == 1:
        return f"{a * c} / {c}"
    if form == 2:
        return f"({a} {rng.choice('+-')} {b}) * {c}"
    if form == 3:
        return f"{a} {rng.choice('+-')} {b} {rng.choice('+-')} {c}"
    return f"{a} * {c} {rng.choice('+-')} {b}"


def _call(name: str, arguments: dict, reasoning: str, index: int = 1) -> dict:
    return {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [
        {"id": f"functions.{name}:{index}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _reply(content: str, reasoning: str) -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


def _tool_result(name: str, content: str, index: int = 1) -> dict:
    return {"role": "tool", "tool_call_id": f"functions.{name}:{index}", "content": content}


class Builder:
    """Conversation builders sharing one seeded ``random.Random``."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def _conversation(self, kind: str, turns: list[dict], tools: list[dict] | None = None) -> Conversation:
        rng = self.rng
        system = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < SYSTEM_SHARE else []
        thinking = rng.random() < THINKING_SHARE
        last = max(i for i, m in enumerate(turns) if m["role"] == "assistant")
        messages = []
        for i, m in enumerate(turns):  # earlier assistant turns often come back without their reasoning
            if m["role"] == "assistant" and i < last and rng.random() >= HISTORY_REASONING_SHARE:
                m = {k: v for k, v in m.items() if k != "reasoning_content"}
            messages.append(m)
        return Conversation(kind, system + messages, tools, thinking, rng.choice(EFFORTS) if thinking else None)

    def question(self, entry: DocEntry, forms: tuple[str, ...] = ()) -> str:
        pool = (ASK_MODULE if entry.kind == "module" else ASK) + forms
        return self.rng.choice(pool).format(n=entry.name)

    def _answer(self, entry: DocEntry) -> dict:
        where = "module" if entry.kind == "module" else f"{entry.kind} in `{entry.module}`"
        reasoning = self.rng.choice((f"The user asks what `{entry.name}` does.\n",
                                     f"`{entry.name}` is a {where}; I recall its summary.\n"))
        return _reply(answer_text(entry), reasoning)

    def _tools(self, main: dict) -> list[dict]:
        other = CALCULATOR if main is LOOKUP_DOC else LOOKUP_DOC
        return self.rng.choice(([main], [main, other], [other, main]))

    def ask(self, entry: DocEntry) -> Conversation:
        tools = [CALCULATOR] if self.rng.random() < 0.15 else None  # declared, but of no use here
        return self._conversation("ask", [{"role": "user", "content": self.question(entry)}, self._answer(entry)],
                                  tools)

    def lookup(self, entry: DocEntry) -> Conversation:
        turns = [{"role": "user", "content": self.question(entry, LOOKUP_ONLY)},
                 _call("lookup_doc", {"name": entry.name}, f"I will look up `{entry.name}` with lookup_doc.\n"),
                 _tool_result("lookup_doc", doc_text(entry)),
                 _reply(answer_text(entry), f"The documentation of `{entry.name}` answers it.\n")]
        return self._conversation("lookup", turns, self._tools(LOOKUP_DOC))

    def _code(self, entry: DocEntry) -> dict:
        return _reply(f"Here is `{entry.short_name}` as the `{entry.module}` module defines it:\n\n"
                      f"```python\n{entry.source}\n```",
                      f"The user wants `{entry.short_name}` from `{entry.module}`.\n")

    def write(self, entry: DocEntry) -> Conversation:
        if entry.source is None:
            raise ValueError(f"entry {entry.name}: write needs a function with its source")
        question = self.rng.choice(WRITE).format(d=entry.display, n=entry.name, s=entry.summary,
                                                 short=entry.short_name + entry.signature)
        return self._conversation("write", [{"role": "user", "content": question}, self._code(entry)])

    def follow_up(self, entry: DocEntry) -> Conversation:
        rng = self.rng
        turns = [{"role": "user", "content": self.question(entry)}, self._answer(entry)]
        options = ["where", "thanks"] + (["signature"] if entry.kind != "module" else []) + (
            ["source"] if entry.source else [])
        choice = rng.choice(options)
        user = lambda forms: {"role": "user", "content": rng.choice(forms)}  # noqa: E731
        if choice == "signature":
            signature = f"Its signature is `{entry.name}{entry.signature}`."
            turns += [user(SIGNATURE), _reply(signature, "The user asks for the signature.\n")]
        elif choice == "where":
            turns += [user(WHERE), _reply(_where(entry), "The user asks where it is.\n")]
        elif choice == "source":
            turns += [user(SOURCE), self._code(entry)]
        if choice == "thanks" or rng.random() < 0.3:
            turns += [user(THANKS), _reply(rng.choice(WELCOME), "The user thanks me.\n")]
        return self._conversation("follow_up", turns)

    def calculator(self) -> Conversation:
        expr = expression(self.rng)
        result = calculate(expr)
        turns = [{"role": "user", "content": self.rng.choice(CALC).format(e=expr)},
                 _call("calculator", {"expression": expr}, f"I will compute {expr} with the calculator.\n"),
                 _tool_result("calculator", result),
                 _reply(f"{expr} = {result}.", f"The calculator returned {result}.\n")]
        return self._conversation("calculator", turns, self._tools(CALCULATOR))

    def greeting(self) -> Conversation:
        reasoning = self.rng.choice(sorted(GREETINGS))
        questions, answers = GREETINGS[reasoning]
        tools = self._tools(self.rng.choice((LOOKUP_DOC, CALCULATOR))) if self.rng.random() < 0.3 else None
        turns = [{"role": "user", "content": self.rng.choice(questions)}, _reply(self.rng.choice(answers), reasoning)]
        return self._conversation("greeting", turns, tools)


def _where(entry: DocEntry) -> str:
    if entry.kind == "module":
        return f"Use `import {entry.name}`."
    if entry.kind == "method":
        owner = entry.name.rsplit(".", 1)[0]
        return f"It is a method of `{owner.rsplit('.', 1)[-1]}` in the `{entry.module}` module."
    return f"It is in the `{entry.module}` module: `from {entry.module} import {entry.short_name}`."


def build_conversations(entries: list[DocEntry], *, seed: int, follow_up_share: float = 0.5,
                        calculator: int | None = None, greeting: int | None = None) -> list[Conversation]:
    """Per entry an ``ask`` and a ``lookup``, a ``write`` for functions with source, a ``follow_up`` for a
    ``follow_up_share`` of them; plus ``calculator`` and ``greeting`` conversations (default: half and a sixth of
    the entry count). In that order; shuffle before packing."""
    b = Builder(seed)
    out = []
    for entry in entries:
        out += [b.ask(entry), b.lookup(entry)]
        if entry.source is not None:
            out.append(b.write(entry))
        if b.rng.random() < follow_up_share:
            out.append(b.follow_up(entry))
    out += [b.calculator() for _ in range(len(entries) // 2 if calculator is None else calculator)]
    out += [b.greeting() for _ in range(len(entries) // 6 if greeting is None else greeting)]
    return out
