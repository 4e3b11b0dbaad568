"""Images in prompts: what a request carries, and the model's processor that turns images into tokens.

A prompt with images is token ids in which every image is a run of placeholder tokens, as many as
the vision encoder makes embeddings for it, plus the image file as it came (PNG, JPEG, WebP ...):
:class:`~megatron_serve.wire.prompt_image.PromptImage` (``data``, and ``offset``/``length`` of its run once
placed). Keeping the encoded file, not pixels, is what makes a request cheap to carry and to move: a photo is
5-30x smaller than the float pixels the processor makes of it, and only the engine that runs the request decodes it.

:class:`ImageProcessor` is the model's own processor from its directory (``transformers``'
``AutoProcessor``): the placeholder token, how many tokens an image of a given size becomes
(:meth:`ImageProcessor.expand` places the runs), and the pixel tensors the vision tower takes.

For the prefix cache an image's placeholder tokens are keyed by the image's content hash
(:func:`cache_keys`): equal text with another image never shares KV blocks; the same image does.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .wire.prompt_image import PromptImage

logger = logging.getLogger(__name__)

#: EXIF orientations that swap width and height (rotated by 90 or 270 degrees)
_TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}


@dataclass(frozen=True)
class ImageOptions:
    """How the HTTP server fetches the ``http(s)`` image URLs of chat requests (the size and count limits
    are request limits: ``limits.RequestLimits``).

    ``fetch_timeout``: seconds for one fetch, connection to last byte; ``allow_remote``: whether
    http(s) URLs are fetched at all (``data:`` URLs always work).
    """

    fetch_timeout: float = 10.0
    allow_remote: bool = True

    def __post_init__(self) -> None:
        if not self.fetch_timeout > 0:
            raise ValueError(f"fetch_timeout must be > 0, got {self.fetch_timeout}")


class ImageError(ValueError):
    """An image that cannot be used; the message names the problem."""


def image_bytes(image: Any) -> bytes:
    """The file of an image given as ``bytes`` (any format PIL reads) or as a ``PIL.Image`` (saved as PNG)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    from PIL import Image  # noqa: PLC0415

    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)  # lossless; level 1: fast, most of the size gain
        return buffer.getvalue()
    raise TypeError(f"an image must be bytes or a PIL.Image, got {type(image).__name__}")


def image_size(data: bytes) -> tuple[int, int]:
    """``(height, width)`` as the image will be seen (EXIF rotation applied), from the header only."""
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            orientation = image.getexif().get(0x0112)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"not an image PIL can read ({_reason(exc)})") from None
    if orientation in _TRANSPOSED_ORIENTATIONS:
        width, height = height, width
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels ({width}x{height})")
    return height, width


def open_image(data: bytes) -> Any:
    """Decode a whole image: RGB, EXIF rotation applied. ``ImageError`` for a broken or truncated file."""
    from PIL import Image, ImageOps, UnidentifiedImageError  # noqa: PLC0415

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image is too large to decode ({exc})") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"cannot decode the image ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    from PIL import UnidentifiedImageError  # noqa: PLC0415 - loaded already: the image failed to decode

    if isinstance(exc, UnidentifiedImageError):  # PIL names the buffer object, which says nothing
        return "unknown image format"
    return str(exc) or type(exc).__name__


def cache_keys(tokens: list[int], images: list[PromptImage], start: int = 0) -> list[int]:
    """``tokens`` (which begin at prompt index ``start``) with image placeholders replaced by their image's key."""
    keyed = None
    end = start + len(tokens)
    for image in images:
        first, last = max(image.offset, start), min(image.offset + image.length, end)
        if first < last:
            if keyed is None:
                keyed = list(tokens)
            keyed[first - start:last - start] = [image.cache_key] * (last - first)
    return tokens if keyed is None else keyed


