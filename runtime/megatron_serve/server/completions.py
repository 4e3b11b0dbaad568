"""``POST /v1/completions``: prompts in, text (and optionally log-probs) out, whole or streamed."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from ..client import StreamPartial
from ..request import DynamicInferenceRequest
from .context import ServerContext
from .errors import APIError, unsupported
from .models import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from .streaming import DONE, error_event, event_stream_response, sse
from .translate import (
    DEFAULT_COMPLETION_TOKENS,
    EngineJob,
    Prompt,
    check_common,
    check_model,
    completion_prompts,
    epoch_fields,
    make_jobs,
    resolve_max_tokens,
    sampling_params,
)


def completion_logprobs(tokenizer: Any, tokens: list[int], log_probs: list[float],
                        top_n: list[dict[int, float]] | None, offset: int) -> CompletionLogprobs:
    """The legacy completions log-prob block; ``offset`` is where the first token's text starts."""
    texts = [tokenizer.token_text(t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    token_logprobs: list[float | None] = [float(x) for x in log_probs[: len(tokens)]]
    token_logprobs += [None] * (len(tokens) - len(token_logprobs))
    top: list[dict[str, float] | None] | None = None
    if top_n is not None:
        top = [{tokenizer.token_text(t): float(lp) for t, lp in d.items()} if d is not None else None
               for d in top_n[: len(tokens)]]
        top += [None] * (len(tokens) - len(top))
    return CompletionLogprobs(tokens=texts, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)


def cached_prompt_tokens(finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> int:
    """Prompt tokens served from the prefix cache, counted once per prompt like ``usage.prompt_tokens``.

    With ``n > 1`` each choice of a prompt is its own engine request with its own count; the count
    of the prompt's first choice (lowest choice index, submitted first) is the one reported: it says
    whether the prompt was already cached when the request arrived, while its siblings may also hit
    the blocks that this very request computed.
    """
    first: dict[int, tuple[int, int]] = {}  # prompt index -> (choice index, cached tokens)
    for job, result in finished:
        known = first.get(job.prompt_index)
        if known is None or job.index < known[0]:
            first[job.prompt_index] = (job.index, min(int(result.cached_tokens or 0), len(job.prompt.tokens)))
    return sum(cached for _, cached in first.values())


def make_usage(prompt_tokens: int, finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> Usage:
    completion_tokens = sum(len(r.generated_tokens) for _, r in finished)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_prompt_tokens(finished)))


def _echo_text(ctx: ServerContext, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.tokens)


class CompletionHandler:
    """Validates one request, submits its engine requests, and shapes the answer."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest) -> None:
        self.ctx = ctx
        self.req = req
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = req.n or 1
        self.want_logprobs = req.logprobs is not None
        self.top = req.logprobs or 0
        check_model(req.model, ctx.served_names)
        check_common(req)
        if req.suffix:
            raise unsupported("suffix", "suffix (insertion)")
        if req.best_of is not None and req.best_of != self.n:
            raise unsupported("best_of", "best_of other than n")
        if req.echo and self.want_logprobs:
            raise unsupported("echo", "echo together with logprobs (prompt tokens are not scored)")
        ctx.monitor.check_accepting()
        self.prompts = completion_prompts(req, ctx.tokenizer, ctx.vocab_size)
        max_len = ctx.max_model_len()

        def params_for(prompt: Prompt, choice: int):
            max_tokens = resolve_max_tokens(len(prompt.tokens), req.max_tokens, DEFAULT_COMPLETION_TOKENS, max_len,
                                            prompt_param="prompt", tokens_param="max_tokens")
            return sampling_params(req, max_tokens=max_tokens, logprobs=self.want_logprobs, top_logprobs=self.top,
                                   choice=choice)

        self.jobs = make_jobs(self.prompts, self.n, params_for)

    def usage(self, finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> Usage:
        return make_usage(sum(len(p.tokens) for p in self.prompts), finished)

    # ------------------------------------------------------------------ whole answer

    async def complete(self) -> CompletionResponse:
        results = await self.ctx.submit(self.jobs).results()
        choices = []
        for job, result in zip(self.jobs, results):
            prefix = _echo_text(self.ctx, job.prompt) if self.req.echo else ""
            text = result.generated_text or ""
            logprobs = None
            if self.want_logprobs:
                logprobs = completion_logprobs(self.ctx.tokenizer, result.generated_tokens,
                                               result.generated_log_probs,
                                               result.generated_top_n_logprobs if self.top else None, len(prefix))
            choices.append(CompletionChoice(index=job.index, text=prefix + text, logprobs=logprobs,
                                            finish_reason=_finish(result), **epoch_fields(self.req, result)))
        return CompletionResponse(id=self.id, created=self.created, model=self.req.model, choices=choices,
                                  usage=self.usage(list(zip(self.jobs, results))))

    # ------------------------------------------------------------------ streamed answer

    def _chunk(self, job: EngineJob, text: str, logprobs: CompletionLogprobs | None = None,
               finish_reason: str | None = None, result: DynamicInferenceRequest | None = None) -> str:
        epochs = epoch_fields(self.req, result) if result is not None else {}
        return sse(CompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=[
            CompletionChoice(index=job.index, text=text, logprobs=logprobs, finish_reason=finish_reason, **epochs)]))

    async def events(self) -> AsyncIterator[str]:
        """SSE events; raises ``APIError`` before the first one, reports in-stream after it."""
        submission = self.ctx.submit(self.jobs)
        emitted: dict[int, str] = {}  # job index -> text sent so far (generated part)
        offsets: dict[int, int] = {}  # job index -> text offset for the next log-prob token
        streamed_tokens: dict[int, int] = {}
        results: list[tuple[EngineJob, DynamicInferenceRequest]] = []
        started = False
        stream = submission.stream()
        try:
            async for job, item in stream:
                first = job.index not in emitted
                prefix = _echo_text(self.ctx, job.prompt) if first and self.req.echo else ""
                if first:
                    emitted[job.index] = ""
                    offsets[job.index] = len(prefix)
                    streamed_tokens[job.index] = 0
                if isinstance(item, StreamPartial):
                    text = item.new_text or ""
                    logprobs = None
                    if self.want_logprobs and item.new_tokens:
                        logprobs = completion_logprobs(self.ctx.tokenizer, item.new_tokens, item.new_log_probs,
                                                       item.new_top_logprobs if self.top else None,
                                                       offsets[job.index])
                        offsets[job.index] += sum(len(t) for t in logprobs.tokens)
                    streamed_tokens[job.index] += len(item.new_tokens)
                    if not (prefix or text or logprobs):
                        continue
                    emitted[job.index] += text
                    started = True
                    yield self._chunk(job, prefix + text, logprobs)
                    continue
                result: DynamicInferenceRequest = item
                results.append((job, result))
                final_text = result.generated_text or ""
                sent = emitted[job.index]
                rest = final_text[len(sent):] if final_text.startswith(sent) else ""
                logprobs = None
                done = streamed_tokens[job.index]
                if self.want_logprobs and len(result.generated_tokens) > done:
                    logprobs = completion_logprobs(
                        self.ctx.tokenizer, result.generated_tokens[done:], result.generated_log_probs[done:],
                        result.generated_top_n_logprobs[done:] if self.top else None, offsets[job.index])
                started = True
                yield self._chunk(job, prefix + rest, logprobs, _finish(result), result)
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield sse(CompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=[],
                                          usage=self.usage(results)))
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


def _finish(result: DynamicInferenceRequest) -> str | None:
    reason = result.finish_reason.value if result.finish_reason is not None else None
    return reason if reason in ("stop", "length") else None
