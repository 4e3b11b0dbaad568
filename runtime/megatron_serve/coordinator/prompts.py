"""What a SUBMIT's prompt must be before it can be dispatched: token ids, with any images placed in them.

The coordinator loads no tokenizer: the caller's process (the HTTP server, ``InferenceClient``)
tokenizes text and expands each image placeholder into the run of tokens its image becomes, with
the model's processor. Here a prompt is only checked: token ids, images placed (offset and
length) and within the per-request byte limit (the engine reads them anyway).
"""

from __future__ import annotations

from ..multimodal import PromptImage
from ..wire.submission import WireImage

#: Image bytes one request may carry: well inside the 16 MiB frame with its prompt, and above the
#: server's 10 MiB per image, so that one large image always fits.
DEFAULT_MAX_IMAGE_BYTES = 12 * 1024 * 1024


def prompt_ids(prompt: str | list[int]) -> list[int]:
    """A SUBMIT's prompt as token ids; ``ValueError`` when it is text or empty."""
    if isinstance(prompt, str):
        raise ValueError("SUBMIT carries a text prompt, and this coordinator loads no tokenizer: the caller's "
                         "process tokenizes (give InferenceClient a tokenizer=, or send token ids)")
    if not prompt:
        raise ValueError("prompt is empty")
    return prompt


def submitted_images(wire: list[WireImage] | None, max_bytes: int) -> list[PromptImage]:
    """A SUBMIT's images, placed and within ``max_bytes`` of image files per request; ``ValueError`` says why not."""
    if not wire:
        return []
    images = [PromptImage(image.data, image.offset, image.length) for image in wire]
    total = sum(len(image.data) for image in images)
    if total > max_bytes:
        raise ValueError(f"the request's {len(images)} image(s) hold {total} bytes; this coordinator accepts at "
                         f"most {max_bytes} bytes of images per request (--max-request-image-bytes)")
    for index, image in enumerate(images):
        if not image.placed:
            raise ValueError(f"images[{index}] is not placed (offset and length): the caller's process expands "
                             "the image placeholders with the model's processor; this coordinator loads none")
        if image.length < 1:
            raise ValueError(f"images[{index}]: a placed image needs length >= 1")
    return images
