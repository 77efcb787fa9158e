"""`image_url` content parts through the OpenAI server on the real engine (the small hybrid model and random
vision tower of test_engine_vision.py, compiled once), driven by the `openai` client: data URLs are served,
local files only below --allowed-local-media-path, remote URLs and every bad image are a 400 with an
OpenAI-style body; the engine ends idle with its media rows free."""

import base64
import io
import time

import pytest
from openai import BadRequestError, OpenAI
from PIL import Image

from kimi_jax.tokenizer import load_tokenizer
from serve.engine import EngineConfig
from serve.engine.async_engine import AsyncEngine
from serve.engine.engine import LLMEngine
from serve.openai.app import build_app
from serve.openai.background import serve_in_thread
from serve.openai.config import ServerConfig
from tests.serve.test_engine_runner import BLOCK
from tests.serve.test_engine_vision import png, runner
from tests.test_golden_vision import _huge_png_header


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(LLMEngine(runner(), tokenizer=load_tokenizer("tiny"), config=EngineConfig(block_size=BLOCK)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "red.png").write_bytes(png((200, 30, 30)))
    return folder


@pytest.fixture(scope="module")
def client(engine, media_dir):
    app = build_app(engine, ServerConfig(served_model_names=("tiny",), model_root="tiny", chat_format="k3",
                                         allowed_local_media_path=str(media_dir)))
    with serve_in_thread(app) as url:
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def strict_client(engine):
    """The same engine behind a server without --allowed-local-media-path."""
    app = build_app(engine, ServerConfig(served_model_names=("tiny",), model_root="tiny", chat_format="k3"))
    with serve_in_thread(app) as url:
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def ask(client, url: str, **kw):
    return client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Colour?"},
                                                {"type": "image_url", "image_url": {"url": url}}]}], **kw)


def test_image_request_end_to_end(client, strict_client, media_dir):
    red = data_url(png((200, 30, 30)))
    first, again = ask(client, red), ask(client, red)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 4
    assert again.choices[0].message.content == first.choices[0].message.content
    text_only = client.chat.completions.create(
        model="tiny", max_tokens=1, temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Colour?"}]}])
    # the image block: media_begin, "image 56x56" (plain text), media_content, 4 pads, media_end
    assert first.usage.prompt_tokens - text_only.usage.prompt_tokens >= 3 + 4 + 1
    local = ask(client, (media_dir / "red.png").as_uri())
    assert local.choices[0].message.content == first.choices[0].message.content
    chunks = list(ask(client, red, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content


def _truncated() -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 40).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()[:-300]


BAD = {
    "remote": ("https://example.com/cat.png", "no network access"),
    "truncated": (data_url(_truncated()), "truncated or corrupt"),
    "zero-size": ("data:image/png;base64,", "empty"),
    "20k x 20k": (data_url(_huge_png_header(20000, 20000)), "at most"),
    "wrong mime": (data_url(png((1, 2, 3)), "text/plain"), "image MIME type"),
    "pdf": (data_url(b"%PDF-1.7\n%\xe2\xe3\n1 0 obj<<>>endobj\n", "application/pdf"), "image MIME type"),
    "pdf as png": (data_url(b"%PDF-1.7\n%\xe2\xe3\n1 0 obj<<>>endobj\n"), "not an image"),
    "bad base64": ("data:image/png;base64,@@@", "malformed"),
    "outside folder": ("file:///etc/hostname", "outside"),
    "ftp": ("ftp://host/x.png", "must be a data: URL"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_images_are_400s(client, case):
    url, message = BAD[case]
    with pytest.raises(BadRequestError) as info:
        ask(client, url)
    error = info.value.body
    assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert message in error["message"] and error["param"] == "messages.0.content.1.image_url.url"
    assert "Traceback" not in error["message"]


def test_local_files_need_the_flag(strict_client, media_dir):
    with pytest.raises(BadRequestError, match="allowed-local-media-path"):
        ask(strict_client, (media_dir / "red.png").as_uri())


def test_engine_ends_idle_with_media_rows_free(client, engine):
    ask(client, data_url(png((9, 9, 200))))
    deadline = time.monotonic() + 30
    while engine.stats().num_running or engine.stats().num_waiting:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cache = engine.engine.scheduler.cache
    assert cache.media.num_free == cache.media.num_rows - 1
