"""Whole answers (not streamed): submitted, awaited, and shaped; a large one built and written one choice at a time,
off the event loop.

A whole answer was one response model, built on a worker thread and then validated and serialized
by FastAPI on the event loop: 184 MB of log probs held the loop (every other request's stream and
``/health``) for seconds, and the server held the records, the model and its JSON at once (over a
gigabyte an answer). Within the request budget (:mod:`megatron_serve.limits`) an answer is bounded;
one over :data:`PIECES_ABOVE_BYTES` (estimated) is also written in pieces:

* the envelope (id, usage, chat's ``prompt_logprobs``, ...) is built and serialized on a worker
  thread with no choices, and split where its empty ``choices`` list is;
* each choice is built and serialized on a worker thread, written, and its finished record dropped,
  so that the server holds the records not yet written and one choice's JSON, and the event loop
  runs between any two pieces (and, beside the worker, at every switch of the GIL). vLLM's
  ``prompt_logprobs`` (thousands of entries a choice) are serialized a position at a time
  (:func:`prompt_logprobs_json`) and put in the choice's JSON, or chat's envelope's;
* the body goes out as it is made, at the pace the client reads it (the server's write buffer
  waits for the socket to drain), as ``application/json`` in chunked encoding.

The bytes are those FastAPI would write for the whole response model: the same models, serialized
by pydantic with their aliases, and nothing left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Literal, Protocol

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, TypeAdapter

from ..tokenizer import Tokenizer
from ..limits import Cost
from ..wire.request import DynamicInferenceRequest
from .intake import Workers
from .models import PromptLogprob, PromptLogprobs

if TYPE_CHECKING:  # annotations only: the endpoints hand their context and jobs in
    from .context import ServerContext
    from .translate import EngineJob

#: Answers estimated larger than this many bytes are written in pieces; smaller ones are serialized whole (on the
#: event loop, well under a millisecond).
PIECES_ABOVE_BYTES = 64 * 1024
_CHOICES = b'"choices":['
_UNSCORED = b'"prompt_logprobs":[]'


class AnswerShape(Protocol):
    """How an endpoint shapes a whole answer: one choice from its finished request, and the envelope around the
    choices (which may read every finished request: usage, chat's ``prompt_logprobs``). With ``scored=False``
    they leave ``prompt_logprobs`` an empty list, for :func:`in_pieces` to write (``scored_in`` says which holds it, of
    how many alternatives ``prompt_logprobs``, None when not asked for)."""

    ctx: ServerContext
    scored_in: Literal["choice", "envelope"]

    @property
    def prompt_logprobs(self) -> int | None: ...

    def choice(self, job: EngineJob, result: DynamicInferenceRequest, scored: bool = True) -> BaseModel: ...

    def envelope(self, choices: list[Any], results: list[DynamicInferenceRequest], scored: bool = True
                 ) -> BaseModel: ...


async def whole_answer(ctx: ServerContext, jobs: list[EngineJob], shape: AnswerShape, cost: Cost,
                       decodes_every_token: bool, label: str = "") -> Any:
    """Submit ``jobs``, wait for all of them, and shape the answer from the finished requests (``cost``: the
    request's, from its budget check; ``label``: the response id, for the request log).

    An answer with log probs decodes every token, which would hold the event loop (and every other
    request's stream) for as long: it is built on the worker threads instead; one estimated over
    :data:`PIECES_ABOVE_BYTES` is also written in pieces.
    """
    results = await ctx.submit(jobs, label).results()
    if cost.answer_bytes > PIECES_ABOVE_BYTES:
        return await in_pieces(ctx.workers, shape, jobs, results)
    if decodes_every_token:
        return await ctx.workers.run(whole, shape, jobs, results)
    return whole(shape, jobs, results)


def whole(shape: AnswerShape, jobs: list[EngineJob], results: list[DynamicInferenceRequest]) -> BaseModel:
    """The answer as one model (small answers; FastAPI serializes it)."""
    return shape.envelope([shape.choice(job, result) for job, result in zip(jobs, results)], results)


def _scored(shape: AnswerShape, model: BaseModel, result: DynamicInferenceRequest) -> bytes:
    """``model``'s JSON with the ``prompt_logprobs`` of ``result`` in place of its empty list (a JSON string writes
    every ``"`` it holds escaped, so the first ``"prompt_logprobs":[]`` is the key's; so for ``"choices":[``)."""
    data = model.model_dump_json(by_alias=True).encode()
    n = shape.prompt_logprobs
    if n is None:
        return data
    at = data.index(_UNSCORED)
    return b"".join((data[:at], b'"prompt_logprobs":', prompt_logprobs_json(shape.ctx.tokenizer, result, n),
                     data[at + len(_UNSCORED):]))


def _frame(shape: AnswerShape, results: list[DynamicInferenceRequest]) -> tuple[bytes, bytes]:
    """The envelope's JSON up to its choices, and from their end."""
    scored = shape.scored_in == "envelope"
    envelope = shape.envelope([], results, scored=not scored)
    data = _scored(shape, envelope, results[0]) if scored else envelope.model_dump_json(by_alias=True).encode()
    at = data.index(_CHOICES) + len(_CHOICES)
    return data[:at], data[at:]


def _choice_json(shape: AnswerShape, job: EngineJob, result: DynamicInferenceRequest) -> bytes:
    if shape.scored_in == "choice":
        return _scored(shape, shape.choice(job, result, scored=False), result)
    return shape.choice(job, result).model_dump_json(by_alias=True).encode()


async def in_pieces(workers: Workers, shape: AnswerShape, jobs: list[EngineJob],
                    results: list[DynamicInferenceRequest]) -> StreamingResponse:
    """The answer's response, written in pieces (see the module docstring); ``results`` is emptied as it goes."""
    head, tail = await workers.run(_frame, shape, results)
    pending: list[DynamicInferenceRequest | None] = list(results)
    results.clear()

    async def body() -> AsyncIterator[bytes]:
        yield head
        for index, job in enumerate(jobs):
            result = pending[index]
            pending[index] = None  # the record goes once its choice is made
            piece = await workers.run(_choice_json, shape, job, result)
            del result
            yield piece if index == 0 else b"," + piece
        yield tail

    return StreamingResponse(body(), media_type="application/json")


def prompt_logprobs(tokenizer: Tokenizer, result: DynamicInferenceRequest, n: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: None for the first token, then per position the prompt token and the top ``n``.

    Every prompt token has its rank (1 = most likely; the engine counts the tokens more likely than it, as vLLM's),
    in the top n or not; an alternative's is its place among them.
    """
    return [None, *(_position(tokenizer, result, position, n) for position in range(len(result.prompt_log_probs)))]


_POSITION_JSON = TypeAdapter(dict[str, PromptLogprob])


def prompt_logprobs_json(tokenizer: Tokenizer, result: DynamicInferenceRequest, n: int) -> bytes:
    """:func:`prompt_logprobs` as the JSON pydantic writes for it, each position serialized as soon as it is made:
    its objects go at once (a list of them all, thousands per choice, lived long enough for the garbage
    collector to walk them again and again, holding the GIL for up to a second each time)."""
    parts = [b"null"]
    for position in range(len(result.prompt_log_probs)):
        parts.append(_POSITION_JSON.dump_json(_position(tokenizer, result, position, n), by_alias=True))
    return b"[" + b",".join(parts) + b"]"


def _position(tokenizer: Tokenizer, result: DynamicInferenceRequest, position: int, n: int) -> dict[str, PromptLogprob]:
    """The ``prompt_logprobs`` entry of prompt token ``position + 1``."""
    token = result.prompt_tokens[position + 1]
    top = result.prompt_top_n_logprobs[position] if position < len(result.prompt_top_n_logprobs) else {}
    ranked = sorted(top.items(), key=lambda item: -item[1])
    rank = (result.prompt_ranks[position] if position < len(result.prompt_ranks)
            else next((r + 1 for r, (t, _) in enumerate(ranked) if t == token), None))
    entry = {str(token): PromptLogprob(logprob=result.prompt_log_probs[position], rank=rank,
                                       decoded_token=tokenizer.token_text(token))}
    for r, (t, value) in enumerate(ranked[:n]):
        entry.setdefault(str(t), PromptLogprob(logprob=value, rank=r + 1, decoded_token=tokenizer.token_text(t)))
    return entry
