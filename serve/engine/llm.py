"""``LLM``: the offline, notebook-facing API on the serving engine (vLLM's ``LLM(...).generate`` shape).

    llm = LLM("tiny", enable_prefix_caching=True)
    outs = llm.generate(["def f(x):", "import"], SamplingParams(temperature=0.0, max_tokens=16))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids
"""

from __future__ import annotations

import itertools
import numbers
from typing import Sequence

from serve.engine.engine import LLMEngine
from serve.engine.outputs import RequestOutput
from serve.engine.sampling_params import SamplingParams

Prompts = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


class LLM:
    """A model behind an LLMEngine, for batch generation.

    Args:
      model: preset name ("tiny", ...), checkpoint folder, KimiLM or KimiModel.
      tokenizer: "auto" (the preset's or folder's own, if any), a preset name or folder, a Tokenizer, or None.
      dtype: parameter dtype ("auto": float32 on CPU, bfloat16 on GPU).
      seed: random-weight seed for presets without weights.
      impl: op implementation (None = backend default).
      tensor_parallel_size, data_parallel_size, enable_expert_parallel, decode_context_parallel_size, num_hosts,
        host_rank, coordinator_address: the parallelism flags of ``vllm serve`` (``sharding.layout``); with
        ``data_parallel_size > 1`` the engine is a ``DataParallelEngine`` of independent replicas.
      engine_args: EngineConfig fields (max_model_len, max_num_seqs, enable_prefix_caching, ...).
    """

    def __init__(self, model="tiny", *, tokenizer="auto", dtype="auto", seed: int = 0, impl: str | None = None,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 decode_context_parallel_size: int = 1, num_hosts: int | None = None, host_rank: int | None = None,
                 coordinator_address: str | None = None, **engine_args):
        from serve.engine.data_parallel import build_engine
        from sharding.layout import ParallelConfig

        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                                  enable_expert_parallel=enable_expert_parallel,
                                  decode_context_parallel_size=decode_context_parallel_size, num_hosts=num_hosts,
                                  host_rank=host_rank, coordinator_address=coordinator_address)
        if not isinstance(model, str) and parallel.num_devices == 1:
            self.engine = LLMEngine.from_pretrained(model, tokenizer=tokenizer, dtype=dtype, seed=seed, impl=impl,
                                                    **engine_args)
        else:
            self.engine = build_engine(model, tokenizer=tokenizer, dtype=dtype, seed=seed, impl=impl,
                                       parallel=parallel, **engine_args)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """An LLM over an existing engine (e.g. one sharing a warmed-up runner)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; one finished RequestOutput per prompt, in prompt order.

        ``prompts``: a string, a list of strings, one token-id list, or a list of token-id lists.
        ``sampling_params``: one for all prompts, one per prompt, or None (``SamplingParams()``).
        """
        token_prompts = self._token_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(token_prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(token_prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(token_prompts)} prompts")
        for p, ids in zip(params, token_prompts):
            self.engine.validate_request(ids, p)
        request_ids = [f"llm-{next(self._ids)}" for _ in token_prompts]
        finals: dict[str, RequestOutput] = {}
        try:
            for request_id, ids, p in zip(request_ids, token_prompts, params):
                self.engine.add_request(request_id, ids, p)
            while self.engine.has_unfinished_requests():
                finals.update((out.request_id, out) for out in self.engine.step() if out.finished)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return [finals[request_id] for request_id in request_ids]

    def _token_prompts(self, prompts: Prompts) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, numbers.Integral) for t in prompts):  # one token-id prompt
            prompts = [prompts]
        tokenizer = self.engine.tokenizer
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids or tokenizer=...")
                out.append(tokenizer.encode(prompt))
            else:
                out.append([int(t) for t in prompt])
        return out
