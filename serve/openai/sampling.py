"""Request fields -> engine `SamplingParams` (and its constraint), with the checks that must answer 400."""

from __future__ import annotations

from collections.abc import Callable

from serve.engine.sampling_params import SamplingParams
from serve.openai.constraints import ConstraintFactory
from serve.openai.errors import bad_request
from serve.openai.protocol import ResponseFormat, SamplingFields


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, *, param: str) -> None:
    if num_prompt_tokens == 0:
        raise bad_request("The prompt is empty.", param=param)
    if num_prompt_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                          f"has {num_prompt_tokens} tokens, which leaves no room for a completion.",
                          param=param, code="context_length_exceeded")


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int, *, param: str) -> int:
    """`requested`, or all the room left in the context when None; 400 when it does not fit."""
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} "
                          f"for the completion).", param=param, code="context_length_exceeded")
    return requested


def build_sampling_params(request: SamplingFields, *, max_tokens: int, logprobs: int | None, vocab_size: int,
                          skip_special_tokens: bool,
                          constraint_factory: Callable[[], object] | None = None,
                          thinking_token_budget: int | None = None,
                          thinking_end_token_ids: list[int] | None = None,
                          thinking_close_len: int = 0) -> SamplingParams:
    """Map the shared request fields onto `SamplingParams` (OpenAI defaults where a field is absent).

    Raises:
      APIError (400): empty stop strings, stop token ids outside the vocabulary, or anything
        `SamplingParams.validate()` rejects.
    """
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if any(s == "" for s in stop):
        raise bad_request("stop strings must not be empty.", param="stop")
    bad_ids = [i for i in request.stop_token_ids if not 0 <= i < vocab_size]
    if bad_ids:
        raise bad_request(f"stop_token_ids {bad_ids} are outside the vocabulary [0, {vocab_size}).",
                          param="stop_token_ids")
    params = SamplingParams(
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(request.top_k or 0, 0),
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        seed=request.seed,
        logprobs=logprobs,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens,
        constraint_factory=constraint_factory,
        thinking_token_budget=thinking_token_budget,
        thinking_end_token_ids=list(thinking_end_token_ids or []),
        thinking_close_len=thinking_close_len,
    )
    try:
        params.validate()
    except ValueError as err:
        raise bad_request(str(err)) from err
    return params


def mask_vocab_size(engine) -> int:
    """Width of constraint masks: the model's vocabulary (`engine.model_config.vocab_size`) when the engine
    exposes it, else the tokenizer's."""
    return getattr(getattr(engine, "model_config", None), "vocab_size", None) or engine.tokenizer.vocab_size


def response_format_factory(tokenizer, response_format: ResponseFormat | None, grammar_of: Callable[[dict], str],
                            *, vocab_size: int) -> ConstraintFactory | None:
    """The constraint for `response_format` (None for text); `grammar_of(schema)` places the JSON in the output,
    `vocab_size` is the mask width (`mask_vocab_size`).

    Raises:
      APIError (400): json_schema without a schema, or a schema llguidance rejects.
    """
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        schema = {"type": "object"}
    elif response_format.json_schema is None:
        raise bad_request("response_format.json_schema is required when type is 'json_schema'.",
                          param="response_format.json_schema")
    else:
        schema = response_format.json_schema.schema_
    try:
        return ConstraintFactory(tokenizer, grammar_of(schema), vocab_size=vocab_size)
    except ValueError as err:
        raise bad_request(f"Invalid JSON schema: {err}", param="response_format") from err
