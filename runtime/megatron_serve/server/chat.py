"""``POST /v1/chat/completions``: messages rendered with the model's chat template, whole or streamed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..tokenizer import Tokenizer
from ..client.outputs import StreamPartial
from ..wire.request import DynamicInferenceRequest
from .answers import Delta, StreamedAnswer, TopPairs, finish_reason, make_usage, paired, token_label
from .context import ServerContext
from .errors import unsupported
from .handlers import GenerationHandler
from .whole_answers import prompt_logprobs
from .models import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatToolCall,
    FunctionCall,
    Usage,
)
from .chunks import ChunkWriter
from .streaming import EventStreamResponse, stream_answer
from .tool_calls import Arguments, CallReader, CallStart, Content, Event, plan_tools
from .translate import (
    EngineJob,
    chat_prompt,
    controls,
    extension_fields,
    resolve_max_tokens,
    structured_outputs,
)


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer, texts: list[str], log_probs: Sequence[float],
                  top_n: list[TopPairs] | None, n: int = 20, ids: Sequence[int] | None = None) -> dict[str, Any]:
    """Log-probs (``ChatChoiceLogprobs``' fields, plain data) of tokens whose texts (what each adds to the
    generated text) are ``texts``; the ``n`` best alternatives are named by their own text. ``ids``: the tokens'
    ids, to name every token ``token_id:N`` instead (``return_tokens_as_token_ids``)."""
    name = tokenizer.token_text if ids is None else token_label
    if ids is not None:
        texts = [token_label(token) for token in ids[: len(texts)]]
    content = []
    for i, text in enumerate(texts):
        entry = _entry(text, log_probs[i] if i < len(log_probs) else -9999.0)  # OpenAI's "unknown"
        alternatives = []
        if top_n is not None and i < len(top_n):
            ranked = sorted(top_n[i], key=lambda kv: -kv[1])[:n]
            alternatives = [_entry(name(t), lp) for t, lp in ranked]
        entry["top_logprobs"] = alternatives
        content.append(entry)
    return {"content": content, "refusal": None}


class ChatHandler(GenerationHandler):
    """Validates one chat request, submits its ``n`` engine requests, and shapes the answer."""

    request_model = ChatCompletionRequest
    scored_in = "envelope"  # where a whole answer's prompt_logprobs go (whole_answers.AnswerShape)
    id_prefix = "chatcmpl"
    req: ChatCompletionRequest

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest) -> None:
        super().__init__(ctx, req)
        self.want_logprobs = bool(req.logprobs)
        self.top = req.top_logprobs or 0
        if req.prompt_logprobs is not None and req.stream:
            raise unsupported("prompt_logprobs", "prompt_logprobs with stream=true")
        ctx.monitor.check_accepting()
        max_len = ctx.max_model_len()
        self.tools = plan_tools(req, ctx.tool_parser)
        extra = controls(req, ctx.vocab_size, structured_outputs(req, ctx.limits, self.tools.constraint),
                         prompt_log_probs=req.prompt_logprobs is not None)  # checked before the costlier rendering
        extra.update(ctx.adapter_fields(req.model))
        self.prompt = chat_prompt(req, ctx.tokenizer, ctx.vocab_size, max_len, tools=self.tools.template_tools)
        top_n = max(self.top, req.prompt_logprobs or 0)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        default_tokens = ctx.generation_defaults.get("num_tokens_to_generate", None)  # None: the rest of the context
        max_tokens = resolve_max_tokens(len(self.prompt.tokens), requested, default_tokens, max_len,
                                        prompt_param="messages", tokens_param=tokens_param)
        self.plan([self.prompt], lambda _prompt: max_tokens, top_n, extra, returns_prompt=bool(req.return_token_ids))

    def usage(self, finished: list[tuple[EngineJob, DynamicInferenceRequest]]) -> Usage:
        """One prompt, counted once: with ``n > 1``, the cached tokens of choice 0 (see ``cached_prompt_tokens``)."""
        return make_usage(len(self.prompt.tokens), finished)

    def _logprobs(self, texts: list[str], log_probs: Sequence[float], top_n: list[TopPairs] | None,
                  ids: Sequence[int]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return chat_logprobs(self.ctx.tokenizer, texts, log_probs, top_n if self.top else None, self.top,
                             ids if self.req.return_tokens_as_token_ids else None)

    def _finish_reason(self, result: DynamicInferenceRequest, called: bool) -> str | None:
        """``tool_calls`` when the model ended its turn with calls (a named function's call ends with ``stop``)."""
        reason = finish_reason(result)
        return "tool_calls" if called and reason == "stop" and self.tools.named is None else reason

    def _message(self, text: str) -> ChatResponseMessage:
        reader = self.tools.reader()
        if reader is None:
            return ChatResponseMessage(content=text)
        events = reader.feed(text) + reader.finish()
        content = "".join(e.text for e in events if isinstance(e, Content))
        calls: list[ChatToolCall] = []
        for event in events:
            if isinstance(event, CallStart):
                calls.append(ChatToolCall(id=event.id, function=FunctionCall(name=event.name, arguments="")))
            elif isinstance(event, Arguments):
                calls[event.index].function.arguments += event.text
        return ChatResponseMessage(content=content if content.strip() or not calls else None, tool_calls=calls or None)

    def choice(self, job: EngineJob, result: DynamicInferenceRequest, scored: bool = True) -> ChatChoice:
        """One choice of the whole answer (:class:`~.whole_answers.AnswerShape`; the envelope holds the prompt log
        probs)."""
        message = self._message(result.generated_text or "")
        logprobs = None
        if self.want_logprobs:
            logprobs = self._logprobs(result.generated_token_texts, result.generated_log_probs,
                                      paired(result.generated_top_n_logprobs), result.generated_tokens)  # texts made once
        ids = {"token_ids": list(result.generated_tokens)} if self.req.return_token_ids else {}
        return ChatChoice(index=job.index, message=message, logprobs=logprobs,
                          finish_reason=self._finish_reason(result, bool(message.tool_calls)),
                          **extension_fields(self.req, result), **ids)

    def envelope(self, choices: list[ChatChoice], results: list[DynamicInferenceRequest],
                 scored: bool = True) -> ChatCompletionResponse:
        """The whole answer around its ``choices`` (:class:`~.whole_answers.AnswerShape`): the prompt's log probs
        once."""
        prompt_scores = None  # scored=False: an empty list, which whole_answers replaces
        if self.req.prompt_logprobs is not None:
            prompt_scores = prompt_logprobs(self.ctx.tokenizer, results[0], self.req.prompt_logprobs) if scored else []
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.req.model, choices=choices,
                                      usage=self.usage(list(zip(self.jobs, results))), prompt_logprobs=prompt_scores,
                                      prompt_token_ids=self.prompt.tokens if self.req.return_token_ids else None)

    @staticmethod
    def _choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
                finish_reason: str | None = None) -> dict[str, Any]:
        """One choice of a ``chat.completion.chunk`` as plain data (see :mod:`.chunks`)."""
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _content(self, writer: ChunkWriter, index: int, delta: Delta, reader: CallReader | None,
                 final: bool = False) -> tuple[bytes | None, bool]:
        """A chunk adding ``delta`` to choice ``index`` (None if nothing), and whether it carries tool calls."""
        logprobs = self._logprobs(delta.token_texts, delta.log_probs, delta.top_n, delta.tokens) if delta.tokens \
            else None
        if reader is None:
            message = {"content": delta.text} if delta.text else {}
        else:
            message = _delta(reader.feed(delta.text) + (reader.finish() if final else []))
        ids = self.req.return_token_ids and bool(delta.tokens)
        if not message and logprobs is None and not ids:
            return None, False
        choice = self._choice(index, message, logprobs)
        if ids:
            choice["token_ids"] = delta.tokens
        return writer.chunk([choice]), "tool_calls" in message

    async def stream(self) -> EventStreamResponse:
        return await stream_answer(self.ctx.submit(self.jobs, self.id), _ChatEvents(self), self.id)


