"""Normalising the prompt shapes the public API accepts into one list of prompts.

A prompt is text, token ids, vLLM's ``TokensPrompt`` (``{"prompt_token_ids": [...]}``) or
``TextPrompt`` (``{"prompt": text}``), or, for vision-language models, a dict ``{"prompt": text or token
ids, "images": [...]}`` whose prompt holds one image placeholder (the model's, e.g. ``<image>``) where
each image goes; images are ``bytes`` of an image file or ``PIL.Image`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict, Union

import msgspec

from ..tokenizer import Tokenizer
from ..multimodal import PromptImage, image_bytes


@dataclass
class ImagePrompt:
    """A prompt with images: the files in placeholder order, or images already placed in token ids."""

    prompt: str | list[int]
    images: list[bytes] | list[PromptImage]


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: a prompt given as token ids."""

    prompt_token_ids: list[int]


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: a prompt given as text."""

    prompt: str


Prompt = Union[str, list[int], ImagePrompt]
PromptInput = Union[str, list[int], dict, list[Union[str, list[int], dict]]]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def dict_prompt(value: dict, what: str = "prompt") -> Prompt:
    """A prompt given as a dict: vLLM's ``{"prompt_token_ids": [...]}`` (token ids), ``{"prompt": text}``
    (text) or ours with ``"images"``; a ``ValueError``/``TypeError`` names the bad part."""
    if "prompt_token_ids" in value:
        unknown = sorted(set(value) - {"prompt_token_ids"})
        if unknown:
            raise ValueError(f"{what} has unknown key(s) {', '.join(map(repr, unknown))} beside 'prompt_token_ids'")
        tokens = value["prompt_token_ids"]
        if _is_token_ids(tokens) and not tokens:
            raise ValueError(f"The decoder prompt cannot be empty ({what}['prompt_token_ids'] is [])")
        if not _is_token_ids(tokens):
            raise TypeError(f"{what}['prompt_token_ids'] must be a non-empty list of token ids")
        return list(tokens)
    prompt = image_prompt(value, what)
    return prompt.prompt if not prompt.images else prompt


def image_prompt(value: dict, what: str = "prompt") -> ImagePrompt:
    """``{"prompt": ..., "images": [...]}`` checked: a ``ValueError``/``TypeError`` names the bad part."""
    unknown = sorted(set(value) - {"prompt", "images"})
    if unknown:
        raise ValueError(f"{what} has unknown key(s) {', '.join(map(repr, unknown))}: expected 'prompt' and "
                         "'images', or 'prompt_token_ids'")
    text = value.get("prompt")
    if not isinstance(text, str) and not (_is_token_ids(text) and text):
        raise TypeError(f"{what}['prompt'] must be a str or a non-empty list of token ids")
    images = value.get("images", [])
    if not isinstance(images, (list, tuple)):
        raise TypeError(f"{what}['images'] must be a list of images (bytes or PIL.Image)")
    files = []
    for index, image in enumerate(images):
        try:
            files.append(image_bytes(image))
        except TypeError as exc:
            raise TypeError(f"{what}['images'][{index}]: {exc}") from None
    return ImagePrompt(text if isinstance(text, str) else list(text), files)


def normalize_prompts(prompts: PromptInput) -> tuple[list[Prompt], bool]:
    """Return ``(prompts as a list, whether a single prompt was given)``; reject anything else clearly."""
    if isinstance(prompts, str):
        return [prompts], True
    if isinstance(prompts, dict):
        return [dict_prompt(prompts)], True
    if isinstance(prompts, ImagePrompt):
        return [prompts], True
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a str, list[int], a dict ('prompt_token_ids', or 'prompt' and 'images'), or "
                        "a list of those, "
                        f"got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty")
    if _is_token_ids(prompts):
        return [list(prompts)], True
    normalized: list[Prompt] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            normalized.append(prompt)
        elif isinstance(prompt, dict):
            normalized.append(dict_prompt(prompt, f"prompts[{index}]"))
        elif isinstance(prompt, ImagePrompt):  # normalized already (MegatronLLM hands its list on)
            normalized.append(prompt)
        elif _is_token_ids(prompt):
            normalized.append(list(prompt))
        else:
            raise TypeError(f"prompts[{index}] must be a str, a list of token ids or a dict with 'prompt' and "
                            f"'images', got {prompt!r:.60}")
    return normalized, False


def as_prompt(value: Prompt | dict) -> Prompt:
    """One prompt in any accepted shape (what ``generate_stream`` takes)."""
    (prompt,), single = normalize_prompts(value)
    if not single:
        raise TypeError("expected one prompt, got a list of prompts")
    return prompt


def tokenize_prompt(prompt: Prompt, tokenizer: Tokenizer) -> tuple[list[int], list[PromptImage], str | None]:
    """``(token ids, placed images, prompt text)``: image placeholders expanded by the model's processor."""
    text = prompt.prompt if isinstance(prompt, ImagePrompt) else prompt
    tokens = tokenizer.encode(text) if isinstance(text, str) else list(text)
    images: list[PromptImage] = []
    if isinstance(prompt, ImagePrompt) and prompt.images:
        if isinstance(prompt.images[0], PromptImage):
            return tokens, list(prompt.images), None  # placed by the caller (the HTTP server)
        if tokenizer.images is None:
            raise ValueError("this model takes no images (it is not a vision-language model)")
        tokens, images = tokenizer.images.expand(tokens, prompt.images)
    return tokens, images, text if isinstance(text, str) else None


def _ids(prompt: Any) -> list[int]:
    """A copy of token ids as plain ints: checked in C where every id is one (128 ids 0.9 us against int() called on
    each, 5.2, most of a request's prompt_for_fleet), else each turned into one (NumPy's, floats: as before)."""
    try:
        return msgspec.convert(prompt, list[int])
    except msgspec.ValidationError:
        return list(map(int, prompt))


def prompt_for_fleet(prompt: str | list[int], images: list[bytes | PromptImage], tokenizer: Tokenizer
                     ) -> tuple[list[int], list[PromptImage]]:
    """What a SUBMIT carries for ``prompt``: token ids, with ``images`` placed in them.

    The coordinator loads no tokenizer: this process tokenizes text and expands each image placeholder
    into its image's run of tokens (the model's processor). Images placed already (the HTTP server
    places them) go as they are. ``ValueError`` when text or unplaced images meet no tokenizer.
    """
    placed = [isinstance(image, PromptImage) and image.placed for image in images]
    if any(placed) and not all(placed):
        raise ValueError("either every image of a request is placed (offset and length) or none is")
    if tokenizer is None and (isinstance(prompt, str) or (images and not all(placed))):
        raise ValueError("no tokenizer in this process to tokenize a text prompt or place images (the coordinator "
                         "loads none): pass tokenizer= to InferenceClient, or send token ids with placed images")
    tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else _ids(prompt)
    if not tokens:
        raise ValueError("prompt is empty")
    if not images or all(placed):
        return tokens, [image for image in images if isinstance(image, PromptImage)]
    if tokenizer.images is None:
        raise ValueError("this model takes no images (it is not a vision-language model)")
    return tokenizer.images.expand(tokens, [image.data if isinstance(image, PromptImage) else bytes(image)
                                            for image in images])
