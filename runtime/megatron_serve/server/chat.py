"""``POST /v1/chat/completions``: messages rendered with the model's chat template, whole or streamed."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from ..client import StreamPartial
from ..request import DynamicInferenceRequest
from .answers import Delta, StreamedChoices, finish_reason, make_usage
from .context import ServerContext
from .models import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    Usage,
)
from .streaming import event_stream_response, openai_events, sse
from .translate import EngineJob, Prompt, chat_prompt, check_common, check_model, make_jobs, resolve_max_tokens, sampling_params
from .translate import epoch_fields


def _top(tokenizer: Any, token: int, logprob: float) -> TopLogprob:
    text = tokenizer.token_text(token)
    return TopLogprob(token=text, logprob=float(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(tokenizer: Any, tokens: list[int], log_probs: list[float],
                  top_n: list[dict[int, float]] | None) -> ChatChoiceLogprobs:
    content = []
    for i, token in enumerate(tokens):
        entry = _top(tokenizer, token, log_probs[i] if i < len(log_probs) else -9999.0)  # OpenAI's "unknown"
        alternatives = []
        if top_n is not None and i < len(top_n) and top_n[i]:
            alternatives = [_top(tokenizer, t, lp) for t, lp in sorted(top_n[i].items(), key=lambda kv: -kv[1])]
        content.append(ChatTokenLogprob(**entry.model_dump(), top_logprobs=alternatives))
    return ChatChoiceLogprobs(content=content)


class ChatHandler:
    """Validates one chat request, submits its ``n`` engine requests, and shapes the answer."""

    request_model = ChatCompletionRequest

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest) -> None:
        self.ctx = ctx
        self.req = req
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = req.n or 1
        self.want_logprobs = bool(req.logprobs)
        self.top = req.top_logprobs or 0
        check_model(req.model, ctx.served_names)
        check_common(req)
        ctx.monitor.check_accepting()
        max_len = ctx.max_model_len()
        self.prompt = chat_prompt(req, ctx.tokenizer, ctx.vocab_size, max_len)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(len(self.prompt.tokens), requested, None, max_len,
                                        prompt_param="messages", tokens_param=tokens_param)

        def params_for(_prompt: Prompt, choice: int):
            return sampling_params(req, max_tokens=max_tokens, logprobs=self.want_logprobs, top_logprobs=self.top,
                                   choice=choice)

        self.jobs = make_jobs([self.prompt], self.n, params_for)

    def usage(self, finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> Usage:
        """One prompt, counted once: with ``n > 1``, the cached tokens of choice 0 (see ``cached_prompt_tokens``)."""
        return make_usage(len(self.prompt.tokens), finished)

    def _logprobs(self, tokens: list[int], log_probs: list[float],
                  top_n: list[dict[int, float]] | None) -> ChatChoiceLogprobs | None:
        if not self.want_logprobs:
            return None
        return chat_logprobs(self.ctx.tokenizer, tokens, log_probs, top_n if self.top else None)

    async def complete(self) -> ChatCompletionResponse:
        results = await self.ctx.submit(self.jobs).results()
        choices = [
            ChatChoice(index=job.index, message=ChatResponseMessage(content=result.generated_text or ""),
                       logprobs=self._logprobs(result.generated_tokens, result.generated_log_probs,
                                               result.generated_top_n_logprobs),
                       finish_reason=finish_reason(result), **epoch_fields(self.req, result))
            for job, result in zip(self.jobs, results)
        ]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.req.model, choices=choices,
                                      usage=self.usage(list(zip(self.jobs, results))))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=choices,
                                       usage=usage))

    def _content(self, index: int, delta: Delta) -> str | None:
        """A chunk adding ``delta`` to choice ``index``; None when it would add nothing."""
        logprobs = self._logprobs(delta.tokens, delta.log_probs, delta.top_n) if delta.tokens else None
        if not (delta.text or logprobs):
            return None
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=delta.text), logprobs=logprobs)])

    async def _events(self, items: AsyncIterator[tuple[EngineJob, Any]]) -> AsyncIterator[str]:
        """The chunks of the answer as the submission's ``items`` arrive (framing: ``openai_events``)."""
        choices = StreamedChoices()
        results: list[tuple[EngineJob, DynamicInferenceRequest]] = []
        async for job, item in items:
            if choices.first_seen(job.index):
                yield self._chunk([ChatChunkChoice(index=job.index, delta=ChatDelta(role="assistant", content=""))])
            if isinstance(item, StreamPartial):
                chunk = self._content(job.index, choices.piece(job.index, item))
                if chunk is not None:
                    yield chunk
                continue
            result: DynamicInferenceRequest = item
            results.append((job, result))
            chunk = self._content(job.index, choices.rest(job.index, result))
            if chunk is not None:  # text the engine held back (a possible stop word) until the end
                yield chunk
            yield self._chunk([ChatChunkChoice(index=job.index, delta=ChatDelta(),
                                               finish_reason=finish_reason(result), **epoch_fields(self.req, result))])
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield self._chunk([], usage=self.usage(results))

    async def stream(self) -> StreamingResponse:
        return await event_stream_response(openai_events(self.ctx.submit(self.jobs).stream(), self._events), self.id)
