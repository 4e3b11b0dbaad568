"""What a SUBMIT's prompt becomes before it can be dispatched: token ids, and images placed in them.

A text prompt is tokenized here; the image files of a vision-language prompt are placed (each
placeholder expanded to the run of tokens its image becomes) by the model's processor, which the
coordinator's tokenizer carries when the model directory has one. Images that arrive placed (the
HTTP server places them itself) are only checked for size here: the engine reads them anyway.
Both need the tokenizer, so such prompts wait while it loads (``Phase.HELD``).
"""

from __future__ import annotations

from typing import Protocol

from ..wire.messages import WireImage
from ..multimodal import PromptImage

#: Image bytes one request may carry: well inside the 16 MiB frame with its prompt, and above the
#: server's 10 MiB per image, so that one large image always fits.
DEFAULT_MAX_IMAGE_BYTES = 12 * 1024 * 1024


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class PromptSource(Protocol):
    """The parts of a request record this module reads and fills (``requests.RequestRecord``)."""

    prompt: str | None
    prompt_tokens: list[int]
    images: list[PromptImage]


def submitted_images(wire: list[WireImage] | None, max_bytes: int) -> list[PromptImage]:
    """A SUBMIT's images, within ``max_bytes`` of image files per request; ``ValueError`` says why not."""
    if not wire:
        return []
    images = [PromptImage(image.data, image.offset, image.length) for image in wire]
    total = sum(len(image.data) for image in images)
    if total > max_bytes:
        raise ValueError(f"the request's {len(images)} image(s) hold {total} bytes; this coordinator accepts at "
                         f"most {max_bytes} bytes of images per request (--max-request-image-bytes)")
    placed = [image.placed for image in images]
    if any(placed) and not all(placed):
        raise ValueError("either every image of a request is placed (offset and length) or none is")
    for index, image in enumerate(images):
        if image.placed and image.length < 1:
            raise ValueError(f"images[{index}]: a placed image needs length >= 1")
    return images


def needs_tokenizer(request: PromptSource) -> bool:
    """Whether preparing the prompt needs the tokenizer: text to tokenize, or images to place."""
    return bool(request.prompt) or any(not image.placed for image in request.images)


def tokenize(tokenizer: TokenizerLike | None, error: str | None, text: str) -> list[int]:
    """Token ids of a text prompt; ``ValueError`` saying why when there are none (``error``: why the
    tokenizer failed to load, if it did)."""
    if not text:
        raise ValueError("prompt is empty")
    if tokenizer is None:
        raise ValueError(error or "this coordinator has no tokenizer: send token ids")
    tokens = list(tokenizer.encode(text))
    if not tokens:
        raise ValueError("prompt is empty")
    return tokens


def prepare(request: PromptSource, tokenizer: TokenizerLike | None, error: str | None) -> None:
    """Tokenize a text prompt and place its images (expand their placeholders); ``ValueError`` says why not."""
    if request.prompt is not None:
        request.prompt_tokens = tokenize(tokenizer, error, request.prompt)
    if not request.images or request.images[0].placed:
        return
    processor = getattr(tokenizer, "images", None)
    if processor is None:
        raise ValueError(error or "the served model takes no images (it is not a vision-language model, or this "
                         "coordinator has no model directory)")
    request.prompt_tokens, request.images = processor.expand(request.prompt_tokens,
                                                             [image.data for image in request.images])
