"""vLLM's tokens-in, tokens-out routes: ``POST /inference/v1/generate`` and ``POST /v1/chat/completions/render``.

SkyRL, prime-rl and AReaL render their own prompts (or ask ``render`` for them), send token ids to
``/inference/v1/generate`` and train on the ids that come back: no text is tokenized twice, so nothing drifts
between turns. ``render`` answers from the chat route's own handler (:class:`~..chat.ChatHandler`: the same template,
tokenization and sampling defaults) with the body ``/inference/v1/generate`` takes, so that posting it there runs
exactly what ``/v1/chat/completions`` would have run. This module reads vLLM's body and shapes vLLM's answers; the
routes (:mod:`.token_routes`) build the handlers.

vLLM's answer, plus what this fleet knows of every token: ``weight_version`` (the weights of the choice's first
token, as vLLM binds a version to a request) and ``weight_versions`` (SGLang's per-token spans). vLLM turns routed
experts on for the whole server; here a request asks with ``return_routed_experts`` (SGLang's name).
``X-data-parallel-rank`` pins the request to one engine, as in vLLM, and ``X-Session-ID`` (or the body's
``session_id``) keeps a multi-turn session on one engine (:mod:`..placement`, read by the route).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ...client.outputs import StreamPartial
from ...wire.request import DynamicInferenceRequest
from ..answers import finish_reason, token_label, usage_fields
from ..chunks import event
from ..models import StreamOptions, Usage
from ..request_log import request_id_header
from ..streaming import stream_answer
from ..whole_answers import prompt_logprobs
from .tokens import WeightVersionSpan, listed, read_anchor, routed_experts_npy, version_spans, weight_version
from .vllm_sampling import VllmSamplingParams, sampling_fields, vllm_sampling

if TYPE_CHECKING:  # annotations only: the routes module builds the handlers (token_routes)
    from ..chat import ChatHandler
    from ..completions import CompletionHandler
    from ..context import ServerContext
    from ..translate import EngineJob

_JSON = msgspec.json.Encoder()


class VllmGenerateRequest(BaseModel):
    """Body of ``POST /inference/v1/generate`` (vLLM's ``GenerateRequest``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    request_id: str | None = Field(None, description="names the answer; the X-Request-Id header wins (vLLM's)")
    token_ids: list[int] = Field(description="the prompt, as token ids")
    sampling_params: VllmSamplingParams = Field(default_factory=VllmSamplingParams)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int | None = None
    return_routed_experts: bool | None = Field(None, description="mixture-of-experts models: each choice's "
                                                                 "routed_experts (SGLang's name for the request field)")
    features: None = Field(None, description="only null: this route takes no multimodal features")
    kv_transfer_params: None = Field(None, description="only null: a fleet disaggregates prefill and decode itself")
    session_id: str | None = Field(None, description="the multi-turn session it belongs to (X-Session-ID wins): kept "
                                                     "on the engine that holds its KV blocks (docs/kv-routing.md)")


class VllmTokenLogprob(BaseModel):
    """One (token, log prob) of a listing, in both of vLLM's forms at once: ``token_id`` and ``rank`` (vLLM >= 0.33's
    ``GenerateLogProb``, output_mode ``tokens``) beside ``token`` and ``bytes`` (the chat-shaped listing of earlier
    releases, which SkyRL and prime-rl pinned to them read)."""

    token_id: int
    token: str = Field(description="token_id:N")
    logprob: float
    rank: int | None = Field(None, description="1 = the most likely; null for a sampled token outside the top n")
    bytes: list[int] | None = None


class VllmTokenLogprobs(VllmTokenLogprob):
    top_logprobs: list[VllmTokenLogprob]


class VllmGenerateLogprobs(BaseModel):
    content: list[VllmTokenLogprobs]


class VllmGenerateChoice(BaseModel):
    index: int
    logprobs: VllmGenerateLogprobs | None = None
    finish_reason: str | None = "stop"
    token_ids: list[int]
    routed_experts: str | None = Field(None, description="base64 of a .npy array (tokens - 1, MoE layers, top-k)")
    weight_version: str | None = Field(None, description="the weights (REFIT epoch) of the choice's first token")
    weight_versions: list[WeightVersionSpan] = Field(description="per generated token, in spans of equal weights")


