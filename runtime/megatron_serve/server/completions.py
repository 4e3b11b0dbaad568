"""``POST /v1/completions``: prompts in, text (and optionally log-probs) out, whole or streamed."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..tokenizer import Tokenizer
from ..client.detokenizer import token_texts
from ..client.outputs import StreamPartial
from ..wire.request import DynamicInferenceRequest, FinishReason
from .answers import Delta, StreamedAnswer, TopPairs, finish_reason, make_usage, paired, token_label
from .context import ServerContext
from .errors import bad_request, unsupported
from .handlers import GenerationHandler
from .whole_answers import prompt_logprobs
from .models import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from .streaming import EventStreamResponse, stream_answer
from .translate import (
    DEFAULT_COMPLETION_TOKENS,
    EngineJob,
    Prompt,
    completion_prompts,
    controls,
    extension_fields,
    resolve_max_tokens,
    structured_outputs,
)


def completion_logprobs(tokenizer: Tokenizer, texts: list[str], log_probs: Sequence[float | None],
                        top_n: list[TopPairs | None] | None, offset: int, ids: Sequence[int], n: int = 0,
                        as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions log-prob block (``CompletionLogprobs``' fields, plain data) of tokens ``ids`` whose
    texts (what each adds to ``text``) are ``texts``; ``offset`` is where the first one starts.

    Each position's ``top_logprobs`` is vLLM's: the token itself first, then its ``n`` best alternatives (so one entry
    for ``logprobs: 0``, which TRL's client sends and indexes, up to ``n + 1`` when the token is not among the
    ``n``), each named by its own text; null where the token has no log prob (an echoed prompt's first).
    ``as_ids``: name every token ``token_id:N`` instead (``return_tokens_as_token_ids``; the offsets then count
    those names, as vLLM's do)."""
    name = token_label if as_ids else tokenizer.token_text
    if as_ids:
        texts = [token_label(token) for token in ids[: len(texts)]]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    token_logprobs: list[float | None] = [None if x is None else float(x) for x in log_probs[: len(texts)]]
    token_logprobs += [None] * (len(texts) - len(token_logprobs))
    top: list[dict[str, float] | None] = []
    for i, logprob in enumerate(token_logprobs):
        if logprob is None:
            top.append(None)
            continue
        entry = {name(ids[i]): logprob}
        pairs = top_n[i] if top_n is not None and i < len(top_n) else None
        for t, lp in sorted(pairs or (), key=lambda kv: -kv[1])[:n]:
            entry.setdefault(name(t), float(lp))
        top.append(entry)
    return {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _echo_text(ctx: ServerContext, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.tokens)


def prompt_only(result: DynamicInferenceRequest) -> DynamicInferenceRequest:
    """A finished request as ``max_tokens: 0`` answers it: the prompt scored, nothing generated (the engine
    generated one token, as vLLM's does for this request, and it is dropped here)."""
    return dataclasses.replace(result, generated_tokens=[], generated_text="", generated_token_texts=[],
                               generated_log_probs=[], generated_top_n_logprobs=[], policy_epochs=[], kv_epochs=[],
                               finish_reason=FinishReason.LENGTH)


class CompletionHandler(GenerationHandler):
    """Validates one request, submits its engine requests, and shapes the answer."""

    request_model = CompletionRequest
    scored_in = "choice"  # where a whole answer's prompt_logprobs go (whole_answers.AnswerShape)
    id_prefix = "cmpl"
    req: CompletionRequest

    def __init__(self, ctx: ServerContext, req: CompletionRequest) -> None:
        super().__init__(ctx, req)
        self.want_logprobs = req.logprobs is not None
        self.top = req.logprobs or 0
        if req.suffix:
            raise unsupported("suffix", "suffix (insertion)")
        if req.best_of is not None and req.best_of != self.n:
            raise unsupported("best_of", "best_of other than n")
        self.echo_logprobs = bool(req.echo) and self.want_logprobs
        self.scoring_only = req.max_tokens == 0  # vLLM's scoring request: the prompt's log probs, no answer
        if self.scoring_only and not (req.echo or req.prompt_logprobs is not None):
            raise bad_request("max_tokens 0 scores the prompt and generates nothing: it needs echo=true (with "
                              "logprobs) or prompt_logprobs", param="max_tokens")
        if self.scoring_only and req.stream:
            raise unsupported("max_tokens", "max_tokens 0 with stream=true")
        if req.stream and (self.echo_logprobs or req.prompt_logprobs is not None):
            raise unsupported("prompt_logprobs" if req.prompt_logprobs is not None else "echo",
                              "log probs of prompt tokens with stream=true")
        ctx.monitor.check_accepting()
        max_len = ctx.max_model_len()
        extra = controls(req, ctx.vocab_size, structured_outputs(req, ctx.limits),
                         prompt_log_probs=self.echo_logprobs or req.prompt_logprobs is not None)
        extra.update(ctx.adapter_fields(req.model))
        self.prompts = completion_prompts(req, ctx.tokenizer, ctx.vocab_size, max_len)
        top_n = max(self.top, req.prompt_logprobs or 0)
        default_tokens = ctx.generation_defaults.get("num_tokens_to_generate", DEFAULT_COMPLETION_TOKENS)

        def max_tokens(prompt: Prompt) -> int:
            return resolve_max_tokens(len(prompt.tokens), 1 if self.scoring_only else req.max_tokens, default_tokens,
                                      max_len, prompt_param="prompt", tokens_param="max_tokens")

        self.plan(self.prompts, max_tokens, top_n, extra, returns_prompt=bool(req.echo or req.return_token_ids))

    def usage(self, finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> Usage:
        return make_usage(sum(len(p.tokens) for p in self.prompts), finished)

    # ------------------------------------------------------------------ whole answer

    def choice(self, job: EngineJob, result: DynamicInferenceRequest, scored: bool = True) -> CompletionChoice:
        """One choice of the whole answer (:class:`~.whole_answers.AnswerShape`)."""
        if self.scoring_only:
            result = prompt_only(result)
        prefix = _echo_text(self.ctx, job.prompt) if self.req.echo else ""
        text = result.generated_text or ""
        logprobs = None
        if self.want_logprobs:
            texts = list(result.generated_token_texts)  # made with the text, by the client's output processor
            log_probs, top = list(result.generated_log_probs), paired(result.generated_top_n_logprobs)
            ids = list(result.generated_tokens)
            if self.echo_logprobs:  # the prompt's tokens first; its first token has no log prob
                skip = self.req.skip_special_tokens is not False
                texts = token_texts(self.ctx.tokenizer, result.prompt_tokens, prefix, skip) + texts
                log_probs = [None, *result.prompt_log_probs, *log_probs]
                top = [None, *paired(result.prompt_top_n_logprobs), *top]
                ids = [*result.prompt_tokens, *ids]
            logprobs = completion_logprobs(self.ctx.tokenizer, texts, log_probs, top,
                                           0 if self.echo_logprobs else len(prefix), ids, self.top,
                                           bool(self.req.return_tokens_as_token_ids))
        prompt_scores = None  # scored=False: an empty list, which whole_answers replaces
        if self.req.prompt_logprobs is not None:
            prompt_scores = prompt_logprobs(self.ctx.tokenizer, result, self.req.prompt_logprobs) if scored else []
        ids = ({"prompt_token_ids": job.prompt.tokens, "token_ids": list(result.generated_tokens)}
               if self.req.return_token_ids else {})
        return CompletionChoice(index=job.index, text=prefix + text, logprobs=logprobs,
                                finish_reason=finish_reason(result), prompt_logprobs=prompt_scores,
                                **extension_fields(self.req, result), **ids)

    def envelope(self, choices: list[CompletionChoice], results: list[DynamicInferenceRequest],
                 scored: bool = True) -> CompletionResponse:
        """The whole answer around its ``choices`` (:class:`~.whole_answers.AnswerShape`; its choices hold the
        prompt log probs)."""
        if self.scoring_only:
            results = [prompt_only(result) for result in results]
        return CompletionResponse(id=self.id, created=self.created, model=self.req.model, choices=choices,
                                  usage=self.usage(list(zip(self.jobs, results))))

    # ------------------------------------------------------------------ streamed answer

    async def stream(self) -> EventStreamResponse:
        return await stream_answer(self.ctx.submit(self.jobs, self.id), _CompletionEvents(self), self.id)


def _text_choice(index: int, text: str) -> dict[str, Any]:
    """A streamed ``text_completion`` choice that adds ``text`` alone (plain data, see :mod:`.chunks`)."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": None}


class _CompletionEvents(StreamedAnswer):
    """The chunks of a streamed completion, made as items arrive (written by ``EventWriter``)."""

    def __init__(self, handler: CompletionHandler) -> None:
        super().__init__(handler, "text_completion", _text_choice, handler.want_logprobs,
                         sum(len(p.tokens) for p in handler.prompts))
        self.handler = handler
        self.offsets: dict[int, int] = {}  # job index -> text offset for the next log-prob token
        self.opened: set[int] = set()  # choices whose first chunk was sent

    def whole_item(self, job: EngineJob, item: Any) -> bytes:
        first = self.choices.first_seen(job.index)
        prefix = _echo_text(self.handler.ctx, job.prompt) if first and self.req.echo else ""
        if first:
            self.offsets[job.index] = len(prefix)
        opening = job.index not in self.opened
        if isinstance(item, StreamPartial):
            delta = self.choices.piece(item)
            logprobs = self._logprobs(delta, self.offsets[job.index])
            if logprobs is not None:
                self.offsets[job.index] += sum(len(t) for t in logprobs["tokens"])
            if self.plain and first:
                self.texted.add(id(job))
            if prefix or delta.text or logprobs or (self.req.return_token_ids and delta.tokens):
                self.opened.add(job.index)
                return self._chunk(job, prefix + delta.text, delta, logprobs, opening)
            return b""
        result: DynamicInferenceRequest = item
        self.results.append((job, result))
        delta = Delta.empty()
        return self._chunk(job, prefix + delta.text, delta, self._logprobs(delta, self.offsets[job.index]), opening,
                           finish_reason(result), result)

    def _chunk(self, job: EngineJob, text: str, delta: Delta, logprobs: dict[str, Any] | None, opening: bool,
               finish_reason: str | None = None, result: DynamicInferenceRequest | None = None) -> bytes:
        """A streamed ``text_completion`` chunk of one choice."""
        return self.writer.chunk([self._choice(job, text, delta, logprobs, opening, finish_reason, result)])

    def _choice(self, job: EngineJob, text: str, delta: Delta, logprobs: dict[str, Any] | None, opening: bool,
                finish_reason: str | None = None, result: DynamicInferenceRequest | None = None) -> dict[str, Any]:
        """One choice of a streamed ``text_completion`` chunk as plain data (see :mod:`.chunks`); with
        ``return_token_ids`` its ``opening`` chunk carries the prompt's ids and every chunk the ids of the
        tokens it lists."""
        choice = _text_choice(job.index, text)
        choice["logprobs"], choice["finish_reason"] = logprobs, finish_reason
        if self.req.return_token_ids:
            if opening:
                choice["prompt_token_ids"] = job.prompt.tokens
            choice["token_ids"] = delta.tokens
        if result is not None:
            choice.update(extension_fields(self.req, result))
        return choice

    def _logprobs(self, delta: Delta, offset: int) -> dict[str, Any] | None:
        """The log-prob block of a streamed chunk; None when not asked for or the chunk adds no token."""
        handler = self.handler
        if not (handler.want_logprobs and delta.tokens):
            return None
        return completion_logprobs(handler.ctx.tokenizer, delta.token_texts, delta.log_probs, delta.top_n, offset,
                                   delta.tokens, handler.top, bool(handler.req.return_tokens_as_token_ids))
