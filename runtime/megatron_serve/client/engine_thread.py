"""The engine thread of direct mode: the one thread that calls into an in-process engine and steps it.

The engine is not thread-safe, so every call into it (tokenization included) happens here; each step's token ids go
to the callers' event loops as deltas (their text is made there), and the requests' budgets are metered here
(:class:`~megatron_serve.client.local_engine.LocalEngineClient` is the client over it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable

import msgspec

from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS, KeptIdsMeter, engine_request_cost, over_budget
from ..engine.output import step_delta
from ..engine.steps import StepOutput
from ..wire.deltas import RequestDelta
from .output_processor import OutputCollector
from .pending_requests import PendingRequest, PendingRequests
from .prompts import ImagePrompt, Prompt, tokenize_prompt
from ..wire.request import (DynamicInferenceRequest, EngineRequest, EventType, FinalRecord, FinishReason, RequestEvent,
                            RequestStatus)
from ..wire.submission import WireImage
from ..wire.sampling_params import SamplingParams
from .streams import Sink
from ..weights.sources import WeightSource

logger = logging.getLogger("megatron_serve.async_llm")


#: What the engine thread tells a request's loop besides its deltas: a failure, its prompt's token ids, or its final
#: record (None: it finished without one).
_Told = BaseException | list[int] | FinalRecord | None


def _posts(out: StepOutput, ended: FinalRecord | None = None) -> list[tuple[str, RequestDelta | _Told]]:
    """What one step output tells its request's loop: its delta, then its final record: ``ended`` (ended here) or,
    finished, the engine's."""
    delta = step_delta(out)
    if ended is not None:
        return [(out.request_id, delta), (out.request_id, ended)]
    return [(out.request_id, delta), (out.request_id, out.final)] if out.finished else [(out.request_id, delta)]


def _over_budget(request_id: str, record: Any, reason: str) -> FinalRecord:
    """The final record of a request its kept ids' budget ended (``record``: the engine's as it dropped it, if
    any), as a coordinator's: FAILED, reason ``length``, the error naming the budget."""
    base = record if isinstance(record, FinalRecord) else FinalRecord(request_id=request_id)
    now = time.time()
    return msgspec.structs.replace(base, status=RequestStatus.FAILED, finish_reason=FinishReason.LENGTH, error=reason,
                                   events=[*base.events, RequestEvent(EventType.FAIL, now, reason)], finish_time=now)


