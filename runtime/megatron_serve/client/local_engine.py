"""The in-process engine client: an engine in this process, stepped on a thread of its own.

:class:`LocalEngineClient` is one of the two implementations of
:class:`~megatron_serve.client.engine_client.EngineClient` (the other is the coordinator client): what
``MegatronLLM``/``MegatronAsyncLLM`` use in direct mode and what the HTTP server serves of a direct-mode
``MegatronAsyncLLM`` (``megatron_serve.server.serve_async_llm``). The engine is not thread-safe, so every call into
it (tokenization included) happens on the engine thread (:class:`EngineThread`), which hands each step's token ids
to the callers' event loops; the text is made there (decoding only reads the tokenizer, which its
Rust core allows from any thread). There is no fleet here: the fleet's lifecycle verbs raise ``NoFleet``; ``refit`` loads new
weights between two steps (one replica, nothing can disagree).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable

import msgspec
import torch

from ..config import InferenceConfig
from ..engine import DynamicInferenceEngine
from ..errors import NoFleet
from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS, KeptIdsMeter, engine_request_cost, over_budget
from ..model.llama import LlamaForCausalLM
from ..wire.lifecycle import FleetState, Verb
from ..wire.verb_calls import verb_call
from ..engine.output import step_delta
from ..engine.steps import StepOutput
from ..wire.connection import ControlError
from ..wire.deltas import RequestDelta
from ..wire.placement import Placement, PlacementError
from ..wire.protocol import ErrorCode
from .output_processor import OutputCollector
from .outputs import StreamItem
from .pending_requests import PendingRequest, PendingRequests
from ..multimodal import PromptImage
from .prompts import ImagePrompt, Prompt, tokenize_prompt
from ..wire.request import (DynamicInferenceRequest, EngineRequest, EventType, FinalRecord, FinishReason, RequestEvent,
                            RequestStatus)
from ..wire.submission import WireImage
from ..wire.sampling_params import SamplingParams
from .streams import Sink, iterate_stream
from ..tokenizer import Tokenizer
from ..weights.sources import TensorSource, WeightSource

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


def build_engine(model: str | Path | LlamaForCausalLM, inference_config: InferenceConfig | None,
                 tokenizer: Tokenizer | str | Path | None) -> DynamicInferenceEngine:
    """An engine from a model directory, or from an already built model plus its tokenizer."""
    config = inference_config or InferenceConfig()
    if isinstance(model, (str, Path)):
        tokenizer_dir = tokenizer if isinstance(tokenizer, (str, Path)) else None
        return DynamicInferenceEngine.from_model_dir(model, config, tokenizer_dir=tokenizer_dir)
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a model directory or a LlamaForCausalLM, got {type(model).__name__}")
    if tokenizer is None:
        raise ValueError("a model object needs tokenizer= (a Tokenizer or a directory holding tokenizer files)")
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_pretrained(tokenizer)
    return DynamicInferenceEngine(model, tokenizer, config)


def direct_refit_answer(source: str, timings: dict[str, Any]) -> dict[str, Any]:
    """A direct-mode refit in the shape of the coordinator's acknowledgement (one engine, ``local``)."""
    facts = {k: v for k, v in timings.items() if k != "epoch"}
    facts.update(epoch=int(timings["epoch"]), source=source)
    return {"state": "RUNNING", "detail": {"epoch": int(timings["epoch"]), "source": source, "noop": False,
                                           "engines": {"local": facts}}}


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


def one_engine(placement: Placement | None) -> None:
    """One engine holds data-parallel rank 0 only (a session needs no choosing)."""
    rank = None if placement is None else placement.data_parallel_rank
    if rank:
        raise PlacementError(f"data-parallel rank {rank} is out of range: 1 engine serves (rank 0)")


