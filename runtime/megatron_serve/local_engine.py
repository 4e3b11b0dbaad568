"""An engine in this process: build it, and step it on a thread of its own for asyncio callers.

``MegatronLLM`` and ``MegatronAsyncLLM`` in direct mode (no coordinator) use these; the engine is not
thread-safe, so every call into it (tokenization included) happens on the engine thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from pathlib import Path
from typing import Any

from .client import StreamPartial
from .config import InferenceConfig
from .engine import DynamicInferenceEngine
from .model.llama import LlamaForCausalLM
from .prompts import Prompt
from .request import DynamicInferenceRequest
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

logger = logging.getLogger("megatron_serve.async_llm")


def build_engine(model: str | Path | LlamaForCausalLM, inference_config: InferenceConfig | None,
                 tokenizer: Tokenizer | str | Path | None) -> DynamicInferenceEngine:
    """An engine from a model directory, or from an already built model plus its tokenizer."""
    config = inference_config or InferenceConfig()
    if isinstance(model, (str, Path)):
        return DynamicInferenceEngine.from_model_dir(model, config)
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a model directory or a LlamaForCausalLM, got {type(model).__name__}")
    if tokenizer is None:
        raise ValueError("a model object needs tokenizer= (a Tokenizer or a directory holding tokenizer files)")
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_pretrained(tokenizer)
    return DynamicInferenceEngine(model, tokenizer, config)


def make_requests(prompts: list, sampling_params: SamplingParams, tokenizer: Tokenizer,
                  ids: "itertools.count[int]") -> list[DynamicInferenceRequest]:
    requests = []
    for prompt in prompts:
        tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        requests.append(DynamicInferenceRequest(
            request_id=str(next(ids)), prompt=prompt if isinstance(prompt, str) else None,
            prompt_tokens=tokens, sampling_params=sampling_params,
        ))
    return requests


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
            tokens = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except Exception as exc:
            self._post(request_id, ValueError(f"cannot tokenize the prompt: {exc}"), final=True)
            return
        request = DynamicInferenceRequest(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                                          prompt_tokens=tokens, sampling_params=params)
        self.engine.add_request(request)  # a bad request fails alone and comes back from step()
