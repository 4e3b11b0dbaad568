"""``MegatronAsyncLLM``: the asyncio Python API (DESIGN section 4).

Two modes behind one interface:

* **direct** (``use_coordinator=False``): one engine in this process, stepped by a dedicated thread
  (:class:`_EngineThread`) so that the event loop never blocks on the model. The engine is not
  thread-safe, so every engine call — tokenization included — happens on that thread.
* **coordinator** (``use_coordinator=True``): an :class:`~megatron_serve.client.InferenceClient`
  on the caller's loop. Without ``coordinator_address`` the object starts its own coordinator and
  ``num_engines`` engine processes (:class:`~megatron_serve.local_fleet.LocalFleet`) and stops them
  on :meth:`shutdown`; with an address it connects to that fleet and :meth:`shutdown` only
  disconnects (it never stops a fleet it did not start; send :meth:`stop` for that).

The lifecycle verbs (``pause``, ``unpause``, ``suspend``, ``resume``, ``shutdown``) exist only in
coordinator mode and raise ``RuntimeError`` in direct mode. ``refit`` works in both: through the
coordinator (fleet PAUSED or SUSPENDED) or, in direct mode, on the in-process engine between two
steps (there is one replica, so nothing can disagree; requests in flight continue on the new
weights and their per-token epochs show the switch). ``async with`` starts the object and
on exit calls :meth:`close`, which shuts down in either mode.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from .client import InferenceClient, StreamPartial
from .config import InferenceConfig
from .local_fleet import LocalFleet
from .prompts import ImagePrompt, Prompt, PromptInput, as_prompt, normalize_prompts, tokenize_prompt
from .request import DynamicInferenceRequest
from .sampling_params import SamplingParams
from .streams import iterate_stream

logger = logging.getLogger("megatron_serve.async_llm")


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


class _EngineThread:
    """Steps a direct-mode engine on its own thread and resolves asyncio futures on their loop."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, asyncio.Queue | None]] = {}
        self._thread = threading.Thread(target=self._main, name="megatron-engine", daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, prompt: Prompt, params: SamplingParams, stream: bool
               ) -> tuple[str, asyncio.Future, asyncio.Queue | None]:
        loop = asyncio.get_running_loop()
        request_id = uuid.uuid4().hex
        future = loop.create_future()
        items: asyncio.Queue | None = asyncio.Queue() if stream else None
        self._commands.put(("add", request_id, prompt, params, loop, future, items))
        return request_id, future, items

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def refit(self, source: str, epoch: int | None) -> asyncio.Future:
        """Refit the engine between two steps; the future resolves to its timings (or its error)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("refit", source, epoch, loop, future))
        return future

    def close(self, timeout: float = 30.0) -> None:
        if self._started and self._thread.is_alive():
            self._commands.put(("close",))
            self._thread.join(timeout)

    def _post(self, request_id: str, item: Any, final: bool) -> None:
        entry = self._waiters.pop(request_id, None) if final else self._waiters.get(request_id)
        if entry is None:
            return
        loop, future, items = entry
        try:
            if items is not None:
                loop.call_soon_threadsafe(items.put_nowait, item)
            if final:
                if isinstance(item, BaseException):
                    loop.call_soon_threadsafe(_settle, future, None, item)
                else:
                    loop.call_soon_threadsafe(_settle, future, item)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass

    def _main(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished_requests()
            while True:
                try:
                    command = self._commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if command[0] == "close":
                    for request_id in list(self._waiters):
                        self._post(request_id, ConnectionError("MegatronAsyncLLM was shut down"), final=True)
                    engine.shutdown()  # stops tensor-parallel followers, if any
                    return
                self._apply(command)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # fail what was running; the engine stays usable for new work
                logger.exception("engine step failed")
                for request in engine.take_unfinished_requests():
                    self._post(request.request_id, RuntimeError(f"engine step failed: {exc}"), final=True)
                continue
            for out in outputs:
                request_id = out.request.request_id
                entry = self._waiters.get(request_id)
                if entry is not None and entry[2] is not None and (out.new_tokens or out.new_text):
                    self._post(request_id, StreamPartial(request_id, list(out.new_tokens), out.new_text,
                                                         list(out.new_log_probs),
                                                         new_top_logprobs=list(out.new_top_logprobs)), final=False)
                if out.finished:
                    self._post(request_id, out.request, final=True)

    def _apply(self, command: tuple[Any, ...]) -> None:
        if command[0] == "refit":
            _, source, epoch, loop, future = command
            try:
                result, exc = self.engine.refit(source, epoch), None
            except Exception as error:  # noqa: BLE001 - handed to the caller
                result, exc = None, error
            try:
                loop.call_soon_threadsafe(_settle, future, result, exc)
            except RuntimeError:  # the caller's loop is closed
                pass
            return
        if command[0] == "abort":
            request = self.engine.abort_request(command[1])
            if request is not None:
                self._post(command[1], request, final=True)
            return
        _, request_id, prompt, params, loop, future, items = command
        self._waiters[request_id] = (loop, future, items)
        try:
            tokens, images, text = tokenize_prompt(prompt, self.engine.tokenizer)
        except Exception as exc:
            self._post(request_id, ValueError(f"cannot tokenize the prompt: {exc}"), final=True)
            return
        request = DynamicInferenceRequest(request_id=request_id, prompt=text, prompt_tokens=tokens,
                                          sampling_params=params, images=images)
        self.engine.add_request(request)  # a bad request fails alone and comes back from step()


class MegatronAsyncLLM:
    """Asyncio front end over one in-process engine or a coordinator fleet (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        inference_config: InferenceConfig | None = None,
        use_coordinator: bool = False,
        coordinator_address: str | None = None,
        num_engines: int = 1,
        tokenizer: Any = None,
        token: str | None = None,
    ) -> None:
        self.use_coordinator = bool(use_coordinator)
        self.model = model
        self.inference_config = inference_config
        self.coordinator_address = coordinator_address
        self.num_engines = int(num_engines)
        self.token = token
        self._tokenizer = tokenizer
        self._client: InferenceClient | None = None
        self._fleet: LocalFleet | None = None
        self._engine_thread: _EngineThread | None = None
        self._start_lock: asyncio.Lock | None = None
        self._closed = False
        if self.use_coordinator:
            if coordinator_address is None and not isinstance(model, (str, os.PathLike)):
                raise ValueError("coordinator mode without coordinator_address starts engine processes, "
                                 "so model must be a model directory")
            if self.num_engines < 1:
                raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        else:
            from .llm import build_engine  # noqa: PLC0415 - torch only when an engine lives here

            self.engine = build_engine(model, inference_config, tokenizer)
            self._tokenizer = self.engine.tokenizer
            self._engine_thread = _EngineThread(self.engine)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded on first use in coordinator mode)."""
        if self._tokenizer is None and isinstance(self.model, (str, os.PathLike)):
            from .tokenizer import Tokenizer  # noqa: PLC0415

            self._tokenizer = Tokenizer.from_pretrained(Path(self.model))
        elif isinstance(self._tokenizer, (str, os.PathLike)):
            from .tokenizer import Tokenizer  # noqa: PLC0415

            self._tokenizer = Tokenizer.from_pretrained(Path(self._tokenizer))
        return self._tokenizer

    @property
    def client(self) -> InferenceClient | None:
        """The coordinator client (coordinator mode, once started)."""
        return self._client

    # ------------------------------------------------------------------ start / stop

    async def start(self, timeout: float = 600.0) -> "MegatronAsyncLLM":
        """Start the engine thread, or connect (starting a local fleet first when no address was given)."""
        if self._closed:
            raise RuntimeError("this MegatronAsyncLLM was shut down")
        if not self.use_coordinator:
            self._engine_thread.start()
            return self
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._client is not None:
                return self
            deadline = time.monotonic() + timeout
            address = self.coordinator_address
            try:
                if address is None:
                    self._fleet = LocalFleet(self.model, self.num_engines, self.inference_config, token=self.token)
                    address = await asyncio.to_thread(self._fleet.start, timeout)
                client = InferenceClient(address, token=self.token)
                await client.start(timeout=max(1.0, deadline - time.monotonic()))
                self._client = client
                if self._fleet is not None:
                    await self._wait_for_local_engines(deadline)
            except BaseException:
                await self._stop_local_fleet(send_stop=False)
                raise
        return self

    async def _wait_for_local_engines(self, deadline: float) -> None:
        logger.info("waiting for %d engine(s) to load the model ...", self.num_engines)
        while True:
            self._fleet.check_alive()
            status = await self._client.status()
            if len(status["engines"]) >= self.num_engines:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(status['engines'])} of {self.num_engines} engine(s) registered in time "
                                   f"(logs: {self._fleet.log_dir})")
            await asyncio.sleep(0.2)

    async def _ensure_started(self) -> None:
        if self.use_coordinator:
            if self._client is None:
                await self.start()
        else:
            if self._closed:
                raise RuntimeError("this MegatronAsyncLLM was shut down")
            self._engine_thread.start()

    async def _stop_local_fleet(self, send_stop: bool) -> None:
        stopped = False
        if self._client is not None and send_stop and self._fleet is not None:
            try:
                await self._client.stop(timeout=120.0)
                stopped = True
            except Exception as exc:  # engines are signalled below anyway
                logger.warning("STOP was not acknowledged (%s): signalling the processes", exc)
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._fleet is not None:
            fleet, self._fleet = self._fleet, None
            await asyncio.to_thread(fleet.stop, 60.0, stopped)

    async def close(self) -> None:
        """Release everything this object holds, in either mode (what ``async with`` calls on exit)."""
        if self._closed:
            return
        self._closed = True
        if self.use_coordinator:
            await self._stop_local_fleet(send_stop=True)
        elif self._engine_thread is not None:
            await asyncio.to_thread(self._engine_thread.close)

    async def __aenter__(self) -> "MegatronAsyncLLM":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ generation

    async def generate(self, prompts: PromptInput, sampling_params: SamplingParams | None = None
                       ) -> DynamicInferenceRequest | list[DynamicInferenceRequest]:
        """One finished request for a single prompt, a list (input order) for a batch.

        A prompt is text, token ids, or ``{"prompt": ..., "images": [bytes or PIL.Image, ...]}`` (see
        :meth:`MegatronLLM.generate`).
        """
        prompt_list, single = normalize_prompts(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params.validate()
        await self._ensure_started()
        if self.use_coordinator:
            futures = [self._submit_remote(p, params) for p in prompt_list]
        else:
            futures = [self._engine_thread.submit(p, params, stream=False)[1] for p in prompt_list]
        results = list(await asyncio.gather(*futures))
        return results[0] if single else results

    def _submit_remote(self, prompt: Prompt, params: SamplingParams) -> asyncio.Future:
        if isinstance(prompt, ImagePrompt):
            return self._client.add_request(prompt.prompt, params, images=prompt.images)
        return self._client.add_request(prompt, params)

    async def generate_stream(self, prompt: Prompt | dict, sampling_params: SamplingParams | None = None
                              ) -> AsyncIterator[StreamPartial | DynamicInferenceRequest]:
        """Yield :class:`StreamPartial` items as tokens are generated, then the finished request."""
        prompt = as_prompt(prompt)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params.validate()
        await self._ensure_started()
        if self.use_coordinator:
            images = prompt.images if isinstance(prompt, ImagePrompt) else None
            text = prompt.prompt if isinstance(prompt, ImagePrompt) else prompt
            async for item in self._client.add_request_streaming(text, params, images=images):
                yield item
            return
        request_id, _future, items = self._engine_thread.submit(prompt, params, stream=True)
        async for item in iterate_stream(items, lambda: self._engine_thread.abort(request_id)):
            yield item

    # ------------------------------------------------------------------ lifecycle (coordinator mode)

    def _require_coordinator(self, verb: str) -> None:
        if not self.use_coordinator:
            raise RuntimeError(f"{verb}() needs coordinator mode (MegatronAsyncLLM(..., use_coordinator=True))")

    async def _lifecycle(self, verb: str, **arguments: Any) -> dict[str, Any]:
        """Send ``verb`` to the fleet (coordinator mode only); resolves on its acknowledgement."""
        self._require_coordinator(verb)
        await self._ensure_started()
        return await getattr(self._client, verb)(**arguments)

    async def pause(self) -> dict[str, Any]:
        """Stop stepping at a step boundary, keep memory; resolves on the fleet's acknowledgement."""
        return await self._lifecycle("pause")

    async def unpause(self) -> dict[str, Any]:
        return await self._lifecycle("unpause")

    async def suspend(self, level: int = 1) -> dict[str, Any]:
        """Release the KV cache (level 2: also weights); pauses first when running."""
        return await self._lifecycle("suspend", level=level)

    async def resume(self) -> dict[str, Any]:
        return await self._lifecycle("resume")

    async def stop(self) -> dict[str, Any]:
        """The STOP verb for the whole fleet (also one this object did not start)."""
        return await self._lifecycle("stop")

    async def refit(self, source: str | os.PathLike, epoch: int | None = None) -> dict[str, Any]:
        """Load new weights of the same shapes from model directory ``source`` in place.

        Coordinator mode: the REFIT verb (the fleet must be PAUSED or SUSPENDED); resolves on the
        acknowledgement. Direct mode: the engine refits between two steps. Either way the answer is
        ``{"state", "detail": {"epoch", "source", "engines": {id: timings}}}``, and a source of other
        shapes raises (``ControlError`` / ``ValueError``) with the old weights still serving.
        """
        source = os.fspath(source)
        await self._ensure_started()
        if self.use_coordinator:
            return await self._client.refit(source, epoch)
        timings = await self._engine_thread.refit(source, epoch)
        return direct_refit_answer(source, timings)

    async def status(self) -> dict[str, Any]:
        return await self._lifecycle("status")

    async def shutdown(self) -> None:
        """Stop the local fleet this object started (STOP, then the processes), or disconnect from a remote one."""
        self._require_coordinator("shutdown")
        await self.close()

    async def serve(self, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
        """Serve the OpenAI-compatible HTTP API for this object until cancelled (either mode).

        ``options``: ``model_name``, ``api_key``, ``max_concurrent_requests``, ``log_level``, ``stop``
        (an ``asyncio.Event``), ``limits``, ``read_timeout``, ``image_options`` (a ``multimodal.ImageOptions``);
        see :func:`megatron_serve.server.serve_async_llm`.
        """
        from .server.local import serve_async_llm  # noqa: PLC0415 - FastAPI only when serving

        await serve_async_llm(self, host, port, **options)
