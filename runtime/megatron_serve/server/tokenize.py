"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, for clients that count tokens.

``/tokenize`` takes a ``prompt`` (tokenized as ``/v1/completions`` does) or ``messages`` (rendered
with the chat template first, as ``/v1/chat/completions`` does, tools included), so a client
counts exactly the tokens the endpoint would run.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from .context import ServerContext
from .errors import bad_request
from .images import load_images
from .intake import check_prompt_size, parse_body, request_body_doc
from .models import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from .streaming import client_closed, read_body
from .translate import check_model, check_tokens, place_images, render_chat


def _check_model(ctx: ServerContext, model: str | None) -> None:
    if model is not None:
        check_model(model, ctx.served_names)


def _parse_tokenize(ctx: ServerContext, raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """On a worker thread: parse, check the model and the limits."""
    body = parse_body(TokenizeRequest, raw)
    _check_model(ctx, body.model)
    if isinstance(body, TokenizeChatRequest):
        check_prompt_size(ctx.limits, ctx.max_model_len(), messages=body.messages)
    else:
        check_prompt_size(ctx.limits, ctx.max_model_len(), prompt=body.prompt)
    return body


def _tokenize(ctx: ServerContext, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    """On a worker thread: render and encode (after the chat's images were loaded)."""
    tokenizer = ctx.tokenizer
    if isinstance(body, TokenizeChatRequest):
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        text = render_chat(body.messages, tokenizer, tools=tools, add_generation_prompt=body.add_generation_prompt)
    else:
        text = body.prompt
    tokens = list(tokenizer.encode(text, add_special_tokens=body.add_special_tokens))
    if isinstance(body, TokenizeChatRequest):
        tokens, _ = place_images(tokens, body.messages, tokenizer)  # each image counts its placeholder tokens
    strs = [tokenizer.token_text(t) for t in tokens] if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len(), tokens=tokens, token_strs=strs)


def add_tokenize_routes(app: FastAPI, ctx: ServerContext, dependencies: list[Any],
                        responses: dict[int | str, dict[str, Any]]) -> None:
    # Both read their bodies themselves (see app.py): parsed, checked and (de)tokenized on the worker threads.
    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=dependencies, responses=responses,
              tags=["tokenizer"], openapi_extra=request_body_doc(TokenizeCompletionRequest, TokenizeChatRequest),
              description="Token ids of a prompt, or of messages rendered with the chat template.")
    async def tokenize(request: Request) -> Any:
        raw = await read_body(request)
        if raw is None:
            return client_closed()
        body = await ctx.workers.run(_parse_tokenize, ctx, raw)
        await load_images(body, ctx)  # a chat's image parts, fetched and checked (none: nothing to do)
        return await ctx.workers.run(_tokenize, ctx, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=dependencies, responses=responses,
              tags=["tokenizer"], openapi_extra=request_body_doc(DetokenizeRequest),
              description="The text of token ids.")
    async def detokenize(request: Request) -> Any:
        raw = await read_body(request)
        return client_closed() if raw is None else await ctx.workers.run(_detokenize, ctx, raw)


def _detokenize(ctx: ServerContext, raw: bytes) -> DetokenizeResponse:
    body = parse_body(DetokenizeRequest, raw)
    _check_model(ctx, body.model)
    if body.tokens:
        check_tokens(body.tokens, ctx.vocab_size, "tokens")
    try:
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))
    except (ValueError, OverflowError, TypeError) as exc:
        raise bad_request(f"tokens cannot be decoded: {exc}", param="tokens") from None
