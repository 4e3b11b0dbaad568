"""The front door: from the bytes of a request to a checked request model, without stalling the server.

The event loop answers every connection, the probes included, so no step whose cost grows with
what a client sends may run on it unbounded:

* :class:`BodySizeLimit` refuses a body over ``max_body_bytes`` with a 413 before reading it
  (by ``Content-Length``) or as soon as the bytes read exceed it (chunked bodies), and a body that
  is not declared ``application/json`` with a 415 (vLLM's rule; a browser's form or ``fetch`` can
  send ``text/plain`` to another site without asking it first, never ``application/json``);
* :func:`parse_body` parses and validates in one pass (pydantic's own JSON parser, which also
  refuses invalid UTF-8, lone surrogates and nesting deeper than a few hundred levels). It holds
  the GIL, so its cost is bounded by the body limit rather than moved off the loop;
* :func:`check_limits` refuses oversized requests before anything is tokenized or rendered, and
  :func:`check_budget` the costly ones (:mod:`megatron_serve.limits`) once their prompts are tokens,
  before anything is submitted;
* :class:`Workers` runs tokenization and chat-template rendering on a few threads (the Rust
  tokenizer releases the GIL while it encodes, so a long prompt on a worker barely delays the event
  loop; inline it stalls it for seconds: docs/design-measurements.md).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..limits import Cost, KeptIdsMeter, RequestLimits, engine_request_cost, over_budget
from .errors import APIError, bad_request, validation_error
from .http_layer import HTTPLayer
from .models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TextContentPart,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    _SamplingRequest,
)

if TYPE_CHECKING:  # annotations only: intake stays below the translation of bodies
    from .translate import EngineJob

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes; the operator sets "
                         "it with --max-request-bytes)", code="request_too_large")


def not_json(content_type: str | None) -> APIError:
    return APIError(415, f"the request body must be JSON sent as 'Content-Type: application/json', not "
                         f"{content_type[:100]!r}" if content_type else "the request body must be JSON sent as "
                         "'Content-Type: application/json' (the request declares no content type)",
                    code="unsupported_media_type")


class BodySizeLimit(HTTPLayer):
    """ASGI middleware: bodies larger than ``limit`` bytes get a 413, bodies not declared JSON a 415, in the
    OpenAI error shape.

    A declared ``Content-Length`` over the limit is answered at once, unread; the server then
    discards the rest of the upload (the connection's read timeout bounds how long), so that the
    client reads the 413 instead of a broken connection. Every route that takes a body takes JSON;
    a request without one (``Content-Length: 0``, or neither it nor chunked encoding: an admin verb
    with no arguments) needs no content type.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        super().__init__(app)
        self.limit = limit

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared, content_type, chunked = _body_headers(scope)
        if declared is not None and declared > self.limit:
            await too_large(self.limit).response()(scope, receive, send)
            return
        if (chunked or (declared or 0) > 0) and not _is_json(content_type):
            await not_json(content_type).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # raised into the route reading the body: the APIError handler answers
                    raise too_large(self.limit)
            return message

        await self.app(scope, limited, send)


def _body_headers(scope: Scope) -> tuple[int | None, str | None, bool]:
    """The request's declared ``Content-Length`` (None: none, or not a number), ``Content-Type`` and whether its
    body comes chunked."""
    length: int | None = None
    content_type: str | None = None
    chunked = False
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                length = None
        elif name == b"content-type":
            content_type = value.decode("latin-1")
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return length, content_type, chunked


def _is_json(content_type: str | None) -> bool:
    """``application/json``, with parameters (``; charset=utf-8``) or not, in any case."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


def parse_body(schema: type[M] | TypeAdapter[M], body: bytes) -> M:
    """``body`` as ``schema`` (a model, or a ``TypeAdapter`` for a union of them), or the 400 that names
    what is wrong."""
    if not body:
        raise bad_request("the request body is empty: send a JSON object", code="invalid_json")
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_json(body)
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def check_limits(req: _SamplingRequest, limits: RequestLimits, max_model_len: int | None) -> None:
    """Refuse a request over the limits before it is tokenized, rendered or submitted."""
    if req.n is not None and req.n > limits.max_n:
        raise bad_request(f"n is {req.n}; this server allows at most {limits.max_n} choices per request", param="n")
    if isinstance(req, CompletionRequest):
        prompts, n = _prompt_count(req.prompt), req.n or 1
        check_choices(prompts * n, limits.max_choices, f" ({prompts} prompts x n={n})", "n" if n > 1 else "prompt")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop:
        raise bad_request(f"stop holds {len(stops)} strings; this server allows at most {limits.max_stop}",
                          param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise bad_request(f"stop holds a string of {longest} characters; this server allows at most "
                          f"{limits.max_stop_chars}", param="stop")
    if req.logit_bias is not None and len(req.logit_bias) > limits.max_logit_bias:
        raise bad_request(f"logit_bias has {len(req.logit_bias)} entries; this server allows at most "
                          f"{limits.max_logit_bias}", param="logit_bias")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"stop_token_ids holds {len(req.stop_token_ids)} ids; this server allows at most "
                          f"{limits.max_stop_token_ids} (--max-stop-token-ids)", param="stop_token_ids")
    check_logprobs(req, limits.max_logprobs)
    if isinstance(req, ChatCompletionRequest):
        check_prompt_size(limits, max_model_len, messages=req.messages)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    elif isinstance(req, CompletionRequest):
        check_prompt_size(limits, max_model_len, prompt=req.prompt)
        requested, tokens_param = req.max_tokens, "max_tokens"
    else:
        raise TypeError(f"not a request model: {type(req).__name__}")
    if max_model_len is not None and requested is not None and requested >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, and {tokens_param} asks "
                            f"for {requested} (the prompt needs at least one token too). Please reduce {tokens_param}.",
                       param=tokens_param, code="context_length_exceeded")


def check_choices(count: int, limit: int, detail: str = "", param: str = "n") -> None:
    """A request asks for ``count`` engine requests (prompts x ``n``; ``detail`` says how they multiply): past
    ``--max-choices`` it is a 400 naming the limit, before anything is tokenized or submitted."""
    if count > limit:
        raise bad_request(f"This request asks for {count} choices{detail}, more than the maximum of {limit} per "
                          "request (--max-choices). Please send fewer prompts or reduce n.", param=param,
                          code="too_many_choices")


def _prompt_count(prompt: Any) -> int:
    """Prompts in a validated completion ``prompt``: a string or one list of token ids is one, a list of strings or
    of id lists one each."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def check_budget(jobs: list[EngineJob], limits: RequestLimits, *, returns_prompt: bool = False) -> Cost:
    """The cost of a request's engine requests (``returns_prompt``: the answer repeats each prompt), or the 400 that
    names the budget it is over and the request's figure."""
    cost = Cost()
    for job in jobs:
        cost += engine_request_cost(len(job.prompt.tokens), job.params, returns_prompt=returns_prompt)
    reason = over_budget(cost, limits.max_request_logprobs, limits.max_response_bytes)
    if reason is not None:
        raise APIError(400, reason, code="over_budget")
    return cost


def kept_ids_meter(jobs: list[EngineJob], limits: RequestLimits) -> KeptIdsMeter | None:
    """The meter of a request whose engine requests keep their top-p ids (None for others): one for all of them, so
    that their ids are counted together, as they arrive, against both budgets (what a request's answer holds besides
    them counted at their most, as :func:`check_budget` does)."""
    if not any(job.params.return_top_p_token_ids for job in jobs):
        return None
    cost = sum((engine_request_cost(len(job.prompt.tokens), job.params) for job in jobs), Cost())
    return KeptIdsMeter(cost, limits.max_request_logprobs, "--max-request-logprobs",
                        max_bytes=limits.max_response_bytes, choices=len(jobs))


def check_logprobs(req: _SamplingRequest, limit: int) -> None:
    """Log probs per token beyond ``--max-logprobs`` are a 400 naming the field (vLLM's check)."""
    asked = [("prompt_logprobs", req.prompt_logprobs)]
    if isinstance(req, ChatCompletionRequest):
        asked.append(("top_logprobs", req.top_logprobs))
    elif isinstance(req, CompletionRequest):
        asked.append(("logprobs", req.logprobs))
    for param, value in asked:
        if value is not None and value > limit:
            raise bad_request(f"{param} asks for {value} log probs per token; this server returns at most {limit} "
                              "(--max-logprobs)", param=param)


def check_prompt_size(limits: RequestLimits, max_model_len: int | None, *, prompt: Any = None,
                      messages: list[ChatMessage] | None = None) -> None:
    """The limits on what is about to be rendered and tokenized: a ``prompt`` (any of its shapes) or
    chat ``messages`` (how many, and their characters)."""
    if messages is not None:
        if len(messages) > limits.max_messages:
            raise bad_request(f"messages holds {len(messages)} messages; this server allows at most "
                              f"{limits.max_messages}", param="messages")
        chars, param = sum(_content_chars(m.content) for m in messages), "messages"
    else:
        chars, param = _prompt_chars(prompt), "prompt"
    chars_limit = limits.prompt_chars(max_model_len)
    if chars_limit is not None and chars > chars_limit:
        raise APIError(400, f"{param} holds {chars} characters; this server tokenizes at most {chars_limit} "
                            "per request (longer text cannot fit the context)", param=param,
                       code="context_length_exceeded")


def _prompt_chars(prompt: Any) -> int:
    """Characters to tokenize in a validated prompt: a string, or strings, token ids or id lists (one kind of item
    per prompt, so the first says which, and no loop walks every id of a long prompt)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(map(len, prompt)) if prompt and isinstance(prompt[0], str) else 0


def _content_chars(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content if isinstance(part, TextContentPart))


def request_body_doc(*models: type[BaseModel], required: bool = True) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a route that parses one of ``models`` itself (``openapi()`` adds
    their schemas, see :data:`SELF_PARSED`); ``required=False``: an empty body takes the defaults."""
    refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


#: The request bodies that routes parse themselves (through :func:`parse_body`), for the OpenAPI document.
SELF_PARSED: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest,
                                            TokenizeChatRequest, DetokenizeRequest)


