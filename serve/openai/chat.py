"""`POST /v1/chat/completions`: render the conversation (kimi_jax.chat), generate, parse reasoning / content /
tool calls back out of the completion text, streaming or not.

Reasoning: without `--reasoning-parser` (`ServerConfig.split_reasoning` False) `reasoning_content` is never
set and `content` carries all the text the model wrote, its thinking included; with it, the thinking channel
is split off into `reasoning_content` and text arrives as `content` whenever the model is outside a thinking
section (it never opened one, e.g. thinking off, or has closed it). kimi_jax.chat.parsed implements the rule.

Thinking budget (K3 format, the prompt ends inside the think channel): a turn may think for at most
`thinking_token_budget` tokens (vLLM's request field), by default half of max_tokens (`THINK_SHARE`), so a model
that would think until max_tokens still answers instead of returning an empty `content`. An unconstrained turn
whose budget runs out gets the think channel closed by the engine (`SamplingParams.thinking_token_budget`);
0 closes it in the prompt. A `<|close|>` the model samples inside the think channel is completed to the channel's
closer `<|close|>think<|sep|>` (`SamplingParams.thinking_close_len`), so a small model that names the wrong
channel there (`<|close|>response`, then the end of the turn) still goes on to answer. The K2 format opens
`<think>` from the model's side, so it takes no budget.

Constrained requests (`response_format` json_object / json_schema, `tool_choice` "required" or a named
function) are constrained over the whole assistant turn (serve.openai.grammars), so the parsed reply always
holds the JSON value or the call(s), whatever the model, unless max_tokens runs out first (`finish_reason`
"length", and the text is a prefix of a valid turn). The think channel of such a turn is bounded:
* without a reasoning parser it is closed at once (empty), since its text would otherwise land in `content`
  ahead of the JSON;
* with one it holds at most the thinking budget above, then it is closed and the constrained part begins.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import ServerSentEvent

from kimi_jax.chat import K2OutputParser, K3OutputParser, encode_chat, render_k2, render_k3
from kimi_jax.chat.media import media_refs
from kimi_jax.chat.parsed import ParsedDelta, ToolCallDelta
from serve.openai.config import ServerConfig
from serve.openai.constraints import ConstraintFactory
from serve.openai.errors import bad_request
from serve.openai.grammars import K2Grammars, K3Grammars
from serve.openai.logprobs import chat_logprobs
from serve.openai.media_prompt import has_images, place_images, with_images
from serve.openai.metrics import ServerMetrics
from serve.openai.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionRequest, ChatCompletionResponse, ChatDelta, DeltaFunctionCall,
                                   DeltaToolCall, ResponseFunctionCall, ResponseToolCall, Usage, new_id, now)
from serve.openai.sampling import (build_sampling_params, check_prompt_length, mask_vocab_size, resolve_max_tokens,
                                   response_format_factory)
from serve.openai.streaming import (CLIENT_CLOSED_REQUEST, SSE_DONE, Deadline, SSEResponse, cancel_on_disconnect,
                                    check_admission, generate_or_abort, sse_error_event, sse_event)


THINK_SHARE = 0.5  # of max_tokens: the default thinking budget of a turn
K3_THINK_CLOSE = "<|close|>think<|sep|>"  # closes the think channel of a K3 turn
K3_THINK_END = K3_THINK_CLOSE + "<|open|>response<|sep|>"  # ... and opens the response


def think_budget(request: ChatCompletionRequest, max_tokens: int) -> int:
    """The turn's thinking budget in tokens: the request's `thinking_token_budget`, else THINK_SHARE of
    max_tokens (module docstring)."""
    if request.thinking_token_budget is not None:
        return request.thinking_token_budget
    return int(max_tokens * THINK_SHARE)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a validated chat request turns into (`constrained`: set once the constraint is known)."""
    prompt_ids: list[int]
    thinking: bool
    tools: list[dict]
    tool_choice: str | dict
    constrained: bool = False
    media: tuple = ()  # the prompt's images (serve.engine.media.ImageSpan)


