"""Serving a ``MegatronAsyncLLM`` in-process (:func:`serve_async_llm`, what ``MegatronAsyncLLM.serve()`` runs). It
reads the object through :class:`ServedLLM`, what it needs of it, so that the server never imports the client class
that imports it.

The app serves the object's engine client (:mod:`megatron_serve.client.engine_client`) as it is, in either
mode: the coordinator client, or the in-process engine with its ``STATUS``-shaped counters.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..generation_config import GenerationDefaults
from ..http_options import HTTPOptions
from ..limits import DEFAULT_KEEP_ALIVE, RequestLimits
from ..multimodal import ImageOptions
from .admin import ADMIN_KEY_ENV
from .app import API_KEY_ENV, create_app
from .backend import Backend
from .modelinfo import ModelFacts, default_model_name
from .runner import serve_app
from .tenants import TenancyOptions

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


class ServedLLM(Protocol):
    """What :func:`serve_async_llm` reads of a ``MegatronAsyncLLM``."""

    model: Any  # a checkpoint directory (str or path), or a model object served in direct mode
    engine: Any  # the in-process engine in direct mode, else None
    generation_defaults: GenerationDefaults

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def client(self) -> Backend: ...

    async def start(self) -> None: ...


def _model_facts(llm: ServedLLM, model_name: str | None, chat_template: str | None) -> tuple[Any, ModelFacts]:
    """A tokenizer for the server's own use, and the model's limits."""
    from ..tokenizer import Tokenizer, load_chat_template  # noqa: PLC0415

    template = load_chat_template(chat_template) if chat_template is not None else None
    if isinstance(llm.model, (str, os.PathLike)):
        # A tokenizer of our own: the direct-mode engine thread uses its tokenizer concurrently.
        return (Tokenizer.from_pretrained(Path(llm.model), chat_template=template),
                ModelFacts.from_dir(llm.model, model_name))
    if template is not None:  # the tokenizer passed with a model object is the caller's: not changed behind its back
        raise ValueError("chat_template applies to a model given as a directory or Hub id; with a model object, "
                         "set the chat template on the tokenizer you pass")
    engine = llm.engine  # a model object is served in direct mode: the engine is here
    if engine is None:
        return llm.tokenizer, ModelFacts(model_name or "model", None, None)
    return llm.tokenizer, ModelFacts(model_name or "model", engine.model.config.vocab_size, engine.max_sequence_length)


async def serve_async_llm(llm: ServedLLM, host: str = "127.0.0.1", port: int = 8000, *,
                          model_name: str | None = None, api_key: str | None = None, admin_key: str | None = None,
                          max_concurrent_requests: int | None = None, chat_template: str | None = None,
                          log_level: str = "warning", stop: asyncio.Event | None = None,
                          limits: RequestLimits | None = None, read_timeout: float = 60.0,
                          timeout_keep_alive: float = DEFAULT_KEEP_ALIVE, max_connections: int | None = None,
                          drain_timeout: float = 0.0, image_options: ImageOptions | None = None,
                          options: HTTPOptions | None = None, stream_interval: int = 1,
                          tenancy: TenancyOptions | None = None) -> None:
    """Serve the OpenAI API for ``llm`` until cancelled (or ``stop`` is set); ``llm`` stays open.

    ``api_key=None`` reads ``$MEGATRON_SERVE_API_KEY`` (no key when unset), like the commands do;
    ``admin_key=None`` reads ``$MEGATRON_SERVE_ADMIN_KEY`` (unset: the admin API answers 403).
    ``limits``, ``read_timeout``, ``timeout_keep_alive``, ``max_connections`` and ``drain_timeout`` (how long
    admitted requests may finish once ``stop`` is set): as the commands' flags of the same names;
    ``image_options``: as ``--image-fetch-timeout`` and ``--no-remote-images``; ``options``: vLLM's HTTP flags
    and the like (tool-call parser, CORS, request and stats logs, ``vllm:`` metrics; ``HTTPOptions``);
    ``stream_interval``: as ``--stream-interval``; ``tenancy``: as ``--tenant-header`` and ``--shed-*`` (the
    tenants themselves come with ``api_key``, a key document: docs/tenants.md).
    ``chat_template``: as ``--chat-template`` (a file or the Jinja text). Requests that leave sampling
    fields out take ``llm.generation_defaults`` (the model's ``generation_config.json``).
    """
    await llm.start()
    tokenizer, facts = await asyncio.to_thread(_model_facts, llm, model_name, chat_template)
    backend = llm.client
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if admin_key is None:
        admin_key = os.environ.get(ADMIN_KEY_ENV) or None
    app = create_app(backend, tokenizer, facts.name, api_key, admin_key=admin_key, vocab_size=facts.vocab_size,
                     max_model_len=facts.max_model_len, max_concurrent_requests=max_concurrent_requests, limits=limits,
                     image_options=image_options, generation_defaults=llm.generation_defaults, options=options,
                     stream_interval=stream_interval, tenancy=tenancy)
    await serve_app(app, host, port, log_level=log_level, stop=stop, read_timeout=read_timeout,
                    timeout_keep_alive=timeout_keep_alive, max_connections=max_connections, drain_timeout=drain_timeout)


__all__ = ["default_model_name", "serve_async_llm"]
