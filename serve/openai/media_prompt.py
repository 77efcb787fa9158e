"""Images of a chat request: load and prepare each `image_url` part, expand its placeholder in the rendered
prompt, and pair the placeholder runs of the encoded prompt with the images for the engine. Every problem is a
400 naming the content part (`messages.{i}.content.{j}.image_url.url`)."""

from __future__ import annotations

from kimi_jax.chat.media import MEDIA_PAD, expand_media, media_refs
from kimi_jax.vision.preprocess import ImageError, PreparedImage, prepare_image
from serve.engine.media import ImageSpan, check_media, find_spans
from serve.openai.config import ServerConfig
from serve.openai.errors import bad_request
from serve.openai.media import image_bytes
from serve.openai.protocol import ChatCompletionRequest, ImagePart


def _image_fields(request: ChatCompletionRequest) -> list[str]:
    return [f"messages.{i}.content.{j}.image_url.url" for i, m in enumerate(request.messages)
            if isinstance(m.content, list) for j, part in enumerate(m.content) if isinstance(part, ImagePart)]


def has_images(request: ChatCompletionRequest) -> bool:
    return bool(_image_fields(request))


def with_images(engine, config: ServerConfig, request: ChatCompletionRequest, segments: list
                ) -> tuple[list, tuple[PreparedImage, ...]]:
    """Rendered segments with every image block expanded, and the prepared images in prompt order."""
    fields = _image_fields(request)
    vision = getattr(engine, "vision_config", None)
    if vision is None:
        raise bad_request("This server does not accept images (the model has no vision tower, or it is served "
                          "across several hosts).", param=fields[0])
    images = []
    for k, url in enumerate(media_refs(segments)):
        field = fields[k] if k < len(fields) else "messages"
        try:
            images.append(prepare_image(image_bytes(url, allowed_local_media_path=config.allowed_local_media_path),
                                        vision))
        except ImageError as err:
            raise bad_request(f"{field}: {err}", param=field) from None
    return expand_media(segments, images), tuple(images)


def place_images(engine, tokenizer, prompt_ids: list[int], images: tuple[PreparedImage, ...]
                 ) -> tuple[ImageSpan, ...]:
    """The images' placeholder spans in the encoded prompt, checked against the engine's media pool."""
    try:
        spans = find_spans(prompt_ids, tokenizer.special_tokens[MEDIA_PAD], images)
        check_media(spans, prompt_ids, getattr(engine, "media_rows", 0))
    except ValueError as err:
        raise bad_request(f"messages: {err}", param="messages") from None
    return tuple(spans)
