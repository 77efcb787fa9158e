"""The engine's greedy outputs for the shipped code-only ``tiny-code`` model on the CPU (reference ops), stored as test
data for the GPU suite to compare against (``tests/data/engine_greedy_tiny_code.json``).

Regenerate on a CPU machine: ``JAX_PLATFORMS=cpu PYTHONPATH=. python tests/gpu/engine_reference.py``. Besides the
tokens it stores, per request, the smallest gap between the top two logits over the generated positions (from
``KimiLM.logits`` on the whole sequence): the GPU's fp32 logits differ from the CPU's by summation order only,
far below that gap, so any other token is a defect."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "engine_greedy_tiny_code.json"
MODEL = "tiny-code"
PROMPTS = [[1, 17, 254, 8, 99], list(range(3, 40, 2)), [7] * 3 + list(range(100, 140))]
"""Token-id prompts of 5, 19 and 43 tokens (the longer one crosses a 16-token page and a KDA chunk of 64 with its
continuation)."""
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,), seq_buckets=(4,),
              page_buckets=(32,))
MAX_TOKENS = 24


def generate(impl: str | None = None) -> list[list[int]]:
    """The greedy continuations (``MAX_TOKENS`` each, no stop tokens) of ``PROMPTS`` by ``kimi_jax.LLM`` on the
    shipped ``MODEL`` in float32 with the ``ENGINE`` settings."""
    import kimi_jax
    from kimi_jax import SamplingParams

    llm = kimi_jax.LLM(MODEL, dtype="float32", impl=impl, tokenizer=None, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]


def write_reference() -> dict:
    import jax
    import numpy as np

    import kimi_jax

    assert jax.default_backend() == "cpu", "the reference is the CPU's"
    tokens = generate("reference")
    lm = kimi_jax.load(MODEL, dtype="float32", impl="reference")
    gaps = []
    for prompt, out in zip(PROMPTS, tokens):
        logits = np.asarray(lm.logits(np.asarray([prompt + out])))[0, len(prompt) - 1:-1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert (logits.argmax(-1) == np.asarray(out)).all(), "the engine's tokens are the logits' argmax"
        gaps.append(float((top2[:, 1] - top2[:, 0]).min()))
    data = dict(about=__doc__.split("\n\n")[0], prompts=PROMPTS, engine=ENGINE, max_tokens=MAX_TOKENS,
                dtype="float32", tokens=tokens, min_top2_logit_gap=gaps, jax=jax.__version__)
    DATA.write_text(json.dumps(data, indent=1) + "\n")
    return data


if __name__ == "__main__":
    print(json.dumps(write_reference(), indent=1))