class VllmGenerateResponse(BaseModel):
    """Answer of ``POST /inference/v1/generate`` (whole; streamed, each event holds the tokens since the last)."""

    request_id: str
    choices: list[VllmGenerateChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    kv_transfer_params: None = None


class VllmRenderResponse(BaseModel):
    """Answer of ``POST /v1/chat/completions/render``: the body that runs the chat on ``/inference/v1/generate``."""

    request_id: str
    token_ids: list[int]
    features: None = None
    sampling_params: dict[str, Any]
    model: str
    stream: bool
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int
    kv_transfer_params: None = None


def fields(ctx: ServerContext, body: VllmGenerateRequest, request_id: str) -> dict[str, Any]:
    """The ``/v1/completions`` request that runs ``body`` (its fields; :data:`NAMES` says where each came from)."""
    given = sampling_fields(body.sampling_params, "sampling_params")
    max_len = ctx.max_model_len()
    if "max_tokens" not in given and max_len is not None and max_len > len(body.token_ids):
        given["max_tokens"] = max_len - len(body.token_ids)  # vLLM's default: the rest of the context
    return {**given, "model": body.model or ctx.model_name, "prompt": body.token_ids, "stream": body.stream,
            "stream_options": body.stream_options, "request_id": request_id, "cache_salt": body.cache_salt,
            "priority": body.priority, "return_routing_indices": body.return_routed_experts}


#: This server's completions fields -> where they are in vLLM's body.
NAMES = {"prompt": "token_ids", **{name: f"sampling_params.{name}" for name in VllmSamplingParams.model_fields}}


def _logprobs(tokens: list[int], log_probs: list[float], top_n: list[dict[int, float]], top: int) -> dict[str, Any]:
    """vLLM's listing of ``tokens`` (chat's shape, every token named ``token_id:N``)."""
    content = []
    for i, token in enumerate(tokens):
        alternatives = top_n[i] if i < len(top_n) else None
        ranks = {t: r + 1 for r, (t, _) in enumerate(sorted((alternatives or {}).items(), key=lambda kv: -kv[1]))}
        entries = listed(token, log_probs[i], alternatives, top)[:max(top, 1)]
        content.append({**_entry(token, log_probs[i], ranks),
                        "top_logprobs": [_entry(t, lp, ranks) for t, lp in entries]})
    return {"content": content}


def _entry(token: int, logprob: float, ranks: dict[int, int]) -> dict[str, Any]:
    """One listing entry (:class:`VllmTokenLogprob`)."""
    return {"token_id": token, "token": token_label(token), "logprob": max(logprob, -9999.0), "rank": ranks.get(token),
            "bytes": None}


def _versions(result: DynamicInferenceRequest) -> dict[str, Any]:
    epochs = list(result.policy_epochs)
    return {"routed_experts": routed_experts_npy(result),
            "weight_version": weight_version(epochs[0]) if epochs else None, "weight_versions": version_spans(epochs)}


def _choice(handler: CompletionHandler, job: EngineJob, result: DynamicInferenceRequest) -> dict[str, Any]:
    logprobs = None
    if handler.want_logprobs:
        logprobs = _logprobs(result.generated_tokens, result.generated_log_probs, result.generated_top_n_logprobs,
                             handler.top)
    return {"index": job.index, "logprobs": logprobs, "finish_reason": finish_reason(result) or "stop",
            "token_ids": list(result.generated_tokens), **_versions(result)}


async def _whole(ctx: ServerContext, handler: CompletionHandler, request_id: str) -> Response:
    results = await ctx.submit(handler.jobs, handler.id).results()
    finished = list(zip(handler.jobs, results))
    answer = {"request_id": request_id, "choices": [_choice(handler, job, r) for job, r in finished],
              "usage": usage_fields(len(handler.prompts[0].tokens), finished),
              "prompt_logprobs": _prompt_scores(ctx, handler, results[0]), "kv_transfer_params": None}
    return Response(await ctx.workers.run(_JSON.encode, answer), media_type="application/json")


def _prompt_scores(ctx: ServerContext, handler: CompletionHandler, result: DynamicInferenceRequest
                   ) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` of the prompt, when asked for (``sampling_params.prompt_logprobs``)."""
    top = handler.req.prompt_logprobs
    if top is None:
        return None
    return [None if position is None else {token: entry.model_dump() for token, entry in position.items()}
            for position in prompt_logprobs(ctx.tokenizer, result, top)]


class _TokenEvents:
    """The events of a streamed generate answer (vLLM's ``GenerateStreamResponse``): each holds the tokens one piece
    added; a choice's last event its finish reason, routed experts and weight versions."""

    def __init__(self, handler: CompletionHandler, request_id: str) -> None:
        self.handler = handler
        self.request_id = request_id
        self.prompt_tokens = len(handler.prompts[0].tokens)
        self.generated: dict[int, int] = {}  # tokens so far, by choice
        self.results: list[tuple[EngineJob, DynamicInferenceRequest]] = []
        options = handler.req.stream_options
        self.usage = options is not None and options.include_usage
        self.running_usage = self.usage and options is not None and options.continuous_usage_stats

    def item(self, job: EngineJob, item: Any) -> bytes:
        handler = self.handler
        if isinstance(item, StreamPartial):
            if not item.new_tokens:
                return b""
            self.generated[job.index] = self.generated.get(job.index, 0) + len(item.new_tokens)
            logprobs = None
            if handler.want_logprobs:
                logprobs = _logprobs(item.new_tokens, item.new_log_probs, item.new_top_logprobs, handler.top)
            choice = {"index": job.index, "logprobs": logprobs, "finish_reason": None, "token_ids": item.new_tokens}
        else:
            self.results.append((job, item))
            choice = {"index": job.index, "logprobs": None, "finish_reason": finish_reason(item) or "stop",
                      "token_ids": [], **_versions(item)}
        chunk: dict[str, Any] = {"request_id": self.request_id, "choices": [choice]}
        if self.running_usage:
            done = self.generated.get(job.index, 0)
            chunk["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                              "total_tokens": self.prompt_tokens + done}
        return event(_JSON.encode(chunk))

    def text_chunks(self, job: EngineJob) -> None:
        """Every event holds its piece's token ids: each piece goes whole (:meth:`item`)."""
        return None

    def end(self) -> bytes:
        if not self.usage:
            return b""
        return event(_JSON.encode({"request_id": self.request_id, "choices": [],
                                   "usage": usage_fields(self.prompt_tokens, self.results)}))


def _request_id(request: Request, body_id: str | None) -> str:
    """The id an answer names: the ``X-Request-Id`` header's, else the body's, else a fresh one (vLLM's order)."""
    return request_id_header(request) or body_id or uuid.uuid4().hex


def read(request: Request, raw: bytes) -> tuple[VllmGenerateRequest, str]:
    """The body of ``/inference/v1/generate`` and the request's id (the ``X-Request-Id`` header wins, as in vLLM)."""
    body = read_anchor(VllmGenerateRequest, raw, "vLLM's GenerateRequest")
    return body, _request_id(request, body.request_id)


async def answer(ctx: ServerContext, handler: CompletionHandler, body: VllmGenerateRequest, request_id: str) -> Any:
    """Submit ``handler``'s jobs; vLLM's answer, whole or streamed."""
    ctx.request_log.received(handler)
    if body.stream:
        return await stream_answer(ctx.submit(handler.jobs, handler.id), _TokenEvents(handler, request_id),
                                   handler.id)
    return await _whole(ctx, handler, request_id)


def render_answer(request: Request, handler: ChatHandler) -> Response:
    """``/v1/chat/completions/render``'s answer: the body of ``/inference/v1/generate`` that runs what ``handler`` (the
    chat route's own, built for the same body) would run."""
    req = handler.req
    rendered = {"request_id": _request_id(request, req.request_id), "token_ids": handler.prompt.tokens,
                "features": None, "sampling_params": vllm_sampling(handler.jobs[0].params, handler.n),
                "model": req.model, "stream": bool(req.stream),
                "stream_options": None if req.stream_options is None else req.stream_options.model_dump(),
                "cache_salt": req.cache_salt, "priority": req.priority or 0, "kv_transfer_params": None}
    return Response(_JSON.encode(rendered), media_type="application/json")
