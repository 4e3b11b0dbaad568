"""vLLM's request fields beyond the OpenAI API, with vLLM's meaning, as mixins of the request models.

A script written for vLLM sends these in ``extra_body``; each is honoured (see ``extensions.py``
for what each does, ``translate.py`` for how):

* ``request_id`` names the request in the response id and the logs (the ``X-Request-Id`` header
  wins, as in vLLM); ``priority`` orders admission (lower first, then arrival) and ``cache_salt``
  isolates prefix-cache entries (both rows of the sampling table, ``wire/sampling_fields.py``,
  declared from it with the other sampling fields); ``truncate_prompt_tokens`` keeps the prompt's last N tokens;
  ``structured_outputs`` is vLLM's current name for the ``guided_*`` family; ``return_token_ids``
  adds the token ids of prompt and answer, so that an RL trainer never tokenizes text again, and
  ``return_tokens_as_token_ids`` names the tokens of log-prob listings by id (``token_id:N``);
* chat only: ``chat_template_kwargs`` reach the template, ``add_generation_prompt``,
  ``continue_final_message`` and ``add_special_tokens`` steer rendering and tokenization;
* numbers sent as strings (``"max_tokens": "10"``) are read as numbers, as vLLM's lax parsing
  does; anything else keeps the strict types of ``models.py``.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .extensions import extension

#: What a client-chosen request id may hold: printable ASCII (it is logged), 1 to 256 characters.
REQUEST_ID_PATTERN = r"^[ -~]{1,256}$"
REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
#: Backends vLLM lets a request name; every constraint is decoded with llguidance here, whichever is named.
GUIDED_BACKENDS = Literal["auto", "xgrammar", "guidance", "llguidance", "outlines", "lm-format-enforcer"]
#: ``apply_chat_template`` arguments that this server sets itself: a request's template kwargs may not.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})

_INTEGER = re.compile(r"^\s*[+-]?\d{1,20}\s*$")


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints (the ``guided_*`` family's meanings)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = Field(None, min_length=1)
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, min_length=1, description="GBNF/EBNF ('root ::= ...') or Lark")
    json_object: bool | None = Field(None, description="true: any JSON object")

    def given(self) -> dict[str, Any]:
        """The constraints set, as ``StructuredOutputsParams`` fields."""
        spec = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object or None}
        return {kind: value for kind, value in spec.items() if value is not None}


def _number_kind(annotation: Any) -> type | None:
    """``int`` or ``float`` for a field typed ``int``/``float`` (optionally ``| None``), else None."""
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if len(options) == 1 and options[0] in (int, float):
        return options[0]
    return None


def _number_fields(model: type[BaseModel]) -> dict[str, type]:
    return {name: kind for name, info in model.model_fields.items() if (kind := _number_kind(info.annotation))}


class VllmSamplingFields(BaseModel):
    """The vLLM fields of both generation endpoints."""

    request_id: str | None = extension("request_id", pattern=REQUEST_ID_PATTERN)
    truncate_prompt_tokens: int | None = extension("truncate_prompt_tokens", ge=-1)
    structured_outputs: StructuredOutputsRequest | None = extension("structured_outputs")
    guided_decoding_backend: GUIDED_BACKENDS | None = extension("guided_decoding_backend")
    return_token_ids: bool | None = extension("return_token_ids")
    return_tokens_as_token_ids: bool | None = extension("return_tokens_as_token_ids")
    use_beam_search: bool = extension("use_beam_search", False)

    @model_validator(mode="before")
    @classmethod
    def _numbers_from_strings(cls, data: Any) -> Any:
        """``"10"`` for an integer field and ``"0.5"`` for a number field are read as numbers (vLLM's lax
        parsing); any other string stays a string, for the strict types to refuse naming the field."""
        if not isinstance(data, dict):
            return data
        fields = _NUMBER_FIELDS.get(cls)
        if fields is None:
            fields = _NUMBER_FIELDS[cls] = _number_fields(cls)
        coerced = None
        for name in fields.keys() & data.keys():  # (the few number fields a body holds, not every one)
            value = data[name]
            if isinstance(value, str) and (number := _parse_number(value, fields[name])) is not None:
                coerced = coerced or dict(data)
                coerced[name] = number
        return coerced or data


_NUMBER_FIELDS: dict[type, dict[str, type]] = {}


def _parse_number(text: str, kind: type) -> int | float | None:
    if kind is int:
        return int(text) if _INTEGER.match(text) else None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class VllmCompletionFields(BaseModel):
    """vLLM's fields of ``/v1/completions`` only."""

    add_special_tokens: bool = extension("add_special_tokens", True)


class VllmChatFields(BaseModel):
    """vLLM's fields of ``/v1/chat/completions`` only: how the conversation is rendered and tokenized."""

    chat_template_kwargs: dict[str, Any] | None = extension("chat_template_kwargs")
    add_generation_prompt: bool = extension("add_generation_prompt", True)
    continue_final_message: bool = extension("continue_final_message", False)
    add_special_tokens: bool = extension("add_special_tokens", False)
