"""The generation routes of TRL's own ``trl vllm-serve`` protocol (TRL <= 1.10): ``POST /generate/``, ``POST /chat/``
and ``POST /get_sequence_logprobs/``, with TRL's trailing slashes, bodies and answers.

TRL's ``VLLMClient`` sends a batch of prompts (text or ids) or conversations with vLLM's sampling fields (and more
in ``generation_kwargs``, vLLM's ``SamplingParams`` names) and reads back ``prompt_ids`` (one per prompt),
``completion_ids`` (one per sequence, ``n`` per prompt in order) and per-token log probs sorted by rank
(``logprobs: 0``: the sampled token's; ``N``: the ``N`` best and the sampled one). ``/get_sequence_logprobs/`` scores
given sequences (a teacher's log probs for distillation), as nested lists or as TRL's base64 numpy arrays.

Every request runs through the handlers of ``/v1/completions`` and ``/v1/chat/completions`` (built in
:mod:`.token_routes`), the conversations of ``/chat/`` and the prompts of ``/generate/`` as one submission each: one
engine job per sequence, all aborted together if the client leaves. This module reads TRL's bodies and shapes
TRL's answers.
"""

from __future__ import annotations

import base64
import math
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...wire.request import DynamicInferenceRequest
from ..errors import bad_request
from .tokens import anchor_error, listed, read_anchor
from .sampling_bodies import sampling_body
from .vllm_sampling import VllmSamplingParams, sampling_fields

if TYPE_CHECKING:  # annotations only: the routes module builds the handlers (token_routes)
    from ..chat import ChatHandler
    from ..completions import CompletionHandler
    from ..context import ServerContext
    from ..translate import EngineJob

_JSON = msgspec.json.Encoder()