class LocalEngineClient:
    """The engine-client interface over an engine in this process (see the module docstring)."""

    def __init__(self, engine: DynamicInferenceEngine, max_request_logprobs: int = DEFAULT_MAX_REQUEST_LOGPROBS
                 ) -> None:
        """``max_request_logprobs``: the log-prob entries one request may ask for, the coordinator's budget
        (:func:`~megatron_serve.limits.engine_request_cost`); more is refused with ``ValueError``."""
        self.engine = engine
        self._thread = EngineThread(engine, max_request_logprobs)
        self._closed = False

    async def start(self, timeout: float | None = None) -> "LocalEngineClient":
        """Nothing to wait for: the engine thread starts with the first request."""
        if self._closed:
            raise RuntimeError("this engine client was closed")
        return self

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, *, request_id: str | None = None,
                    images: list[bytes | PromptImage] | None = None, placement: Placement | None = None,
                    meter: KeptIdsMeter | None = None) -> "asyncio.Future[DynamicInferenceRequest]":
        """Submit one prompt; the future resolves to the finished request. ``meter``: as
        :meth:`InferenceClient.add_request <megatron_serve.client.coordinator_client.InferenceClient.add_request>`."""
        one_engine(placement)
        prompt = ImagePrompt(prompt, images) if images else prompt
        return self._thread.submit(prompt, sampling_params, stream=False, request_id=request_id, meter=meter)[1]

    async def add_request_streaming(self, prompt: Prompt, sampling_params: SamplingParams, *,
                                    request_id: str | None = None, images: list[bytes | PromptImage] | None = None,
                                    placement: Placement | None = None) -> AsyncIterator[StreamItem]:
        """Partials as steps add tokens, then the finished request; leaving early aborts it."""
        one_engine(placement)
        prompt = ImagePrompt(prompt, images) if images else prompt
        request_id, _future, items = self._thread.submit(prompt, sampling_params, stream=True, request_id=request_id)
        async for item in iterate_stream(items, lambda: self._thread.abort(request_id)):
            yield item

    def add_request_streaming_to(self, prompt: Prompt, sampling_params: SamplingParams, sink: Sink, *,
                                 request_id: str | None = None, images: list[bytes | PromptImage] | None = None,
                                 placement: Placement | None = None, meter: KeptIdsMeter | None = None) -> str:
        """Submit one prompt whose pieces, final request or error the caller's loop puts straight into ``sink`` as the
        engine thread hands them over (no task per stream); its id. The caller aborts it when it stops listening.
        ``meter``: as :meth:`add_request`."""
        one_engine(placement)
        prompt = ImagePrompt(prompt, images) if images else prompt
        return self._thread.submit(prompt, sampling_params, stream=True, request_id=request_id, sink=sink,
                                   meter=meter)[0]

    @property
    def connected(self) -> bool:
        """Always: the engine is in this process (a status it answers late means busy, never unreachable)."""
        return True

    def abort(self, request_id: str) -> None:
        self._thread.abort(request_id)

    async def status(self, timeout: float | None = None) -> dict[str, Any]:
        """A ``STATUS_REPLY``-shaped answer from the engine's own counters (one engine, always RUNNING)."""
        engine = self.engine
        load = engine.load()
        return {
            "state": FleetState.RUNNING.value,
            "engines": [{"id": "local", "group": 0, "state": FleetState.RUNNING.value, "running": load.running,
                         "waiting": load.waiting, "kv_blocks_free": load.kv_blocks_free,
                         "kv_blocks_total": load.kv_blocks_total, "cached_tokens": load.cached_tokens,
                         "computed_tokens": load.computed_tokens, "epoch": engine.epoch,
                         "last_refit": engine.memory.last_refit, "metrics": engine.metrics_snapshot(),
                         "loras": engine.adapters.names(),
                         "info": {"max_sequence_length": engine.max_sequence_length,
                                  "block_size": engine.config.block_size_tokens}}],
            "epoch": engine.epoch,
            "refits": engine.memory.refits,
            "queued": 0,
            "in_flight": load.running + load.waiting,
            "completed": self._thread.completed,
            "failed": self._thread.failed,
            "aborted": self._thread.aborted,
        }

    async def refit(self, source: str, epoch: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Load new weights between two steps; the answer has the coordinator's acknowledgement's shape."""
        timings = await self._thread.refit(source, epoch)
        return direct_refit_answer(source, timings)

    async def refit_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                            epoch: int | None = None) -> dict[str, Any]:
        """Copy these tensors into the live weights between two steps (names and shapes checked first)."""
        source = TensorSource.of(named_tensors)
        timings = await self._thread.refit(source, epoch)
        return direct_refit_answer(source.label, timings)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: float | None = None) -> dict[str, Any]:
        """Serve the adapter as ``lora_name`` between two steps; the answer has the coordinator's acknowledgement's
        shape. A bad adapter raises :class:`ControlError` (``lora_refused``, as a fleet's) and changes nothing."""
        try:
            seconds = await self._thread.call(lambda engine: engine.adapters.load(lora_name, lora_path))
        except ValueError as exc:  # LoraAdapterError
            raise ControlError(ErrorCode.LORA_REFUSED.value, str(exc)) from None
        return self._lora_answer(lora_name, {"load_s": round(seconds, 6)})

    async def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> dict[str, Any]:
        """Stop serving ``lora_name`` to new requests (running ones finish under it); :class:`ControlError`
        (``lora_not_found``) when it is not served."""
        try:
            await self._thread.call(lambda engine: engine.adapters.unload(lora_name))
        except ValueError as exc:  # LoraAdapterError: not loaded, or no enable_lora
            raise ControlError(ErrorCode.LORA_NOT_FOUND.value, str(exc)) from None
        return self._lora_answer(lora_name, {})

    def _lora_answer(self, lora_name: str, facts: dict[str, Any]) -> dict[str, Any]:
        loras = self.engine.adapters.names() or {}
        return {"state": FleetState.RUNNING.value,
                "detail": {"lora_name": lora_name, "noop": False, "engines": {"local": {**facts, "loras": loras}}}}

    def _no_fleet(self, verb: Verb | str) -> NoFleet:
        name = verb.value if isinstance(verb, Verb) else verb
        return NoFleet(f"{name}() needs coordinator mode (use_coordinator=True): this engine runs in this "
                            "process, with no fleet lifecycle")

    async def control(self, verb: Verb | str, timeout: float | None = None, **arguments: Any) -> dict[str, Any]:
        """A verb in direct mode, checked as a fleet's client checks it: the verb table's direct verbs (refit, the
        LoRA adapters) run on this engine between two steps, by the method of the verb's name; the fleet's verbs
        (pause, suspend, stop, ...) raise :class:`~megatron_serve.errors.NoFleet`."""
        call = verb_call(verb)
        call.bind(arguments)
        if not call.direct:
            raise self._no_fleet(call.verb)
        given = {name: value for name, value in arguments.items() if value is not None}
        return await getattr(self, call.method_name)(**given, timeout=timeout)

    async def shutdown(self) -> None:
        raise self._no_fleet("shutdown")

    async def aclose(self) -> None:
        """Stop the engine thread and shut the engine down; pending requests fail."""
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self._thread.close)