def _settle(future: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class EngineThread:
    """Steps a direct-mode engine on its own thread; its callers' event loops make the outputs.

    The thread only steps: each step's deltas (:func:`~megatron_serve.engine.output.step_delta`,
    token ids) go to the event loop of each request's caller in one call, and that loop makes the
    text and finds stop strings (:class:`~megatron_serve.client.pending_requests.PendingRequests`), as an
    ``InferenceClient`` does with a fleet's ``STEP_TOKENS``. A request a stop string ends is resolved
    there at once and aborted here.

    Requests submitted in one turn of the caller's event loop reach the engine together, before its
    next step (as one command): ``generate`` of a list is one batch from its first step, as in vLLM's
    ``LLM.generate``, and its results do not depend on when the thread woke up. Measured before:
    two runs of the same 8 greedy prompts differed in their log-probs (batches of 1 then 7 vs 8) and
    a CUDA-graph test saw decode batches it did not submit.

    The thread decides whether it will wait for commands before it hands out a step's results, so
    once a caller has every result it asked for, the thread is waiting and leaves the engine alone
    (tests step ``MegatronLLM.engine`` directly between calls).
    """

    def __init__(self, engine: Any, max_request_logprobs: int = DEFAULT_MAX_REQUEST_LOGPROBS) -> None:
        self.engine = engine
        self.max_request_logprobs = max_request_logprobs
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._arriving: list[tuple[Any, ...]] = []  # submissions of this event-loop turn (see _flush)
        self._arriving_lock = threading.Lock()
        self._pending = PendingRequests()  # touched on the callers' loops only
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # the engine thread's: where each request's output goes
        self._kept: dict[str, KeptIdsMeter] = {}  # the engine thread's: kept ids counted as produced, per request
        self._thread = threading.Thread(target=self._main, name="megatron-engine", daemon=True)
        self._started = False
        self.completed = 0  # finished requests, by outcome (for the STATUS-shaped answer)
        self.failed = 0
        self.aborted = 0  # by the caller: not a failure

    def start(self) -> None:
        """Start the thread (on the first request: an engine nobody asked anything of stays unowned)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, prompt: Prompt, params: SamplingParams, stream: bool, request_id: str | None = None,
               sink: Sink | None = None, meter: KeptIdsMeter | None = None) -> tuple[str, asyncio.Future, Any]:
        """``sink``: where a stream's items go (a queue made here without one); ``meter``: the request's kept ids'
        budget, counted on the caller's loop as they arrive (the engine thread keeps its own, per engine request)."""
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already pending")
        future = loop.create_future()
        items = sink if sink is not None else asyncio.Queue() if stream else None
        text_prompt = prompt.prompt if isinstance(prompt, ImagePrompt) else prompt
        collector = OutputCollector(request_id, text_prompt, params, self.engine.tokenizer)
        self._pending.add(PendingRequest(request_id, text_prompt, params, stream, future, collector, items,
                                         meter=meter))
        self.start()
        with self._arriving_lock:
            self._arriving.append((request_id, prompt, params, loop))
            first = len(self._arriving) == 1
        if first:
            loop.call_soon(self._flush)
        return request_id, future, items

    def _flush(self) -> None:
        """Hand the submissions gathered so far to the thread as one command (once per loop turn, and
        before any other command, so that an abort never overtakes its request)."""
        with self._arriving_lock:
            arriving, self._arriving = self._arriving, []
        if arriving:
            self._commands.put(("add", arriving))

    def abort(self, request_id: str) -> None:
        self._flush()
        self._commands.put(("abort", request_id))

    def refit(self, source: str | WeightSource, epoch: int | None) -> asyncio.Future:
        """Refit the engine between two steps; the future resolves to its timings (or its error)."""
        return self.call(lambda engine: engine.memory.refit(source, epoch))

    def call(self, action: Callable[[Any], Any]) -> asyncio.Future:
        """Run ``action(engine)`` between two steps; the future resolves to its result (or its error)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.start()
        self._flush()
        self._commands.put(("call", action, loop, future))
        return future

    def close(self, timeout: float = 30.0) -> None:
        """Fail what is pending, stop the thread and shut the engine down (its tensor-parallel followers)."""
        if not self._started:
            self._started = True  # never again
            self.engine.shutdown()
        elif self._thread.is_alive():
            self._flush()
            self._commands.put(("close",))
            self._thread.join(timeout)

    # -- the callers' loops

    def _deliver(self, items: list[RequestDelta | tuple[str, _Told]]) -> None:
        """Outputs for requests of this loop, in order (on the loop): deltas, and each request's final record,
        failure, or the token ids of a prompt made here (a text's, images' placeholders expanded: the finished
        request's ``prompt_tokens``)."""
        for item in items:
            if isinstance(item, tuple):
                request_id, value = item
                if isinstance(value, list):
                    pending = self._pending.get(request_id)
                    if pending is not None:
                        pending.collector.prompt_tokens = value
                elif isinstance(value, BaseException):
                    if request_id in self._pending:
                        self.failed += 1
                        self._pending.fail(request_id, value)
                else:  # its final record (after its last delta): nothing is pending if a stop string ended it
                    self._count(self._pending.on_final(request_id, value))
                continue
            stopped = self._pending.on_delta(item.request_id, item)
            if stopped is not None:  # a stop string (completed) or its request's budget (failed) ended it
                if stopped.collector.stopped:
                    self.completed += 1
                else:
                    self.failed += 1
                if not item.finished:
                    self.abort(item.request_id)

    def _count(self, request: DynamicInferenceRequest | None) -> None:
        if request is None:
            return
        if request.status is RequestStatus.COMPLETED:
            self.completed += 1
        elif request.finish_reason is FinishReason.ABORT:
            self.aborted += 1
        else:
            self.failed += 1

    # -- the engine thread

    def _post(self, outputs: list[tuple[str, RequestDelta | _Told]]) -> None:
        """Send each output to its request's loop: one call per loop (a request leaves the map with its final record
        or its failure)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for request_id, output in outputs:
            loop = self._loops.get(request_id)
            if loop is None:
                continue
            if isinstance(output, RequestDelta):
                by_loop.setdefault(loop, []).append(output)
                continue
            if not isinstance(output, list):
                del self._loops[request_id]
            by_loop.setdefault(loop, []).append((request_id, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
                pass

    def _main(self) -> None:
        engine = self.engine
        block = True
        while True:
            while True:
                try:
                    command = self._commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if command[0] == "close":
                    self._post([(request_id, ConnectionError("MegatronAsyncLLM was shut down"))
                                for request_id in list(self._loops)])
                    engine.shutdown()  # stops tensor-parallel followers, if any
                    return
                self._apply(command)
            if not engine.has_unfinished_requests():
                block = True
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # fail what was running; the engine stays usable for new work
                logger.exception("engine step failed")
                try:
                    engine.take_unfinished_requests()
                except Exception:  # noqa: BLE001 - the records the failed step could not build fail here too
                    logger.exception("handing back the unfinished requests failed")
                block = True
                # Every request a caller waits for, not only those the engine still held: one whose final record
                # the step was building when it raised is held by no one else, and its caller would wait forever.
                self._post([(request_id, RuntimeError(f"engine step failed: {exc}")) for request_id in list(self._loops)])
                self._kept.clear()
                continue
            over = self._metered(outputs)
            block = not engine.has_unfinished_requests()  # decided before the results go out (see class doc)
            if outputs:
                self._post([post for out in outputs for post in _posts(out, over.get(out.request_id))])

    def _metered(self, outputs: list[StepOutput]) -> dict[str, FinalRecord]:
        """Count the step's kept ids; each request they carry past the budget is dropped by the engine (it computes
        no more for it) and ends after this step's tokens as a coordinator ends it (FAILED, reason ``length``, the
        error naming the budget), so that a server answers both alike."""
        over: dict[str, FinalRecord] = {}
        for out in outputs:
            meter = self._kept.get(out.request_id)
            reason = None if meter is None else meter.add(out.top_p_token_ids)
            if reason is not None:
                over[out.request_id] = _over_budget(out.request_id, self.engine.abort_request(out.request_id), reason)
            if out.finished or reason is not None:
                self._kept.pop(out.request_id, None)
        return over

    def _apply(self, command: tuple[Any, ...]) -> None:
        if command[0] == "call":
            _, action, loop, future = command
            try:
                result, exc = action(self.engine), None
            except Exception as error:  # noqa: BLE001 - handed to the caller
                result, exc = None, error
            try:
                loop.call_soon_threadsafe(_settle, future, result, exc)
            except RuntimeError:  # the caller's loop is closed
                pass
            return
        if command[0] == "abort":
            self._kept.pop(command[1], None)
            record = self.engine.abort_request(command[1])
            if record is not None:
                self._post([(command[1], record)])
            return
        told: list[tuple[str, BaseException | list[int]]] = []
        for request_id, prompt, params, loop in command[1]:
            self._loops[request_id] = loop
            try:
                tokens, images, text = tokenize_prompt(prompt, self.engine.tokenizer)
            except Exception as exc:
                told.append((request_id, ValueError(f"cannot tokenize the prompt: {exc}")))
                continue
            cost = engine_request_cost(len(tokens), params)
            over = over_budget(cost, self.max_request_logprobs, option="max_request_logprobs")
            if over is not None:  # as a coordinator refuses it (vLLM raises ValueError for a request it cannot take)
                told.append((request_id, ValueError(over)))
                continue
            if params.return_top_p_token_ids:  # top-p alone bounds nothing up front: counted as produced (_metered)
                self._kept[request_id] = KeptIdsMeter(cost, self.max_request_logprobs, "max_request_logprobs")
            if text is not None or images:  # ids the caller lacks (a text's, images' placeholders expanded)
                told.append((request_id, list(tokens)))
            self.engine.add_request(EngineRequest(
                request_id=request_id, prompt_tokens=tokens, sampling_params=params, arrival_time=time.time(),
                images=[WireImage(data=image.data, offset=image.offset, length=image.length) for image in images]))
            # (a bad request fails alone and comes back from step())
        self._post(told)
