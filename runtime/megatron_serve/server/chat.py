"""``POST /v1/chat/completions``: messages rendered with the model's chat template, whole or streamed."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from ..client import StreamPartial
from ..request import DynamicInferenceRequest
from .completions import _finish, make_usage
from .context import ServerContext
from .errors import APIError
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
from .streaming import DONE, error_event, event_stream_response, sse
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
        self.prompt = chat_prompt(req, ctx.tokenizer, ctx.vocab_size)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(len(self.prompt.tokens), requested, None, ctx.max_model_len(),
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
                       finish_reason=_finish(result), **epoch_fields(self.req, result))
            for job, result in zip(self.jobs, results)
        ]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.req.model, choices=choices,
                                      usage=self.usage(list(zip(self.jobs, results))))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=choices,
                                       usage=usage))

    async def events(self) -> AsyncIterator[str]:
        """SSE events; raises ``APIError`` before the first one, reports in-stream after it."""
        submission = self.ctx.submit(self.jobs)
        emitted: dict[int, str] = {}
        streamed_tokens: dict[int, int] = {}
        results: list[tuple[EngineJob, DynamicInferenceRequest]] = []
        started = False
        stream = submission.stream()
        try:
            async for job, item in stream:
                job: EngineJob
                if job.index not in emitted:
                    emitted[job.index] = ""
                    streamed_tokens[job.index] = 0
                    started = True
                    yield self._chunk([ChatChunkChoice(index=job.index, delta=ChatDelta(role="assistant", content=""))])
                if isinstance(item, StreamPartial):
                    text = item.new_text or ""
                    logprobs = None
                    if self.want_logprobs and item.new_tokens:
                        logprobs = self._logprobs(item.new_tokens, item.new_log_probs, item.new_top_logprobs)
                    streamed_tokens[job.index] += len(item.new_tokens)
                    if not (text or logprobs):
                        continue
                    emitted[job.index] += text
                    yield self._chunk([ChatChunkChoice(index=job.index, delta=ChatDelta(content=text),
                                                       logprobs=logprobs)])
                    continue
                result: DynamicInferenceRequest = item
                results.append((job, result))
                final_text = result.generated_text or ""
                sent = emitted[job.index]
                rest = final_text[len(sent):] if final_text.startswith(sent) else ""
                done = streamed_tokens[job.index]
                logprobs = None
                if self.want_logprobs and len(result.generated_tokens) > done:
                    logprobs = self._logprobs(result.generated_tokens[done:], result.generated_log_probs[done:],
                                              result.generated_top_n_logprobs[done:])
                if rest or logprobs:  # text the engine held back (a possible stop word) until the end
                    yield self._chunk([ChatChunkChoice(index=job.index, delta=ChatDelta(content=rest),
                                                       logprobs=logprobs)])
                yield self._chunk([ChatChunkChoice(index=job.index, delta=ChatDelta(),
                                                   finish_reason=_finish(result), **epoch_fields(self.req, result))])
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield self._chunk([], usage=self.usage(results))
            yield DONE
        except APIError as exc:
            if not started:
                raise
            yield error_event(exc)
            yield DONE
        finally:
            await stream.aclose()

    async def stream(self) -> StreamingResponse:
        return await event_stream_response(self.events())
