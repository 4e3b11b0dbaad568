"""A stand-in for ``InferenceClient``: instant, deterministic generation over the real tokenizer.

The HTTP layer's own behaviour (shapes, errors, streaming, aborts, queue limit, readiness) is
tested against this, without processes or a model; the end-to-end module covers the real stack.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from megatron_serve.client.coordinator_client import StreamPartial
from megatron_serve.client.local_engine import one_engine
from megatron_serve.wire.messages import TokenDelta
from megatron_serve.client.output_processor import OutputCollector
from megatron_serve.wire.placement import Placement
from megatron_serve.wire.request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams


class FakeBackend:
    """``gate`` cleared = a paused fleet (requests wait); ``reachable=False`` = no coordinator."""

    def __init__(self, tokenizer: Any, *, state: str = "RUNNING", max_sequence_length: int = 64,
                 token_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.state = state
        self.reachable = True
        self.max_sequence_length = max_sequence_length
        self.token_delay = token_delay
        self.gate = asyncio.Event()
        self.gate.set()
        self.submitted: list[tuple[list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.connected = False  # a late status means unreachable (the coordinator client's is True while it hears)
        self._tasks: dict[str, asyncio.Task] = {}

    async def start(self, timeout: float = 30.0) -> "FakeBackend":
        return self

    async def status(self, timeout: float | None = 10.0) -> dict[str, Any]:
        if not self.reachable:
            raise TimeoutError("no answer")
        return {"state": self.state, "queued": 0, "in_flight": len(self.running), "completed": 0, "failed": 0,
                "engines": [{"id": "e1-g0", "group": 0, "state": self.state, "running": len(self.running),
                             "waiting": 0, "kv_blocks_free": 64 - len(self.running), "kv_blocks_total": 64,
                             "info": {"max_sequence_length": self.max_sequence_length}}]}

    @staticmethod
    def next_token(prompt: list[int], i: int, seed: int | None) -> int:
        return 5 + (sum(prompt) * 31 + i * 17 + (seed or 0) * 7) % 400  # past the special tokens

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                        ) -> AsyncIterator[StreamPartial | DynamicInferenceRequest]:
        self.submitted.append((list(prompt), params))
        request = DynamicInferenceRequest(request_id=request_id, prompt=None, prompt_tokens=list(prompt),
                                          sampling_params=params)
        request.add_event(EventType.ADD)
        await self.gate.wait()
        self.running.add(request_id)
        try:
            request.add_event(EventType.PREFILL)
            collector = OutputCollector(request_id, list(prompt), params, self.tokenizer)  # the client's side, real
            limit = min(params.num_tokens_to_generate, self.max_sequence_length - len(prompt))
            for i in range(limit):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                await self.gate.wait()
                token = self.next_token(prompt, i, params.seed)
                if i == 0:
                    request.add_event(EventType.FIRST_TOKEN)
                logprob = -0.5 - i / 100
                delta = TokenDelta(new_tokens=[token])
                if params.return_log_probs or params.top_n_logprobs:
                    delta.new_log_probs = [logprob]
                if params.top_n_logprobs:
                    others = list(range(10, 10 + params.top_n_logprobs - 1))
                    delta.top_ids = [[token, *others]]
                    delta.top_log_probs = [[logprob, *(logprob - 1 - k for k in range(len(others)))]]
                partial = collector.add(delta)
                if collector.stopped:
                    yield partial
                    yield collector.finish_stopped()
                    return
                if partial.new_tokens or partial.new_text:
                    yield partial
            request.status = RequestStatus.COMPLETED
            request.finish_reason = FinishReason.LENGTH
            request.add_event(EventType.FINISH)
            rest = collector.tail()
            if rest is not None:
                yield rest
            yield collector.finish(request.final_record())
        finally:
            self.running.discard(request_id)

    def add_request(self, prompt: list[int], sampling_params: SamplingParams, *, request_id: str | None = None,
                    placement: Placement | None = None, meter: Any = None
                    ) -> "asyncio.Future[DynamicInferenceRequest]":
        # ``meter``: its request's kept ids' budget; this fake keeps no top-p ids, so there is nothing to count
        one_engine(placement)  # one engine, as the in-process client: rank 0 only
        async def collect() -> DynamicInferenceRequest:
            final = None
            async for item in self._generate(request_id, prompt, sampling_params):
                final = item
            return final

        task = asyncio.ensure_future(collect())
        self._tasks[request_id] = task
        return task

    async def add_request_streaming(self, prompt: list[int], sampling_params: SamplingParams, *,
                                    request_id: str | None = None, placement: Placement | None = None
                                    ) -> AsyncIterator[Any]:
        one_engine(placement)
        finished = False
        try:
            async for item in self._generate(request_id, prompt, sampling_params):
                finished = isinstance(item, DynamicInferenceRequest)
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def add_request_streaming_to(self, prompt: list[int], sampling_params: SamplingParams, sink: Any, *,
                                 request_id: str, placement: Placement | None = None, meter: Any = None) -> str:
        """Its stream's items put into ``sink`` as they come (a task of its own here: the real clients' receive
        loops put them); an abort cancels the task."""
        one_engine(placement)

        async def pump() -> None:
            try:
                async for item in self.add_request_streaming(prompt, sampling_params, request_id=request_id):
                    sink.put_nowait(item)
            except Exception as exc:  # as the real clients deliver a request's failure: in its place
                sink.put_nowait(exc)

        self._tasks[request_id] = asyncio.ensure_future(pump())
        return request_id

    def abort(self, request_id: str) -> None:
        if request_id not in self.aborted:  # like the real client: aborting twice is one abort
            self.aborted.append(request_id)
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
