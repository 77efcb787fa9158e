"""Prefix-cache hit rates of two workloads on a running engine, and a script that prints them.

* shared system prompt: every request is one system prompt plus its own user suffix, arriving in waves;
* multi-turn chat: conversations whose every turn resends the whole history (previous prompt, the model's
  answer, a new user message).
Hit rate = prompt tokens served from the cache / prompt tokens looked up at admission (engine stats).

    python -m serve.bench.hit_rates            # small random model on this machine's default backend
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from serve.engine.sampling_params import SamplingParams


WORKLOAD_UNIT = 16
"""Tokens that the script's prompt lengths are multiples of (a 328-token system prompt, 128-token first turns)."""


@dataclasses.dataclass(frozen=True)
class HitRate:
    queries: int
    hits: int

    @property
    def rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def run_to_completion(engine) -> dict[str, list[int]]:
    """Step until every request ends; output token ids of each (first completion) by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _measure(engine, run) -> HitRate:
    before = engine.stats()
    run()
    after = engine.stats()
    return HitRate(after.prefix_cache_queries - before.prefix_cache_queries,
                   after.prefix_cache_hits - before.prefix_cache_hits)


def shared_system_prompt(engine, *, num_requests: int = 16, system_len: int = 24, suffix_len: tuple[int, int] = (3, 8),
                         max_tokens: int = 4, wave: int = 4, seed: int = 0) -> HitRate:
    """``num_requests`` prompts = one random system prompt + a random suffix, ``wave`` at a time, greedy."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    system = rng.integers(0, vocab, system_len).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run():
        for start in range(0, num_requests, wave):
            for i in range(start, min(start + wave, num_requests)):
                suffix = rng.integers(0, vocab, int(rng.integers(*suffix_len, endpoint=True))).tolist()
                engine.add_request(f"sys-{seed}-{i}", system + suffix, params)
            run_to_completion(engine)

    return _measure(engine, run)


def multi_turn_chat(engine, *, num_conversations: int = 4, num_turns: int = 3, first_len: int = 12,
                    user_len: int = 6, max_tokens: int = 4, seed: int = 0) -> HitRate:
    """Each turn of each conversation resends the history plus ``user_len`` new tokens; conversations of a
    turn run together."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    histories = [rng.integers(0, vocab, first_len).tolist() for _ in range(num_conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run():
        for turn in range(num_turns):
            for c, history in enumerate(histories):
                engine.add_request(f"chat-{seed}-{c}-{turn}", history, params)
            answers = run_to_completion(engine)
            for c in range(num_conversations):
                histories[c] = (histories[c] + answers[f"chat-{seed}-{c}-{turn}"]
                                + rng.integers(0, vocab, user_len).tolist())

    return _measure(engine, run)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--retention-interval", type=int, default=0)
    args = parser.parse_args(argv)

    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.config import ModelConfig
    from kimi_jax.model import KimiModel
    from serve.engine.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.runner import ModelRunner

    cfg = ModelConfig(vocab_size=1024, hidden_size=64, num_layers=4, layer_types=("kda", "mla", "kda", "mla"),
                      mlp_types=("dense", "moe", "moe", "moe"), kda_num_heads=2, kda_num_v_heads=2, kda_head_dim=16,
                      kda_v_head_dim=16, mla_num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, intermediate_size=64, num_experts=4, num_experts_per_token=2,
                      moe_intermediate_size=32, attn_res_block_size=2, max_position_embeddings=1024)
    model = KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    bs = args.block_size
    runner = ModelRunner(model, EngineConfig(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512,
                                             block_size=bs, prefix_cache_retention_interval=args.retention_interval,
                                             token_buckets=(64, 512), seq_buckets=(8,)))
    engine = LLMEngine(runner)
    unit = WORKLOAD_UNIT  # the workloads do not change with --block-size, so block sizes compare on one workload
    system = shared_system_prompt(engine, num_requests=32, system_len=20 * unit + unit // 2, suffix_len=(4, 40),
                                  max_tokens=8, wave=8)
    chat = multi_turn_chat(engine, num_conversations=8, num_turns=4, first_len=8 * unit, user_len=2 * unit,
                           max_tokens=16)
    print(f"shared system prompt: {system.hits}/{system.queries} prompt tokens from cache = {system.rate:.1%}")
    print(f"multi-turn chat:      {chat.hits}/{chat.queries} prompt tokens from cache = {chat.rate:.1%}")


if __name__ == "__main__":
    main()