class ImageProcessor:
    """The model's image processor, its placeholder token, and how many tokens an image becomes."""

    def __init__(self, image_processor: Any, placeholder: str, placeholder_id: int,
                 count: Callable[[int, int], int]):
        self.image_processor = image_processor
        self.placeholder = placeholder
        self.placeholder_id = placeholder_id
        self._count = count

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, image_token_id: int) -> "ImageProcessor":
        """The processor of ``model_dir`` (``AutoProcessor``, local files only).

        transformers builds Qwen-VL processors only together with their video processor, which needs
        torchvision. Serving images needs none of it, so without torchvision the same parts come from
        ``AutoImageProcessor`` (the processor's own image processor) and the tokenizer, and an image's
        token count is the processor's own formula (patches of the resized image / merge size squared).
        """
        from transformers import AutoProcessor  # noqa: PLC0415 - heavy import, only for vision-language models

        try:
            processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        except (ImportError, ValueError, TypeError, AttributeError) as exc:
            return cls._without_video_processor(model_dir, image_token_id, exc)

        def count(height: int, width: int) -> int:
            return int(processor._get_num_multimodal_tokens(image_sizes=[[height, width]]).num_image_tokens[0])

        placeholder_id = int(processor.tokenizer.convert_tokens_to_ids(processor.image_token))
        return cls(processor.image_processor, processor.image_token, placeholder_id, count)

    @classmethod
    def _without_video_processor(cls, model_dir: str | Path, image_token_id: int, error: Exception
                                 ) -> "ImageProcessor":
        from transformers import AutoImageProcessor, AutoTokenizer  # noqa: PLC0415
        from transformers.utils import is_torchvision_available  # noqa: PLC0415

        images = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        merge = getattr(images, "merge_size", None)
        if is_torchvision_available() or merge is None:
            raise ValueError(f"cannot load the image processor of {model_dir}: {error}") from error
        logger.info("image processor of %s loaded without its video processor (torchvision is not installed)",
                    model_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

        def count(height: int, width: int) -> int:
            return int(images.get_number_of_image_patches(height, width, {})) // merge**2

        return cls(images, tokenizer.convert_ids_to_tokens(image_token_id), image_token_id, count)

    def num_tokens(self, data: bytes) -> int:
        """Placeholder tokens the image in file ``data`` becomes (reads its header only)."""
        height, width = image_size(data)
        try:
            return self._count(height, width)
        except ValueError as exc:  # e.g. Qwen-VL refuses aspect ratios beyond 200:1
            raise ImageError(f"the model's processor refuses a {width}x{height} image: {exc}") from None

    def expand(self, tokens: list[int], images: list[bytes]) -> tuple[list[int], list[PromptImage]]:
        """Replace the ``i``-th placeholder token of ``tokens`` by as many as image ``i`` needs.

        Raises ``ValueError`` when the prompt holds a different number of placeholders than images,
        and :class:`ImageError` for an image that cannot be read.
        """
        positions = [i for i, token in enumerate(tokens) if token == self.placeholder_id]
        if len(positions) != len(images):
            raise ValueError(f"the prompt holds {len(positions)} image placeholder(s) {self.placeholder!r} but "
                             f"{len(images)} image(s) were given: put one {self.placeholder!r} where each image goes")
        expanded: list[int] = []
        placed: list[PromptImage] = []
        previous = 0
        for index, (position, data) in enumerate(zip(positions, images)):
            try:
                count = self.num_tokens(data)
            except ImageError as exc:
                raise ImageError(f"image {index + 1}: {exc}") from None
            expanded.extend(tokens[previous:position])
            placed.append(PromptImage(data, len(expanded), count))
            expanded.extend([self.placeholder_id] * count)
            previous = position + 1
        expanded.extend(tokens[previous:])
        return expanded, placed

    def pixel_inputs(self, data: bytes) -> dict[str, Any]:
        """The vision tower's inputs for one image (``pixel_values`` and, for Qwen-VL, ``image_grid_thw``)."""
        features = self.image_processor(images=[open_image(data)], return_tensors="pt")
        return dict(features)


def load_image_processor(model_dir: str | Path) -> ImageProcessor | None:
    """The image processor of a vision-language model directory; None for a text model."""
    import json  # noqa: PLC0415

    from .model.vision.config import is_vision_language, split_vision_language  # noqa: PLC0415

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if not is_vision_language(raw):
        return None
    _, vision = split_vision_language(raw)
    return ImageProcessor.from_pretrained(model_dir, vision.image_token_id)
