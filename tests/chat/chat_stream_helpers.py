"""Drive a streaming output parser over every chunking of a transcript and check the pieces agree."""

import random

from kimi_jax.chat import ParsedMessage


def stream(make_parser, chunks: list[str]) -> tuple[list, ParsedMessage]:
    """Feed chunks, then flush; returns (deltas including the flush delta, finished message)."""
    parser = make_parser()
    deltas = [parser.feed(chunk) for chunk in chunks]
    deltas.append(parser.flush())
    return deltas, parser.finish()


def parse_in_all_chunkings(make_parser, text: str) -> ParsedMessage:
    """The message parsed from `text` whole; asserts every 2-way split, char-by-char feeding and a random
    chunking give the same message, and that the deltas add up to it."""
    _, whole = stream(make_parser, [text])
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(6, max(len(text) - 1, 0))))
    random_chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    chunkings = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text), random_chunks]
    for chunks in chunkings:
        deltas, message = stream(make_parser, chunks)
        assert message == whole, chunks
        assert "".join(d.reasoning for d in deltas) == message.reasoning_content
        assert "".join(d.content for d in deltas) == message.content
        assert [c for d in deltas for c in d.tool_calls] == message.tool_calls
    return whole
