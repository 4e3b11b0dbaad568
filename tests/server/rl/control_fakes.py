"""A stand-in fleet for the control routes: the lifecycle table's states and verbs, requests that generate a token
per tick while the fleet runs, and an abort that ends a request as the coordinator does (``abort``, tokens so far).

``verbs`` records every verb a route ran with its arguments; ``wedge()`` makes the one engine's step loop stand
still with a request assigned, as the coordinator's status shows it (``stalled_s`` growing, ``stall_timeout``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from megatron_serve.client.output_processor import OutputCollector
from megatron_serve.wire.lifecycle import FleetState, PauseMode, Verb, parse_verb, transition
from megatron_serve.wire.messages import TokenDelta
from megatron_serve.wire.request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.client.coordinator_client import ControlError

STALL_TIMEOUT = 4.0


class _Request:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, tokenizer: Any) -> None:
        self.request_id = request_id
        self.record = DynamicInferenceRequest(request_id=request_id, prompt=None, prompt_tokens=list(prompt),
                                              sampling_params=params)
        self.record.add_event(EventType.ADD)
        self.collector = OutputCollector(request_id, list(prompt), params, tokenizer)
        self.queue: Any = asyncio.Queue()  # or the caller's sink (add_request_streaming_to)
        self.left = params.num_tokens_to_generate
        self.done = False


class ControlledFleet:
    """See the module docstring. ``tick``: seconds between two tokens of a running request."""

    def __init__(self, tokenizer: Any, *, tick: float = 0.01, tensor_parallel_size: int = 1, engines: int = 1) -> None:
        self.tokenizer = tokenizer
        self.tick = tick
        self.state = FleetState.RUNNING
        self.suspend_level: int | None = None
        self.verbs: list[tuple[str, dict[str, Any]]] = []
        self.requests: dict[str, _Request] = {}
        self.aborted: list[str] = []
        self.engine_info = {"tensor_parallel_size": tensor_parallel_size, "max_sequence_length": 256,
                            "dtype": "float32", "block_size": 16, "prefix_caching": True}
        self.engine_count = engines
        self.wedged_since: float | None = None
        self._runner: asyncio.Task | None = None

    # ------------------------------------------------------------------ what the server reads

    connected = True  # its status never comes late

    async def start(self, timeout: float = 30.0) -> "ControlledFleet":
        return self

    async def status(self, timeout: float | None = 10.0) -> dict[str, Any]:
        stalled = 0.0 if self.wedged_since is None else time.monotonic() - self.wedged_since
        engines = [{"id": f"e{i}-g0", "group": 0, "state": self.state.value, "running": len(self.requests),
                    "waiting": 0, "kv_blocks_free": 64, "kv_blocks_total": 64, "assigned": len(self.requests),
                    "progress": 7, "stalled_s": stalled if i == 0 else 0.0, "info": dict(self.engine_info)}
                   for i in range(self.engine_count)]
        return {"state": self.state.value, "queued": 0, "in_flight": len(self.requests), "completed": 0,
                "failed": 0, "engines": engines, "epoch": 3, "stall_timeout": STALL_TIMEOUT,
                "suspend_level": self.suspend_level}

    async def control(self, verb: Verb | str, timeout: float | None = None, **arguments: Any) -> dict[str, Any]:
        verb = parse_verb(verb)
        self.verbs.append((verb.value, arguments))
        try:
            target = transition(self.state, verb).target
        except ValueError as exc:
            raise ControlError("illegal_transition", str(exc)) from None
        if verb is Verb.PAUSE and arguments.get("mode") == PauseMode.ABORT.value:
            for request in list(self.requests.values()):
                self._end(request, RequestStatus.COMPLETED)
        if verb is Verb.SUSPEND:
            self.suspend_level = arguments.get("level")
        if verb is Verb.RESUME and target is not FleetState.RUNNING:
            self.suspend_level = None
        previous, self.state = self.state, target
        detail: dict[str, Any] = {"previous_state": previous.value}
        if verb is Verb.RESET_PREFIX_CACHE:  # as an engine answers it: refused while requests run, unless recomputed
            detail["reset"] = not self.requests or bool(arguments.get("reset_running_requests"))
        return {"state": target.value, "detail": detail}

    def wedge(self) -> None:
        self.wedged_since = time.monotonic()

    # ------------------------------------------------------------------ generation

    def _start(self, prompt: list[int], params: SamplingParams, request_id: str) -> _Request:
        request = _Request(request_id, prompt, params, self.tokenizer)
        self.requests[request_id] = request
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        return request

    async def _run(self) -> None:
        """One token for every running request per tick, while the fleet runs and its loop is not wedged."""
        while self.requests:
            await asyncio.sleep(self.tick)
            if self.state is not FleetState.RUNNING or self.wedged_since is not None:
                continue
            for request in list(self.requests.values()):
                token = 5 + (len(request.collector.tokens) * 17 + sum(request.record.prompt_tokens)) % 400
                if not request.collector.tokens:
                    request.record.add_event(EventType.PREFILL)
                piece = request.collector.add(TokenDelta(new_tokens=[token]))
                if piece.new_tokens or piece.new_text:
                    request.queue.put_nowait(piece)
                request.left -= 1
                if request.left <= 0:
                    self._end(request, RequestStatus.COMPLETED, FinishReason.LENGTH)

    def _end(self, request: _Request, status: RequestStatus, reason: FinishReason = FinishReason.ABORT) -> None:
        if request.done:
            return
        request.done = True
        self.requests.pop(request.request_id, None)
        request.record.status, request.record.finish_reason = status, reason
        request.record.add_event(EventType.FINISH)
        rest = request.collector.tail()
        if rest is not None:
            request.queue.put_nowait(rest)
        request.queue.put_nowait(request.collector.finish(request.record.final_record()))

    def add_request(self, prompt: list[int], sampling_params: SamplingParams, *, request_id: str | None = None,
                    images: list[Any] | None = None) -> "asyncio.Future[DynamicInferenceRequest]":
        request = self._start(prompt, sampling_params, request_id or f"r{len(self.requests)}")

        async def final() -> DynamicInferenceRequest:
            while True:
                item = await request.queue.get()
                if isinstance(item, DynamicInferenceRequest):
                    return item

        return asyncio.ensure_future(final())

    async def add_request_streaming(self, prompt: list[int], sampling_params: SamplingParams, *,
                                    request_id: str | None = None, images: list[Any] | None = None
                                    ) -> AsyncIterator[Any]:
        request = self._start(prompt, sampling_params, request_id or f"r{len(self.requests)}")
        try:
            while True:
                item = await request.queue.get()
                yield item
                if isinstance(item, DynamicInferenceRequest):
                    return
        finally:
            if not request.done:
                self.abort(request.request_id)

    def add_request_streaming_to(self, prompt: list[int], sampling_params: SamplingParams, sink: Any, *,
                                 request_id: str, images: list[Any] | None = None) -> str:
        self._start(prompt, sampling_params, request_id).queue = sink  # its items go straight to the caller
        return request_id

    def abort(self, request_id: str) -> None:
        """As the coordinator ends a client's abort: FAILED, ``abort``, the tokens so far."""
        self.aborted.append(request_id)
        request = self.requests.get(request_id)
        if request is not None:
            self._end(request, RequestStatus.FAILED)
