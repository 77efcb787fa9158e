"""One streamed request against an OpenAI-compatible endpoint, timed like `vllm bench serve`."""

from __future__ import annotations

import dataclasses
import json
import time

import httpx

from serve.bench.datasets import BenchRequest


@dataclasses.dataclass
class RequestResult:
    """Timings in seconds. `itl`: gaps between successive chunks that carried text after the first."""
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    generated_text: str = ""
    error: str = ""


def build_payload(request: BenchRequest, *, model: str, chat: bool, ignore_eos: bool, temperature: float,
                  extra_body: dict) -> dict:
    payload = {"model": model, "max_tokens": request.output_len, "temperature": temperature, "stream": True,
               "stream_options": {"include_usage": True}, **extra_body}
    if ignore_eos:
        payload["ignore_eos"] = True
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    return payload


def _chunk_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "") + "".join(
        (c.get("function") or {}).get("arguments") or "" for c in delta.get("tool_calls") or [])


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, request: BenchRequest, *,
                       chat: bool, headers: dict) -> RequestResult:
    """POST `payload`, read the SSE stream, record TTFT / ITL / latency and the usage the server reports.

    Output tokens come from the final usage chunk; servers that send none are counted one token per chunk.
    """
    result = RequestResult(prompt_len=request.prompt_len)
    start = result.start_time = time.perf_counter()
    last = start
    text, chunks, usage = [], 0, None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = json.dumps(event["error"])
                    return result
                usage = event.get("usage") or usage
                piece = "".join(_chunk_text(c, chat) for c in event.get("choices") or [])
                if not piece:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                result.chunk_times.append(now)
                last, chunks = now, chunks + 1
                text.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.latency = time.perf_counter() - start
    result.generated_text = "".join(text)
    result.output_tokens = usage["completion_tokens"] if usage else chunks
    if usage:
        result.prompt_len = usage["prompt_tokens"]
    result.success = chunks > 0
    if not result.success:
        result.error = "the stream carried no text"
    return result