def _text_choice(index: int, text: str) -> dict[str, Any]:
    """A ``chat.completion.chunk`` choice that adds ``text`` alone to the content (plain data)."""
    return ChatHandler._choice(index, {"content": text})


class _ChatEvents(StreamedAnswer):
    """The chunks of a streamed chat answer, made as items arrive (written by ``EventWriter``)."""

    def __init__(self, handler: ChatHandler) -> None:
        super().__init__(handler, "chat.completion.chunk", _text_choice, handler.want_logprobs,
                         len(handler.prompt.tokens))
        self.handler = handler
        self.readers: dict[int, CallReader | None] = {}
        self.called: set[int] = set()

    def whole_item(self, job: EngineJob, item: Any) -> bytes:
        handler, req, writer = self.handler, self.handler.req, self.writer
        events: list[bytes] = []
        if self.choices.first_seen(job.index):
            reader = self.readers[job.index] = handler.tools.reader()
            opening = handler._choice(job.index, {"role": "assistant", "content": ""})
            if req.return_token_ids:  # vLLM: the prompt's ids on the opening chunk, none generated yet
                opening["token_ids"] = []
            events.append(writer.chunk([opening], prompt_token_ids=handler.prompt.tokens if req.return_token_ids
                                       else None))
            if self.plain and reader is None:
                self.texted.add(id(job))
        final = not isinstance(item, StreamPartial)
        delta = Delta.empty() if final else self.choices.piece(item)
        chunk, calls = handler._content(writer, job.index, delta, self.readers[job.index], final)
        if calls:
            self.called.add(job.index)
        if chunk is not None:  # for the final record: only what finishing a tool-call reader adds
            events.append(chunk)
        if not final:
            return b"".join(events)
        result: DynamicInferenceRequest = item
        self.results.append((job, result))
        last = handler._choice(job.index, {}, finish_reason=handler._finish_reason(result, job.index in self.called))
        last.update(extension_fields(req, result))
        events.append(writer.chunk([last]))
        return b"".join(events)


def _delta(events: list[Event]) -> dict[str, Any]:
    """One chunk's delta (the fields it sets: role, content, tool_calls; plain data) from a call reader's events:
    its content text and its pieces of calls (index; id, type and name first; then arguments)."""
    text = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, CallStart):
            calls.append({"index": event.index, "id": event.id, "type": "function",
                          "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, Arguments):
            if calls and calls[-1]["index"] == event.index:
                calls[-1]["function"]["arguments"] += event.text
            else:
                calls.append({"index": event.index, "id": None, "type": None,
                              "function": {"name": None, "arguments": event.text}})
    delta: dict[str, Any] = {"content": text} if text else {}
    if calls:
        delta["tool_calls"] = calls
    return delta
