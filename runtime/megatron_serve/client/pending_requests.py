"""Requests submitted and not resolved yet, and what arrives for them: the client side of the output path.

Both engine clients keep them: :class:`~megatron_serve.client.coordinator_client.InferenceClient` (deltas come as
``STEP_TOKENS``, the final record as ``RESULT``) and, in direct mode, the caller's event loop in
:mod:`megatron_serve.client.local_engine` (the engine thread hands it each step's deltas). Each pending
request holds its :class:`~megatron_serve.client.output_processor.OutputCollector`: deltas become stream
pieces and text here, a stop string ends the request here (the caller then aborts it where it
runs), so does the request's budget for kept ids (a :class:`~megatron_serve.limits.KeptIdsMeter` its caller gave,
perhaps shared with the request's other choices: the ids delivered stay counted wherever the request runs next), and
the final record (how it went) becomes the public result there, built once. A request is resolved
exactly once: whatever arrives for it afterwards (the result of a request a stop string ended, a
duplicate after a reconnect) finds nothing pending and is dropped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import msgspec

from ..limits import KeptIdsMeter
from ..wire.deltas import TokenDelta, delta_past
from ..wire.placement import Placement
from .output_processor import OutputCollector
from .outputs import StreamPartial
from ..wire.request import DynamicInferenceRequest, FinalRecord
from ..wire.sampling_params import SamplingParams


_FINAL_RECORD = msgspec.msgpack.Decoder(FinalRecord | None)


@dataclass(slots=True)  # (a step reads every stream's: one object each, no dict beside it)
class PendingRequest:
    request_id: str
    prompt: list[int]  # token ids: the caller's process tokenizes
    sampling_params: SamplingParams
    stream: bool
    future: asyncio.Future
    collector: OutputCollector
    queue: asyncio.Queue | None = None
    aborted: bool = False
    images: list[dict[str, Any]] = field(default_factory=list)  # wire form (PromptImage.to_wire)
    placement: Placement | None = None  # its session and data-parallel rank (wire.placement)
    meter: KeptIdsMeter | None = None  # its request's kept ids counted as delivered (on_delta)
    put: Callable[[Any], None] | None = field(init=False, repr=False)  # the queue's put_nowait, bound once
    # A plain stream's text alone, to a sink that takes it (streams.TextSink): no piece made per token (on_delta)
    put_text: Callable[[str], bool] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.put = None if self.queue is None else self.queue.put_nowait
        plain = self.collector.plain and self.meter is None
        self.put_text = getattr(self.queue, "put_text", None) if plain else None  # (an asyncio.Queue has none)

    def submit_body(self) -> dict[str, Any]:
        """Its ``SUBMIT`` (again after a reconnect: it goes on from the tokens it has)."""
        body: dict[str, Any] = {"client_request_id": self.request_id, "prompt": self.prompt,
                                "sampling_params": self.sampling_params, "stream": self.stream}
        if self.collector.tokens:
            body["generated_tokens"] = self.collector.tokens
            kept = sum(map(len, self.collector.out.top_p_token_ids))
            if kept:  # counted where it goes on as they were before (a coordinator's own bound)
                body["kept_ids"] = kept
        if self.images:
            body["images"] = self.images
        if self.placement is not None:
            body["placement"] = self.placement
        return body

    def resolve(self, request: DynamicInferenceRequest, tail: bool = True) -> None:
        """Hand out the finished request (a stream first gets the text held back until now)."""
        if not self.future.done():
            self.future.set_result(request)
        if self.queue is not None:
            rest = self.collector.tail() if tail else None
            if rest is not None:
                self.queue.put_nowait(rest)
            self.queue.put_nowait(request)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)
        if self.queue is not None:
            self.queue.put_nowait(exc)
            # A stream's caller reads the queue, never the future: marked retrieved here, or asyncio logs
            # "Future exception was never retrieved" when it is collected (and on Python 3.11 that log,
            # run by the collector inside an ``ast.parse`` of the caret-drawing traceback, broke the parse).
            if not self.future.cancelled():
                self.future.exception()


class PendingRequests:
    """Pending requests by id (the client's own ids, as strings)."""

    def __init__(self) -> None:
        self._by_id: dict[str, PendingRequest] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __iter__(self) -> Iterator[PendingRequest]:
        return iter(list(self._by_id.values()))

    def add(self, pending: PendingRequest) -> None:
        self._by_id[pending.request_id] = pending

    def get(self, request_id: Any) -> PendingRequest | None:
        return self._by_id.get(str(request_id))

    def on_delta(self, request_id: Any, delta: TokenDelta, start: int | None = None) -> PendingRequest | None:
        """Take a request's new tokens (``start``: a catch-up's, from generated token ``start`` on); returns the
        request when a stop string or its kept ids' budget ended it here (resolved already, the budget's as FAILED
        with reason ``length`` as a coordinator ends it: the caller aborts it where it runs)."""
        pending = self._by_id.get(str(request_id))
        if pending is None:
            return None
        collector = pending.collector
        put_text = pending.put_text
        if put_text is not None and start is None:  # a plain stream: its text alone, most often
            text = collector.add_plain(delta)
            if text is not None:
                if not put_text(text):
                    pending.put(StreamPartial(pending.request_id, delta.new_tokens, text))
                return None
        if start is not None:  # a catch-up: the steps since may have come first
            delta = delta_past(delta, start, len(collector.tokens))
            if delta is None:
                return None
        partial = collector.add(delta)
        if pending.put is not None and (partial.new_tokens or partial.new_text):
            pending.put(partial)
        over = None if collector.stopped or pending.meter is None else pending.meter.add(delta.top_p_token_ids)
        if not collector.stopped and over is None:
            return None
        del self._by_id[pending.request_id]
        ended = collector.finish_stopped() if over is None else collector.finish_over_budget(over)
        pending.resolve(ended, tail=False)  # its piece above had the whole rest
        return pending

    def on_final(self, request_id: Any, record: FinalRecord | msgspec.Raw | None) -> DynamicInferenceRequest | None:
        """The final record (its bytes from a coordinator, decoded here where it enters; the struct itself in
        direct mode); the finished request, if it was pending, built once by its collector."""
        pending = self._by_id.pop(str(request_id), None)
        if pending is None:
            return None
        try:
            final = _FINAL_RECORD.decode(record) if isinstance(record, msgspec.Raw) else record
            if not isinstance(final, FinalRecord):
                raise ValueError("the request finished without a final record")
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            final = FinalRecord(request_id=pending.request_id).failed(f"unreadable result from the coordinator: {exc}")
        request = pending.collector.finish(final)
        pending.resolve(request)
        return request

    def fail(self, request_id: Any, exc: BaseException) -> None:
        pending = self._by_id.pop(str(request_id), None)
        if pending is not None:
            pending.fail(exc)

    def fail_all(self, exc: BaseException) -> None:
        for pending in self._by_id.values():
            pending.fail(exc)
        self._by_id.clear()
