"""/metrics carries the speculative-decoding counters in vLLM's names when the engine speculates, none otherwise."""

from prometheus_client import CollectorRegistry, generate_latest

from serve.engine.outputs import EngineStats, SpecDecodeStats
from serve.openai.metrics import _EngineCollector


class _Engine:
    def __init__(self, spec):
        self.spec = spec

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, cache_usage=0.0, prefix_cache_queries=0,
                           prefix_cache_hits=0, num_preemptions=0, prompt_tokens=5, generation_tokens=9,
                           spec_decode=self.spec)


def _scrape(engine) -> str:
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine, "tiny"))
    return generate_latest(registry).decode()


def test_spec_counters_in_vllm_names():
    spec = SpecDecodeStats(num_drafts=3, num_draft_tokens=12, num_accepted_tokens=7, accepted_per_pos=[3, 2, 1, 1],
                           num_paused_steps=5)
    text = _scrape(_Engine(spec))
    assert 'kimi_jax:spec_decode_num_paused_steps_total{model_name="tiny"} 5.0' in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="tiny"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 12.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 7.0' in text
    for position, count in enumerate([3, 2, 1, 1]):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{position}"}} '
                f'{count}.0') in text


def test_no_spec_counters_without_speculation():
    assert "spec_decode" not in _scrape(_Engine(None))