class Workers:
    """A few threads for tokenization and chat-template rendering, shared by every request of an app.

    Bounded: at most ``threads`` such jobs run at once, the others wait their turn (a request
    whose client leaves stops waiting; a job that already runs finishes, bounded by the limits).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        if self.threads < 1:
            raise ValueError(f"tokenizer threads must be >= 1, got {self.threads}")
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="megatron-serve-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


#: A completion body up to this size is parsed, checked and tokenized on the event loop, not on a worker
#: thread: handing two jobs per request to the pool (``ThreadPoolExecutor.submit`` alone) was 12% of the
#: HTTP server's samples that held the GIL at 64 streams of 64 tokens (``benchmarks/serving.py``: 128-id
#: prompts, bodies of about 800 bytes), more than the work it moved. Bigger bodies, chats (templates)
#: and any output constraint (a grammar to check) still go to :class:`Workers`.
INLINE_BODY_BYTES = 4096
#: The request fields that make an output constraint (``translate.structured_outputs`` checks them).
_CONSTRAINT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                      "response_format")


def small_body(body: bytes) -> bool:
    """Whether ``body`` is parsed on the event loop (see :data:`INLINE_BODY_BYTES`)."""
    return len(body) <= INLINE_BODY_BYTES


def unconstrained(req: BaseModel) -> bool:
    """Whether ``req`` asks for no output constraint (whose check compiles a grammar: never on the loop)."""
    return all(getattr(req, name, None) is None for name in _CONSTRAINT_FIELDS)


def default_threads() -> int:
    """Up to 4 threads: tokenizing is fast per request; more threads than cores only queue elsewhere."""
    return max(1, min(4, os.cpu_count() or 1))
