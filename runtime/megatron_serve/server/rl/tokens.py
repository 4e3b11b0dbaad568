"""What the tokens-in, tokens-out routes of every framework share: their bodies read onto the completions path,
and the per-token facts (log probs, weight versions, routed experts) in the shapes the anchors answer with.

Each anchor's module (:mod:`.vllm_generate`, :mod:`.sglang_generate`, :mod:`.trl_generate`) reads its body and
names its fields in this server's terms; the routes (:mod:`.token_routes`) run them through the handler of
``/v1/completions`` or ``/v1/chat/completions`` (:func:`handler_for`): one validation, one tokenization, one
submission path, so that a token run through an anchor's route is the token the OpenAI routes run. Only the
answers differ.
"""

from __future__ import annotations

import base64
import contextlib
import io
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, TypeVar

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ValidationError

from ...wire.request import DynamicInferenceRequest
from ..errors import APIError, bad_request, validation_error
from ..images import load_images
from ..intake import check_limits
from ..streaming import cancel_on_disconnect, client_closed, read_body

if TYPE_CHECKING:  # annotations only: the routes module builds the handlers (token_routes)
    from ..chat import ChatHandler
    from ..completions import CompletionHandler
    from ..context import ServerContext

M = TypeVar("M", bound=BaseModel)
H = TypeVar("H", "CompletionHandler", "ChatHandler")


async def serve(ctx: ServerContext, request: Request, answer: Callable[[bytes], Awaitable[Any]]) -> Any:
    """``answer(body)`` once the fleet's first status is in, given up (its engine requests aborted) if the client
    leaves or the server stops, as the OpenAI routes answer."""
    body = await read_body(request)  # whole, before anything watches the connection for a disconnect
    if body is None:
        return client_closed()

    async def work() -> Any:
        await ctx.monitor.wait_first_poll()
        return await answer(body)

    return await cancel_on_disconnect(request, work, ctx.stopping)


def read_anchor(model: type[M], body: bytes, anchor: str) -> M:
    """``body`` as the anchor's ``model``, or the 400 naming what is wrong (:func:`anchor_error`)."""
    if not body:
        raise bad_request("the request body is empty: send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise anchor_error(exc.errors(include_url=False), anchor) from None


def anchor_error(errors: list[Any], anchor: str) -> APIError:
    """The 400 of an anchor's body that failed validation: first a field the anchor has and this server does not
    take (or no anchor has), named; else the first problem, as the OpenAI routes name it."""
    unknown = [error for error in errors if error.get("type") == "extra_forbidden"]
    if not unknown:
        return validation_error(errors)
    param = validation_error(unknown[:1]).param
    return bad_request(f"{param}: not a field of {anchor} that this server takes (the parameter is refused rather "
                       "than ignored, since ignoring it would change the answer)", param=param,
                       code="unsupported_parameter")


async def handler_for(ctx: ServerContext, kind: type[H], fields: dict[str, Any], names: dict[str, str]) -> H:
    """The completions (or chat) handler of a request given as this server's ``fields``, built as the OpenAI routes
    build theirs: checked on a worker thread, a chat's images fetched, then tokenized or rendered on a worker thread
    (its engine jobs made, nothing submitted). Every 400 names the anchor's field (``names``: this server's field ->
    the anchor's path, dotted)."""
    with _anchor_params(names):
        req = await ctx.workers.run(_request, ctx, kind, fields, names)
        await load_images(req, ctx)
        return await ctx.workers.run(kind, ctx, req)


def _request(ctx: ServerContext, kind: type[H], fields: dict[str, Any], names: dict[str, str]) -> Any:
    """On a worker thread: ``fields`` as ``kind``'s request model, within the limits."""
    try:
        req = kind.request_model.model_validate(fields)
    except ValidationError as exc:
        raise validation_error([_renamed(error, names) for error in exc.errors(include_url=False)]) from None
    check_limits(req, ctx.limits, ctx.max_model_len())
    return req


@contextlib.contextmanager
def _anchor_params(names: dict[str, str]) -> Iterator[None]:
    """The ``param`` of an error raised inside, named as the anchor names it."""
    try:
        yield
    except APIError as exc:
        if exc.param is not None:
            head, _, rest = exc.param.partition(".")
            exc.param = names.get(head, head) + ("." + rest if rest else "")
        raise


def _renamed(error: Any, names: dict[str, str]) -> Any:
    """A validation error of this server's field, located at the anchor's (``messages[2]`` names list item 2)."""
    loc = tuple(error.get("loc", ()))
    if not loc or loc[0] not in names:
        return error
    path: list[str | int] = []
    for part in names[loc[0]].split("."):
        name, _, index = part.partition("[")
        path += [name, int(index.rstrip("]"))] if index else [name]
    return {**error, "loc": (*path, *loc[1:])}


def listed(token: int, logprob: float, alternatives: dict[int, float] | None, top: int) -> list[tuple[int, float]]:
    """The log probs vLLM keeps for one generated ``token``: the sampled token first, then those of the ``top`` most
    likely tokens that are others (vLLM's order; a listing by rank sorts them by log prob)."""
    best = sorted((alternatives or {}).items(), key=lambda item: -item[1])[:top]
    return [(token, float(logprob)), *((t, float(lp)) for t, lp in best if t != token)]


def weight_version(epoch: int) -> str:
    """The weight version of a token generated under REFIT epoch ``epoch``: the epoch, as the string the anchors
    report (``/finish_weight_update`` and ``/update_weights_from_*`` name epochs the same way)."""
    return str(epoch)


class WeightVersionSpan(BaseModel):
    """Generated tokens ``start`` to ``end`` (exclusive) came from weight version ``version`` (SGLang's span)."""

    start: int
    end: int
    version: str


def version_spans(epochs: list[int]) -> list[dict[str, Any]]:
    """Per-token weight versions as SGLang's spans: ``{start, end, version}`` over the generated tokens, one per run
    of tokens generated under the same weights (two spans: a REFIT landed mid-answer)."""
    spans: list[dict[str, Any]] = []
    for index, epoch in enumerate(epochs):
        version = weight_version(epoch)
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"start": index, "end": index + 1, "version": version})
    return spans


def routed_experts_npy(result: DynamicInferenceRequest) -> str | None:
    """vLLM's ``routed_experts``: the routing rows (processed tokens x MoE layers x top-k) as a ``.npy`` file,
    base64; None when not asked for."""
    if result.routing_indices is None:
        return None
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(result.routing_indices))
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def routed_experts_int32(result: DynamicInferenceRequest) -> str | None:
    """SGLang's ``routed_experts``: the same rows as raw little-endian int32, base64 (the reader reshapes them to
    ``(len(tokens) - 1, layers, top_k)``); None when not asked for."""
    if result.routing_indices is None:
        return None
    rows = np.ascontiguousarray(result.routing_indices, dtype="<i4")
    return base64.b64encode(rows.tobytes()).decode("ascii")
