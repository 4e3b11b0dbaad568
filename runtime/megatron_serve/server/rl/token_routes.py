"""The tokens-in, tokens-out routes of vLLM, SGLang and TRL, behind the API key like ``/v1/*``.

Each route reads its anchor's body (the anchor's module), builds the handler of ``/v1/completions`` or
``/v1/chat/completions`` for it on a worker thread, as the OpenAI routes do, and answers in the anchor's shape (the
anchor's module again). The app registers these routes itself, beside the OpenAI ones: they run the same handlers.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel

from ..api_key import APIKeyGuard
from ..chat import ChatHandler
from ..completions import CompletionHandler
from ..context import ServerContext
from ..images import load_images
from ..intake import check_limits, parse_body, request_body_doc
from ..models import ChatCompletionRequest
from ..openapi_doc import error_responses
from ..placement import place, request_placement
from . import sglang_generate, trl_generate, vllm_generate
from .tokens import handler_for, serve

Answer = TypeVar("Answer", bound=Callable[[Request, bytes], Awaitable[Any]])

#: The bodies these routes parse themselves, for the OpenAPI document (the render route's is the chat route's).
TOKEN_BODIES: tuple[type[BaseModel], ...] = (
    vllm_generate.VllmGenerateRequest, sglang_generate.SglangGenerateRequest, trl_generate.TrlGenerateRequest,
    trl_generate.TrlChatRequest, trl_generate.TrlSequenceLogprobsRequest)


def _chat_request(ctx: ServerContext, raw: bytes) -> ChatCompletionRequest:
    """On a worker thread: a chat body parsed and checked, as the chat route reads it."""
    req = parse_body(ChatCompletionRequest, raw)
    check_limits(req, ctx.limits, ctx.max_model_len())
    return req


def add_token_routes(app: FastAPI, ctx: ServerContext, guard: APIKeyGuard) -> None:
    """vLLM's ``/inference/v1/generate`` and ``/v1/chat/completions/render``, SGLang's ``/generate``, TRL's
    ``/generate/``, ``/chat/`` and ``/get_sequence_logprobs/`` on ``app``."""
    codes = [400, 401, 404, 413, 415, 429, 500, 503] if guard.on else [400, 404, 413, 415, 429, 500, 503]
    errors = error_responses(codes)

    def route(path: str, tag: str, body: Any, answer: Any, description: str, stream: bool = False
              ) -> Callable[[Answer], Answer]:
        """Register ``answer_of(request, raw body)`` at ``path`` (``stream``: it may answer server-sent events)."""
        ok = {"model": answer, **({"content": {"text/event-stream": {}}} if stream else {})}

        def register(answer_of: Answer) -> Answer:
            async def endpoint(request: Request) -> Any:
                return await serve(ctx, request, lambda raw: answer_of(request, raw))

            app.post(path, dependencies=guard.dependencies, tags=[tag], responses={200: ok, **errors},
                     openapi_extra=request_body_doc(body), description=description,
                     name=answer_of.__name__)(endpoint)
            return answer_of

        return register

    @route("/inference/v1/generate", "vLLM", vllm_generate.VllmGenerateRequest, vllm_generate.VllmGenerateResponse,
           "vLLM's tokens-in, tokens-out generation: token ids in; token ids, log probs (`token_id:N`), weight "
           "versions and routed experts out; with `stream: true`, one event per piece, then `data: [DONE]`.",
           stream=True)
    async def vllm_generate_tokens(request: Request, raw: bytes) -> Any:
        body, request_id = vllm_generate.read(request, raw)
        placement = request_placement(request, body.session_id)  # X-Session-ID, X-data-parallel-rank
        handler = await handler_for(ctx, CompletionHandler, vllm_generate.fields(ctx, body, request_id),
                                    vllm_generate.NAMES)
        place(handler.jobs, placement)
        return await vllm_generate.answer(ctx, handler, body, request_id)

    @route("/v1/chat/completions/render", "vLLM", ChatCompletionRequest, vllm_generate.VllmRenderResponse,
           "The exact prompt token ids (and sampling parameters) that /v1/chat/completions runs for this body, as "
           "the body of /inference/v1/generate.")
    async def vllm_render_chat(request: Request, raw: bytes) -> Any:
        req = await ctx.workers.run(_chat_request, ctx, raw)
        await load_images(req, ctx)  # a chat's image parts, as the chat route fetches them
        return vllm_generate.render_answer(request, await ctx.workers.run(ChatHandler, ctx, req))

    @route("/generate", "SGLang", sglang_generate.SglangGenerateRequest, sglang_generate.SglangGenerateAnswer,
           "SGLang's native generation: input_ids (or text) in; text, output_ids and meta_info (finish reason, log "
           "probs, weight versions, routed experts) out, a list for a batch or n > 1; with `stream: true`, "
           "cumulative events, then `data: [DONE]`.", stream=True)
    async def sglang_generate_tokens(request: Request, raw: bytes) -> Any:
        body = sglang_generate.read(raw)
        placement = request_placement(request, body.session_id)
        handler = await handler_for(ctx, CompletionHandler, sglang_generate.fields(ctx, body), sglang_generate.NAMES)
        place(handler.jobs, placement)
        return await sglang_generate.answer(ctx, body, handler)

    @route("/generate/", "TRL", trl_generate.TrlGenerateRequest, trl_generate.TrlGenerateResponse,
           "TRL's vllm-serve generation: prompts (text or ids) in, prompt and completion ids (with log probs by "
           "rank) out.")
    async def trl_generate_tokens(request: Request, raw: bytes) -> Any:
        fields, names = trl_generate.generate_fields(ctx, trl_generate.read_generate(raw))
        return await trl_generate.answer_generate(ctx, await handler_for(ctx, CompletionHandler, fields, names))

    @route("/chat/", "TRL", trl_generate.TrlChatRequest, trl_generate.TrlGenerateResponse,
           "TRL's vllm-serve chat: conversations in (each rendered with the chat template), prompt and completion "
           "ids (with log probs by rank) out.")
    async def trl_chat(request: Request, raw: bytes) -> Any:
        body = trl_generate.read_chat(raw)
        handlers = [await handler_for(ctx, ChatHandler, *trl_generate.conversation_fields(ctx, body, index))
                    for index in range(len(body.messages))]
        return await trl_generate.answer_chat(ctx, handlers)

    @route("/get_sequence_logprobs/", "TRL", trl_generate.TrlSequenceLogprobsRequest,
           trl_generate.TrlSequenceLogprobsResponse,
           "TRL's teacher scoring: the log probs of each sequence's completion tokens (the top ones and the actual "
           "one), as nested lists or base64 numpy arrays.")
    async def trl_sequence_logprobs(request: Request, raw: bytes) -> Any:
        body = trl_generate.read_scoring(raw)
        fields, names = trl_generate.scoring_fields(ctx, body)
        return await trl_generate.answer_scores(ctx, await handler_for(ctx, CompletionHandler, fields, names), body)