#: TRL's sampling fields (vLLM's names, so their types are the sampling table's) with TRL's defaults, in its order.
TRL_DEFAULTS: dict[str, Any] = {"n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                "min_p": 0.0, "max_tokens": 16, "logprobs": 0}
#: TRL's fields that are no row of the table: its output constraint, and more of vLLM's SamplingParams.
TRL_OWN: dict[str, tuple[Any, Any]] = {
    "structured_outputs_regex": (str | None, None),
    "generation_kwargs": (dict[str, Any], Field(default_factory=dict, description="more of vLLM's SamplingParams "
                                                                                  "(seed, stop, ...); they win")),
}

_Sampling = sampling_body(
    "_Sampling", "vllm", "The sampling fields of TRL's generation bodies, with TRL's defaults.",
    defaults=TRL_DEFAULTS, nullable=frozenset({"logprobs"}), only=tuple(TRL_DEFAULTS), own=TRL_OWN,
    descriptions={"logprobs": "0: the sampled token's log prob; N: the N best and the sampled one; null: none"})


class TrlGenerateRequest(_Sampling):  # type: ignore[misc,valid-type]
    """Body of ``POST /generate/`` (TRL's ``GenerateRequest``)."""

    prompts: list[str] | list[list[int]]
    images: list[None] | None = Field(None, description="only null: this server serves no images through TRL's "
                                                        "protocol")


class TrlChatRequest(_Sampling):  # type: ignore[misc,valid-type]
    """Body of ``POST /chat/`` (TRL's ``ChatRequest``): conversations, each rendered with the chat template."""

    messages: list[list[dict[str, Any]]]
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


class TrlGenerateResponse(BaseModel):
    """Answer of ``POST /generate/`` and ``POST /chat/``."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[list[float | None]]] | None
    logprob_token_ids: list[list[list[int]]] | None


class TrlSequenceLogprobsRequest(BaseModel):
    """Body of ``POST /get_sequence_logprobs/``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    sequences: list[list[int]] = Field(description="whole sequences: prompt, then completion")
    prompt_lengths: list[int] = Field(description="per sequence, where its completion starts")
    top_logprobs: int = 100
    temperature: float = Field(1.0, description="passed on as vLLM does; prompt log probs are the model's own")
    response_format: Literal["json", "binary"] = "json"


class TrlSequenceLogprobsResponse(BaseModel):
    """Answer of ``POST /get_sequence_logprobs/``: nested lists (json), or base64 numpy arrays (binary)."""

    logprobs: list[list[list[float | None]]] | None = None
    logprob_token_ids: list[list[list[int]]] | None = None
    logprobs_b64: str | None = None
    token_ids_b64: str | None = None
    actual_logprobs_b64: str | None = None
    actual_token_ids_b64: str | None = None
    shape: list[int] | None = None
    completion_lengths: list[int] | None = None


def _sampling(body: TrlGenerateRequest | TrlChatRequest) -> tuple[dict[str, Any], dict[str, str]]:
    """The completions fields of TRL's sampling fields (``generation_kwargs`` winning, as TRL merges them), and where
    each came from."""
    given = body.model_dump(include=set(TRL_DEFAULTS))
    try:
        params = VllmSamplingParams.model_validate(body.generation_kwargs)
    except ValidationError as exc:
        raise anchor_error([{**e, "loc": ("generation_kwargs", *e["loc"])} for e in exc.errors(include_url=False)],
                           "vLLM's SamplingParams") from None
    extra = sampling_fields(params, "generation_kwargs")
    names = {name: f"generation_kwargs.{name}" for name in extra}
    given.update(extra)
    if body.structured_outputs_regex is not None:
        given.pop("structured_outputs", None)
        given["guided_regex"] = body.structured_outputs_regex
        names["guided_regex"] = "structured_outputs_regex"
    return given, names


def _listing(result: DynamicInferenceRequest, top: int) -> tuple[list[list[float | None]], list[list[int]]]:
    """One sequence's log probs and their token ids, per token, by rank (TRL's ``extract_logprobs``)."""
    values: list[list[float | None]] = []
    ids: list[list[int]] = []
    for i, token in enumerate(result.generated_tokens):
        alternatives = result.generated_top_n_logprobs[i] if i < len(result.generated_top_n_logprobs) else None
        entries = sorted(listed(token, result.generated_log_probs[i], alternatives, top), key=lambda e: -e[1])
        values.append([None if math.isnan(lp) else lp for _, lp in entries])
        ids.append([t for t, _ in entries])
    return values, ids


def _answer(prompts: list[list[int]], results: list[DynamicInferenceRequest], top: int | None) -> bytes:
    """TRL's answer (JSON) of the sequences ``results`` of ``prompts``; ``top``: the log probs asked for, or None."""
    listings = [_listing(result, top) for result in results] if top is not None else None
    return _JSON.encode({"prompt_ids": prompts, "completion_ids": [list(result.generated_tokens) for result in results],
                         "logprobs": None if listings is None else [values for values, _ in listings],
                         "logprob_token_ids": None if listings is None else [ids for _, ids in listings]})


def read_generate(raw: bytes) -> TrlGenerateRequest:
    """The body of ``/generate/``."""
    return read_anchor(TrlGenerateRequest, raw, "TRL's GenerateRequest")


def generate_fields(ctx: ServerContext, body: TrlGenerateRequest) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``/v1/completions`` request that runs ``body``'s prompts, and where each field came from."""
    given, names = _sampling(body)
    return {**given, "model": ctx.model_name, "prompt": body.prompts}, {"prompt": "prompts", **names}


async def answer_generate(ctx: ServerContext, handler: CompletionHandler) -> Response:
    """Submit ``handler``'s jobs; TRL's answer."""
    ctx.request_log.received(handler)
    results = await ctx.submit(handler.jobs, handler.id).results()
    answer = await ctx.workers.run(_answer, [p.tokens for p in handler.prompts], results, handler.req.logprobs)
    return Response(answer, media_type="application/json")


def read_chat(raw: bytes) -> TrlChatRequest:
    """The body of ``/chat/``."""
    body = read_anchor(TrlChatRequest, raw, "TRL's ChatRequest")
    if not body.messages:
        raise bad_request("messages holds no conversation", param="messages")
    return body


def conversation_fields(ctx: ServerContext, body: TrlChatRequest, index: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``/v1/chat/completions`` request that runs conversation ``index`` of ``body``, and where each field came
    from."""
    given, names = _sampling(body)
    top = given.pop("logprobs", None)
    fields = {**given, "model": ctx.model_name, "messages": body.messages[index], "tools": body.tools,
              "chat_template_kwargs": body.chat_template_kwargs or None, "logprobs": top is not None,
              "top_logprobs": top}
    return fields, {"messages": f"messages[{index}]", "top_logprobs": names.get("logprobs", "logprobs"), **names}


async def answer_chat(ctx: ServerContext, handlers: list[ChatHandler]) -> Response:
    """Submit every conversation's jobs as one submission (aborted together); TRL's answer."""
    for handler in handlers:
        ctx.request_log.received(handler)
    jobs: list[EngineJob] = [job for handler in handlers for job in handler.jobs]
    results = await ctx.submit(jobs, handlers[0].id).results()
    first = handlers[0].req
    answer = await ctx.workers.run(_answer, [h.prompt.tokens for h in handlers], results,
                                   first.top_logprobs if first.logprobs else None)
    return Response(answer, media_type="application/json")


def _check_lengths(body: TrlSequenceLogprobsRequest) -> None:
    if len(body.sequences) != len(body.prompt_lengths):
        raise bad_request(f"prompt_lengths holds {len(body.prompt_lengths)} lengths for {len(body.sequences)} "
                          "sequences", param="prompt_lengths")
    for i, (sequence, length) in enumerate(zip(body.sequences, body.prompt_lengths)):
        if not 0 <= length <= len(sequence):
            raise bad_request(f"prompt_lengths[{i}] is {length}, outside [0, {len(sequence)}] (sequence {i}'s length)",
                              param=f"prompt_lengths[{i}]")


def _position(result: DynamicInferenceRequest, position: int, top: int) -> tuple[list[tuple[int, float]], float]:
    """Sequence position ``position`` (>= 1) scored: the ``top`` best tokens and the actual one (vLLM's prompt
    log probs, by rank), and the actual token's log prob."""
    actual = result.prompt_tokens[position]
    value = float(result.prompt_log_probs[position - 1])
    alternatives = result.prompt_top_n_logprobs[position - 1] if position - 1 < len(result.prompt_top_n_logprobs) \
        else {}
    best = [(t, float(lp)) for t, lp in sorted(alternatives.items(), key=lambda item: -item[1])[:top]]
    return (best if any(t == actual for t, _ in best) else [*best, (actual, value)]), value


def _scores_json(results: list[DynamicInferenceRequest], lengths: list[int], top: int) -> dict[str, Any]:
    values, ids = [], []
    for result, start in zip(results, lengths):
        rows = [_position(result, p, top)[0] if p else [] for p in range(start, len(result.prompt_tokens))]
        values.append([[None if math.isnan(lp) else lp for _, lp in row] for row in rows])
        ids.append([[t for t, _ in row] for row in rows])
    return {"logprobs": values, "logprob_token_ids": ids}


def _scores_binary(results: list[DynamicInferenceRequest], lengths: list[int], top: int) -> dict[str, Any]:
    """TRL's binary answer: float32/int32 arrays (sequences x longest completion x ``top``; the actual token's as
    x 1), base64, padded with -inf and 0."""
    completions = [len(result.prompt_tokens) - start for result, start in zip(results, lengths)]
    shape = (len(results), max(completions, default=0), top)
    values = np.full(shape, -np.inf, dtype=np.float32)
    ids = np.zeros(shape, dtype=np.int32)
    actual_values = np.full((*shape[:2], 1), -np.inf, dtype=np.float32)
    actual_ids = np.zeros((*shape[:2], 1), dtype=np.int32)
    for i, (result, start) in enumerate(zip(results, lengths)):
        for p in range(max(start, 1), len(result.prompt_tokens)):
            row, value = _position(result, p, top)
            t = p - start
            actual_values[i, t, 0], actual_ids[i, t, 0] = value, result.prompt_tokens[p]
            for k, (token, logprob) in enumerate(row[:top]):
                values[i, t, k], ids[i, t, k] = logprob, token
    return {"logprobs_b64": _b64(values), "token_ids_b64": _b64(ids), "actual_logprobs_b64": _b64(actual_values),
            "actual_token_ids_b64": _b64(actual_ids), "shape": list(shape), "completion_lengths": completions}


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def read_scoring(raw: bytes) -> TrlSequenceLogprobsRequest:
    """The body of ``/get_sequence_logprobs/``, its prompt lengths checked."""
    body = read_anchor(TrlSequenceLogprobsRequest, raw, "TRL's SequenceLogprobsRequest")
    _check_lengths(body)
    return body


def scoring_fields(ctx: ServerContext, body: TrlSequenceLogprobsRequest) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``/v1/completions`` request that scores ``body``'s sequences (nothing generated), and where each field came
    from."""
    fields = {"model": ctx.model_name, "prompt": body.sequences, "max_tokens": 0, "temperature": body.temperature,
              "prompt_logprobs": body.top_logprobs}
    return fields, {"prompt": "sequences", "prompt_logprobs": "top_logprobs"}


async def answer_scores(ctx: ServerContext, handler: CompletionHandler, body: TrlSequenceLogprobsRequest) -> Response:
    """Submit ``handler``'s jobs; TRL's scores, as nested lists or base64 arrays."""
    ctx.request_log.received(handler)
    results = await ctx.submit(handler.jobs, handler.id).results()
    shape = _scores_binary if body.response_format == "binary" else _scores_json
    answer = await ctx.workers.run(shape, results, body.prompt_lengths, body.top_logprobs)
    return Response(_JSON.encode(answer), media_type="application/json")
