"""Chat figures of a checkpoint through the real OpenAI server, on standard-library modules it never saw.

    python -m serve.bench.chat_eval CHECKPOINT [--limit N] [--concurrency 32] [--no-update-report]

Serves CHECKPOINT in this process as ``kimi-jax serve CHECKPOINT --enable-auto-tool-choice --tool-call-parser
kimi_k3 --reasoning-parser kimi_k3`` would (same argument parser, engine, app and parsers) and sends, at
temperature 0, the first turns of conversations built by :mod:`kimi_jax.training.transcripts` from the held-out
names of :func:`kimi_jax.training.stdlib_docs.stdlib_entries` (files never trained on) with a fresh seed:

* ``ask``: "What does `functools.reduce` do?" without tools: the summary line, exactly or nearly (closed book);
* ``lookup`` / ``calculator``: the same with ``lookup_doc`` / ``calculator`` declared and ``tool_choice`` auto: a
  call parsed into ``tool_calls``, the right call, and after the tool's result an answer with the summary line /
  the value (the round trip a client runs);
* ``write``, ``follow_up``, ``greeting``: code, a second turn, hello (with tools declared: no call).

An answer is empty when its ``content`` (reasoning split off) is blank. The figures go into CHECKPOINT's
``training.json`` under ``chat_eval`` and its ``TRAINING.md`` is rewritten (unless ``--no-update-report``), with
sample exchanges for the README; they are also printed as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import time

import httpx

from kimi_jax.training.stdlib_docs import DocEntry, stdlib_entries
from kimi_jax.training.transcripts import CALCULATOR, LOOKUP_DOC, Builder, Conversation, calculate, run_tool

NEAR_RATIO = 0.8  # difflib ratio of answer and summary line that counts as a near match
SEED = 1234  # conversations' seed: phrasings and system prompts differ from training's
CALCULATOR_PROMPTS = 60
GREETING_PROMPTS = 20
MAX_TOKENS = {"write": 512}
DEFAULT_MAX_TOKENS = 256
SHOWCASE = ("os.path.join", "functools.reduce")  # a trained and a held-out name, for the samples
SERVE_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3",
               "--warm-up", "full")  # every bucket compiled before the first request: nothing compiles beside it


def _normal(text: str) -> str:
    return " ".join(text.split())


def summary_match(content: str, summary: str) -> str | None:
    """"exact" when the summary line is in the answer (whitespace-normalised), "near" when the answer (or its part
    after the first ": ") is at least :data:`NEAR_RATIO` similar to it, else None."""
    content, summary = _normal(content), _normal(summary)
    if summary and summary in content:
        return "exact"
    candidates = [content] + ([content.split(": ", 1)[1]] if ": " in content else [])
    best = max(difflib.SequenceMatcher(None, c, summary).ratio() for c in candidates)
    return "near" if best >= NEAR_RATIO else None


def is_empty(message: dict) -> bool:
    return not (message.get("content") or "").strip()


def first_turn(conv: Conversation) -> list[dict]:
    """The messages before the conversation's first assistant turn: what a client sends first."""
    return conv.messages[:next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")]


def heldout_conversations(heldout: list[DocEntry], *, limit: int | None, seed: int = SEED
                          ) -> dict[str, list[tuple[DocEntry | None, Conversation]]]:
    """(entry, conversation) pairs of each kind about the ``heldout`` entries (the first ``limit`` of them)."""
    b = Builder(seed)
    entries = heldout[:limit] if limit else heldout
    return {"ask": [(e, b.ask(e)) for e in entries], "lookup": [(e, b.lookup(e)) for e in entries],
            "calculator": [(None, b.calculator()) for _ in range(limit or CALCULATOR_PROMPTS)],
            "write": [(e, b.write(e)) for e in entries if e.source is not None],
            "follow_up": [(e, b.follow_up(e)) for e in entries],
            "greeting": [(None, b.greeting()) for _ in range(limit or GREETING_PROMPTS)]}


class Chat:
    """Temperature-0 chat requests to the server at ``url``, at most ``concurrency`` at a time."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, concurrency: int):
        self.client, self.url, self.model = client, url, model
        self.slots = asyncio.Semaphore(concurrency)

    async def __call__(self, messages: list[dict], tools: list[dict] | None, *, thinking: bool = True,
                       max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
        """The reply's choice: ``{"message": {...}, "finish_reason": ...}`` (message without null fields)."""
        body = {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
                "chat_template_kwargs": {"thinking": thinking}, **({"tools": tools} if tools else {})}
        async with self.slots:
            response = await self.client.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        message = {k: v for k, v in choice["message"].items() if v is not None}
        return {"message": message, "finish_reason": choice["finish_reason"]}


def _tool_results(message: dict, entries: dict[str, DocEntry]) -> list[dict]:
    results = []
    for call in message.get("tool_calls", []):
        arguments = json.loads(call["function"]["arguments"])
        results.append({"role": "tool", "tool_call_id": call["id"],
                        "content": run_tool(call["function"]["name"], arguments, entries)})
    return results


async def converse(chat: Chat, entry: DocEntry | None, conv: Conversation, entries: dict[str, DocEntry]) -> dict:
    """The first reply to ``conv`` and, for a tool call or a follow-up, the reply to the next turn:
    ``{"entry", "conv", "first", "second"}`` (second None when there is none)."""
    request = first_turn(conv)
    max_tokens = MAX_TOKENS.get(conv.kind, DEFAULT_MAX_TOKENS)
    first = await chat(request, conv.tools, thinking=conv.thinking, max_tokens=max_tokens)
    history = request + [first["message"]]
    if first["message"].get("tool_calls"):
        history += _tool_results(first["message"], entries)
    elif conv.kind == "follow_up":
        history.append(conv.messages[len(request) + 1])
    else:
        return {"entry": entry, "conv": conv, "first": first, "second": None}
    second = await chat(history, conv.tools, thinking=conv.thinking, max_tokens=max_tokens)
    return {"entry": entry, "conv": conv, "first": first, "second": second}


def _expected_call(conv: Conversation) -> dict:
    call = conv.messages[len(first_turn(conv))]["tool_calls"][0]["function"]
    return {"name": call["name"], "arguments": json.loads(call["arguments"])}


def _right_call(message: dict, expected: dict) -> bool:
    calls = message.get("tool_calls", [])
    if len(calls) != 1 or calls[0]["function"]["name"] != expected["name"]:
        return False
    got = json.loads(calls[0]["function"]["arguments"])
    if expected["name"] == "calculator":
        try:
            return calculate(str(got.get("expression", ""))) == calculate(expected["arguments"]["expression"])
        except ValueError:
            return False
    return got == expected["arguments"]


def _share(part: int, whole: int) -> dict:
    return {"count": part, "of": whole, "share": part / whole if whole else 0.0}


def score(results: dict[str, list[dict]]) -> dict:
    """The figures of :func:`converse` results by kind (see the module docstring)."""
    figures = {}
    asks = results["ask"]
    matches = [summary_match(r["first"]["message"].get("content", ""), r["entry"].summary) for r in asks]
    figures["ask_exact"] = _share(matches.count("exact"), len(asks))
    figures["ask_exact_or_near"] = _share(sum(m is not None for m in matches), len(asks))
    tool_runs = results["lookup"] + results["calculator"]
    figures["tool_calls_parsed"] = _share(sum(bool(r["first"]["message"].get("tool_calls")) for r in tool_runs),
                                          len(tool_runs))
    for kind in ("lookup", "calculator"):
        runs = results[kind]
        figures[f"{kind}_parsed"] = _share(sum(bool(r["first"]["message"].get("tool_calls")) for r in runs), len(runs))
        figures[f"{kind}_right_call"] = _share(sum(_right_call(r["first"]["message"], _expected_call(r["conv"]))
                                                   for r in runs), len(runs))
        answered = [r for r in runs if r["second"] is not None]
        figures[f"{kind}_answered"] = _share(sum(not is_empty(r["second"]["message"]) for r in answered), len(runs))
    grounded = [summary_match(r["second"]["message"].get("content", ""), r["entry"].summary)
                for r in results["lookup"] if r["second"] is not None]
    figures["lookup_answer_exact_or_near"] = _share(sum(m is not None for m in grounded), len(results["lookup"]))
    figures["calculator_answer_correct"] = _share(sum(
        r["second"] is not None and calculate(_expected_call(r["conv"])["arguments"]["expression"])
        in r["second"]["message"].get("content", "") for r in results["calculator"]), len(results["calculator"]))
    greetings_with_tools = [r for r in results["greeting"] if r["conv"].tools]
    figures["greeting_with_tools_called"] = _share(sum(bool(r["first"]["message"].get("tool_calls"))
                                                       for r in greetings_with_tools), len(greetings_with_tools))
    chat = chat_replies(results)
    figures["chat_empty"] = _share(sum(is_empty(c["message"]) for _, c in chat if not c["message"].get("tool_calls")),
                                   len(chat))
    figures["chat_cut_by_max_tokens"] = _share(sum(c["finish_reason"] == "length" for _, c in chat), len(chat))
    return figures


def chat_replies(results: dict) -> list[tuple[str, dict]]:
    """(kind, reply) of every chat answer scored for emptiness: the first replies of the conversations without a
    tool turn, and every second reply."""
    chat = [(kind, r["first"]) for kind in ("ask", "write", "follow_up", "greeting") for r in results[kind]]
    return chat + [(kind, r["second"]) for kind, rs in results.items() for r in rs if r["second"] is not None]


def empty_answers(results: dict) -> list[dict]:
    """The empty answers, for a look at why: kind, finish reason and the start of the reasoning."""
    return [{"kind": kind, "finish_reason": c["finish_reason"],
             "reasoning": (c["message"].get("reasoning_content") or "")[:200]}
            for kind, c in chat_replies(results) if is_empty(c["message"]) and not c["message"].get("tool_calls")]


ROWS = (("held-out tool prompts parsed into `tool_calls` (auto tool choice)", "tool_calls_parsed"),
        ("of them `lookup_doc` prompts: parsed / right call", ("lookup_parsed", "lookup_right_call")),
        ("of them `calculator` prompts: parsed / right call", ("calculator_parsed", "calculator_right_call")),
        ("answer after the tool result: summary line exact or near (`lookup_doc`)", "lookup_answer_exact_or_near"),
        ("answer after the tool result: the value (`calculator`)", "calculator_answer_correct"),
        ("closed book, held-out names: summary line exact / exact or near", ("ask_exact", "ask_exact_or_near")),
        ("empty answers on held-out chat prompts (temperature 0)", "chat_empty"),
        ("answers cut by max_tokens", "chat_cut_by_max_tokens"),
        ("greetings with tools declared that called a tool", "greeting_with_tools_called"))


def report_rows(figures: dict) -> list[list[str]]:
    """(figure, "k/n (p%)") rows for TRAINING.md."""
    def cell(key):
        f = figures[key]
        return f"{f['count']}/{f['of']} ({100 * f['share']:.0f}%)"
    return [[label, " / ".join(cell(k) for k in ((keys,) if isinstance(keys, str) else keys))]
            for label, keys in ROWS]


def sample_text(conv_messages: list[dict], replies: list[dict]) -> str:
    """A readable exchange: the client's messages, then each reply's reasoning, content and calls."""
    lines = []
    for m in conv_messages:
        if m["role"] in ("user", "tool"):
            lines.append(f"{m['role']}: {m['content']}")
    for reply in replies:
        m = reply["message"]
        if m.get("reasoning_content"):
            lines.append(f"reasoning_content: {m['reasoning_content'].strip()}")
        for call in m.get("tool_calls", []):
            lines.append(f"tool_calls: {call['function']['name']}({call['function']['arguments']})")
        if m.get("content"):
            lines.append(f"content: {m['content']}")
    return "\n".join(lines)


async def showcase(chat: Chat, train: list[DocEntry], heldout: list[DocEntry], entries: dict) -> list[str]:
    """Sample exchanges: a question about a trained name, a held-out one through ``lookup_doc``, a calculation,
    a greeting (as the README shows them)."""
    known = next((e for e in train if e.name == SHOWCASE[0]), train[0])
    unseen = next((e for e in heldout if e.name == SHOWCASE[1]), heldout[0])
    convs = [Conversation("ask", [{"role": "user", "content": f"What does `{known.name}` do?"}]),
             Conversation("lookup", [{"role": "user", "content": f"What does `{unseen.name}` do?"}], [LOOKUP_DOC]),
             Conversation("calculator", [{"role": "user", "content": "What is 37 * 12 + 5?"}], [CALCULATOR]),
             Conversation("greeting", [{"role": "user", "content": "Hi, who are you?"}])]
    samples = []
    for conv in convs:
        messages = list(conv.messages)
        first = await chat(messages, conv.tools)
        replies = [first]
        if first["message"].get("tool_calls"):
            results = _tool_results(first["message"], entries)
            replies.append(await chat(messages + [first["message"]] + results, conv.tools))
            messages += results
        samples.append(sample_text(messages, replies))
    return samples


async def evaluate(url: str, model: str, *, limit: int | None, concurrency: int, heldout_percent: int = 3,
                   root: str | None = None) -> dict:
    """Figures and samples against the server at ``url`` (serving ``model``)."""
    train, heldout = stdlib_entries(heldout_percent=heldout_percent, root=root)
    entries = {e.name: e for e in train + heldout}
    async with httpx.AsyncClient() as client:
        chat = Chat(client, url, model, concurrency)
        convs = heldout_conversations(heldout, limit=limit)
        runs = await asyncio.gather(*(converse(chat, e, c, entries) for cs in convs.values() for e, c in cs))
        results, i = {}, 0
        for kind, cs in convs.items():
            results[kind], i = runs[i:i + len(cs)], i + len(cs)
        figures = score(results)
        samples = await showcase(chat, train, heldout, entries)
    return {"figures": figures, "rows": report_rows(figures), "samples": samples, "empty": empty_answers(results)}


def serve_args(checkpoint: str, extra: list[str]) -> argparse.Namespace:
    from serve.openai.cli_args import add_serve_args

    return add_serve_args(argparse.ArgumentParser()).parse_args([checkpoint, *SERVE_FLAGS, *extra])


def run(checkpoint: str, *, limit: int | None = None, concurrency: int = 32, extra: list[str] = (),
        heldout_percent: int = 3, root: str | None = None) -> dict:
    """Serve ``checkpoint`` in this process with :data:`SERVE_FLAGS` plus ``extra`` serve flags, and evaluate."""
    import jax

    from serve.cli import engine_args_from_cli
    from serve.engine.async_engine import AsyncEngine
    from serve.engine.engine import LLMEngine
    from serve.openai.app import build_app
    from serve.openai.background import serve_in_thread
    from serve.openai.cli_args import server_config_from_args

    start = time.perf_counter()
    args = serve_args(checkpoint, list(extra))
    engine = AsyncEngine(LLMEngine.from_pretrained(checkpoint, dtype=args.dtype, **engine_args_from_cli(args)))
    ready = time.perf_counter() - start
    try:
        config = server_config_from_args(args, engine)
        with serve_in_thread(build_app(engine, config)) as url:
            found = asyncio.run(evaluate(url, config.model_name, limit=limit, concurrency=concurrency,
                                         heldout_percent=heldout_percent, root=root))
    finally:
        engine.shutdown()
    found.update(command=" ".join(["kimi-jax serve", "CHECKPOINT", *SERVE_FLAGS, *extra]),
                 device=f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
                 engine_ready_seconds=ready, seconds=time.perf_counter() - start)
    return found


def main(argv=None) -> None:
    from kimi_jax.training.report import update_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--limit", type=int, default=None, help="held-out names (and calculator / greeting prompts) "
                                                            "per kind (default: all names)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--heldout-percent", type=int, default=3)
    ap.add_argument("--stdlib-root", default=None, help="standard-library folder (default: this interpreter's)")
    ap.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                    help="extra `kimi-jax serve` flag, e.g. --serve-flag=--max-num-seqs=32 (repeatable)")
    ap.add_argument("--no-update-report", action="store_true")
    args = ap.parse_args(argv)
    found = run(args.checkpoint, limit=args.limit, concurrency=args.concurrency, extra=args.serve_flag,
                heldout_percent=args.heldout_percent, root=args.stdlib_root)
    print(json.dumps(found, indent=1))
    if not args.no_update_report:
        update_report(args.checkpoint, {"chat_eval": found})


if __name__ == "__main__":
    main()
