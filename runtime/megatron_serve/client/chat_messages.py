"""Conversations for ``MegatronLLM.chat`` (vLLM's ``LLM.chat``): checked, then rendered by the chat template.

A conversation is a list of ``{"role", "content"}`` dicts (``content`` text, or OpenAI text parts),
optionally with ``name``, ``tool_calls`` and ``tool_call_id``; ``chat`` takes one or a list of them.
Images go through ``generate({"prompt": ..., "images": [...]})``: a template would render their
placeholders here without the images that fill them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

Conversation = list[dict[str, Any]]

ROLES = ("system", "developer", "user", "assistant", "tool")
_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation or a list of them, as a list; ``ValueError``/``TypeError`` name what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
    batch = [list(messages)] if isinstance(messages[0], dict) else [list(c) for c in messages]
    for i, conversation in enumerate(batch):
        if not conversation:
            raise ValueError(f"messages[{i}] is an empty conversation")
        for j, message in enumerate(conversation):
            _check(message, f"messages[{i}][{j}]" if len(batch) > 1 else f"messages[{j}]")
    return batch


def _check(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    unknown = sorted(set(message) - _KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(sorted(_KEYS))})")
    if message.get("role") not in ROLES:
        raise ValueError(f"{where}['role'] must be one of {', '.join(ROLES)}, got {message.get('role')!r}")
    content = message.get("content")
    if isinstance(content, list):
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}['content'][{k}] must be a text part {{'type': 'text', 'text': ...}}; "
                                 "prompts with images go through generate({'prompt': ..., 'images': [...]})")
    elif content is not None and not isinstance(content, str):
        raise TypeError(f"{where}['content'] must be a str or a list of text parts, got {type(content).__name__}")


def render_conversations(tokenizer: Tokenizer, messages: Conversation | Sequence[Conversation], *,
                         tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                         continue_final_message: bool = False,
                         template_kwargs: dict[str, Any] | None = None) -> list[str]:
    """Each conversation rendered with the tokenizer's chat template, in order."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message needs add_generation_prompt=False (the answer continues the last "
                         "message instead of opening a new turn)")
    return [tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                                          continue_final_message=continue_final_message, **(template_kwargs or {}))
            for conversation in conversations(messages)]
