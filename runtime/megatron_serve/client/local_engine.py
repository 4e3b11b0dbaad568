"""The in-process engine client: an engine in this process, stepped on a thread of its own.

:class:`LocalEngineClient` is one of the two implementations of
:class:`~megatron_serve.client.engine_client.EngineClient` (the other is the coordinator client): what
``MegatronLLM``/``MegatronAsyncLLM`` use in direct mode and what the HTTP server serves of a direct-mode
``MegatronAsyncLLM`` (``megatron_serve.server.serve_async_llm``). The engine is not thread-safe, so every call into
it (tokenization included) happens on the engine thread (:class:`~.engine_thread.EngineThread`), which hands each
step's token ids to the callers' event loops; the text is made there (decoding only reads the tokenizer, which its
Rust core allows from any thread). There is no fleet here: the fleet's lifecycle verbs raise ``NoFleet``;
``refit`` loads new weights between two steps (one replica, nothing can disagree).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Iterable

import torch

from ..config import InferenceConfig
from ..engine import DynamicInferenceEngine
from ..errors import NoFleet
from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS, KeptIdsMeter
from ..model.llama import LlamaForCausalLM
from ..wire.lifecycle import FleetState, Verb
from ..wire.verb_calls import verb_call
from ..wire.connection import ControlError
from ..wire.placement import Placement, PlacementError
from ..wire.protocol import ErrorCode
from .engine_thread import EngineThread
from .outputs import StreamItem
from ..multimodal import PromptImage
from .prompts import ImagePrompt, Prompt
from ..wire.request import DynamicInferenceRequest
from ..wire.sampling_params import SamplingParams
from .streams import Sink, iterate_stream
from ..tokenizer import Tokenizer
from ..weights.sources import TensorSource

logger = logging.getLogger("megatron_serve.async_llm")

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
