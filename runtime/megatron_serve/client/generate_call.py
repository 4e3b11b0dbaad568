"""What ``MegatronAsyncLLM.generate`` returns: awaited, the finished records; iterated, vLLM's ``AsyncLLM`` stream.

One method serves both callers, so that there are not two generate APIs side by side:

* ``await llm.generate(prompts, params)``: the finished
  :class:`~megatron_serve.wire.request.DynamicInferenceRequest` (a list for a batch), as before;
* ``async for out in llm.generate(prompt, params, request_id)``: vLLM's ``AsyncLLM.generate``, one
  prompt, a :class:`~megatron_serve.client.vllm_outputs.RequestOutput` each time a choice gains
  tokens (cumulative, as vLLM's default ``RequestOutputKind.CUMULATIVE``), the last one
  ``finished``. Leaving the loop early aborts every choice.

Nothing runs until the object is awaited or iterated (as a coroutine that is never awaited).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, Generator

from .engine_client import EngineClient
from .outputs import StreamItem, StreamPartial
from .prompts import Prompt, tokenize_prompt
from .vllm_outputs import RequestOutput, request_output
from ..wire.request import DynamicInferenceRequest
from ..wire.sampling_params import SamplingParams

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


async def stream_request_outputs(client: EngineClient, tokenizer: Any, prompt: Prompt, choices: list[SamplingParams],
                                 request_id: str) -> AsyncIterator[RequestOutput]:
    """Cumulative ``RequestOutput``s of one prompt's choices, merged as their pieces arrive."""
    prompt_tokens = tokenize_prompt(prompt, tokenizer)[0] if tokenizer is not None else []
    text = prompt if isinstance(prompt, str) else None
    ids = child_ids(request_id, len(choices))
    # Per choice, what has arrived: a scratch record that partials extend, until the final record replaces it.
    records = [DynamicInferenceRequest(request_id=child, prompt=text, prompt_tokens=list(prompt_tokens),
                                       sampling_params=params, generated_text="")
               for child, params in zip(ids, choices)]
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
                scratch = records[index]
                scratch.generated_tokens.extend(item.new_tokens)
                scratch.generated_text = (scratch.generated_text or "") + item.new_text
                scratch.generated_log_probs.extend(item.new_log_probs)
                scratch.generated_top_n_logprobs.extend(item.new_top_logprobs)
            else:
                records[index] = item
                done += 1
            yield request_output(records, tokenizer, request_id=request_id)  # finished once every choice is
    finally:
        for task in tasks:
            task.cancel()  # a stream left early aborts its request
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

