"""`image_url` content parts -> image bytes, under the server's rules (no network access):

* `data:` URLs (`data:image/png;base64,...`) always; the MIME type must be an image type;
* local files (`file:///...`) only below `--allowed-local-media-path`, after resolving links;
* `http(s)://` and every other scheme: refused with a 400 that says to send a data URL.

Every refusal is an `ImageError` naming the reason (the handler turns it into a 400 on the content part's field).
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse

from kimi_jax.vision.preprocess import ImageError

MAX_IMAGE_BYTES = 32 << 20
"""Largest encoded image accepted (data URL payload or file size)."""


def _data_url(url: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise ImageError("a data URL needs a ',' between its header and its data")
    mime, *params = header.split(";")
    if not mime.strip().lower().startswith("image/"):
        raise ImageError(f"a data URL must carry an image MIME type (image/png, image/jpeg, ...), got {mime!r}")
    if "base64" not in [p.strip().lower() for p in params]:
        raise ImageError("an image data URL must be base64-encoded (data:image/png;base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError("the data URL's base64 data is malformed") from err


def _local_file(url: str, allowed: str | None) -> bytes:
    if allowed is None:
        raise ImageError("local image files are not served; start the server with --allowed-local-media-path "
                         "or send the image as a data URL")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise ImageError("the image file is outside --allowed-local-media-path")
    if not os.path.isfile(path):
        raise ImageError("the image file does not exist")
    if os.path.getsize(path) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    with open(path, "rb") as f:
        return f.read()


def image_bytes(url: str, *, allowed_local_media_path: str | None = None) -> bytes:
    """The encoded image an `image_url` names, or ImageError."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url)
    if scheme == "file":
        return _local_file(url, allowed_local_media_path)
    if scheme in ("http", "https"):
        raise ImageError("remote image URLs are not fetched (this server has no network access); send the image "
                         "as a data URL (data:image/png;base64,...)")
    raise ImageError("the image URL must be a data: URL (or a file: URL below --allowed-local-media-path)")
