"""Normalising the prompt shapes the public API accepts into one list of prompts."""

from __future__ import annotations

from typing import Union

Prompt = Union[str, list[int]]
PromptInput = Union[str, list[int], list[str], list[list[int]]]


def normalize_prompts(prompts: PromptInput) -> tuple[list[Prompt], bool]:
    """Return ``(prompts as a list, whether a single prompt was given)``; reject anything else clearly."""
    if isinstance(prompts, str):
        return [prompts], True
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, list[int], list[str] or list[list[int]], got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)], True
    normalized: list[Prompt] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            normalized.append(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            normalized.append(list(prompt))
        else:
            raise TypeError(f"prompts[{index}] must be a str or a list of token ids, got {prompt!r:.60}")
    return normalized, False
