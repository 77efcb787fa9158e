"""`POST /v1/completions`: raw prompts (text or token ids, one or many) -> text completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import ServerSentEvent

from serve.openai.config import ServerConfig
from serve.openai.errors import bad_request
from serve.openai.grammars import json_grammar
from serve.openai.logprobs import completion_logprobs
from serve.openai.metrics import ServerMetrics
from serve.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage, new_id, now
from serve.openai.sampling import (build_sampling_params, check_prompt_length, mask_vocab_size, resolve_max_tokens,
                                   response_format_factory)
from serve.openai.streaming import (CLIENT_CLOSED_REQUEST, SSE_DONE, Deadline, SSEResponse, cancel_on_disconnect,
                                    check_admission, generate_or_abort, merge_streams, sse_error_event, sse_event)

class CompletionHandler:
    def __init__(self, engine, config: ServerConfig, metrics: ServerMetrics):
        self._engine = engine
        self._config = config
        self._metrics = metrics
        self._tokenizer = engine.tokenizer

    def _prompts(self, prompt: str | list) -> list[list[int]]:
        """Token ids of each prompt; raw text may spell special tokens (it is model input, not a chat message)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty.", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        vocab_size = self._tokenizer.vocab_size
        prompts = []
        for p in prompt:
            ids = self._tokenizer.encode(p, allow_special=True) if isinstance(p, str) else list(p)
            if any(not 0 <= i < vocab_size for i in ids):
                raise bad_request(f"prompt token ids must lie in [0, {vocab_size}).", param="prompt")
            check_prompt_length(len(ids), self._engine.max_model_len, param="prompt")
            prompts.append(ids)
        return prompts

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        if request.echo and request.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported.", param="echo")
        prompts = self._prompts(request.prompt)
        factory = response_format_factory(self._tokenizer, request.response_format, json_grammar,
                                          vocab_size=mask_vocab_size(self._engine))
        params = [build_sampling_params(
            request, max_tokens=resolve_max_tokens(request.max_tokens, len(ids), self._engine.max_model_len,
                                                   param="max_tokens"),
            logprobs=request.logprobs, vocab_size=self._tokenizer.vocab_size,
            skip_special_tokens=request.skip_special_tokens, constraint_factory=factory) for ids in prompts]
        request_id = new_id("cmpl")
        check_admission(self._engine, sum(len(ids) for ids in prompts), request.n * len(prompts))
        deadline = Deadline.of(request.timeout, self._config.request_timeout_s)
        streams = [generate_or_abort(self._engine, ids, p, f"{request_id}-{i}", deadline)
                   for i, (ids, p) in enumerate(zip(prompts, params))]
        if request.stream:
            return SSEResponse(self._stream(request, request_id, prompts, streams))
        body = await cancel_on_disconnect(raw_request, self._collect(request, request_id, prompts, streams))
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(body.model_dump(mode="json"))

    def _prompt_texts(self, request: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        return [self._tokenizer.decode(ids) for ids in prompts] if request.echo else [""] * len(prompts)

    async def _collect(self, request: CompletionRequest, request_id: str, prompts: list[list[int]],
                       streams: list[AsyncIterator]) -> CompletionResponse:
        timers = [self._metrics.timer() for _ in prompts]
        finals = [None] * len(prompts)
        async with aclosing(merge_streams(streams)) as merged:
            async for i, output in merged:
                timers[i].on_output(sum(len(o.token_ids) for o in output.outputs))
                if output.finished:
                    timers[i].finish(output.outputs[0].finish_reason)
                    finals[i] = output
        echoes = self._prompt_texts(request, prompts)
        choices = []
        for i, final in enumerate(finals):
            for out in sorted(final.outputs, key=lambda o: o.index):
                logprobs = None if request.logprobs is None else completion_logprobs(
                    self._tokenizer, out.token_ids, out.logprobs or [], request.logprobs, 0)
                choices.append(CompletionChoice(index=i * request.n + out.index, text=echoes[i] + out.text,
                                                logprobs=logprobs, finish_reason=out.finish_reason,
                                                stop_reason=out.stop_reason))
        num_generated = sum(len(o.token_ids) for f in finals for o in f.outputs)
        num_prompt = sum(len(ids) for ids in prompts)
        return CompletionResponse(id=request_id, created=now(), model=self._config.model_name, choices=choices,
                                  usage=Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                              total_tokens=num_prompt + num_generated))

    async def _stream(self, request: CompletionRequest, request_id: str, prompts: list[list[int]],
                      streams: list[AsyncIterator]) -> AsyncIterator[ServerSentEvent]:
        created, model = now(), self._config.model_name
        timers = [self._metrics.timer() for _ in prompts]
        echoes = self._prompt_texts(request, prompts)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        num_prompt = sum(len(ids) for ids in prompts)
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats

        def usage() -> Usage:
            generated = sum(sent_tokens.values())
            return Usage(prompt_tokens=num_prompt, completion_tokens=generated, total_tokens=num_prompt + generated)

        def choice_chunk(i: int, out) -> ServerSentEvent | None:
            """The chunk one engine output adds to choice `i * n + out.index` (None when it adds nothing)."""
            index = i * request.n + out.index
            start_text, start_tokens = sent_text.get(index, 0), sent_tokens.get(index, 0)
            delta = out.text[start_text:] if index in sent_text else echoes[i] + out.text
            if not delta and out.finish_reason is None and index in sent_text:
                return None  # e.g. the bytes of a character that is not complete yet
            new_ids = out.token_ids[start_tokens:]
            logprobs = None if request.logprobs is None else completion_logprobs(
                self._tokenizer, new_ids, (out.logprobs or [])[start_tokens:], request.logprobs, start_text)
            sent_text[index], sent_tokens[index] = len(out.text), len(out.token_ids)
            if out.finish_reason is not None:
                finished.add(index)
            return sse_event(CompletionResponse(
                id=request_id, created=created, model=model,
                choices=[CompletionChoice(index=index, text=delta, logprobs=logprobs, finish_reason=out.finish_reason,
                                          stop_reason=out.stop_reason)],
                usage=usage() if continuous else None))

        try:
            async with aclosing(merge_streams(streams)) as merged:
                async for i, output in merged:
                    timers[i].on_output(sum(len(o.token_ids) for o in output.outputs))
                    if output.finished:
                        timers[i].finish(output.outputs[0].finish_reason)
                    for out in output.outputs:
                        if i * request.n + out.index not in finished and (event := choice_chunk(i, out)):
                            yield event
            if include_usage:
                yield sse_event(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                                   usage=usage()))
        except Exception as err:  # noqa: BLE001 - the status line is gone; report in-band like vLLM
            yield sse_error_event(err)
        yield SSE_DONE
