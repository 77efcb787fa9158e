"""Serving stack: engine (scheduler, cache manager, runner, sampler), OpenAI-compatible server, CLI."""
