"""Grammars of structured-output constraints, and checking one before any engine sees it.

Torch-free, so the HTTP server checks a request's schema, regex or grammar (a 400 naming the
problem) without importing the engine; the engine builds its matchers from :func:`grammar_for`.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import TYPE_CHECKING, Any

from .wire.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance import LLTokenizer

#: JSON as ``json.dumps`` writes it: no free whitespace (a small model could spend its whole budget on
#: it), ``", "`` and ``": "`` between items. A schema may override this with its own
#: ``"x-guidance": {"whitespace_flexible": true}``.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that does not say otherwise.

    vLLM's default backend (xgrammar, strict mode) reads a schema that way, and clients rely on it: LangChain's
    ``with_structured_output`` and a forced tool send schemas without the key, and llguidance's own default (extra
    keys allowed) let a small model add keys until its budget ran out, so the answer never parsed. A schema that
    sets the key (``true``, or a schema for the extra values) keeps it."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    is_object = schema.get("type") == "object" or isinstance(schema.get("properties"), dict)
    if is_object and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: see :func:`grammar_error`)."""
    import llguidance  # noqa: PLC0415 - only processes that constrain output load it

    kind = spec.kind
    if kind == "json":
        schema = closed_objects(json.loads(spec.json) if isinstance(spec.json, str) else spec.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)


def constraint_bytes(spec: StructuredOutputsParams) -> int:
    """The size of a constraint as the client wrote it (UTF-8): what its grammar's cost grows with."""
    if spec.choice is not None:
        return sum(len(choice.encode()) for choice in spec.choice)
    text = spec.regex or spec.grammar or spec.json or ""
    return len((json.dumps(text) if isinstance(text, dict) else text).encode())


def grammar_error(spec: StructuredOutputsParams, tokenizer: LLTokenizer | None = None,
                  timeout: float | None = None) -> str | None:
    """Why the constraint cannot be used (a bad schema, regex or grammar), or None when it can.

    ``timeout``: seconds the check may take, waiting for a checker thread included; a constraint
    that takes longer cannot be used either. The checks run on :data:`CHECKER_THREADS` threads of
    their own: llguidance cannot be interrupted, but it releases the GIL, so a slow check costs one
    of those threads until it ends and no more (checks that waited past their deadline never start).
    """
    if timeout is None:
        return _check(spec, tokenizer)
    future = _checkers().submit(_check, spec, tokenizer)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        return f"it could not be checked within {timeout:g}s (the server's --grammar-compile-timeout)"


def warm_checker() -> None:
    """Import llguidance and check one small grammar, so that a server's first constrained request does not
    pay for it: the import holds the interpreter for a moment, which stalled every other completion of a
    fresh server. Servers call it on a thread of their own at start-up."""
    grammar_error(StructuredOutputsParams(regex="[a-z]+"), timeout=None)


#: Threads that check constraints for :func:`grammar_error` with a timeout, per process.
CHECKER_THREADS = 2
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _checkers() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(CHECKER_THREADS, thread_name_prefix="megatron-serve-grammar")
        return _pool


def _check(spec: StructuredOutputsParams, tokenizer: LLTokenizer | None) -> str | None:
    import llguidance  # noqa: PLC0415

    try:
        grammar = grammar_for(spec)
    except (ValueError, TypeError) as exc:  # unparsable JSON, a GBNF grammar that does not convert
        return str(exc)
    message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    return message.strip() or None