def _tool_choice(request: ChatCompletionRequest, tools: list[dict], enable_auto: bool) -> str | dict:
    """The effective tool_choice ("none" | "auto" | "required" | {"type": "function", ...}); 400 if unusable."""
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "auto" and tools and not enable_auto:
        raise bad_request('"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                          "(pass tool_choice 'none', 'required' or a function name instead).", param="tool_choice")
    if choice == "required" and not tools:
        raise bad_request('tool_choice "required" needs at least one tool in `tools`.', param="tool_choice")
    if not isinstance(choice, str):
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in `tools`.",
                              param="tool_choice")
        return choice.model_dump()
    return choice


def _tool_call(call: ToolCallDelta) -> ResponseToolCall:
    return ResponseToolCall(id=call.id, function=ResponseFunctionCall(name=call.name, arguments=call.arguments))


def _delta_tool_call(call: ToolCallDelta) -> DeltaToolCall:
    return DeltaToolCall(index=call.index, id=call.id, type="function",
                         function=DeltaFunctionCall(name=call.name, arguments=call.arguments))


def _finish_reason(engine_reason: str | None, has_tool_calls: bool) -> str | None:
    return "tool_calls" if engine_reason == "stop" and has_tool_calls else engine_reason


class ChatHandler:
    def __init__(self, engine, config: ServerConfig, metrics: ServerMetrics):
        self._engine = engine
        self._config = config
        self._metrics = metrics
        self._tokenizer = engine.tokenizer
        self._mask_vocab_size = mask_vocab_size(engine)
        self._grammars = (K3Grammars if config.chat_format == "k3" else K2Grammars)(engine.tokenizer)
        self._think_end = (self._tokenizer.encode(K3_THINK_END, allow_special=True)
                           if config.chat_format == "k3" else [])
        self._think_close_len = (len(self._tokenizer.encode(K3_THINK_CLOSE, allow_special=True))
                                 if config.chat_format == "k3" else 0)

    # ------------------------------------------------------------ request -> prompt, params

    def _plan(self, request: ChatCompletionRequest) -> _Plan:
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        tool_choice = _tool_choice(request, tools, self._config.enable_auto_tool_choice)
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        kwargs = request.chat_template_kwargs or {}
        thinking = kwargs.get("thinking", self._config.chat_format == "k3")
        if not isinstance(thinking, bool):
            raise bad_request("chat_template_kwargs.thinking must be a boolean.", param="chat_template_kwargs")
        try:
            if self._config.chat_format == "k3":
                response_format = None if request.response_format is None else request.response_format.model_dump(
                    by_alias=True, exclude_none=True)
                segments = render_k3(messages, tools=tools or None, thinking=thinking,
                                     reasoning_effort=request.reasoning_effort,
                                     tool_choice=tool_choice if tools and isinstance(tool_choice, str) else None,
                                     response_format=response_format)
            else:
                segments = render_k2(messages, tools=tools or None, thinking=thinking)
        except ValueError as err:
            message = str(err)
            raise bad_request(message, param=message.split(":")[0].split("[")[0] or None) from err
        media = ()
        if media_refs(segments):
            segments, media = with_images(self._engine, self._config, request, segments)
        prompt_ids = encode_chat(self._tokenizer, segments)
        check_prompt_length(len(prompt_ids), self._engine.max_model_len, param="messages")
        return _Plan(prompt_ids, thinking, tools, tool_choice, media=media)

    def _placed(self, plan: _Plan) -> _Plan:
        """Pair the prompt's placeholder runs with its images (400 when the pool cannot hold them)."""
        if not plan.media:
            return plan
        return dataclasses.replace(plan, media=place_images(self._engine, self._tokenizer, plan.prompt_ids,
                                                            plan.media))

    def _constraint(self, request: ChatCompletionRequest, plan: _Plan, max_tokens: int) -> ConstraintFactory | None:
        think_tokens = think_budget(request, max_tokens) if self._config.split_reasoning else 0
        forces_tools = plan.tool_choice == "required" or isinstance(plan.tool_choice, dict)
        has_format = request.response_format is not None and request.response_format.type != "text"
        if forces_tools and has_format:
            raise bad_request("response_format cannot be combined with a required or named tool_choice.",
                              param="response_format")
        if has_format:
            return response_format_factory(self._tokenizer, request.response_format,
                                           lambda schema: self._grammars.response(schema, thinking=plan.thinking,
                                                                                 think_tokens=think_tokens),
                                           vocab_size=self._mask_vocab_size)
        if not forces_tools:
            return None
        if isinstance(plan.tool_choice, dict):
            tools = [t for t in plan.tools if t["function"]["name"] == plan.tool_choice["function"]["name"]]
        else:
            tools = plan.tools
        try:
            grammar = self._grammars.tool_calls(tools, thinking=plan.thinking, think_tokens=think_tokens,
                                                call_tokens=max_tokens - think_tokens,
                                                multiple=plan.tool_choice == "required" and request.parallel_tool_calls)
            return ConstraintFactory(self._tokenizer, grammar, vocab_size=self._mask_vocab_size)
        except ValueError as err:
            raise bad_request(f"Invalid tool parameters schema: {err}", param="tools") from err

    def _new_parser(self, plan: _Plan):
        options = dict(tools=plan.tools, split_reasoning=self._config.split_reasoning, constrained=plan.constrained)
        if self._config.chat_format == "k3":
            return K3OutputParser(thinking=plan.thinking, **options)
        return K2OutputParser(**options)

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
        # decoding images is CPU work: off the event loop
        plan = await asyncio.to_thread(self._plan, request) if has_images(request) else self._plan(request)
        plan = self._placed(plan)
        if request.thinking_token_budget is not None and self._config.chat_format != "k3":
            raise bad_request("thinking_token_budget needs the kimi_k3 chat format (a K2 model opens its own "
                              "<think> section).", param="thinking_token_budget")
        if request.thinking_token_budget == 0 and plan.thinking:  # no thinking: the prompt closes the channel
            plan = dataclasses.replace(plan, prompt_ids=plan.prompt_ids + self._think_end, thinking=False)
            check_prompt_length(len(plan.prompt_ids), self._engine.max_model_len, param="messages")
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(getattr(request, param), len(plan.prompt_ids), self._engine.max_model_len,
                                        param=param)
        top_k = (request.top_logprobs or 0) if request.logprobs else None
        constraint = self._constraint(request, plan, max_tokens)
        plan = dataclasses.replace(plan, constrained=constraint is not None)
        budget = think_budget(request, max_tokens)
        closes_thinking = constraint is None and plan.thinking and 1 <= budget < max_tokens
        params = build_sampling_params(request, max_tokens=max_tokens, logprobs=top_k,
                                       vocab_size=self._tokenizer.vocab_size, skip_special_tokens=False,
                                       constraint_factory=constraint,
                                       thinking_token_budget=budget if closes_thinking else None,
                                       thinking_end_token_ids=self._think_end if closes_thinking else None,
                                       thinking_close_len=self._think_close_len if closes_thinking else 0)
        request_id = new_id("chatcmpl")
        check_admission(self._engine, len(plan.prompt_ids), request.n)
        deadline = Deadline.of(request.timeout, self._config.request_timeout_s)
        outputs = generate_or_abort(self._engine, plan.prompt_ids, params, request_id, deadline, media=plan.media)
        if request.stream:
            return SSEResponse(self._stream(request, plan, request_id, outputs))
        body = await cancel_on_disconnect(raw_request, self._collect(request, plan, request_id, outputs))
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(body.model_dump(mode="json"))

    # ------------------------------------------------------------ responses

    async def _collect(self, request: ChatCompletionRequest, plan: _Plan, request_id: str,
                       outputs: AsyncIterator) -> ChatCompletionResponse:
        timer = self._metrics.timer()
        final = None
        async with aclosing(outputs):
            async for output in outputs:
                timer.on_output(sum(len(o.token_ids) for o in output.outputs))
                final = output
        timer.finish(final.outputs[0].finish_reason)
        choices = []
        for out in sorted(final.outputs, key=lambda o: o.index):
            parser = self._new_parser(plan)
            parser.feed(out.text)
            parsed = parser.finish()
            message = AssistantMessage(content=None if parsed.tool_calls and not parsed.content else parsed.content,
                                       reasoning_content=parsed.reasoning_content or None,
                                       tool_calls=[_tool_call(c) for c in parsed.tool_calls])
            logprobs = None if not request.logprobs else chat_logprobs(
                self._tokenizer, out.token_ids, out.logprobs or [], request.top_logprobs or 0)
            choices.append(ChatChoice(index=out.index, message=message, logprobs=logprobs,
                                      finish_reason=_finish_reason(out.finish_reason, bool(parsed.tool_calls)),
                                      stop_reason=out.stop_reason))
        num_generated = sum(len(o.token_ids) for o in final.outputs)
        num_prompt = len(plan.prompt_ids)
        return ChatCompletionResponse(id=request_id, created=now(), model=self._config.model_name, choices=choices,
                                      usage=Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                                  total_tokens=num_prompt + num_generated))

    async def _stream(self, request: ChatCompletionRequest, plan: _Plan, request_id: str,
                      outputs: AsyncIterator) -> AsyncIterator[ServerSentEvent]:
        created, model = now(), self._config.model_name
        timer = self._metrics.timer()
        parsers = [self._new_parser(plan) for _ in range(request.n)]
        sent_text, sent_tokens = [0] * request.n, [0] * request.n
        has_tool_calls, finished = [False] * request.n, [False] * request.n
        num_prompt = len(plan.prompt_ids)
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats

        def usage() -> Usage:
            generated = sum(sent_tokens)
            return Usage(prompt_tokens=num_prompt, completion_tokens=generated, total_tokens=num_prompt + generated)

        def chunk(index: int, delta: ChatDelta, **fields: Any) -> ServerSentEvent:
            return sse_event(ChatCompletionChunk(
                id=request_id, created=created, model=model,
                choices=[ChatChunkChoice(index=index, delta=delta, **fields)],
                usage=usage() if continuous else None))

        def choice_chunks(out) -> list[ServerSentEvent]:
            """The chunks one engine output adds to choice `out.index` (text delta, then finish)."""
            i = out.index
            parsed = parsers[i].feed(out.text[sent_text[i]:])
            new_ids = out.token_ids[sent_tokens[i]:]
            logprobs = None if not request.logprobs or not new_ids else chat_logprobs(
                self._tokenizer, new_ids, (out.logprobs or [])[sent_tokens[i]:], request.top_logprobs or 0)
            sent_text[i], sent_tokens[i] = len(out.text), len(out.token_ids)
            if out.finish_reason is not None:
                finished[i] = True
                last = parsers[i].flush()
                parsed = ParsedDelta(parsed.reasoning + last.reasoning, parsed.content + last.content,
                                     parsed.tool_calls + last.tool_calls)
            has_tool_calls[i] |= bool(parsed.tool_calls)
            delta = ChatDelta(content=parsed.content or None, reasoning_content=parsed.reasoning or None,
                              tool_calls=[_delta_tool_call(c) for c in parsed.tool_calls] or None)
            chunks = []
            if delta.content or delta.reasoning_content or delta.tool_calls or logprobs:
                chunks.append(chunk(i, delta, logprobs=logprobs))
            if out.finish_reason is not None:
                chunks.append(chunk(i, ChatDelta(), finish_reason=_finish_reason(out.finish_reason, has_tool_calls[i]),
                                    stop_reason=out.stop_reason))
            return chunks

        try:
            for i in range(request.n):
                yield chunk(i, ChatDelta(role="assistant", content=""))
            async with aclosing(outputs):
                async for output in outputs:
                    timer.on_output(sum(len(o.token_ids) for o in output.outputs))
                    if output.finished:
                        timer.finish(output.outputs[0].finish_reason)
                    for out in output.outputs:
                        if not finished[out.index]:
                            for event in choice_chunks(out):
                                yield event
            if include_usage:
                yield sse_event(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                                    usage=usage()))
        except Exception as err:  # noqa: BLE001 - the status line is gone; report in-band like vLLM
            yield sse_error_event(err)
        yield SSE_DONE
