"""Engine logprobs (`list[dict[token id, logprob]]`, one dict per generated token) in the OpenAI formats."""

from __future__ import annotations

from serve.openai.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf; vLLM reports a token missing from the engine's dict with this value too.
MISSING_LOGPROB = -9999.0


def token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes; a token that is only part of a character reads `bytes:\\xe4\\xbd`."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], top_k: int) -> ChatLogprobs:
    """`choices[].logprobs` of a chat completion for the tokens `token_ids` (`top_k` alternatives each)."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        text, raw = token_text(tokenizer, token_id)
        top = [TopLogprob(token=t, logprob=lp, bytes=b)
               for (t, b), lp in ((token_text(tokenizer, i), lp) for i, lp in _top(entry, top_k))]
        content.append(TokenLogprob(token=text, logprob=entry.get(token_id, MISSING_LOGPROB), bytes=raw,
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], top_k: int,
                        text_offset: int) -> CompletionLogprobs:
    """`choices[].logprobs` of a legacy completion; `text_offset` is where the first token starts in the text."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text, _ = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id, MISSING_LOGPROB))
        tops.append({token_text(tokenizer, i)[0]: lp for i, lp in _top(entry, top_k)})
        offsets.append(text_offset)
        text_offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets)
