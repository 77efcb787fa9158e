"""OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""

from serve.openai.app import build_app
from serve.openai.cli_args import add_serve_args, build_server, run_server, serve_http, server_config_from_args
from serve.openai.config import ServerConfig

__all__ = ["ServerConfig", "add_serve_args", "build_app", "build_server", "run_server", "serve_http",
           "server_config_from_args"]
