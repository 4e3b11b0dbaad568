"""What ``MegatronAsyncLLM.generate`` returns: awaited, the finished records; iterated, vLLM's ``AsyncLLM`` stream.

One method serves both callers, so that there are not two generate APIs side by side:

* ``await llm.generate(prompts, params)``: the finished
  :class:`~megatron_serve.wire.request.DynamicInferenceRequest` (a list for a batch), as before;
* ``async for out in llm.generate(prompt, params, request_id)``: vLLM's ``AsyncLLM.generate``, one
  prompt, a :class:`~megatron_serve.client.vllm_outputs.RequestOutput` each time a choice gains
  tokens, the last one ``finished``, as ``params.output_kind`` says (vLLM's ``RequestOutputKind``):
  the whole output so far (``CUMULATIVE``, the default), only what is new (``DELTA``: the pieces
  add up to the final output), or only the finished output (``FINAL_ONLY``). Leaving the loop early
  aborts every choice.

Nothing runs until the object is awaited or iterated (as a coroutine that is never awaited). It is an
awaitable, not a coroutine: ``asyncio.gather`` and ``asyncio.ensure_future`` take it, ``create_task`` does not
(``asyncio.ensure_future(llm.generate(...))`` makes the task).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any, AsyncIterator, Awaitable, Callable, Generator

from ..tokenizer import Tokenizer
from .engine_client import EngineClient
from .outputs import StreamItem, StreamPartial
from .prompts import Prompt, tokenize_prompt
from .vllm_outputs import CompletionOutput, LogprobsDict, RequestOutput, Shaper
from ..wire.request import DynamicInferenceRequest
from ..wire.sampling_params import RequestOutputKind, SamplingParams

Result = DynamicInferenceRequest | list[DynamicInferenceRequest]


class GenerateCall:
    """Awaitable (the records) and async-iterable (vLLM's ``RequestOutput`` stream); see the module docstring."""

    def __init__(self, result: Callable[[], Awaitable[Result]],
                 stream: Callable[[], AsyncIterator[RequestOutput]]) -> None:
        self._result = result
        self._stream = stream

    def __await__(self) -> Generator[Any, None, Result]:
        return self._result().__await__()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._stream()


def child_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's ``n`` choices: the id itself for one, vLLM's ``{index}_{id}`` for several."""
    return [request_id] if n == 1 else [f"{index}_{request_id}" for index in range(n)]


class GrowingChoice:
    """One choice of a stream as its pieces arrive: each piece's tokens, text and log probs are added once (a
    snapshot copies the lists; rebuilding every log-prob entry per piece would cost O(tokens^2) per stream),
    until the final record replaces them."""

    def __init__(self, index: int, params: SamplingParams, shaper: Shaper) -> None:
        self.index = index
        self.asked = params.return_log_probs
        self.shaper = shaper
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[LogprobsDict] = []
        self.cumulative = 0.0
        self.final: CompletionOutput | None = None
        self.sent = (0, 0)  # the tokens and characters of text a delta handed out already (RequestOutputKind.DELTA)

    def extend(self, piece: StreamPartial) -> None:
        self.token_ids.extend(piece.new_tokens)
        self.text += piece.new_text
        if self.asked:
            self.logprobs.extend(self.shaper.logprob_entries(piece.new_tokens, piece.new_log_probs,
                                                             piece.new_top_logprobs))
            for log_prob in piece.new_log_probs:  # in order, as the final record's sum adds them
                self.cumulative += log_prob

    def finish(self, record: DynamicInferenceRequest) -> None:
        self.final = self.shaper.completion_output(self.index, record)

    def snapshot(self) -> CompletionOutput:
        if self.final is not None:
            return self.final
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative if self.asked else None,
                                list(self.logprobs) if self.asked else None)

    def delta(self) -> CompletionOutput:
        """What is new since the last delta (the final one closes with the record's ``finish_reason``)."""
        whole = self.snapshot()
        tokens, chars = self.sent
        self.sent = (len(whole.token_ids), len(whole.text))
        return dataclasses.replace(whole, text=whole.text[chars:], token_ids=whole.token_ids[tokens:],
                                   logprobs=None if whole.logprobs is None else whole.logprobs[tokens:])


async def stream_request_outputs(client: EngineClient, tokenizer: Tokenizer, prompt: Prompt, choices: list[SamplingParams],
                                 request_id: str) -> AsyncIterator[RequestOutput]:
    """``RequestOutput``s of one prompt's choices, merged as their pieces arrive, of the choices' ``output_kind``."""
    ids = child_ids(request_id, len(choices))
    kind = choices[0].output_kind  # the choices of one prompt share their params but for their index
    shaper = Shaper(tokenizer)
    growing = [GrowingChoice(index, params, shaper) for index, params in enumerate(choices)]
    # What the prompt fields say until a final record says it (partials carry no prompt tokens).
    prompt_tokens = tokenize_prompt(prompt, tokenizer)[0] if tokenizer is not None else []
    head = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, prompt_tokens, None, [], False)
    queue: asyncio.Queue[tuple[int, StreamItem | BaseException]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for item in client.add_request_streaming(prompt, choices[index], request_id=ids[index]):
                queue.put_nowait((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(index)) for index in range(len(choices))]
    try:
        done = 0
        while done < len(choices):
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, StreamPartial):
                growing[index].extend(item)
            else:
                growing[index].finish(item)
                if done == 0:
                    head = shaper.request_output([item], request_id=request_id)
                done += 1
            finished = done == len(choices)
            if kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            outputs = [choice.delta() if kind == RequestOutputKind.DELTA else choice.snapshot() for choice in growing]
            yield dataclasses.replace(head, outputs=outputs, finished=finished)
    finally:
        for task in tasks:
            task.cancel()  # a stream left early aborts its request
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
