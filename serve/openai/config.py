"""Server-side settings (everything the HTTP layer needs that is not the engine)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Args:
      served_model_names: names clients may put in `model`; the first is the one reported back.
      model_root: the MODEL argument (preset or checkpoint folder), shown as `root` in /v1/models.
      chat_format: "k3" (XTML) or "k2" (Kimi-Linear) rendering and output parsing.
      api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`.
      enable_auto_tool_choice: allow `tool_choice="auto"` (vLLM's --enable-auto-tool-choice); it is the default
        choice when tools are declared, so without this flag such requests must say "none", "required" or a name.
      request_timeout_s: the longest a request may run (--request-timeout; a request's `timeout` may shorten
        it); past it the request is stopped with a 408. None: no limit.
      protect_metrics: /metrics requires the API key too (--protect-metrics).
      split_reasoning: `--reasoning-parser` was given: thinking text is returned as `reasoning_content`, apart
        from `content`. Without it (the default, as in vLLM) `reasoning_content` is never set and the thinking
        text is part of `content` (kimi_jax.chat.parsed states the rule; serve.openai.chat what it means for
        constrained requests).
      allowed_local_media_path: `image_url` parts may name `file:` URLs below this folder (none otherwise).

    Replies are always parsed with the chat format's parser (content, tool calls, and reasoning when split).
    """

    served_model_names: tuple[str, ...]
    model_root: str
    chat_format: str = "k3"
    api_key: str | None = None
    enable_auto_tool_choice: bool = False
    split_reasoning: bool = False
    request_timeout_s: float | None = None
    protect_metrics: bool = False
    allowed_local_media_path: str | None = None

    def __post_init__(self):
        if not self.served_model_names:
            raise ValueError("served_model_names must not be empty")
        if self.chat_format not in ("k3", "k2"):
            raise ValueError(f"chat_format must be 'k3' or 'k2', got {self.chat_format!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
