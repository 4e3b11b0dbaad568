"""The sampling fields of the frameworks' bodies (vLLM's ``sampling_params``, SGLang's, TRL's generation fields), built
from the table of sampling parameters (``wire/sampling_fields.py``).

A row with a framework's name (its ``vllm`` or ``sglang`` column) and an HTTP field is one field of that framework's
body, of the row's body type, which the server passes on to ``/v1/completions`` under the HTTP name: so a new sampling
parameter with both names reaches every tokens-in route by its row alone. What a route adds of its own (a default of
the framework's, a description, a field that changes nothing or is refused) is data next to that route's body.
The ranges are not repeated here: the completions request checks them, naming the framework's field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo

from ...wire.sampling_fields import FIELDS, SamplingField

Framework = Literal["vllm", "sglang"]


def framework_rows(framework: Framework) -> dict[str, SamplingField]:
    """The rows a framework's body names, by the framework's name: those with an HTTP field to set (where two rows
    share a name, as vLLM's ``logprobs`` for the flag and the count, the first sets the HTTP field)."""
    rows: dict[str, SamplingField] = {}
    for row in FIELDS:
        name = getattr(row, framework)
        if name is not None and row.http is not None:
            rows.setdefault(name, row)
    return rows


def completions_names(framework: Framework) -> dict[str, str]:
    """The framework's name -> the ``/v1/completions`` field, where they differ."""
    return {name: row.http for name, row in framework_rows(framework).items() if name != row.http}  # type: ignore[misc]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def sampling_body(model: str, framework: Framework, doc: str, *, defaults: dict[str, Any] | None = None,
                  nullable: frozenset[str] = frozenset(), only: tuple[str, ...] | None = None,
                  descriptions: dict[str, str] | None = None,
                  own: dict[str, tuple[Any, FieldInfo]] | None = None) -> type[BaseModel]:
    """A strict pydantic body: one field per row the framework names (``only``: these names alone, in this order), of
    the row's body type, left out (None) unless ``defaults`` gives the framework's own default (then it must be of
    that type, unless also ``nullable``), described by ``descriptions``; ``own``: the route's fields that are no row."""
    rows = framework_rows(framework)
    defaults, descriptions = defaults or {}, descriptions or {}
    unknown = sorted((set(defaults) | set(descriptions) | set(only or ())) - set(rows))
    if unknown:
        raise ValueError(f"{model}: {', '.join(unknown)} is no {framework} name of the sampling table")
    fields: dict[str, Any] = {}
    for name in only if only is not None else tuple(rows):
        kind = rows[name].body_type
        required = name in defaults and name not in nullable
        info = Field(defaults.get(name), description=descriptions.get(name))
        fields[name] = (kind if required else kind | None, info)
    fields.update(own or {})
    return create_model(model, __base__=_Strict, __doc__=doc, __module__=__name__, **fields)


#: SGLang's names -> vLLM's, where they differ (the table's).
_SGLANG_TO_VLLM = {row.sglang: row.vllm for row in FIELDS
                   if row.sglang is not None and row.vllm is not None and row.sglang != row.vllm}


def vllm_names(params: dict[str, Any]) -> dict[str, Any]:
    """Sampling parameters with SGLang's names turned into vLLM's, for a caller that may be handed either (verl's
    agent loop: its SGLang rollout speaks ``max_new_tokens``); vLLM's name wins where both are given."""
    renamed = {name: value for name, value in params.items() if name not in _SGLANG_TO_VLLM}
    for name, value in params.items():
        if name in _SGLANG_TO_VLLM:
            renamed.setdefault(_SGLANG_TO_VLLM[name], value)
    return renamed
