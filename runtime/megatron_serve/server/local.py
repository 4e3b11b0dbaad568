"""Serving a ``MegatronAsyncLLM`` in-process: what ``MegatronAsyncLLM.serve()`` runs.

In coordinator mode the object already holds an ``InferenceClient``, which the app uses as is. In
direct mode the engine lives in this process, so :class:`AsyncLLMBackend` gives it the client's
interface on top of ``generate_stream`` (whose cleanup aborts the engine request), and reports a
``STATUS``-shaped answer built from the engine's own counters.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from ..limits import RequestLimits
from ..multimodal import ImageOptions, PromptImage
from ..prompts import ImagePrompt
from .app import API_KEY_ENV, create_app
from .modelinfo import ModelFacts, default_model_name
from .runner import serve_app


class AsyncLLMBackend:
    """The ``InferenceClient`` interface over a direct-mode ``MegatronAsyncLLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._tasks: dict[str, asyncio.Task] = {}
        self.completed = 0
        self.failed = 0
        self.aborted = 0

    async def start(self, timeout: float | None = None) -> "AsyncLLMBackend":
        await self.llm.start()
        return self

    def add_request(self, prompt: str | list[int], sampling_params: Any, *, request_id: str | None = None,
                    images: list[PromptImage] | None = None) -> "asyncio.Future[Any]":
        request_id = request_id or uuid.uuid4().hex
        task = asyncio.ensure_future(self._collect(prompt, sampling_params, images))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(request_id, None))
        return task

    async def _collect(self, prompt: str | list[int], sampling_params: Any, images: list[PromptImage] | None) -> Any:
        final = None
        async for item in self.add_request_streaming(prompt, sampling_params, images=images):
            final = item
        return final

    async def add_request_streaming(self, prompt: str | list[int], sampling_params: Any, *,
                                    request_id: str | None = None, images: list[PromptImage] | None = None
                                    ) -> AsyncIterator[Any]:
        from ..request import DynamicInferenceRequest, FinishReason, RequestStatus  # noqa: PLC0415

        async for item in self.llm.generate_stream(ImagePrompt(prompt, images) if images else prompt,
                                                   sampling_params):
            if isinstance(item, DynamicInferenceRequest):
                if item.status is RequestStatus.COMPLETED:
                    self.completed += 1
                elif item.finish_reason is FinishReason.ABORT:
                    self.aborted += 1
                else:
                    self.failed += 1
            yield item

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(str(request_id))
        if task is not None:
            task.cancel()  # generate_stream's cleanup aborts the engine request

    @property
    def num_pending(self) -> int:
        return len(self._tasks)

    async def status(self, timeout: float | None = 10.0) -> dict[str, Any]:
        if self.llm.use_coordinator:
            return await self.llm.status()
        engine = self.llm.engine
        return {
            "state": "RUNNING",
            "engines": [{"id": "local", "group": 0, "state": "RUNNING", "running": engine.num_running,
                         "waiting": engine.num_waiting, "kv_blocks_free": engine.kv_blocks_free,
                         "kv_blocks_total": engine.kv_blocks_total,
                         "cached_tokens": int(getattr(engine, "cached_tokens", 0) or 0),
                         "computed_tokens": int(getattr(engine, "computed_tokens", 0) or 0),
                         "epoch": int(getattr(engine, "epoch", 0)), "last_refit": getattr(engine, "last_refit", None),
                         "metrics": engine.metrics_snapshot(),
                         "info": {"max_sequence_length": engine.max_sequence_length}}],
            "epoch": int(getattr(engine, "epoch", 0)),
            "refits": int(getattr(engine, "refits", 0)),
            "queued": 0,
            "in_flight": engine.num_running + engine.num_waiting,
            "completed": self.completed,
            "failed": self.failed,
            "aborted": self.aborted,
        }


def _model_facts(llm: Any, model_name: str | None) -> tuple[Any, ModelFacts]:
    """A tokenizer for the server's own use, and the model's limits."""
    from ..tokenizer import Tokenizer  # noqa: PLC0415

    if isinstance(llm.model, (str, os.PathLike)):
        # A tokenizer of our own: the direct-mode engine thread uses its tokenizer concurrently.
        return Tokenizer.from_pretrained(Path(llm.model)), ModelFacts.from_dir(llm.model, model_name)
    engine = getattr(llm, "engine", None)
    config = getattr(getattr(engine, "model", None), "config", None)
    return llm.tokenizer, ModelFacts(model_name or "model", getattr(config, "vocab_size", None),
                                     getattr(engine, "max_sequence_length", None))


async def serve_async_llm(llm: Any, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
                          api_key: str | None = None, max_concurrent_requests: int | None = None,
                          log_level: str = "warning", stop: asyncio.Event | None = None,
                          limits: RequestLimits | None = None, read_timeout: float = 60.0,
                          image_options: ImageOptions | None = None) -> None:
    """Serve the OpenAI API for ``llm`` until cancelled (or ``stop`` is set); ``llm`` stays open.

    ``api_key=None`` reads ``$MEGATRON_SERVE_API_KEY`` (no key when unset), like the commands do.
    ``limits`` and ``read_timeout``: as the commands' ``--max-*`` and ``--read-timeout`` flags;
    ``image_options``: as ``--image-fetch-timeout`` and ``--no-remote-images``.
    """
    await llm.start()
    tokenizer, facts = await asyncio.to_thread(_model_facts, llm, model_name)
    backend = llm.client if llm.use_coordinator else AsyncLLMBackend(llm)
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    app = create_app(backend, tokenizer, facts.name, api_key, vocab_size=facts.vocab_size,
                     max_model_len=facts.max_model_len, max_concurrent_requests=max_concurrent_requests, limits=limits,
                     image_options=image_options)
    await serve_app(app, host, port, log_level=log_level, stop=stop, read_timeout=read_timeout)


__all__ = ["AsyncLLMBackend", "default_model_name", "serve_async_llm"]
