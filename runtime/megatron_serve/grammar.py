"""Grammars of structured-output constraints, and checking one before any engine sees it.

Torch-free, so the HTTP server checks a request's schema, regex or grammar (a 400 naming the
problem) without importing the engine; the engine builds its matchers from :func:`grammar_for`.
"""

from __future__ import annotations

import json
from typing import Any

from .sampling_params import StructuredOutputsParams

#: JSON as ``json.dumps`` writes it: no free whitespace (a small model could spend its whole budget on
#: it), ``", "`` and ``": "`` between items. A schema may override this with its own
#: ``"x-guidance": {"whitespace_flexible": true}``.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: see :func:`grammar_error`)."""
    import llguidance  # noqa: PLC0415 - only processes that constrain output load it

    kind = spec.kind
    if kind == "json":
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)


def grammar_error(spec: StructuredOutputsParams, tokenizer: Any = None) -> str | None:
    """Why the constraint cannot be used (a bad schema, regex or grammar), or None when it can."""
    import llguidance  # noqa: PLC0415

    try:
        grammar = grammar_for(spec)
    except (ValueError, TypeError) as exc:  # unparsable JSON, a GBNF grammar that does not convert
        return str(exc)
    message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    return message.strip() or None
