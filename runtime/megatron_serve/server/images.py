"""Images of chat requests: ``image_url`` content parts fetched, checked, and handed to the prompt.

OpenAI clients send images as ``{"type": "image_url", "image_url": {"url": ...}}`` parts, the URL
either a ``data:`` URL (the file inline, base64) or an ``http(s)`` URL that the server fetches.
Every image is loaded before anything is submitted, concurrently, and each failure is a 400 whose
message names the part (``messages[1].content[0]``) and the problem: not a URL we take, a fetch
that failed or timed out, a response that is not an image, a file over the size limit, a file that
does not decode. Remote fetches can be switched off (``--no-remote-images``), e.g. where the server
must not reach into the network it runs in; ``data:`` URLs always work.

Decoding (to refuse broken files with a 400 rather than failing later in an engine) runs in a
worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from ..multimodal import ImageError, ImageOptions, open_image
from .errors import APIError, bad_request
from .models import ChatCompletionRequest, ChatMessage, ImageContentPart, TokenizeChatRequest

if TYPE_CHECKING:
    from .context import ServerContext

_MAX_REDIRECTS = 5


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context (httpx's default: the CA bundle, the environment's settings) for every request's fetches: a
    client made without one loads the bundle again, 43 ms of CPU here for each request that holds images."""
    return httpx.create_ssl_context()


@dataclass(frozen=True)
class _Fetch:
    """The fetch settings and the per-image size limit of one request."""

    options: ImageOptions
    max_bytes: int


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, ImageContentPart]]:
    """``(where, part)`` of every image part, in conversation order."""
    parts = []
    for m, message in enumerate(messages):
        if isinstance(message.content, list):
            parts.extend((f"messages[{m}].content[{p}]", part) for p, part in enumerate(message.content)
                         if isinstance(part, ImageContentPart))
    return parts


async def load_images(req: Any, ctx: ServerContext) -> None:
    """Fetch and check every image part of the messages of ``req`` (a chat or a chat ``/tokenize``; each
    part then holds its file); 400 on the first failure, the count limit first.
    """
    messages = req.messages if isinstance(req, (ChatCompletionRequest, TokenizeChatRequest)) else []
    parts = image_parts(messages)
    if len(parts) > ctx.limits.max_images:
        raise bad_request(f"the request holds {len(parts)} images; this server accepts at most "
                          f"{ctx.limits.max_images} per request (--max-images-per-request)",
                          param=parts[ctx.limits.max_images][0], code="too_many_images")
    if not parts:
        return
    if not ctx.accepts_images:
        raise bad_request("this model takes no images (it is not a vision-language model): send text only",
                          param=f"{parts[0][0]}", code="images_not_supported")
    fetch = _Fetch(ctx.images, ctx.limits.max_image_bytes)
    async with httpx.AsyncClient(follow_redirects=True, max_redirects=_MAX_REDIRECTS, verify=_tls(),
                                 timeout=fetch.options.fetch_timeout) as client:
        loads = [asyncio.ensure_future(_load(client, where, part.image_url.url, fetch)) for where, part in parts]
        try:
            files = await asyncio.gather(*loads)
        finally:  # the first failure answers the request: the other fetches stop
            for load in loads:
                load.cancel()
    for (_, part), data in zip(parts, files):
        part.attach(data)


async def _load(client: httpx.AsyncClient, where: str, url: str, fetch: _Fetch) -> bytes:
    param = f"{where}.image_url.url"
    if url.startswith("data:"):
        data = _data_url(url, param, fetch.max_bytes)
    elif url.startswith(("http://", "https://")):
        if not fetch.options.allow_remote:
            raise bad_request("this server does not fetch remote images (--no-remote-images): send the image "
                              "inline as a data: URL", param=param, code="remote_images_disabled")
        try:
            data = await asyncio.wait_for(_fetch(client, url, param, fetch.max_bytes), fetch.options.fetch_timeout)
        except asyncio.TimeoutError:
            raise bad_request(f"fetching the image at {_short(url)} took longer than {fetch.options.fetch_timeout:g}s",
                              param=param, code="image_fetch_failed") from None
    else:
        raise bad_request(f"image URL must be a data: URL or an http(s) URL, got {_short(url)}", param=param,
                          code="invalid_image_url")
    try:
        await asyncio.to_thread(open_image, data)
    except ImageError as exc:
        raise bad_request(f"the image at {where} is not usable: {exc}", param=param, code="invalid_image") from None
    return data


def _data_url(url: str, param: str, max_bytes: int) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise bad_request("malformed data: URL (no ',' before the data)", param=param, code="invalid_image_url")
    media_type, *attributes = header.split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise bad_request(f"the data: URL holds {media_type}, not an image", param=param, code="invalid_image")
    if "base64" not in attributes:
        raise bad_request("data: URLs of images must be base64 ('data:image/png;base64,...')", param=param,
                          code="invalid_image_url")
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise _too_large(len(payload) * 3 // 4, param, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data: URL is not valid base64", param=param, code="invalid_image_url") from None
    if len(data) > max_bytes:
        raise _too_large(len(data), param, max_bytes)
    return data


async def _fetch(client: httpx.AsyncClient, url: str, param: str, max_bytes: int) -> bytes:
    try:
        async with client.stream("GET", url, headers={"Accept": "image/*"}) as response:
            if response.status_code >= 400:
                raise bad_request(f"fetching the image at {_short(url)} failed: HTTP {response.status_code}",
                                  param=param, code="image_fetch_failed")
            media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type and not media_type.startswith("image/") and media_type != "application/octet-stream":
                raise bad_request(f"the URL {_short(url)} returned {media_type}, not an image", param=param,
                                  code="invalid_image")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise _too_large(int(declared), param, max_bytes)
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(size, param, max_bytes, at_least=True)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise bad_request(f"fetching the image at {_short(url)} failed: {type(exc).__name__}: {exc}", param=param,
                          code="image_fetch_failed") from None


def _too_large(size: int, param: str, max_bytes: int, at_least: bool = False) -> APIError:
    return bad_request(f"the image is {'over ' if at_least else ''}{size} bytes; this server accepts images of at "
                       f"most {max_bytes} bytes (--max-image-bytes)", param=param, code="image_too_large")


def _short(url: str, limit: int = 80) -> str:
    return url if len(url) <= limit else url[:limit] + "..."

